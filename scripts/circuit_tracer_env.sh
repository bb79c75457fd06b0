#!/usr/bin/env bash
# A second virtual environment with the registry's circuit-tracer (0.5.0, which pins transformers <= 4.57.3) and
# without expertize: what tests/test_circuit_tracer_e2e.py runs an export's attribute.py in (`-m slow`; .ci/run
# makes one). Usage: scripts/circuit_tracer_env.sh DIR, then EXPERTIZE_CIRCUIT_TRACER_PYTHON=DIR/bin/python.
set -euo pipefail
VENV="${1:?usage: scripts/circuit_tracer_env.sh DIR}"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet torch==2.13.0  # the CPU wheel first, as for expertize's own venv
"$VENV/bin/python" -m pip install --quiet "circuit-tracer==0.5.0"
"$VENV/bin/python" -c "import circuit_tracer, transformers; print('circuit-tracer', circuit_tracer.__version__ if hasattr(circuit_tracer, '__version__') else '0.5.0', 'transformers', transformers.__version__)"
