"""benchmarks/real_model.py (issue 48) from its documented CLI: refusals before any work, and a whole run on a model
folder of another family than the SmolLM2 it was written for, whose table `--from-rows` regenerates."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import shared_data_dir

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "real_model.py"
COLUMNS = ("| model | layer | tokens | kind | units | seeds | KL | KL / transcoder | ΔCE | FVU | code share | L0 | "
           "dead % | train s (run) |")


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(cwd)})


@pytest.mark.parametrize("args, message", [
    (["--model", "no/such/folder", "--corpus", "x", "--cache-dir", "c", "--runs-dir", "r"],
     "--model 'no/such/folder': not a local model folder"),
    (["--kinds", "mxd,moe_x"], "--kinds must include transcoder"),
    (["--kinds", "transcoder,mxdd"], "--kinds: unknown ['mxdd']"),
])
def test_bad_arguments_are_refused_before_any_work(tmp_path, args, message):
    model = shared_data_dir() / "models" / "tiny-gpt2-shakespeare"
    base = ["--model", str(model), "--corpus", str(shared_data_dir() / "corpora" / "tinyshakespeare.txt"),
            "--cache-dir", str(tmp_path / "cache"), "--runs-dir", str(tmp_path / "runs")]
    done = run(*base, *args, cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "cache").exists() and not (tmp_path / "runs").exists()


def test_a_cache_of_more_layers_and_more_tokens_serves_a_smaller_run(tmp_path, monkeypatch):
    """A run of one layer at a smaller budget reads the cache captured for three layers at the top budget (a prefix
    of its stream) instead of capturing again; a cache missing a layer or short of tokens is not taken."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from real_model import find_cache

    for name in ("smollm2-l5-15-25-1048576", "smollm2-l15-1000", "other-l6-9999999"):
        (tmp_path / name).mkdir()
    assert find_cache(tmp_path, "smollm2", [15], 262_144).name == "smollm2-l5-15-25-1048576"
    assert find_cache(tmp_path, "smollm2", [5, 25], 1_048_576).name == "smollm2-l5-15-25-1048576"
    assert find_cache(tmp_path, "smollm2", [15], 1000).name == "smollm2-l15-1000"  # the first that fits, by name
    assert find_cache(tmp_path, "smollm2", [15], 2_000_000) is None  # too few tokens
    assert find_cache(tmp_path, "smollm2", [6], 1000) is None  # layer 6 is only in another model's cache


def test_two_captures_of_one_name_whose_shards_differ_get_different_digests(tmp_path, monkeypatch):
    """The cache's content digest reads its shards' sha256 (cache.json): the same shards give the same digest wherever
    the folder lies, one changed shard another."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from real_model import cache_digest

    def capture(folder: Path, hashes: list[str]) -> Path:
        folder.mkdir()
        (folder / "cache.json").write_text(json.dumps({"shards": [{"file": f"shard-{i:05d}.safetensors", "sha256": h}
                                                                   for i, h in enumerate(hashes)]}))
        return folder

    first = cache_digest(capture(tmp_path / "a", ["1d" * 32, "31" * 32]))
    assert first == cache_digest(capture(tmp_path / "b", ["1d" * 32, "31" * 32]))
    assert first != cache_digest(capture(tmp_path / "c", ["1d" * 32, "32" * 32]))
    assert len(first) == 12 and int(first, 16) >= 0


@pytest.mark.slow
def test_a_model_it_was_never_tuned_on_runs_from_the_cli_and_its_rows_regenerate_the_table(tmp_path, monkeypatch):
    """tiny-gpt2-shakespeare (GPT-2: Conv1D MLP, biases, GELU) where the benchmark was written for SmolLM2 (Llama):
    one cache for both layers, every kind asked for at both budgets, the columns the results page shows."""
    data = shared_data_dir()
    done = run("--model", str(data / "models" / "tiny-gpt2-shakespeare"),
               "--corpus", str(data / "corpora" / "tinyshakespeare.txt"), "--separator", "blank_line",
               "--layers", "1,3", "--budgets", "1024,4096", "--seeds", "0,1", "--top-seeds", "1",
               "--kinds", "transcoder,mxd", "--eval-tokens", "2048", "--cache-dir", str(tmp_path / "cache"),
               "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "table.md"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (tmp_path / "table.md").read_text(encoding="utf-8")
    assert COLUMNS in table
    rows = [line for line in table.splitlines() if line.startswith("| tiny-gpt2-shakespeare |")]
    # 2 layers x 2 budgets (2 seeds at 1,024, 1 at 4,096) x 2 kinds, each layer's trend row of MxD, and MxD's
    # model-wide row per budget (4 runs at 1,024: both layers' two seeds; 2 at 4,096)
    assert len([r for r in rows if r.count("|") == 15 and ("| 1,024 |" in r or "| 4,096 |" in r)]) == 2 * 2 * 2
    assert len([r for r in rows if r.count("|") == 8]) == 2
    assert [r.split("|")[4].strip() for r in rows if r.count("|") == 7] == ["4 (1, 3)", "2 (1, 3)"]
    caches = list((tmp_path / "cache").iterdir())
    assert sorted(p.name for p in caches) == ["capture.json", "tiny-gpt2-shakespeare-l1-3-4096"]
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from real_model import cache_digest

    digest = cache_digest(tmp_path / "cache" / "tiny-gpt2-shakespeare-l1-3-4096")
    assert f"(content {digest})" in table  # the budget line names the capture the rows were trained on
    saved = json.loads((tmp_path / "runs" / "rows.json").read_text(encoding="utf-8"))
    assert {r["cache"] for r in saved["rows"]} == {digest}
    again = run("--from-rows", str(tmp_path / "runs" / "rows.json"), "--out", str(tmp_path / "again.md"), cwd=tmp_path)
    assert again.returncode == 0 and (tmp_path / "again.md").read_text(encoding="utf-8") == table


LM_EVAL_SCRIPT = REPO / "benchmarks" / "real_model_lm_eval.py"


def two_domains(folder: Path) -> Path:
    """A corpus folder of two real domains as JSON lines: the play's speeches and wikitext's lines."""
    import json

    data = shared_data_dir() / "corpora"
    folder.mkdir()
    speeches = (data / "tinyshakespeare.txt").read_text(encoding="utf-8").split("\n\n")
    lines = [x.strip() for x in (data / "wikitext2_test.raw").read_text(encoding="utf-8").splitlines()
             if len(x.strip()) > 200]
    for name, docs in (("plays", speeches[:1500]), ("wiki", lines[:1500])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs),
                                              encoding="utf-8")
    return folder


@pytest.mark.slow
def test_the_whole_model_table_splices_the_trained_layers_and_scores_them_as_the_harness_does(tmp_path):
    """benchmarks/real_model_lm_eval.py after a --keep-weights run: one folder per kind with both trained layers
    spliced in and every other weight the base's; its bits per byte and accuracy recomputed from the harness's
    per-document samples equal the harness's own aggregates, and every difference sits inside its interval."""
    import json

    import torch
    from expertize.conversion.surgery.splice import load_expertize_model
    from transformers import AutoModelForCausalLM

    model = shared_data_dir() / "models" / "tiny-gpt2-shakespeare"
    corpus = two_domains(tmp_path / "domains")
    trained = run("--model", str(model), "--corpus", str(corpus), "--layers", "1,3", "--budgets", "2048",
                  "--seeds", "0", "--top-seeds", "1", "--kinds", "transcoder,mxd", "--eval-tokens", "1024",
                  "--cache-dir", str(tmp_path / "cache"), "--runs-dir", str(tmp_path / "runs"), "--keep-weights",
                  cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    done = subprocess.run(
        [sys.executable, str(LM_EVAL_SCRIPT), "--model", str(model), "--corpus", str(corpus), "--runs-dir",
         str(tmp_path / "runs"), "--layers", "1,3", "--budget", "2048", "--seed", "0", "--kinds", "transcoder,mxd",
         "--docs", "8", "--chars", "600", "--out-dir", str(tmp_path / "out"), "--out", str(tmp_path / "table.md")],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]

    composed = load_expertize_model(tmp_path / "out" / "models" / "mxd")
    base = AutoModelForCausalLM.from_pretrained(model)
    assert sorted(composed.sparse_layers()) == [1, 3]
    for layer in (1, 3):
        alone = load_expertize_model(tmp_path / "runs" / f"l{layer}-b2048-s0" / "mxd").sparse_layers()[layer]
        for name, tensor in alone.state_dict().items():
            assert torch.equal(composed.sparse_layers()[layer].state_dict()[name], tensor), (layer, name)
    dense = {k: v for k, v in base.state_dict().items()
             if not k.startswith(("transformer.h.1.mlp.", "transformer.h.3.mlp."))}
    mine = composed.state_dict()
    assert len(dense) > 20 and all(torch.equal(mine[k], v) for k, v in dense.items())

    table = (tmp_path / "table.md").read_text(encoding="utf-8")
    rows = [line.strip("| ").split(" | ") for line in table.splitlines()
            if line.startswith(("| transcoder |", "| mxd |"))]
    assert sorted((r[0], r[1]) for r in rows) == [(k, d) for k in ("mxd", "transcoder") for d in ("plays", "wiki")]
    for kind in ("transcoder", "mxd"):
        out = tmp_path / "out" / "lm_eval" / kind
        results = json.loads(next((out / "model").glob("results_*.json")).read_text(encoding="utf-8"))["results"]
        row = next(r for r in rows if r[0] == kind and r[1] == "wiki")
        assert float(row[4]) == pytest.approx(results["held_wiki_ppl"]["bits_per_byte,none"], abs=5e-5)
        assert float(row[8]) == pytest.approx(results["held_wiki_cloze"]["acc,none"], abs=5e-4)
    for r in rows:  # each difference inside its own bootstrap interval
        for delta in (r[5], r[9]):
            point, bounds = delta.split(" [")
            low, high = (float(x) for x in bounds.rstrip("]").split(", "))
            assert low <= float(point) <= high, r
    assert "L1 KL" in table and "L3 KL" in table


def test_across_depths_pools_each_kinds_paired_ratios_over_layers_and_seeds(monkeypatch):
    """The model-wide row: every (layer, seed) run's own KL ratio to its transcoder, their mean and Student-t interval
    (here 4 runs: 3 degrees of freedom, t = 3.182); a budget with one run gets no row."""
    import math
    import statistics

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import real_model
    rows, ratios = [], []
    for layer, seed, base, mxd in [(5, 0, 0.05, 0.049), (5, 1, 0.04, 0.042), (15, 0, 0.03, 0.027), (15, 1, 0.02, 0.019)]:
        for variant, kl in (("transcoder", base), ("mxd", mxd)):
            rows.append({"model": "m", "layer": layer, "budget": 1024, "variant": variant, "seed": seed, "kl": kl,
                         "share": 0.9 if variant == "mxd" else 1.0})
        ratios.append(mxd / base)
    rows += [{"model": "m", "layer": 5, "budget": 256, "variant": v, "seed": 0, "kl": 0.1, "share": 1.0}
             for v in ("transcoder", "mxd")]
    text = real_model.across_depths(rows)
    mean, half = statistics.fmean(ratios), 3.182 * statistics.stdev(ratios) / math.sqrt(4)
    assert f"| m | 1,024 | mxd | 4 (5, 15) | {mean:.3f} [{mean - half:.3f}, {mean + half:.3f}] | 0.90–0.90 |" in text
    assert "| 256 |" not in text and "| transcoder |" not in text
