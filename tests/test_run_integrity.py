"""A run can never be lost, mixed or misdiagnosed (issue 23): the run folder's identity does not depend on how
output_dir is spelled, a second run on a folder in use is refused, a damaged activation cache is named, one corpus
reader serves every command, and the README's own-text evaluation flow works on the quickstart model."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from expertize.conversion.cli import main as cli_main
from expertize.conversion.publishing.run_folder import LOCK, RunFolder, RunFolderBusy
from expertize.conversion.recipe import recipe_from_dict, recipe_to_dict

# -- 1. the folder's identity -------------------------------------------------------------------------------------


def test_resume_does_not_depend_on_how_output_dir_and_paths_are_spelled(tiny_run, monkeypatch):
    """Ctrl-C a run of output_dir=runs/int3, rerun it as runs/int3/, as the absolute path, or as ../runs/int3 from a
    subfolder (data.paths spelled relative too): it resumes. Before: refused "differs at output_dir ... pass
    --restart", and following that advice deleted the checkpoint."""
    tmp_path, tree = tiny_run
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    tree = {**tree, "output_dir": "runs/int3", "data": {**tree["data"], "paths": ["corpus.txt"]}}
    first = RunFolder("runs/int3")
    assert first.claim(recipe_to_dict(recipe_from_dict(tree))) is False
    first.unlock()
    first.train_state.write_bytes(b"state")

    spellings = [("runs/int3/", tmp_path), (str(tmp_path / "runs" / "int3"), tmp_path),
                 ("../runs/int3", tmp_path / "sub"), ("./runs//int3", tmp_path)]
    for output_dir, cwd in spellings:
        monkeypatch.chdir(cwd)
        corpus = os.path.relpath(tmp_path / "corpus.txt", cwd)
        again = {**tree, "output_dir": output_dir, "data": {**tree["data"], "paths": [corpus]}}
        folder = RunFolder(output_dir)
        assert folder.check_claimable(recipe_to_dict(recipe_from_dict(again))) is True, (output_dir, cwd)
        assert folder.claim(recipe_to_dict(recipe_from_dict(again))) is True
        folder.unlock()
        assert folder.train_state.read_bytes() == b"state"
    # The claim records no spelling: no output_dir, the corpus as an absolute path.
    claimed = yaml.safe_load(first.claimed_recipe_path.read_text())
    assert "output_dir" not in claimed and claimed["data"]["paths"] == [str(tmp_path / "corpus.txt")]


# -- 2. one run per folder ----------------------------------------------------------------------------------------


def test_a_second_run_on_a_folder_in_use_is_refused_naming_the_holder(tiny_run, capsys):
    """Two `expertize upcycle` on one folder: the second (and a --restart from a second shell) exits 2 naming the
    first one's pid and touches nothing; once the first is killed the folder is free again and resuming it gives
    one clean log. Before: both trained and interleaved their steps in one train_log.jsonl (exit 0, 0), and
    --restart killed the first run."""
    tmp_path, tree = tiny_run
    tree["eval"].update(generation_prompts=0, histogram=False)
    tree["data"]["train_tokens"] = 256 * 16
    recipe = tmp_path / "run.yaml"
    recipe.write_text(yaml.safe_dump(tree), encoding="utf-8")
    out = Path(tree["output_dir"])
    first = subprocess.Popen(
        [sys.executable, "-m", "expertize", "upcycle", str(recipe), "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "HF_HUB_OFFLINE": "1"}, text=True,
    )
    try:
        deadline = time.time() + 120
        while not (out / "checkpoint" / "recipe.resolved.yaml").is_file():  # claimed (under the lock)
            assert first.poll() is None, f"the first run ended before claiming its folder: {first.stderr.read()}"
            assert time.time() < deadline
            time.sleep(0.005)
        first.send_signal(signal.SIGSTOP)  # holds the folder for as long as the test needs
        assert not (out / "metrics.json").exists() and (out / LOCK).read_text().strip() == str(first.pid)
        before = sorted(p.name for p in out.rglob("*"))
        for extra in ([], ["--restart"]):
            assert cli_main(["upcycle", str(recipe), "--no-progress", *extra]) == 2
            err = capsys.readouterr().err
            assert f"is in use by another expertize run (pid {first.pid}" in err and "Traceback" not in err, err
        assert sorted(p.name for p in out.rglob("*")) == before
        with pytest.raises(RunFolderBusy, match=f"pid {first.pid}"):
            RunFolder(out).claim(recipe_to_dict(recipe_from_dict(tree)))
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The kernel released the lock with the process: the folder resumes (or starts) and finishes with one log.
    assert cli_main(["upcycle", str(recipe), "--no-progress"]) == 0
    steps = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 16
    assert not (out / LOCK).exists()


# -- 3. a damaged activation cache --------------------------------------------------------------------------------


def test_a_damaged_cache_shard_is_named_not_reported_as_divergence(tiny_run, capsys):
    """4 KB of a shard overwritten in place (same size): the run stops naming the shard (exit 1), never "distil
    diverged ... Lower train.lr" (before) or a silent run on damaged pairs; a truncated shard is refused up front."""
    from expertize.conversion.data.cache import capture_activations

    tmp_path, tree = tiny_run
    tree["eval"].update(generation_prompts=0, histogram=False)
    tree["data"]["train_tokens"] = 256 * 16
    cache = capture_activations(recipe_from_dict(tree), tmp_path / "cache")
    shard = cache / json.loads((cache / "cache.json").read_text())["shards"][0]["file"]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xff" * 4096)  # NaN float32s
    assert shard.stat().st_size == size
    recipe = tmp_path / "cached.yaml"
    recipe.write_text(yaml.safe_dump({**tree, "data": {**tree["data"], "activation_cache": str(cache)}}), "utf-8")
    assert cli_main(["upcycle", str(recipe), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"shard {shard} is damaged: its sha256" in err and "diverged" not in err and "Traceback" not in err, err
    assert (Path(tree["output_dir"]) / "checkpoint").is_dir() and not (Path(tree["output_dir"]) / "metrics.json").exists()

    with open(shard, "r+b") as f:
        f.truncate(size - 4096)
    assert cli_main(["upcycle", str(recipe), "--no-progress"]) == 2
    assert f"shard {shard} is damaged: {size - 4096:,} bytes where cache.json recorded {size:,}" in capsys.readouterr().err
