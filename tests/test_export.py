"""`expertize export` without the tools installed: the TopK-coder capability every export rests on, each refusal as
its one line, the base model and hookpoints the files name, writing whole or not at all, and circuit-tracer's
format as its source defines it (tests/circuit_tracer_reference.py, run where expertize cannot be imported).
The tools' own loaders: tests/test_export_tools.py."""

import json
import os
import re
import stat
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModel

from expertize.conversion.cli import main
from expertize.conversion.export import endpoints as export_folder_module
from expertize.conversion.export.expressible import exportable_kinds, hookpoint
from expertize.conversion.recipe import recipe_from_dict
from expertize.conversion.surgery.splice import load_expertize_model
from expertize.conversion.upcycle import upcycle
from expertize.modeling import LAYER_KINDS, SparseSpec, build_sparse_layer
from tests.conftest import FAMILY_NAMES, run_isolated, tiny_base_config, write_corpus
from tests.export_helpers import held_out_ids, mlp_inputs_outputs, model_folder, sparse_layer
from tests.kinds import KINDS, randomized, tiny_spec

CODER_KINDS = [kind for kind in KINDS if kind in exportable_kinds()]
OTHER_KINDS = [kind for kind in KINDS if kind not in exportable_kinds()]
REFERENCE = (Path(__file__).parent / "circuit_tracer_reference.py").read_text(encoding="utf-8")


def _export(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()  # what building the folder printed
    code = main(["export", *map(str, args)])
    return code, capsys.readouterr().err.strip()


# -- the capability: a layer that says it is a TopK coder is exactly one --------------------------------------------


@pytest.mark.parametrize("variant", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_sparse_coder_computes_the_layer_or_the_kind_says_why_not(kind, variant):
    layer = randomized(build_sparse_layer(tiny_spec(kind, variant=variant)), seed=3).eval()
    coder = layer.sparse_coder()
    spec_class = LAYER_KINDS[kind][0]
    if coder is None:
        assert kind in OTHER_KINDS
        assert spec_class.not_sparse_coder != SparseSpec.not_sparse_coder, f"{kind} must say why it is no sparse coder"
        return
    x = torch.randn(200, layer.spec.d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pre = torch.nn.functional.linear(x, coder.W_enc, coder.b_enc)  # (T, L)
    if coder.activation == "topk":
        score = pre if coder.b_select is None else torch.where(pre > 0, pre + coder.b_select, float("-inf"))
        index = score.topk(coder.k, dim=-1).indices  # (T, K)
        dense = torch.zeros_like(pre).scatter_(-1, index, pre.gather(-1, index).relu())  # TopK(ReLU(pre)), (T, L)
    else:  # circuit-tracer's JumpReLU: x * (x > threshold), thresholds > 0
        assert coder.activation == "jumprelu" and coder.b_select is None and bool((coder.threshold > 0).all())
        dense = pre * (pre > coder.threshold)
    expected = dense @ coder.W_dec + coder.b_dec
    if coder.W_skip is not None:
        expected = expected + x @ coder.W_skip.T
    torch.testing.assert_close(layer(x), expected, rtol=1e-10, atol=1e-10)


# -- refusals, one line each, nothing written -------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["sparsify", "circuit-tracer"])
@pytest.mark.parametrize("kind", [k for k in OTHER_KINDS if not LAYER_KINDS[k][0].cross_layer])  # tests/test_clt.py
def test_kinds_without_fixed_decoder_rows_are_refused(kind, target, tmp_path, capsys):
    folder = model_folder(tmp_path, {0: sparse_layer(kind), 1: sparse_layer(kind, seed=1)})
    code, err = _export(capsys, folder, "--to", target, tmp_path / "out")
    spec = LAYER_KINDS[kind][0]
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err == (
        f"expertize export: error: layer 0 ({spec.title}) cannot be written for {target}: {spec.not_sparse_coder}; "
        f"{target} holds sparse coders only (kinds: {', '.join(exportable_kinds())})"
    )
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_a_selection_bias_that_changes_the_choice_is_refused(tmp_path, capsys):
    layer = sparse_layer("transcoder", selection_bias=True)
    with torch.no_grad():
        layer.b_select.copy_(torch.linspace(0, 0.5, layer.b_select.numel()))
    folder = model_folder(tmp_path, {0: layer, 1: sparse_layer("transcoder", seed=1)})
    code, err = _export(capsys, folder, "--to", "sparsify", tmp_path / "out")
    assert code == 2 and err == (
        "expertize export: error: layer 0: its selection bias b_select (spread 0.5) changes which units are chosen, "
        "and sparsify chooses by the pre-activations alone, so its outputs would differ; export a model trained "
        "without a selection bias (train.balance: none)"
    )
    assert not (tmp_path / "out").exists()
    # A constant bias shifts every positive score alike: the same units are chosen, and the export goes ahead.
    with torch.no_grad():
        layer.b_select.fill_(0.25)
    folder = model_folder(tmp_path, {0: layer, 1: sparse_layer("transcoder", seed=1)}, name="constant")
    assert _export(capsys, folder, "--to", "sparsify", tmp_path / "out")[0] == 0


@pytest.mark.parametrize(
    "layers, expected",
    [
        ({0: dict()}, r"circuit-tracer needs a sparse coder at every decoder layer 0\.\.1 \(its per-layer set and "
                      r"replacement model cover all of them\), but layer\(s\) \[1\] of \S+ keep their dense MLP; "
                      r"convert every layer \(recipe `layers: all`\)"),
        ({0: dict(), 1: dict(num_latents=48)}, r"circuit-tracer's per-layer set has one width \(units\) for every "
                                               r"layer, but \S+ has layer 0: 64, layer 1: 48; convert every layer "
                                               r"with the same width"),
        ({0: dict(), 1: dict(k=2)}, r"circuit-tracer's per-layer set has one k for every layer, but \S+ has layer 0: "
                                    r"4, layer 1: 2; convert every layer with the same k"),
    ],
    ids=["not-every-layer", "two-widths", "two-ks"],
)
def test_circuit_tracer_refuses_a_set_it_cannot_hold(layers, expected, tmp_path, capsys):
    folder = model_folder(tmp_path, {i: sparse_layer("transcoder", seed=i, **f) for i, f in layers.items()})
    code, err = _export(capsys, folder, "--to", "circuit-tracer", tmp_path / "out", "--circuit-tracer-topk")
    assert code == 2 and len(err.splitlines()) == 1
    assert re.fullmatch("expertize export: error: " + expected, err), err
    assert not (tmp_path / "out").exists()
    # sparsify holds any subset of layers at any widths.
    assert _export(capsys, folder, "--to", "sparsify", tmp_path / "sparsify")[0] == 0


def test_flags_of_another_target_and_a_non_empty_output_are_refused(tmp_path, capsys):
    folder = model_folder(tmp_path, {0: sparse_layer("transcoder"), 1: sparse_layer("transcoder", seed=1)})
    code, err = _export(capsys, folder, "--to", "sparsify", tmp_path / "out", "--corpus", "a=b.txt")
    assert code == 2 and err == (
        "expertize export: error: --corpus only applies to --to delphi (a sparsify export holds every layer's "
        "weights, read from the folder without any text)"
    )
    code, err = _export(capsys, folder, "--to", "sparsify", tmp_path / "out", "--corpus", "a=b.txt", "--layers", "0")
    assert code == 2 and err.startswith("expertize export: error: --corpus and --layers only apply to --to delphi (")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep", encoding="utf-8")
    code, err = _export(capsys, folder, "--to", "sparsify", tmp_path / "taken")
    assert code == 2 and "already exists and is not empty; choose a new folder" in err
    assert (tmp_path / "taken" / "x").read_text(encoding="utf-8") == "keep"
    code, err = _export(capsys, folder, "--to", "delphi", tmp_path / "d")
    assert code == 2 and err == (
        "expertize export: error: --to delphi reads the folder's activations over text: give --corpus NAME=PATH "
        "(repeatable)"
    )


def test_a_failed_write_leaves_nothing_behind(tmp_path, capsys, monkeypatch):
    folder = model_folder(tmp_path, {0: sparse_layer("transcoder"), 1: sparse_layer("transcoder", seed=1)})
    from expertize.conversion.export import sparsify

    write = sparsify.write_sparsify

    def write_one_then_fail(layers, staging):
        write(layers[:1], staging)
        raise OSError(28, "No space left on device", str(staging))

    monkeypatch.setattr(sparsify, "write_sparsify", write_one_then_fail)
    assert main(["export", str(folder), "--to", "sparsify", str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask-022", "umask-027"])
def test_exports_and_saved_models_are_as_readable_as_a_run_folder(umask, tmp_path, capsys):
    """The staging folder renamed into place is the output: made by mkdtemp it was 0700 (private to its owner)."""
    old = os.umask(umask)
    try:
        folder = model_folder(tmp_path, {0: sparse_layer("transcoder"), 1: sparse_layer("transcoder", seed=1)})
        for target, flags in (("sparsify", ()), ("circuit-tracer", ("--circuit-tracer-topk",))):
            assert _export(capsys, folder, "--to", target, tmp_path / target, *flags)[0] == 0
        (tmp_path / "a-run-folder").mkdir()  # as RunFolder and inspect's report folder make theirs
    finally:
        os.umask(old)
    for path in (tmp_path / "a-run-folder", folder, tmp_path / "sparsify", tmp_path / "circuit-tracer"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o777 & ~umask, path


# -- the names the files give: the base model and its hookpoints -----------------------------------------------------


def test_the_base_model_is_named_as_the_tools_can_load_it(tmp_path, capsys):
    layers = {0: sparse_layer("transcoder"), 1: sparse_layer("transcoder", seed=1)}
    folder = model_folder(tmp_path, layers)
    base = str((tmp_path / "base-llama").resolve())
    assert export_folder_module.base_model_name(folder) == base  # provenance.json: a local base folder
    (folder / "provenance.json").write_text(json.dumps({"base_model": "/gone/base", "base_model_hub_id": "org/base"}))
    assert export_folder_module.base_model_name(folder) == "org/base"  # a recorded Hub id wins
    assert export_folder_module.base_model_name(folder, "mine/other") == "mine/other"
    # A recorded base that is the folder itself (an expertize model, which the tools cannot load) is no base.
    (folder / "provenance.json").write_text(json.dumps({"base_model": str(folder), "base_model_hub_id": None}))
    code, err = _export(capsys, folder, "--to", "sparsify", tmp_path / "out")
    assert code == 2 and err == (
        f"expertize export: error: {folder} does not name a loadable base model (recorded: {folder}); the tools "
        "load the base, so name it: --base-model HUB_ID_OR_FOLDER"
    )
    (folder / "provenance.json").unlink()  # save_model alone records no base
    code, err = _export(capsys, folder, "--to", "sparsify", tmp_path / "out")
    assert code == 2 and "does not name a loadable base model (recorded: none)" in err
    assert _export(capsys, folder, "--to", "sparsify", tmp_path / "out", "--base-model", "org/base")[0] == 0
    assert json.loads((tmp_path / "out" / "expertize_export.json").read_text())["base_model"] == "org/base"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_hookpoints_are_the_base_models_mlps(family):
    config = tiny_base_config(family)
    torch.manual_seed(0)
    base = AutoModel.from_config(config)  # what sparsify's trainer and delphi resolve hookpoints against
    from expertize.modeling import FAMILIES

    causal = FAMILIES[family].causal_lm_class
    blocks = base.get_submodule(FAMILIES[family].blocks_path.removeprefix(causal._base_attr + "."))
    for i in range(config.num_hidden_layers):
        assert base.get_submodule(hookpoint("expertize_" + family, i)) is blocks[i].mlp


def test_a_delphi_cache_of_any_kind_names_the_base(tmp_path, capsys):
    """`--to delphi` holds activations, so kinds with no fixed decoder rows export too; each hookpoint's
    config.json names the base model (delphi's loader reads its tokenizer there). delphi's own loader on it:
    tests/test_export_tools.py."""
    folder = model_folder(tmp_path, {0: sparse_layer("mxd"), 1: sparse_layer("routed_neurons", seed=1)})
    corpus = write_corpus(tmp_path / "a.txt", 40)
    args = ["--to", "delphi", tmp_path / "cache", "--corpus", f"a={corpus}", "--tokens", "128",
            "--context-length", "16", "--no-progress"]
    assert _export(capsys, folder, *args)[0] == 0
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["layers.0.mlp", "layers.1.mlp"]
    for hook in ("layers.0.mlp", "layers.1.mlp"):
        config = json.loads((tmp_path / "cache" / hook / "config.json").read_text())
        assert config["model_name"] == str((tmp_path / "base-llama").resolve()) and config["cache_ctx_len"] == 16
    code, err = _export(capsys, folder, *args)
    assert code == 2 and "already exists and is not empty" in err


# -- circuit-tracer, as its source loads and runs a transcoder set ----------------------------------------------------

CIRCUIT_TRACER_CHECK = REFERENCE + """
import json, sys
import torch
config, transcoders = load_transcoder_set(sys.argv[1])
ref = torch.load("reference.pt")
report = {"config": config, "diff": {}, "fewer_than_k": {}, "unpadded_diff": {}}
with torch.no_grad():
    for i, t in enumerate(transcoders):
        x, y = ref["x"][i], ref["y"][i]
        report["diff"][i] = (t(x) - y).abs().max().item()
        width = t.d_transcoder - config["k"]
        assert (t.encode(x)[:, width:] == 0).all()  # the appended latents never fire
        positive = (torch.nn.functional.linear(x, t.W_enc, t.b_enc)[:, :width] > 0).sum(-1)  # (T,)
        report["fewer_than_k"][i] = (positive < config["k"]).float().mean().item()
        # The same weights without the K zero latents: circuit-tracer's TopK then keeps negative pre-activations.
        bare = SingleLayerTranscoder(x.shape[1], width, TopK(config["k"]), t.W_skip is not None)
        state = t.state_dict()
        bare.load_state_dict({n: (p[:width] if n in ("W_enc", "W_dec", "b_enc") else p) for n, p in state.items()})
        report["unpadded_diff"][i] = (bare(x) - y).abs().max().item()
print(json.dumps(report))
"""


def test_circuit_tracer_set_equals_every_layer_on_every_token(tmp_path, capsys):
    layers = {0: sparse_layer("skip_transcoder"), 1: sparse_layer("skip_transcoder", seed=1)}
    with torch.no_grad():  # few positive pre-activations: tokens with fewer than K of them are common
        for layer in layers.values():
            layer.b_enc.fill_(-2.5)
    folder = model_folder(tmp_path, layers)
    assert _export(capsys, folder, "--to", "circuit-tracer", tmp_path / "ct", "--circuit-tracer-topk")[0] == 0
    seen = mlp_inputs_outputs(load_expertize_model(folder).eval(), held_out_ids())
    torch.save({"x": {i: x for i, (x, _) in seen.items()}, "y": {i: y for i, (_, y) in seen.items()}},
               tmp_path / "reference.pt")
    report = json.loads(run_isolated(CIRCUIT_TRACER_CHECK, tmp_path, args=(str(tmp_path / "ct"),)).splitlines()[-1])
    print(f"circuit-tracer max abs diff per layer: {report['diff']} (bound 1e-5); tokens with fewer than K positive "
          f"pre-activations: {report['fewer_than_k']}; without the zero latents: {report['unpadded_diff']}")
    assert report["config"] == {
        "model_kind": "transcoder_set", "model_name": str((tmp_path / "base-llama").resolve()),
        "feature_input_hook": "mlp.hook_in", "feature_output_hook": "mlp.hook_out", "activation": "topk", "k": 4,
        "scan": "base-llama/model",
    }
    assert all(d <= 1e-5 for d in report["diff"].values()), report
    # Both cases occur: tokens with at least K positive pre-activations, and the ones the zero latents are for.
    assert all(0.2 < f < 1 for f in report["fewer_than_k"].values()), report
    assert all(d > 0.1 for d in report["unpadded_diff"].values()), report  # and without them it differs


def test_a_topk_set_is_never_written_for_the_registry_circuit_tracer(tmp_path, capsys):
    """circuit-tracer 0.5.0 reads a TopK file as a ReLU transcoder without a word: refused unless asked for by name,
    and a JumpReLU layer is refused by sparsify (TopK only), each in one line, nothing written."""
    folder = model_folder(tmp_path, {0: sparse_layer("transcoder"), 1: sparse_layer("transcoder", seed=1)})
    code, err = _export(capsys, folder, "--to", "circuit-tracer", tmp_path / "out")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "layers are TopK coders, which the registry's circuit-tracer (0.5.0) reads silently as ReLU" in err
    assert "train a kind it reads, jumprelu_transcoder (layer.kind" in err and "pass --circuit-tracer-topk" in err
    assert not (tmp_path / "out").exists()
    jump = model_folder(tmp_path, {0: sparse_layer("jumprelu_transcoder"), 1: sparse_layer("transcoder", seed=1)},
                        name="mixed")
    code, err = _export(capsys, jump, "--to", "circuit-tracer", tmp_path / "out", "--circuit-tracer-topk")
    assert code == 2 and "mixes TopK layers ([1]) with others" in err, err
    code, err = _export(capsys, jump, "--to", "sparsify", tmp_path / "out")
    assert code == 2 and err == (
        "expertize export: error: layer 0 (JumpReLU transcoder) is a jumprelu coder and sparsify computes topk only, "
        "so it would read it as another layer; export it --to circuit-tracer or delphi"), err
    assert not (tmp_path / "out").exists()


def test_a_jumprelu_set_equals_every_layer_as_circuit_tracer_loads_it(tmp_path, capsys):
    """The JumpReLU set as the registry's circuit-tracer loads it (its `load_relu_transcoder`, restated): every layer's
    output on every token, with the thresholds under the key 0.5.0 reads; no zero latents, no activation key."""
    layers = {0: sparse_layer("jumprelu_transcoder"), 1: sparse_layer("jumprelu_transcoder", seed=1, skip_connection=True)}
    folder = model_folder(tmp_path, layers)
    assert _export(capsys, folder, "--to", "circuit-tracer", tmp_path / "ct")[0] == 0
    seen = mlp_inputs_outputs(load_expertize_model(folder).eval(), held_out_ids())
    torch.save({"x": {i: x for i, (x, _) in seen.items()}, "y": {i: y for i, (_, y) in seen.items()}},
               tmp_path / "reference.pt")
    script = REFERENCE + """
import json, sys
import torch
config, transcoders = load_transcoder_set(sys.argv[1])
ref = torch.load("reference.pt")
with torch.no_grad():
    report = {"config": config, "diff": {i: (t(ref["x"][i]) - ref["y"][i]).abs().max().item()
                                          for i, t in enumerate(transcoders)},
              "l0": {i: (t.encode(ref["x"][i]) != 0).sum(-1).float().mean().item() for i, t in enumerate(transcoders)},
              "kind": [type(t.activation_function).__name__ for t in transcoders]}
print(json.dumps(report))
"""
    report = json.loads(run_isolated(script, tmp_path, args=(str(tmp_path / "ct"),)).splitlines()[-1])
    assert report["config"] == {
        "model_kind": "transcoder_set", "model_name": str((tmp_path / "base-llama").resolve()),
        "feature_input_hook": "mlp.hook_in", "feature_output_hook": "mlp.hook_out", "scan": "base-llama/model",
    }
    assert report["kind"] == ["JumpReLU", "JumpReLU"]
    assert all(d <= 1e-5 for d in report["diff"].values()), report
    assert all(0 < l0 < 64 for l0 in report["l0"].values()), report  # some latents fire, not all
    record = json.loads((tmp_path / "ct" / "expertize_export.json").read_text())
    assert "zero_latents_appended" not in record


# -- a recipe over every layer, then one command to a circuit-tracer set ---------------------------------------------


def test_a_recipe_over_every_layer_exports_a_circuit_tracer_set(tiny_run, capsys):
    """`layers: all` end to end: preflight, capture, training, splice, card and provenance cover every decoder layer,
    and the folder exports as circuit-tracer's set (every layer, one width, one k) naming the recorded base."""
    tmp_path, tree = tiny_run
    tree.update(layers="all", layer={"kind": "transcoder", "k": 4, "num_latents": 64})
    tree["data"]["train_tokens"] = 2_048
    # the default dead-unit handling (the floor, annealed to 0 by the end) leaves no selection bias: it exports as is
    assert "balance" not in tree["train"] and "balance_anneal" not in tree["train"]
    out = upcycle(recipe_from_dict(tree), progress=False)
    assert sorted(json.loads((out / "config.json").read_text())["sparse_layers"]) == ["0", "1"]
    assert sorted(json.loads((out / "metrics.json").read_text())["layers"]) == ["0", "1"]
    assert yaml.safe_load((out / "recipe.resolved.yaml").read_text())["layers"] == "all"
    assert "the MLPs of layers 0 and 1 replaced by TopK transcoder layers" in (out / "README.md").read_text()
    assert _export(capsys, out, "--to", "circuit-tracer", tmp_path / "ct", "--circuit-tracer-topk") == (0, "")
    config = yaml.safe_load((tmp_path / "ct" / "config.yaml").read_text())
    assert config["model_name"] == str((tmp_path / "base").resolve()) and config["k"] == 4
    assert sorted(p.name for p in (tmp_path / "ct").glob("layer_*")) == ["layer_0.safetensors", "layer_1.safetensors"]


def test_every_family_has_a_transformer_lens_entry_point():
    """TransformerLens finds an adapter by the folder's architecture name through this entry-point group
    (pyproject.toml): a new family needs its line there (then reinstall: entry points are install metadata)."""
    from importlib.metadata import entry_points

    from expertize.modeling import FAMILIES

    found = {ep.name: ep.value for ep in entry_points(group="transformer_lens.architectures")
             if getattr(ep.dist, "name", None) == "expertize"}
    expected = {f.causal_lm_class.__name__: f"expertize.conversion.export.transformer_lens:"
                f"{f.causal_lm_class.__name__}Adapter" for f in FAMILIES.values()}
    assert found == expected
