"""`torchrun --nproc_per_node 2 -m expertize capture`: one cache from two processes (gloo on CPU), holding the
one-process cache's sequences in its order, that `expertize upcycle` trains from; refusals before any work and no
cache left by a failed process."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from expertize.conversion.capture import capture_activations
from expertize.conversion.cli import main as cli_main
from expertize.conversion.data.cache import CACHE_MANIFEST, ActivationCache, CacheError
from expertize.conversion.recipe import recipe_from_dict

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.fixture
def ranks_run(tiny_run):
    """tiny_run with 125 sequences (8 capture batches of 16, the last short) and a light evaluation."""
    tmp_path, tree = tiny_run
    tree["data"]["train_tokens"] = 2000
    tree["eval"].update(generation_prompts=0, histogram=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tree))
    return tmp_path, tree, recipe


def _launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TORCHRUN, *args], capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _everything(folder: Path) -> tuple[dict, torch.Tensor]:
    cache = ActivationCache(folder)
    return cache.read(list(range(cache.sequences)), cache.layers, torch.device("cpu"), torch.float32)


@pytest.mark.slow  # 5-25 s (subprocesses or a whole upcycle): in CI's opt-in run, off the fast suite's 8 minutes
def test_two_processes_write_the_one_process_cache_that_upcycle_trains_from(ranks_run, capsys):
    tmp_path, tree, recipe = ranks_run
    result = _launch(tmp_path, "-m", "expertize", "capture", str(recipe), "--output", "two",
                     "--shard-tokens", str(40 * 16), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    two = tmp_path / "two"
    manifest = json.loads((two / CACHE_MANIFEST).read_text())
    # Rank 0 captured batches 0-3 (sequences 0-63), rank 1 batches 4-7 (64-124), each in shards of 40 sequences.
    assert [(s["file"], s["sequences"]) for s in manifest["shards"]] == [
        ("shard-r000-00000.safetensors", 40), ("shard-r000-00001.safetensors", 24),
        ("shard-r001-00000.safetensors", 40), ("shard-r001-00001.safetensors", 21)]
    with safe_open(str(two / "shard-r001-00001.safetensors"), framework="pt") as f:
        assert f.metadata()["first_sequence"] == "104"
    assert (manifest["sequences"], manifest["processes"], manifest["exhausted"]) == (125, 2, False)
    assert not list(tmp_path.glob(".two*")), "the staging folder is left"

    one = capture_activations(recipe_from_dict(tree), tmp_path / "one")
    (pairs, ids), (reference, reference_ids) = _everything(two), _everything(one)
    assert torch.equal(ids, reference_ids)  # the same sequences, in the same order
    for layer in (0, 1):  # forwarded in the same batches: the same pairs, bit for bit
        assert torch.equal(pairs[layer][0], reference[layer][0]) and torch.equal(pairs[layer][1], reference[layer][1])
    assert ActivationCache(two).mismatches(recipe_from_dict(tree), [0, 1]) == []

    tree["train"]["checkpoint_every"] = 1000
    cached = tmp_path / "cached.yaml"
    cached.write_text(yaml.safe_dump({**tree, "data": {**tree["data"], "activation_cache": str(two)}}))
    assert cli_main(["upcycle", str(cached), "--no-progress"]) == 0, capsys.readouterr().err
    metrics = json.loads((Path(tree["output_dir"]) / "metrics.json").read_text())
    assert metrics["train"]["steps"] == 7


def test_a_share_smaller_than_a_capture_batch_is_refused_before_any_work(ranks_run, monkeypatch):
    tmp_path, tree, _ = ranks_run
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(CacheError, match=r"RANK, MASTER_ADDR, MASTER_PORT are not set: launch .* with `torchrun"):
        capture_activations(recipe_from_dict(tree), tmp_path / "cache")
    for key, value in {"RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    tree["train"]["capture_batch_sequences"] = 64  # 125 sequences: 2 batches for 4 processes
    with pytest.raises(CacheError, match=r"125 sequences, 2 capture batch\(es\) of 64 .* fewer than the 4 processes"):
        capture_activations(recipe_from_dict(tree), tmp_path / "cache")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "corpus.txt", "recipe.yaml"]


FAILING_RANK = """
import os, sys
from expertize.conversion.data.mlp_pairs import MlpCapture

if os.environ["RANK"] == "1":  # rank 1's third forward fails, after it wrote a shard
    calls, original = [], MlpCapture.__call__

    def failing(self, input_ids):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("a failure on rank 1")
        return original(self, input_ids)

    MlpCapture.__call__ = failing
from expertize.conversion.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # a 2-process torchrun launch
def test_a_failure_on_one_process_leaves_no_cache(ranks_run):
    tmp_path, tree, recipe = ranks_run
    script = tmp_path / "failing.py"
    script.write_text(textwrap.dedent(FAILING_RANK))
    result = _launch(tmp_path, str(script), "capture", str(recipe), "--output", "cache", "--shard-tokens", "256",
                     "--no-progress")
    assert result.returncode != 0
    assert "capture: error: the capture failed on rank 1: a failure on rank 1; nothing was kept" in result.stderr
    assert not (tmp_path / "cache").exists() and not list(tmp_path.glob(".cache*")), "a failed capture left files"
