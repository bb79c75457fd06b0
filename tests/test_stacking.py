"""Stacking (docs/upcycle.md#stacking): a run whose base_model is an expertize folder adds sparse layers at the base's
dense layers, reports its cost against the original dense model, and refuses to re-sparsify a sparse layer."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from expertize.conversion.publishing.formats import format_number
from expertize.conversion.cli import main
from expertize.conversion.data.text import load_eval_sequences
from expertize.conversion.recipe import RecipeError, recipe_from_dict
from expertize.conversion.surgery.splice import save_model, splice
from expertize.conversion.training.losses import next_token_ce
from expertize.modeling import build_sparse_layer
from tests.conftest import tiny_base_model, tiny_tokenizer
from tests.kinds import tiny_spec


def _first_step(tmp_path: Path, tree: dict) -> Path:
    """Folder A: the tiny Llama base with a (random, hence costly) transcoder at layer 1, recording its dense base
    as an upcycle run would (provenance.json)."""
    torch.manual_seed(0)
    layer = build_sparse_layer(tiny_spec("transcoder"))
    torch.nn.init.normal_(layer.W_dec, std=1.0)
    torch.nn.init.normal_(layer.b_dec, std=3.0)  # a large shift of the residual stream: a costly layer
    folder = save_model(splice(tiny_base_model("llama"), {1: layer}), tmp_path / "step1", tokenizer=tiny_tokenizer())
    (folder / "provenance.json").write_text(json.dumps({"base_model": tree["base_model"]}), encoding="utf-8")
    return folder


def test_a_layer_already_sparse_in_the_base_is_refused_before_any_work(tiny_run, capsys):
    tmp_path, tree = tiny_run
    tree["base_model"], tree["layers"] = str(_first_step(tmp_path, tree)), [0, 1]
    capsys.readouterr()  # save_model's progress bar
    recipe = tmp_path / "again.yaml"
    recipe.write_text(yaml.safe_dump(tree))
    assert main(["upcycle", str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "layers [1] of base_model" in err and "are already sparse (layer 1: transcoder, from an earlier run)" in err
    assert "List only dense layers (here [0])" in err and "docs/upcycle.md#stacking" in err
    assert not Path(tree["output_dir"]).exists()  # refused before the run folder was claimed


@pytest.mark.parametrize("setting", [{"layers": {0: "mxd", 1: "transcoder"}}, {"layer": {"kind": ["mxd", "moe_x"]}}])
def test_asking_for_a_kind_per_layer_points_at_stacking(tiny_run, setting):
    _, tree = tiny_run
    with pytest.raises(RecipeError, match=r"to mix kinds, convert in steps.*docs/upcycle\.md#stacking"):
        recipe_from_dict({**tree, **setting})


def test_a_stacked_run_reports_its_cost_against_the_original_dense_model(tiny_run):
    """Before: ΔCE against the intermediate model only, and the card's first line claimed every sparse layer for this
    run. After: metrics.json["stacking"] holds the original dense model's CE on the same held-out sequences and the
    whole model's ΔCE against it; the card shows both and says which layers this run replaced."""
    tmp_path, tree = tiny_run
    dense = tree["base_model"]
    tree["base_model"], tree["layers"] = str(_first_step(tmp_path, tree)), [0]
    tree["data"]["train_tokens"] = 2048
    tree["train"].update(checkpoint_every=0)
    tree["eval"].update(generation_prompts=0)
    recipe = tmp_path / "step2.yaml"
    recipe.write_text(yaml.safe_dump(tree))
    assert main(["upcycle", str(recipe), "--no-progress"]) == 0
    run = Path(tree["output_dir"])
    metrics = json.loads((run / "metrics.json").read_text(encoding="utf-8"))
    stacking = metrics["stacking"]
    assert stacking["base_sparse_layers"] == {"1": "transcoder"} and stacking["original_base_model"] == dense

    # The original's CE, measured independently on the run's held-out sequences.
    sequences = load_eval_sequences(recipe_from_dict(tree).data, tiny_tokenizer())
    with torch.no_grad():
        original = tiny_base_model("llama")(input_ids=sequences).logits
    expected = float(next_token_ce(original, sequences).double().mean())
    assert stacking["original_ce"] == pytest.approx(expected, rel=1e-6)
    assert stacking["delta_original"] == pytest.approx(metrics["ce"]["spliced"] - expected, rel=1e-9)
    # The earlier step's layer costs something, which ΔCE against the intermediate base leaves out (the tiny random
    # base's logits are nearly uniform, so every cost here is small).
    assert metrics["ce"]["base"] - expected > 1e-4
    assert stacking["delta_original"] > metrics["ce"]["delta"]

    card = (run / "README.md").read_text(encoding="utf-8")
    summary = card.split("\n# ", 1)[1].split("\n\n", 2)[1]
    assert "the MLP of layer 0 replaced by a Mixture of Decoders (MxD) layer" in summary
    step1 = tree["base_model"]  # the folder's own card names a local base by its path (the pushed one: `step1`)
    assert f"by this run. `{step1}` is itself an expertize model, made in an earlier run from the dense `base`" \
        in summary
    assert "the MLP of layer 1 replaced by a TopK transcoder layer" in summary and "layers 0 and 1" in summary
    assert f"| ΔCE against the original dense model (`base`) | {format_number(stacking['delta_original'])} |" in card
    from expertize.conversion.upcycle import upcycle_summary

    assert "stacked on an expertize model: ΔCE" in upcycle_summary(run)
