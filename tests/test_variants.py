"""Variants on one activation stream (recipe `variants:`): each variant's folder equals training it alone, resume is
exact even when the variants stopped at different steps, a diverging variant stops alone, finished ones are skipped."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from expertize.conversion.capture import capture_activations
from expertize.conversion.errors import ExpertizeError, RunFailed
from expertize.conversion.publishing.formats import format_number, format_percent
from expertize.conversion.publishing.run_folder import RunFolderTaken
from expertize.conversion.recipe import RecipeError, load_recipe, recipe_from_dict, recipe_to_dict, variant_recipes
from expertize.conversion.training.distill import Trainer
from expertize.conversion.training.errors import RunInterrupted
from expertize.conversion.upcycle import upcycle, upcycle_summary

STEPS = 12
VARIANTS = [
    {"name": "a"},  # the recipe's layer: mxd with random K (draws from the RNG every step)
    {"name": "b", "layer": {"k": 2}, "train": {"lr": 1e-2, "auxk_coef": 0.0}},
    {"name": "c", "layer": {"kind": "transcoder", "k": 4, "num_latents": 64}, "train": {"warmup_steps": 0}},
]


@pytest.fixture
def variants_run(tiny_run):
    """conftest's tiny Llama run, shorter, with three variants."""
    tmp_path, tree = tiny_run
    tree["layer"]["options"] = {"random_k": True}
    tree["data"]["train_tokens"] = 256 * STEPS
    tree["train"].update(checkpoint_every=4, log_every=2)
    tree["eval"].update(generation_prompts=2, continuation_tokens=3)
    tree.update(output_dir=str(tmp_path / "sweep"), variants=VARIANTS)
    return tmp_path, tree


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    different = [key for key in wa if not torch.equal(wa[key], wb[key])]
    assert not different, f"{a.name} vs {b.name}: {different[:4]}"


def _losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.slow  # every variant trained twice (~12 s)
def test_each_variant_equals_its_recipe_trained_alone(variants_run):
    """Distillation, then LoRA healing (whose adapters are initialized from the RNG) and evaluation per variant."""
    tmp_path, tree = variants_run
    tree["heal"] = {"tokens": 16 * 2 * 4, "batch_sequences": 2, "rest": "lora", "warmup_steps": 0}
    out = upcycle(recipe_from_dict(tree), progress=False)
    assert out == tmp_path / "sweep"
    for variant in ("a", "b", "c"):
        folder = out / variant
        assert (folder / "metrics.json").is_file() and not (folder / "checkpoint").exists()
        # The folder's recipe is an ordinary recipe: trained alone it gives bit-identical weights and logs.
        alone = recipe_to_dict(load_recipe(folder / "recipe.resolved.yaml"))
        assert "variants" not in alone
        solo = upcycle(recipe_from_dict({**alone, "output_dir": str(tmp_path / f"solo-{variant}")}), progress=False)
        _assert_same_weights(folder, solo)
        assert _losses(folder) == _losses(solo)
        # The variants share their ablated eval forwards (shared_passes.AblationMemo): the CE metrics stay exact.
        ce, ce_alone = (json.loads((f / "metrics.json").read_text())["ce"] for f in (folder, solo))
        assert ce == ce_alone
    # Not three copies of one run: the variants differ from each other.
    assert not torch.equal(_weights(out / "a")["model.layers.0.mlp.W_gate"], _weights(out / "b")["model.layers.0.mlp.W_gate"])
    # The comparison table (variants.md, printed by the CLI) reads the folders' metrics.
    table = (out / "variants.md").read_text()
    assert upcycle_summary(out) == table.rstrip("\n")
    for name, kind, k, lr in (("a", "mxd", 4, "0.003"), ("b", "mxd", 2, "0.01"), ("c", "transcoder", 4, "0.003")):
        metrics = json.loads((out / name / "metrics.json").read_text())
        assert f"| {name} | {kind} | {k} | 64 | {lr} | " in table and f" | {format_number(metrics['ce']['delta'])} | " in table
        # Issue 35: both axes of the verdict and the code share beside the fidelity.
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} | "))
        verdict = metrics["verdict"]
        assert verdict["fidelity"] and f" | {verdict['grade']} (fidelity {verdict['fidelity']}" in row
        shares = [m["code_share"] for m in metrics["layers"].values() if m["code_share"] is not None]
        cell = format_percent(sum(shares) / len(shares) if shares else None, 0)
        assert f" | {cell} | {verdict['grade']} (" in row
    assert "| effective units | code share | verdict | health |" in table


def test_variant_recipes_merge_the_layer_unless_the_kind_changes(variants_run):
    _, tree = variants_run
    recipes = dict(variant_recipes(recipe_from_dict(tree)))
    assert recipes["a"].layer == recipe_from_dict({**tree, "variants": []}).layer
    assert (recipes["b"].layer.kind, recipes["b"].layer.k, recipes["b"].layer.num_experts) == ("mxd", 2, 64)
    assert recipes["b"].layer.options == {"random_k": True} and recipes["b"].train.lr == 1e-2
    assert (recipes["c"].layer.kind, recipes["c"].layer.options) == ("transcoder", {})  # replaced, not merged
    assert recipes["c"].output_dir.endswith("sweep/c") and recipes["c"].train.warmup_steps == 0


@pytest.mark.parametrize(
    "variants, message",
    [
        ([{"name": "a", "train": {"seed": 1}}], r"variants\[0\]: train\.seed: variant 'a' cannot set train\.seed"),
        ([{"name": "a", "train": {"tokens_per_step": 128}}], r"shared by all variants"),
        ([{"name": "a"}, {"name": "a"}], r"the name 'a' appears more than once"),
        ([{"name": "../up"}], r"name '\.\./up' is not a folder name"),
        ([{"name": "a", "layer": {"kk": 2}}], r"variants\[a\]: unknown key 'layer\.kk' \(did you mean 'layer\.k'\?\)"),
    ],
)
def test_bad_variants_are_refused_when_the_recipe_loads(variants_run, variants, message):
    _, tree = variants_run
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict({**tree, "variants": variants})


def test_an_impossible_variant_is_refused_before_any_folder_is_made(variants_run):
    tmp_path, tree = variants_run
    tree["variants"] = [{"name": "a"}, {"name": "huge-k", "layer": {"k": 65}}]
    with pytest.raises(ExpertizeError, match=r"variant 'huge-k': .*k"):
        upcycle(recipe_from_dict(tree), progress=False)
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow  # upcycle processes killed and resumed
def test_kill_between_two_variants_steps_resumes_exactly(variants_run, monkeypatch):
    """Ctrl-C inside variant b's step 6: a has done it and c has not begun it, so both are between two steps and
    save (at 6 and 5); b, mid-step, keeps its step-4 checkpoint. The rerun streams from step 4, a and c wait for
    theirs, and every folder equals a straight run."""
    tmp_path, tree = variants_run
    straight = upcycle(recipe_from_dict({**tree, "output_dir": str(tmp_path / "straight")}), progress=False)

    compute_loss = Trainer.compute_loss

    def interrupted(self, batch):
        if self.name == "distil[b]" and self.step == 5:
            raise KeyboardInterrupt
        return compute_loss(self, batch)

    monkeypatch.setattr(Trainer, "compute_loss", interrupted)
    with pytest.raises(RunInterrupted, match=r"training of 3 variants interrupted") as caught:
        upcycle(recipe_from_dict(tree), progress=False)
    for said in ("saved a checkpoint of step 6", "saved a checkpoint of step 5", "last checkpoint is of step 4"):
        assert said in str(caught.value)
    steps = {name: torch.load(tmp_path / "sweep" / name / "checkpoint" / "state.pt", weights_only=False)["step"]
             for name in "abc"}
    assert steps == {"a": 6, "b": 4, "c": 5}

    monkeypatch.setattr(Trainer, "compute_loss", compute_loss)
    messages = []
    upcycle(recipe_from_dict(tree), progress=False, log=messages.append)
    assert sum("resuming the unfinished run" in m for m in messages) == 3
    for name in "abc":
        _assert_same_weights(tmp_path / "sweep" / name, straight / name)
        assert _losses(tmp_path / "sweep" / name) == _losses(straight / name)


@pytest.mark.slow  # two variant runs
def test_a_diverging_variant_stops_alone_and_the_rerun_trains_only_it(variants_run, monkeypatch):
    tmp_path, tree = variants_run
    compute_loss = Trainer.compute_loss

    def poisoned(self, batch):
        loss, parts = compute_loss(self, batch)
        return (loss * torch.nan if self.name == "distil[b]" and self.step == 6 else loss), parts

    monkeypatch.setattr(Trainer, "compute_loss", poisoned)
    with pytest.raises(RunFailed, match=r"variant\(s\) b diverged and were not published \(the other variants were\)"):
        upcycle(recipe_from_dict(tree), progress=False)
    sweep = tmp_path / "sweep"
    assert (sweep / "a" / "metrics.json").is_file() and (sweep / "c" / "metrics.json").is_file()
    assert not (sweep / "b" / "metrics.json").exists()
    assert torch.load(sweep / "b" / "checkpoint" / "state.pt", weights_only=False)["step"] == 4  # last good one kept

    monkeypatch.setattr(Trainer, "compute_loss", compute_loss)
    tree["variants"] = [VARIANTS[0], {**VARIANTS[1], "train": {"lr": 3e-3, "auxk_coef": 0.0}}, VARIANTS[2]]
    with pytest.raises(ExpertizeError, match=r"unfinished run of a different recipe \(differs at train\.lr \("):
        upcycle(recipe_from_dict(tree), progress=False)
    messages = []
    before = _weights(sweep / "a")
    upcycle(recipe_from_dict(tree), progress=False, restart=True, log=messages.append)
    assert any("variant 'a' is finished" in m for m in messages) and any("variant 'c' is finished" in m for m in messages)
    assert (sweep / "b" / "metrics.json").is_file()
    assert all(torch.equal(before[key], value) for key, value in _weights(sweep / "a").items())


def test_a_finished_variant_of_another_recipe_is_refused(variants_run):
    tmp_path, tree = variants_run
    tree["variants"] = [VARIANTS[1]]
    upcycle(recipe_from_dict(tree), progress=False)
    tree["variants"] = [{**VARIANTS[1], "train": {**VARIANTS[1]["train"], "lr": 5e-3}}]
    with pytest.raises(RunFolderTaken, match=r"variant 'b': .* finished run of a different recipe \(differs at train\.lr"):
        upcycle(recipe_from_dict(tree), progress=False)


def test_variants_need_a_folder_of_their_own(variants_run):
    tmp_path, tree = variants_run
    single = {**tree, "variants": []}
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "metrics.json").write_text("{}")
    with pytest.raises(RunFolderTaken, match=r"holds a single-model run, but this recipe has variants"):
        upcycle(recipe_from_dict(tree), progress=False)
    assert recipe_from_dict(single).variants == []


@pytest.mark.slow  # two variant runs
def test_variants_train_from_an_activation_cache_like_from_live_capture(variants_run):
    tmp_path, tree = variants_run
    tree["variants"] = VARIANTS[1:]
    live = upcycle(recipe_from_dict({**tree, "output_dir": str(tmp_path / "live")}), progress=False)
    cache = capture_activations(recipe_from_dict({**tree, "variants": []}), tmp_path / "cache")
    cached = upcycle(recipe_from_dict({**tree, "data": {**tree["data"], "activation_cache": str(cache)}}),
                     progress=False)
    for name in ("b", "c"):
        _assert_same_weights(cached / name, live / name)


@pytest.mark.slow  # a 2-process torchrun launch
def test_two_process_data_parallel_variants_on_cpu(variants_run):
    """Variants under a 2-process launch (gloo on CPU): every variant trains on the shared stream and is published
    once."""
    tmp_path, tree = variants_run
    tree["variants"] = VARIANTS[1:]
    tree["train"]["tokens_per_step"] = 128
    tree["data"]["train_tokens"] = 128 * 8
    import yaml

    recipe = tmp_path / "ddp.yaml"
    recipe.write_text(yaml.safe_dump(tree), encoding="utf-8")
    torchrun = Path(sys.executable).parent / "torchrun"
    result = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", "-m", "expertize", "upcycle", str(recipe), "--no-progress"],
        capture_output=True, text=True, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"}, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("b", "c"):
        metrics = json.loads((tmp_path / "sweep" / name / "metrics.json").read_text())
        assert (metrics["train"]["steps"], metrics["train"]["tokens"]) == (8, 128 * 8)
    assert result.stdout.count("expertize: wrote") == 1 and result.stdout.count("| b | mxd |") == 1


def test_the_table_says_a_kind_without_selection_bias_was_not_balanced():
    """variants.md names the handling each layer got, not the recipe's request: under `train.balance: floor` a kind
    that chooses no top K by a score (Monet, μMoE) trains unbalanced (distill says so in its log), and the table
    said "floor 0.3" for it."""
    from expertize.conversion.publishing.variants_table import handling
    from expertize.conversion.recipe.layer_config import spec_field_names
    from expertize.modeling import LAYER_KINDS

    train = {"balance": "floor", "balance_floor": 0.3}
    kinds = {kind: "selection_bias" in spec_field_names(kind) for kind in LAYER_KINDS}
    assert any(kinds.values()) and not all(kinds.values())
    for kind, has_bias in kinds.items():
        assert handling(train, kind) == ("floor 0.3" if has_bias else "no balancing (no selection bias)"), kind
    assert handling({"balance": "none"}, "monet_vd") == "none"
