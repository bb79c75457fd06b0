"""`expertize export --to saelens`: the layout SAELens's `SAE.save_model` writes (conversion/export/saelens.py), read
by the registry's SAELens with its own loader (`SAE.load_from_disk`) in a virtual environment without expertize
(EXPERTIZE_SAELENS_PYTHON: scripts/circuit_tracer_env.sh installs SAELens 6.54 beside circuit-tracer, both pinning
transformers 4.x; .ci/run makes it): every layer's output on every token equal to the expertize model's, JumpReLU
(skip) transcoders and a cross-layer transcoder's per-layer view; TopK refused with SAELens's reason."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from expertize.conversion.cli import main
from expertize.conversion.surgery.splice import load_expertize_model
from safetensors.torch import load_file

from tests.export_helpers import held_out_ids, mlp_inputs_outputs, model_folder, sparse_layer, tool_python
from tests.test_clt import clt_layers


def _export(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["export", *map(str, args)])
    return code, capsys.readouterr().err.strip()


def _jumprelu_folder(tmp_path: Path, family: str = "llama") -> Path:
    layers = {0: sparse_layer("jumprelu_transcoder", family), 1: sparse_layer("jumprelu_transcoder", family, seed=1,
                                                                                skip_connection=True)}
    for layer in layers.values():  # thresholds around 0.2, as training leaves them (a normal draw would be ~1)
        with torch.no_grad():
            layer.threshold_exponent.fill_(torch.log(torch.tensor(0.2)).item() / 10)
    return model_folder(tmp_path, layers, family)


def test_a_jumprelu_set_is_written_in_saelens_layout(tmp_path, capsys):
    folder = _jumprelu_folder(tmp_path)
    assert _export(capsys, folder, "--to", "saelens", tmp_path / "sl")[0] == 0
    model = load_expertize_model(folder)
    for i, architecture in ((0, "jumprelu_transcoder"), (1, "jumprelu_skip_transcoder")):
        out = tmp_path / "sl" / f"blocks.{i}.mlp.hook_in"
        cfg = json.loads((out / "cfg.json").read_text())
        coder = model.sparse_layers()[i].sparse_coder()
        L, d_in = coder.W_enc.shape
        assert cfg["architecture"] == architecture and (cfg["d_in"], cfg["d_sae"], cfg["d_out"]) == (d_in, L, d_in)
        assert cfg["apply_b_dec_to_input"] is False and cfg["normalize_activations"] == "none"
        assert cfg["metadata"]["hook_name"] == f"blocks.{i}.mlp.hook_in"
        assert cfg["metadata"]["hook_name_out"] == f"blocks.{i}.hook_mlp_out"
        assert int(cfg["metadata"]["sae_lens_version"].split(".")[0]) >= 6  # no pre-6 renames on load
        weights = load_file(out / "sae_weights.safetensors")
        expected = {"W_enc", "b_enc", "W_dec", "b_dec", "threshold"} | ({"W_skip"} if i == 1 else set())
        assert set(weights) == expected
        torch.testing.assert_close(weights["W_enc"], coder.W_enc.T.contiguous())  # SAELens: x @ W_enc
        torch.testing.assert_close(weights["threshold"], coder.threshold)
    record = json.loads((tmp_path / "sl" / "expertize_export.json").read_text())
    assert record["target"] == "saelens" and record["layers"] == {"0": "layers.0.mlp", "1": "layers.1.mlp"}


def test_topk_layers_are_refused_with_saelens_reason(tmp_path, capsys):
    folder = model_folder(tmp_path, {0: sparse_layer("transcoder")})
    code, err = _export(capsys, folder, "--to", "saelens", tmp_path / "sl")
    assert code == 2 and "SAELens has no TopK class" in err and "jumprelu_transcoder" in err, err
    assert not (tmp_path / "sl").exists()


def test_a_clt_is_written_as_its_per_layer_view_with_the_later_writes_beside_it(tmp_path, capsys):
    folder = model_folder(tmp_path, clt_layers())
    assert _export(capsys, folder, "--to", "saelens", tmp_path / "sl")[0] == 0
    layers = clt_layers()  # the same seeded weights as the folder's
    first = tmp_path / "sl" / "blocks.0.mlp.hook_in"
    weights = load_file(first / "sae_weights.safetensors")
    torch.testing.assert_close(weights["W_dec"], layers[0].W_dec.detach()[0])  # its own layer
    later = load_file(first / "cross_layer_decoders.safetensors")
    assert set(later) == {"W_dec_to_1"}
    torch.testing.assert_close(later["W_dec_to_1"], layers[1].W_dec.detach()[0])
    assert not (tmp_path / "sl" / "blocks.1.mlp.hook_in" / "cross_layer_decoders.safetensors").exists()
    cfg = json.loads((first / "cfg.json").read_text())
    assert cfg["architecture"] == "jumprelu_transcoder"
    assert cfg["metadata"]["expertize_cross_layer"]["writes_to"] == [0, 1]


# -- the registry's SAELens reads them, in a venv without expertize ---------------------------------------------------


LOAD = """
import json, sys
import torch
from safetensors.torch import load_file
from sae_lens import SAE
import sae_lens
ref = torch.load("reference.pt")
out, report = sys.argv[1], {"version": sae_lens.__version__, "diff": {}, "l0": {}, "class": {}}
saes = {i: SAE.load_from_disk(f"{out}/blocks.{i}.mlp.hook_in") for i in ref["x"]}
with torch.no_grad():
    acts = {i: sae.encode(ref["x"][i]) for i, sae in saes.items()}
    for j, sae in saes.items():
        y = sae.decode(acts[j]) if ref["clt"] else sae(ref["x"][j])  # SAELens's own forward (its skip path too)
        for i in [i for i in saes if i < j and ref["clt"]]:  # what earlier layers' latents write into layer j
            later = load_file(f"{out}/blocks.{i}.mlp.hook_in/cross_layer_decoders.safetensors")
            y = y + acts[i] @ later[f"W_dec_to_{j}"]
        report["diff"][j] = (y - ref["y"][j]).abs().max().item()
        report["l0"][j] = (acts[j] != 0).sum(-1).float().mean().item()
        report["class"][j] = type(sae).__name__
print(json.dumps(report))
"""


def _read_in_saelens(folder: Path, out: Path, tmp_path: Path, clt: bool) -> dict:
    seen = mlp_inputs_outputs(load_expertize_model(folder).eval(), held_out_ids())
    torch.save({"x": {i: x for i, (x, _) in seen.items()}, "y": {i: y for i, (_, y) in seen.items()}, "clt": clt},
               tmp_path / "reference.pt")
    # a clean environment: the venv's python alone, offline, no PYTHONPATH that could reach expertize
    env = {"PATH": os.environ["PATH"], "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)}
    python = tool_python("EXPERTIZE_SAELENS_PYTHON", "SAELens 6.54")
    result = subprocess.run([python, "-c", LOAD, str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a second interpreter that imports SAELens (~20 s)
@pytest.mark.parametrize("family", ["llama", "gpt2"])  # a Llama's SwiGLU MLP and GPT-2's Conv1D one
def test_the_registry_saelens_loads_a_jumprelu_set_exactly(family, tmp_path, capsys):
    folder = _jumprelu_folder(tmp_path, family)
    assert _export(capsys, folder, "--to", "saelens", tmp_path / "sl")[0] == 0
    report = _read_in_saelens(folder, tmp_path / "sl", tmp_path, clt=False)
    assert report["version"] == "6.54.0"
    assert report["class"] == {"0": "JumpReLUTranscoder", "1": "JumpReLUSkipTranscoder"}
    assert all(d <= 1e-5 for d in report["diff"].values()), report
    assert all(0 < l0 < 64 for l0 in report["l0"].values()), report  # some latents fire, not all


@pytest.mark.slow
def test_the_registry_saelens_reads_a_clt_per_layer_with_its_thresholds(tmp_path, capsys):
    """Each source layer's latents as SAELens encodes them (the thresholds kept: the L0 is the CLT's), and with the
    later layers' decoders beside them every layer's output exactly."""
    folder = model_folder(tmp_path, clt_layers())
    assert _export(capsys, folder, "--to", "saelens", tmp_path / "sl")[0] == 0
    report = _read_in_saelens(folder, tmp_path / "sl", tmp_path, clt=True)
    assert report["class"] == {"0": "JumpReLUTranscoder", "1": "JumpReLUTranscoder"}
    assert all(d <= 1e-5 for d in report["diff"].values()), report
    assert all(0 < l0 < 48 for l0 in report["l0"].values()), report


@pytest.mark.slow  # a short training and a second interpreter (~40 s)
@pytest.mark.parametrize("kind", ["jumprelu_transcoder", "clt"])
def test_the_registry_saelens_reads_stories260k_as_a_user_upcycles_it(kind, tmp_path, capsys):
    """The real stories260k with layers trained by the shipped circuit recipe (as the README runs it, at a test's
    budget), exported and read by SAELens's own loader: every layer's output exactly (SAELens's encode, then its
    decode and, for the CLT, the later layers' decoders beside it)."""
    from tests.test_circuit_tracer_e2e import train

    folder = train(tmp_path, kind)
    assert _export(capsys, folder, "--to", "saelens", tmp_path / "sl")[0] == 0
    report = _read_in_saelens(folder, tmp_path / "sl", tmp_path, clt=kind == "clt")
    assert report["version"] == "6.54.0" and set(report["class"].values()) == {"JumpReLUTranscoder"}
    assert len(report["diff"]) == 5 and all(d <= 1e-5 for d in report["diff"].values()), report  # every layer
    # exact outputs need the thresholds (SAELens's own CLT loader drops them: its outputs differ); and latents fire
    assert all(l0 > 0 for l0 in report["l0"].values()), report
