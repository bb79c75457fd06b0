"""benchmarks/pipeline_throughput.py: `--variants N` spreads the learning rate around the one the recipe's
distillation trains at, `train.lr: auto` resolved by the recipe's own rule (it multiplied the string "auto")."""

import math
from pathlib import Path

import pytest
from expertize.conversion.recipe import load_recipe
from expertize.conversion.recipe.loader import variant_recipes
from expertize.conversion.training.distill_plan import recipe_schedule

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("lr", ["auto", "0.003"])
def test_the_variants_spread_the_rate_the_recipe_trains_at(monkeypatch, tmp_path, lr):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import pipeline_throughput

    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [f"output_dir={tmp_path}/one", f"train.lr={lr}"])
    expected = recipe_schedule(recipe).lr
    if lr == "auto":
        assert recipe.train.lr == "auto" and expected > 0
    else:
        assert expected == pytest.approx(float(lr))
    many = pipeline_throughput.variants_recipe(recipe, 4, str(tmp_path / "many"))
    rates = [r.train.lr for _, r in variant_recipes(many)]
    factors = [1.0, 2 ** (1 / 3), 2 ** (-1 / 3), 2 ** (2 / 3)]
    assert all(isinstance(rate, float) for rate in rates), rates
    assert rates == pytest.approx([expected * f for f in factors])
    assert [v.name for v in many.variants] == [f"v{i}-lr{expected * f:.3g}" for i, f in enumerate(factors)]
    assert all(math.isclose(recipe_schedule(r).lr, rate) for (_, r), rate in zip(variant_recipes(many), rates))
