"""benchmarks/specialization.py end to end on a tiny Llama: per seed one activation cache (reused by a rerun), every
kind trained from it, every figure with its interval, the seeds' summary with mean ± sd and the significance counts,
and the measured speed-up line."""

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_base_model, tiny_tokenizer

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.slow  # the benchmark end to end (~13 s)
def test_benchmark_trains_from_one_cache_per_seed_and_prints_intervals(tmp_path, monkeypatch):
    base = tmp_path / "base"
    tiny_base_model("llama").save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    domains = tmp_path / "domains"
    domains.mkdir()
    for name, lo in (("low", 0), ("high", 45)):
        docs = [" ".join(f"w{lo + (7 * i + 3 * j) % 45}" for j in range(12)) for i in range(120)]
        (domains / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    runs = tmp_path / "runs"
    argv = ["specialization.py", "--domains", str(domains), "--model", str(base), "--kinds", "mxd,transcoder",
            "--layer", "1", "--seeds", "0,1", "--context-length", "16", "--train-tokens", "512",
            "--tokens-per-step", "64", "--upcycle-eval-tokens", "64", "--fit-tokens", "96", "--eval-tokens", "64",
            "--document-tokens", "6", "--probe-top", "3", "--bootstrap", "20", "--runs-dir", str(runs),
            "--png", str(tmp_path / "plot.png"), "--out", str(tmp_path / "table.md")]
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", argv)
    import specialization

    assert specialization.main() == 0
    table = (tmp_path / "table.md").read_text()
    assert "Mean ± standard deviation over 2 seeds" in table and "| mxd (2/2) |" in table
    assert "| transcoder (2/2) |" in table and "| dense MLP neurons (2/2) |" in table
    assert table.count("seed 0:") == 1 and table.count("seed 1:") == 1
    assert "Cheap interventions: one masking condition" in table and "identical CE: True" in table
    assert " [" in table and "above " in table  # intervals and directional significance counts
    assert "### Each claim, read out (2 seeds" in table and "**2. Sparse probing (MxD paper)**" in table
    caches = sorted(p.name for p in runs.glob("cache-*"))
    assert len(caches) == 2 and all((runs / c / "cache.json").is_file() for c in caches)  # one per seed
    for seed in (0, 1):
        resolved = (runs / f"seed{seed}" / "runs" / "mxd" / "recipe.resolved.yaml").read_text()
        assert "activation_cache" in resolved and "cache-" in resolved
    rows = json.loads((runs / "rows.json").read_text())
    assert [s["seed"] for s in rows["seeds"]] == [0, 1] and len(rows["seeds"][0]["rows"]) == 2
    row = rows["seeds"][0]["rows"][0]
    assert row["probe_best_1d_ci"][0] <= row["probe_best_1d"] <= row["probe_best_1d_ci"][1]
    # the code share column: the run's own reading (metrics.json), beside ΔCE and FVU
    # (None here: these tiny layers explain nothing, FVU > 1, so no share of it is defined; the table says n/a)
    metrics = json.loads((runs / "seed0" / "runs" / row["kind"] / "metrics.json").read_text())
    assert "fvu_mean_code" in metrics["layers"]["1"] and row["code_share"] == metrics["layers"]["1"]["code_share"]
    assert "| code share |" in table
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert specialization.main() == 0  # a rerun reuses the caches and the finished runs: the same figures
    assert sorted(p.name for p in runs.glob("cache-*")) == caches
    again = json.loads((runs / "rows.json").read_text())
    assert [s["rows"] for s in again["seeds"]] == [s["rows"] for s in rows["seeds"]]
    assert all(s["timing"]["capture and train"] is None for s in again["seeds"])  # nothing trained again
    # --from-rows re-tabulates the finished run from rows.json alone: the same tables and claims, no model needed.
    table = (tmp_path / "table.md").read_text()
    monkeypatch.setattr(sys, "argv", ["specialization.py", "--from-rows", str(runs / "rows.json"),
                                      "--png", str(tmp_path / "again.png"), "--out", str(tmp_path / "again.md")])
    assert specialization.main() == 0
    assert (tmp_path / "again.md").read_text() == table and (tmp_path / "again.png").stat().st_size > 0
    # --train-only reads the same runs (reused) without the specialization passes: one table with intervals
    monkeypatch.setattr(sys, "argv", [*argv[:argv.index("--png")], "--train-only", "--out", str(tmp_path / "t.md")])
    assert specialization.main() == 0
    only = (tmp_path / "t.md").read_text()
    assert "| kind (seeds) | ΔCE | KL | FVU | code share | L0 | dead % |" in only and "| mxd (2/2) |" in only
    assert "Each claim" not in only and "dense MLP neurons" not in only
    kl = [json.loads((runs / f"seed{seed}" / "runs" / "mxd" / "metrics.json").read_text())["ce"]["kl_base_spliced"]
          for seed in (0, 1)]
    mean, low, high = specialization.seed_interval(kl)  # the mean over seeds with its 95 % t-interval
    assert "| mxd (2/2) | " in only and f"| {mean:.4f} [{low:.4f}, {high:.4f}] |" in only


def test_lr_per_kind_and_layer_options(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import argparse

    import pytest
    from specialization import lr_of, lr_text, parse_layer_option, parse_lrs

    assert parse_layer_option("mxd.d_hidden=1536") == ("mxd", "d_hidden", 1536)
    assert parse_layer_option("mxd.options={random_k: true}") == ("mxd", "options", {"random_k": True})
    with pytest.raises(argparse.ArgumentTypeError, match="is not KIND.KEY=VALUE"):
        parse_layer_option("d_hidden=1536")
    args = argparse.Namespace(lr=parse_lrs("mxd=1e-3,transcoder=3e-3"))
    assert [lr_of(args, k) for k in ("mxd", "transcoder", "moe_x")] == [1e-3, 3e-3, 1e-2]  # unnamed: 1e-2
    assert lr_text(args, ["mxd", "transcoder"]) == "lr mxd 0.001, transcoder 0.003"
    args = argparse.Namespace(lr=parse_lrs("3e-3,mxd=1e-3"))
    assert (lr_of(args, "moe_x"), lr_of(args, "mxd"), lr_text(args, ["moe_x"])) == (3e-3, 1e-3, "lr 0.003")
    with pytest.raises(argparse.ArgumentTypeError, match="--lr: 'mxd=fast' is not LR or KIND=LR"):
        parse_lrs("mxd=fast")
