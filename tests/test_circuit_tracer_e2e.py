"""From a shipped model to an attribution graph with the registry's circuit-tracer, end to end: train a cross-layer
transcoder and a JumpReLU transcoder set on stories260k (every layer, `expertize upcycle stories260k-clt` by the
shipped recipe's name, as the README's circuit-tracing section runs it, at a test's budget), export each with
`expertize export --to circuit-tracer`, then run the export's own attribute.py in a second virtual environment that
holds circuit-tracer 0.5.0 and its transformers pin and not expertize (EXPERTIZE_CIRCUIT_TRACER_PYTHON, made by
scripts/circuit_tracer_env.sh; .ci/run makes it). There circuit-tracer's own loaders read the folder, its
ReplacementModel is built offline from the local base, `attribute` runs on a prompt and the graph files are written;
the loaded transcoders' outputs on the layers' inputs must equal the expertize model's to 1e-5 (float32).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from expertize.conversion.cli import main as cli_main
from expertize.conversion.surgery.splice import load_expertize_model
from safetensors.torch import save_file

from tests.export_helpers import tool_python

pytestmark = pytest.mark.slow  # two short trainings, two exports and a second interpreter (~1 min)

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to"


def circuit_tracer_python() -> str:
    return tool_python("EXPERTIZE_CIRCUIT_TRACER_PYTHON", "circuit-tracer 0.5.0")


def train(tmp_path: Path, kind: str) -> Path:
    """The README's first circuit-tracing command as a user runs it — the shipped recipe by name, no environment
    variable — at a test's budget (`--set layer.kind=...` is the recipe header's switch to a JumpReLU set)."""
    out = tmp_path / kind
    args = ["upcycle", "stories260k-clt", "--no-progress", "--set", f"layer.kind={kind}", "--set",
            "data.train_tokens=16384", "--set", "data.eval_tokens=2048", "--set", "eval.generation_prompts=2",
            "--set", "eval.histogram=false", "--set", "train.checkpoint_every=1000", "--set", f"output_dir={out}"]
    assert cli_main(args) == 0
    return out


def reference(folder: Path, path: Path) -> None:
    """x_{i} / y_{i}: every sparse layer's input and output in the expertize model's forward over real text."""
    model = load_expertize_model(folder).eval()
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(PROMPT + " play outside with her friends.", return_tensors="pt").input_ids
    seen = {}
    for i, layer in model.sparse_layers().items():
        # clone: the block adds to its hidden states in place after the MLP has read them
        layer.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(
            i, (args[0].detach().reshape(-1, args[0].shape[-1]).clone(), out.detach().reshape(-1, out.shape[-1]).clone())))
    with torch.no_grad():
        model(ids)
    save_file({**{f"x_{i}": x for i, (x, _) in seen.items()}, **{f"y_{i}": y for i, (_, y) in seen.items()}}, str(path))


@pytest.mark.parametrize("kind, layout", [("clt", "cross_layer_transcoder"), ("jumprelu_transcoder", "transcoder_set")])
def test_the_registry_circuit_tracer_draws_a_graph_from_an_export(kind, layout, tmp_path, capsys):
    python = circuit_tracer_python()
    folder = train(tmp_path, kind)
    assert cli_main(["export", str(folder), "--to", "circuit-tracer", str(tmp_path / "ct")]) == 0
    config = yaml.safe_load((tmp_path / "ct" / "config.yaml").read_text())
    assert config["model_kind"] == layout and "activation" not in config
    reference(folder, tmp_path / "reference.safetensors")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = subprocess.run(
        [python, str(tmp_path / "ct" / "attribute.py"), "--prompt", PROMPT, "--out", str(tmp_path / "graph"),
         "--check", str(tmp_path / "reference.safetensors"), "--scores", str(tmp_path / "scores-one.json")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    print(run.stdout[-3000:], run.stderr[-3000:], file=sys.stderr)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    check = next(line for line in run.stdout.splitlines() if line.startswith("[check]"))
    assert float(check.split("max=")[1].split()[0]) <= 1e-5, check
    # scripts/circuit_tracer_env.sh pins the nnsight circuit-tracer's nnsight backend imports (0.6.3): on a Llama
    # `--backend auto` takes it; the TransformerLens route (GPT-2's only one) must still draw the same prompt
    assert "backend=nnsight" in run.stdout, [line for line in run.stdout.splitlines() if line.startswith("[base]")]
    tl = subprocess.run(
        [python, str(tmp_path / "ct" / "attribute.py"), "--prompt", PROMPT, "--out", str(tmp_path / "graph-tl"),
         "--backend", "transformerlens"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert tl.returncode == 0 and "backend=transformerlens" in tl.stdout, tl.stdout[-2000:] + tl.stderr[-2000:]
    assert len(json.loads((tmp_path / "graph-tl" / "graph.json").read_text())["nodes"]) > 0
    # expertize is not importable there: the graph came from circuit-tracer's own code
    probe = subprocess.run([python, "-c", "import expertize"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'expertize'" in probe.stderr
    graph = json.loads((tmp_path / "graph" / "graph.json").read_text())
    assert graph["nodes"] and graph["links"]
    features = [n for n in graph["nodes"] if n.get("feature_type") in ("cross layer transcoder", "transcoder",
                                                                       "cross-layer transcoder")]
    assert features, {n.get("feature_type") for n in graph["nodes"]}
    assert (tmp_path / "graph" / "graph.pt").is_file() and (tmp_path / "graph" / "graph-metadata.json").is_file()
    assert_graph_scores(python, env, tmp_path)


def assert_graph_scores(python: str, env: dict, tmp_path: Path) -> None:
    """--scores writes circuit-tracer's own compute_graph_scores of the drawn graph (recomputed here from graph.pt by
    circuit-tracer alone), and --prompts scores every line of a file the same way, prompt by prompt."""
    one = json.loads((tmp_path / "scores-one.json").read_text())
    reference = subprocess.run(
        [python, "-c", "import json, sys; from circuit_tracer.graph import Graph, compute_graph_scores; "
         "print(json.dumps(compute_graph_scores(Graph.from_pt(sys.argv[1]))))", str(tmp_path / "graph" / "graph.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert reference.returncode == 0, reference.stderr[-2000:]
    replacement, completeness = json.loads(reference.stdout.strip().splitlines()[-1])
    first = one["prompts"][0]
    assert (first["replacement"], first["completeness"]) == pytest.approx((replacement, completeness), abs=1e-6)
    assert 0 < replacement <= 1 and 0 < completeness <= 1 and first["tokens"] > 1
    (tmp_path / "prompts.txt").write_text(PROMPT + "\n\nOne day, a little dog found a big red ball in the park. He\n")
    many = subprocess.run(
        [python, str(tmp_path / "ct" / "attribute.py"), "--prompts", str(tmp_path / "prompts.txt"), "--scores",
         str(tmp_path / "scores-many.json"), "--out", str(tmp_path / "graph-many")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert many.returncode == 0, many.stdout[-2000:] + many.stderr[-2000:]
    scored = json.loads((tmp_path / "scores-many.json").read_text())
    assert [p["prompt"] for p in scored["prompts"]] == [PROMPT, "One day, a little dog found a big red ball in the "
                                                        "park. He"]  # the blank line is not a prompt
    assert (scored["prompts"][0]["replacement"], scored["prompts"][0]["completeness"]) == pytest.approx(
        (first["replacement"], first["completeness"]), abs=1e-6)
    assert scored["replacement_mean"] == pytest.approx(sum(p["replacement"] for p in scored["prompts"]) / 2)
    assert not (tmp_path / "graph-many" / "graph.json").exists()  # scores only: no graph files per prompt

