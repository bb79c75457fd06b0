"""The recipes under benchmarks/ (SmolLM2 runs whose commands the results pages give) load as `expertize upcycle`
reads them, with the variables their headers name set: a typo in one would otherwise surface only on the real model,
after a long capture."""

from pathlib import Path

import pytest

from expertize.conversion.recipe.loader import load_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "benchmarks").glob("*.yaml"))


def load_with_variables(path: Path, tmp_path: Path, monkeypatch):
    """The recipe at `path` with $SMOLLM2 a folder name and $DOMAINS a folder of the five domains' files."""
    domains = tmp_path / "domains"
    domains.mkdir()
    for name in ("code", "docs", "wiki", "literature", "stories"):  # benchmarks/data/domain_corpora.py's files
        (domains / f"{name}.jsonl").write_text('{"text": "a"}\n', encoding="utf-8")
    monkeypatch.setenv("SMOLLM2", str(tmp_path / "smollm2"))
    monkeypatch.setenv("DOMAINS", str(domains))
    return load_recipe(path), domains


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_a_benchmark_recipe_loads_with_its_variables_set(path, tmp_path, monkeypatch):
    recipe, domains = load_with_variables(path, tmp_path, monkeypatch)
    assert recipe.base_model == str(tmp_path / "smollm2")
    assert [Path(p).parent for p in recipe.data.paths] == [domains] * 5


def test_the_circuit_cost_probe_is_a_jumprelu_set_at_every_layer(tmp_path, monkeypatch):
    """circuit-tracer's per-layer set covers every decoder layer: the probe must convert all of them with a kind its
    loader reads (conversion/export/circuit_tracer.py refuses anything else, after training)."""
    recipe, _ = load_with_variables(REPO / "benchmarks" / "smollm2_circuit_cost.yaml", tmp_path, monkeypatch)
    assert recipe.layers == "all" and recipe.layer.kind == "jumprelu_transcoder" and recipe.layer.k == 32
