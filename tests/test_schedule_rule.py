"""`train.warmup_steps: auto` and the schedule's defaults (conversion/recipe/schedule_rule.py, issue 40): the rule's
values, what a recipe without schedule keys resolves to and records, the refusal of a warm-up not shorter than its
run (before the run folder is claimed), the paper recipes' own settings, and a minimal recipe's fidelity against a
small grid of schedules on the quickstart's model."""

import json
from pathlib import Path

import pytest
import yaml
from expertize.conversion.cli import main as cli_main
from expertize.conversion.recipe import HealConfig, TrainConfig, load_recipe, recipe_from_dict, recipe_to_dict
from expertize.conversion.recipe.lr_rule import rule_lr
from expertize.conversion.recipe.schedule_rule import (
    HEAL_MIN_LR_RATIO,
    HEAL_SCHEDULE,
    HEAL_WARMUP_FRACTION,
    MIN_LR_RATIO,
    SCHEDULE,
    WARMUP_FRACTION,
    rule_warmup,
)
from expertize.conversion.training.distill_plan import recipe_schedule
from expertize.conversion.training.engine import OptimConfig, lr_lambda
from expertize.conversion.upcycle import upcycle

RECIPES = Path(__file__).parent.parent / "recipes"
SCHEDULE_KEYS = ("lr", "warmup_steps", "schedule", "min_lr_ratio")


# -- the rule ---------------------------------------------------------------------------------------------------------


def test_the_rule_is_a_tenth_of_the_steps_then_cosine_to_a_tenth_of_the_rate():
    # The schedule the lr rule was measured under (docs/results/dead_units.md): warm-up a tenth, cosine to 0.1 lr.
    assert (WARMUP_FRACTION, SCHEDULE, MIN_LR_RATIO) == (0.1, "cosine", 0.1)
    assert (HEAL_WARMUP_FRACTION, HEAL_SCHEDULE, HEAL_MIN_LR_RATIO) == (WARMUP_FRACTION, SCHEDULE, MIN_LR_RATIO)
    expected = {0: 0, 1: 0, 2: 1, 4: 1, 5: 1, 14: 1, 15: 2, 25: 3, 48: 5, 195: 20, 320: 32, 1000: 100,
                117_187: 11_719}
    assert {steps: rule_warmup(steps) for steps in expected} == expected  # nearest, halves up; >= 1 from 2 steps
    assert all(0 < rule_warmup(steps) < steps for steps in range(2, 3000))  # never refused by its own check
    assert rule_warmup(100, 0.5) == 50 and rule_warmup(3, 0.9) == 2  # a larger share stays below the run


def test_the_defaults_are_auto_and_the_measured_schedule_for_distillation_and_healing():
    train, heal = TrainConfig(), HealConfig()
    assert (train.lr, train.warmup_steps, train.schedule, train.min_lr_ratio) == ("auto", "auto", "cosine", 0.1)
    assert (heal.warmup_steps, heal.schedule, heal.min_lr_ratio) == ("auto", "cosine", 0.1)
    resolved = train.resolved(320)
    assert (resolved.lr, resolved.warmup_steps, resolved.schedule, resolved.min_lr_ratio) == (1e-2, 32, "cosine", 0.1)
    assert (resolved.lr_rule, resolved.warmup_rule, resolved.lr_auto, resolved.warmup_auto) == (1e-2, 32, True, True)
    fixed = TrainConfig(lr=3e-4, warmup_steps=7, schedule="constant").resolved(320)
    assert (fixed.lr, fixed.warmup_steps, fixed.schedule) == (3e-4, 7, "constant")  # numbers are used as given
    assert (fixed.lr_rule, fixed.warmup_rule) == (1e-2, 32) and fixed.note("train") is None  # the rules, recorded
    healed = HealConfig().resolved(976)  # the default budget: 1M tokens, context 128, 8 sequences per step
    assert (healed.warmup_steps, healed.lr, healed.lr_rule) == (98, 1e-4, None)  # the former default was 100
    assert TrainConfig(warmup_steps="auto").warmup_steps == "auto"
    with pytest.raises(ValueError, match=r'train\.warmup_steps: must be >= 0 or "auto", got -1'):
        TrainConfig(warmup_steps=-1)
    with pytest.raises(ValueError, match=r'heal\.warmup_steps: must be >= 0 or "auto", got -2'):
        HealConfig(warmup_steps=-2)


# -- a recipe without schedule keys -----------------------------------------------------------------------------------


def test_a_recipe_without_train_schedule_keys_trains_and_records_the_rule(tiny_run):
    """48 steps: warm-up 5, cosine to 0.1 of the rule's 1e-2. The optimizer runs exactly that schedule
    (train_log.jsonl, every step), the log line says it, metrics.json records it beside the rules' values, the card's
    Training rows show it, and recipe.resolved.yaml keeps `auto`."""
    _, tree = tiny_run
    for key in SCHEDULE_KEYS:
        tree["train"].pop(key, None)
    tree["train"].update(log_every=1, checkpoint_every=0)
    tree["layers"] = [0]
    messages = []
    out = upcycle(recipe_from_dict(tree), progress=False, log=messages.append)
    metrics = json.loads((out / "metrics.json").read_text())
    train = metrics["train"]
    assert train["steps"] == 48
    assert (train["lr"], train["lr_rule"]) == (1e-2, rule_lr(48))
    assert (train["warmup_steps"], train["warmup_rule"], train["schedule"], train["min_lr_ratio"]) == (
        5, 5, "cosine", 0.1)
    factor = lr_lambda(OptimConfig(lr=1e-2, warmup_steps=5, schedule="cosine", min_lr_ratio=0.1), 48)
    logged = {json.loads(line)["step"]: json.loads(line)["lr"] for line in (out / "train_log.jsonl").open()}
    assert sorted(logged) == list(range(1, 49))
    # A record at step n holds the rate of the next step: the peak after the warm-up, 0.1 of it at the end.
    assert [logged[n] for n in logged] == pytest.approx([1e-2 * factor(n) for n in logged])
    assert logged[4] == pytest.approx(1e-2) and logged[48] == pytest.approx(1e-3)
    notes = [part for m in messages for part in m.split("; ") if "train.warmup_steps auto" in part]
    assert notes == ["train.lr auto: 0.01, train.warmup_steps auto: 5, then cosine to 0.1 lr, for 48 steps (the rules "
                     "of conversion/recipe/lr_rule.py, schedule_rule.py)"], messages
    assert metrics["recipe_summary"]["optimizer"] == "AdamW (lr auto (0.01), warmup auto (5), cosine to 0.1 lr)"
    resolved = yaml.safe_load((out / "recipe.resolved.yaml").read_text())["train"]
    assert (resolved["lr"], resolved["warmup_steps"], resolved["schedule"], resolved["min_lr_ratio"]) == (
        "auto", "auto", "cosine", 0.1)


@pytest.mark.slow  # an upcycle with healing (~4 s; tests/test_heal.py heals in the fast suite)
def test_healing_resolves_its_own_warmup_and_records_it(tiny_run):
    """heal.warmup_steps: auto is a tenth of the healing steps: 128 sequences of 16 tokens // 8 = 16 steps -> 2."""
    _, tree = tiny_run
    tree["layers"], tree["data"]["train_tokens"] = [0], 256 * 8
    tree["heal"] = {"tokens": 2048, "batch_sequences": 8, "lr": 3e-3, "log_every": 1, "checkpoint_every": 0}
    recipe = recipe_from_dict(tree)
    assert recipe.heal_steps() == 16 and recipe.heal_schedule().warmup_steps == 2
    messages = []
    out = upcycle(recipe, progress=False, log=messages.append)
    heal = json.loads((out / "metrics.json").read_text())["heal"]
    assert (heal["steps"], heal["warmup_steps"], heal["warmup_rule"], heal["schedule"], heal["min_lr_ratio"]) == (
        16, 2, 2, "cosine", 0.1)
    rates = [json.loads(line)["lr"] for line in (out / "heal_log.jsonl").open()]
    factor = lr_lambda(OptimConfig(lr=3e-3, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1), 16)
    assert rates == pytest.approx([3e-3 * factor(n) for n in range(1, 17)])
    assert "heal.lr 0.003, heal.warmup_steps auto: 2, then cosine to 0.1 lr, for 16 steps" in " | ".join(messages)
    summary = json.loads((out / "metrics.json").read_text())["recipe_summary"]
    assert "warmup auto (2), cosine to 0.1 lr" in summary["healing"]


# -- a warm-up not shorter than its run is refused before any work -------------------------------------------------


def _write(tmp_path: Path, tree: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree), encoding="utf-8")
    return path


def _refused(capsys, recipe: Path, *sets: str) -> str:
    argv = ["upcycle", str(recipe), "--no-progress"]
    for s in sets:
        argv += ["--set", s]
    assert cli_main(argv) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("expertize upcycle: error: "), err
    return lines[0]


@pytest.mark.parametrize("warmup", [48, 5000])
def test_a_warmup_not_shorter_than_the_run_is_refused_before_the_folder_is_claimed(tiny_run, capsys, warmup):
    tmp_path, tree = tiny_run  # 12,288 tokens // 256 per step = 48 steps
    out = Path(tree["output_dir"])
    line = _refused(capsys, _write(tmp_path, tree), f"train.warmup_steps={warmup}")
    assert (f"train.warmup_steps={warmup:,} is not below the 48 steps of the run (data.train_tokens=12,288 // "
            "train.tokens_per_step=256)") in line, line
    assert "write train.warmup_steps: auto (10% of the steps: 5) or a number below 48" in line, line
    assert not out.exists()  # nothing written: no folder, no lock, no claimed recipe
    # One step shorter runs (the check is `warmup_steps < steps`).
    assert recipe_from_dict({**tree, "train": {**tree["train"], "warmup_steps": 47}}).check_warmups() is None


def test_a_variants_warmup_and_a_heal_warmup_are_checked_too(tiny_run, capsys):
    tmp_path, tree = tiny_run
    sweep = tmp_path / "sweep"
    tree.update(output_dir=str(sweep), variants=[{"name": "ok"}, {"name": "long", "train": {"warmup_steps": 60}}])
    line = _refused(capsys, _write(tmp_path, tree))
    assert "variant 'long': train.warmup_steps=60 is not below the 48 steps of the run" in line, line
    assert not sweep.exists()
    # The recipe's own warm-up, inherited by every variant: the first variant is named too.
    line = _refused(capsys, _write(tmp_path, tree), "train.warmup_steps=100")
    assert "variant 'ok': train.warmup_steps=100 is not below the 48 steps" in line, line
    assert not sweep.exists()
    del tree["variants"]
    tree.update(output_dir=str(tmp_path / "healed"),
                heal={"tokens": 2048, "batch_sequences": 8, "warmup_steps": 16})  # 128 sequences // 8 = 16 steps
    line = _refused(capsys, _write(tmp_path, tree))
    assert ("heal.warmup_steps=16 is not below the 16 steps of the run (heal.tokens=2,048 in sequences of "
            "data.context_length=16 // heal.batch_sequences=8)") in line, line
    assert "heal.warmup_steps: auto (10% of the steps: 2) or a number below 16" in line, line
    assert not (tmp_path / "healed").exists()


def test_a_recipe_made_under_the_former_defaults_still_loads():
    """The check is preflight's, not the loader's: a finished run's recipe.resolved.yaml with the paper's 5,000
    warm-up steps on a short run still loads (eval, plot-sweep and reruns read it)."""
    tree = {"base_model": "gpt2", "layers": [0], "layer": {"kind": "mxd", "k": 32, "match_transcoder": 32},
            "data": {"source": "hub", "name": "x", "train_tokens": 200_000},
            "train": {"warmup_steps": 5000, "schedule": "constant", "min_lr_ratio": 0.0}, "output_dir": "runs/x"}
    recipe = recipe_from_dict(tree)
    assert recipe.distill_steps() == 48 and recipe_schedule(recipe).warmup_steps == 5000


# -- the paper recipes keep the papers' settings ---------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((RECIPES / "paper").glob("*.yaml")), ids=lambda p: p.stem)
def test_the_paper_recipes_write_the_papers_schedule_out(path):
    text = path.read_text(encoding="utf-8")
    written = yaml.safe_load(text)["train"]
    assert {key: written.get(key) for key in SCHEDULE_KEYS} == {
        "lr": 1e-4, "warmup_steps": 5000, "schedule": "constant", "min_lr_ratio": 0.0}, "set explicitly, not defaults"
    assert "it assumes the paper's budget" in text
    recipe = load_recipe(path)
    schedule = recipe_schedule(recipe)
    assert (schedule.lr, schedule.warmup_steps, schedule.schedule, schedule.min_lr_ratio) == (
        1e-4, 5000, "constant", 0.0)
    assert recipe.distill_steps() > 100_000 and recipe.check_warmups() is None  # the paper's budget: ~117k steps
    assert {key: recipe_to_dict(recipe)["train"][key] for key in SCHEDULE_KEYS} == {
        "lr": 1e-4, "warmup_steps": 5000, "schedule": "constant", "min_lr_ratio": 0.0}


# -- a minimal recipe trains close to the best of a grid of schedules -----------------------------------------------

GRID_STEPS = 96
GRID_TOKENS_PER_STEP = 1024  # the quickstart's and issue 40's step (the recipe's one train: key: the budget's step)
GRID = [
    {"name": "default"},  # no schedule keys: lr, warm-up and schedule are the defaults
    {"name": "warmup0-constant", "train": {"warmup_steps": 0, "schedule": "constant"}},
    {"name": "warmup5pct-cosine", "train": {"warmup_steps": round(0.05 * GRID_STEPS), "schedule": "cosine"}},
    {"name": "warmup20pct-cosine", "train": {"warmup_steps": round(0.2 * GRID_STEPS), "schedule": "cosine"}},
    {"name": "warmup10pct-linear0", "train": {"warmup_steps": round(0.1 * GRID_STEPS), "schedule": "linear",
                                              "min_lr_ratio": 0.0}},
]


@pytest.mark.slow  # eight variants of a real training (~20 s, the default run's longest test): the opt-in run has it
def test_a_minimal_recipe_trains_within_1_3x_of_the_best_schedule_on_the_quickstart_model(tmp_path):
    """The quickstart's model and text, a recipe naming only the model, the layer, the text and the budget (its
    tokens and their step size: no other `train:` key), against four other schedules on the same activation stream
    (one `variants:` run): its held-out KL(base ‖ spliced) is within 1.3x of the grid's best (issue 40's "done when"
    on a shipped tiny model). Measured when written (3 seeds, this budget): 1.07-1.14x, the best being a constant
    rate without warm-up; at 48 steps of 4,096 tokens 1.22-1.26x (20 s here against 33 s there)."""
    quickstart = recipe_to_dict(load_recipe("quickstart"))
    data = {**quickstart["data"], "train_tokens": GRID_STEPS * GRID_TOKENS_PER_STEP, "eval_tokens": 8192}
    tree = {
        "base_model": quickstart["base_model"],
        "layers": [2],
        "layer": {"kind": "mxd", "k": 16, "match_transcoder": 8},
        "data": data,
        "train": {"tokens_per_step": GRID_TOKENS_PER_STEP},
        "eval": {"generation_prompts": 0, "histogram": False},
        "output_dir": str(tmp_path / "grid"),
        "variants": GRID,
    }
    recipe = recipe_from_dict(tree)
    assert recipe.distill_steps() == GRID_STEPS
    upcycle(recipe, progress=False)
    kl = {v["name"]: json.loads((tmp_path / "grid" / v["name"] / "metrics.json").read_text())["ce"]["kl_base_spliced"]
          for v in GRID}
    default = json.loads((tmp_path / "grid" / "default" / "metrics.json").read_text())["train"]
    assert (default["lr"], default["warmup_steps"], default["schedule"], default["min_lr_ratio"]) == (
        1e-2, 10, "cosine", 0.1)
    assert kl["default"] <= 1.3 * min(kl.values()), kl
