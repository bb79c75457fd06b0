#!/usr/bin/env bash
# A second virtual environment, without expertize, with the analysis tools from the registry that pin transformers 4.x
# (expertize runs on 5.x): circuit-tracer 0.5.0 (transformers <= 4.57.3) and SAELens 6.54 (transformer-lens < 4),
# installed beside it with circuit-tracer's packages held as they are. tests/test_circuit_tracer_e2e.py runs an
# export's attribute.py there and tests/test_saelens.py loads a SAELens export with SAELens's own loader (`-m slow`;
# .ci/run makes one). Usage: scripts/circuit_tracer_env.sh DIR, then
# EXPERTIZE_CIRCUIT_TRACER_PYTHON=DIR/bin/python EXPERTIZE_SAELENS_PYTHON=DIR/bin/python.
set -euo pipefail
VENV="${1:?usage: scripts/circuit_tracer_env.sh DIR}"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet torch==2.13.0  # the CPU wheel first, as for expertize's own venv
# nnsight 0.6.3: circuit-tracer 0.5.0 leaves nnsight unpinned, and the 0.8 the registry resolves today cannot be
# imported by it (`No module named 'nnsight.intervention.tracing'`); with 0.6.3 its nnsight backend works (a Llama's
# graph: the same as the TransformerLens route's), so attribute.py's `--backend auto` can take either.
"$VENV/bin/python" -m pip install --quiet "circuit-tracer==0.5.0" "nnsight==0.6.3"
# SAELens next to it, changing none of what circuit-tracer resolved (its transformer-lens 3.x and transformers 4.57
# satisfy SAELens's pins).
"$VENV/bin/python" -m pip freeze > "$VENV/circuit-tracer-constraints.txt"
"$VENV/bin/python" -m pip install --quiet "sae-lens==6.54.0" -c "$VENV/circuit-tracer-constraints.txt"
"$VENV/bin/python" -c "import circuit_tracer, sae_lens, transformers; print('circuit-tracer', getattr(circuit_tracer, '__version__', '0.5.0'), 'nnsight', __import__('nnsight').__version__, 'sae-lens', sae_lens.__version__, 'transformers', transformers.__version__)"
