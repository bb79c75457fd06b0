"""benchmarks/real_model.py (issue 48) from its documented CLI: refusals before any work, and a whole run on a model
folder of another family than the SmolLM2 it was written for, whose table `--from-rows` regenerates."""

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


@pytest.mark.slow
def test_a_model_it_was_never_tuned_on_runs_from_the_cli_and_its_rows_regenerate_the_table(tmp_path):
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
    # 2 layers x 2 budgets (2 seeds at 1,024, 1 at 4,096) x 2 kinds, and each layer's trend row of MxD
    assert len([r for r in rows if "| 1,024 |" in r or "| 4,096 |" in r]) == 2 * 2 * 2
    assert len([r for r in rows if r.count("|") == 8]) == 2
    caches = list((tmp_path / "cache").iterdir())
    assert sorted(p.name for p in caches) == ["capture.json", "tiny-gpt2-shakespeare-l1-3-4096"]
    again = run("--from-rows", str(tmp_path / "runs" / "rows.json"), "--out", str(tmp_path / "again.md"), cwd=tmp_path)
    assert again.returncode == 0 and (tmp_path / "again.md").read_text(encoding="utf-8") == table
