"""The failure catalogue of `expertize upcycle`: the mistakes users really make, each refused before any work (or
reported as a failure after it) with a message that names the problem and the fix, never a raw traceback, never a
locked folder and never a broken result that exits 0.

Exit codes: 0 success, 2 input refused up front (nothing written), 1 a run that started and failed (what was kept and
how to continue are in the message), 130 interrupted.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from expertize.conversion.cli import main as cli_main


def _recipe(tmp_path: Path, tree: dict, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree), encoding="utf-8")
    return path


def _run(capsys, recipe: Path, *sets: str, extra: tuple[str, ...] = ()) -> tuple[int, str, str]:
    argv = ["upcycle", str(recipe), "--no-progress", *extra]
    for s in sets:
        argv += ["--set", s]
    code = cli_main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _assert_untouched(out_dir: Path) -> None:
    """A refused start leaves no trace: no folder, or one the run never claimed."""
    assert not (out_dir / "checkpoint").exists(), sorted(p.name for p in out_dir.rglob("*"))
    assert not (out_dir / "metrics.json").exists()


# -- 1. a failed start never locks the folder -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("base_model=/nonexistent/model", "does not exist"),
        ("layers=[7]", "out of range"),
        ("layer.k=65", "k"),
        ("data.paths=[/nonexistent/corpus.txt]", "corpus.txt"),
        ("base_model=someone/not-cached-model", "offline"),
    ],
    ids=["missing-base", "layer-range", "k-greater-than-n", "unreadable-corpus", "offline-hub-id"],
)
def test_a_failed_start_leaves_the_folder_free_for_the_corrected_command(tiny_run, capsys, override, message):
    tmp_path, tree = tiny_run
    recipe = _recipe(tmp_path, tree)
    code, _, err = _run(capsys, recipe, override)
    assert code == 2, err
    assert message in err and "Traceback" not in err, err
    _assert_untouched(Path(tree["output_dir"]))
    # The corrected command (the recipe as it is) is accepted and finishes.
    code, out, err = _run(capsys, recipe, "data.train_tokens=2048")
    assert code == 0, err
    assert (Path(tree["output_dir"]) / "metrics.json").is_file()


def test_restart_discards_an_unfinished_run_of_another_recipe(tiny_run, capsys):
    tmp_path, tree = tiny_run
    out_dir = Path(tree["output_dir"])
    (out_dir / "checkpoint").mkdir(parents=True)
    old = dict(tree, layer={"kind": "transcoder", "k": 4, "num_latents": 64})
    (out_dir / "checkpoint" / "recipe.resolved.yaml").write_text(yaml.safe_dump(old), encoding="utf-8")
    recipe = _recipe(tmp_path, tree)
    code, _, err = _run(capsys, recipe, "data.train_tokens=2048")
    assert code == 2 and "--restart" in err, err
    code, _, err = _run(capsys, recipe, "data.train_tokens=2048", extra=("--restart",))
    assert code == 0, err
    assert (out_dir / "metrics.json").is_file()


# -- 2. a diverged run is a failure, with strict JSON and the last good checkpoint ---------------------------------


def test_a_diverged_run_exits_non_zero_and_keeps_the_last_good_checkpoint(tiny_run, capsys):
    tmp_path, tree = tiny_run
    recipe = _recipe(tmp_path, tree)
    code, _, err = _run(capsys, recipe, "train.lr=1e4", "train.grad_clip=null", "train.checkpoint_every=1")
    assert code == 1, err
    assert "non-finite" in err and "train.lr" in err and "Traceback" not in err, err
    out_dir = Path(tree["output_dir"])
    assert not (out_dir / "metrics.json").exists()
    state = out_dir / "checkpoint" / "state.pt"
    if state.exists():  # whatever was kept holds finite weights
        layers = torch.load(state, map_location="cpu", weights_only=False)["model"]
        assert all(torch.isfinite(t).all() for t in layers.values() if t.is_floating_point())


def test_metrics_json_is_strict_json_even_with_non_finite_values(tiny_run, capsys):
    tmp_path, tree = tiny_run
    code, _, err = _run(capsys, _recipe(tmp_path, tree), "data.train_tokens=2048")
    assert code == 0, err
    text = (Path(tree["output_dir"]) / "metrics.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"metrics.json holds the non-JSON constant {c}"))


# -- 3. train.device is respected or refused -------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_an_unavailable_device_is_refused(tiny_run, capsys, device):
    tmp_path, tree = tiny_run
    code, _, err = _run(capsys, _recipe(tmp_path, tree), f"train.device={device}")
    assert code == 2 and device.split(":")[0] in err and "--set train.device=" in err, err
    _assert_untouched(Path(tree["output_dir"]))


def test_provenance_records_the_device_used(tiny_run, capsys):
    tmp_path, tree = tiny_run
    code, _, err = _run(capsys, _recipe(tmp_path, tree), "data.train_tokens=2048", "train.device=auto")
    assert code == 0, err
    provenance = json.loads((Path(tree["output_dir"]) / "provenance.json").read_text())
    assert provenance["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")


# -- 4. the data-parallel launch (docs/upcycle.md) --------------------------------------------------------------------


@pytest.mark.slow  # a 2-process torchrun launch
def test_torchrun_with_the_default_device_exits_0_and_publishes_once(tiny_run):
    tmp_path, tree = tiny_run
    tree["train"]["device"] = "auto"  # the quickstart's setting: on a CPU machine, gloo on CPU
    tree["data"]["train_tokens"] = 256 * 8
    recipe = _recipe(tmp_path, tree)
    torchrun = Path(sys.executable).parent / "torchrun"
    result = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", "-m", "expertize", "upcycle", str(recipe), "--no-progress"],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("expertize: wrote") == 1
    metrics = json.loads((Path(tree["output_dir"]) / "metrics.json").read_text())
    assert metrics["train"]["steps"] == 8


# -- 5. data problems surface before training ----------------------------------------------------------------------


def test_a_corpus_too_short_for_the_budget_is_refused_up_front(tiny_run, capsys):
    tmp_path, tree = tiny_run
    code, _, err = _run(capsys, _recipe(tmp_path, tree), "data.train_tokens=10000000")
    assert code == 2 and "data.train_tokens" in err, err
    _assert_untouched(Path(tree["output_dir"]))


def test_an_empty_held_out_split_is_refused_up_front(tiny_run, capsys):
    tmp_path, tree = tiny_run
    code, _, err = _run(capsys, _recipe(tmp_path, tree), "data.document_separator=blank_line")
    assert code == 2 and "held-out" in err, err
    _assert_untouched(Path(tree["output_dir"]))


# -- 6. no raw tracebacks ------------------------------------------------------------------------------------------


def test_output_dir_that_is_a_file(tiny_run, capsys):
    tmp_path, tree = tiny_run
    Path(tree["output_dir"]).write_text("not a folder")
    code, _, err = _run(capsys, _recipe(tmp_path, tree))
    assert code == 2 and "is a file" in err and "Traceback" not in err, err


def test_ctrl_c_says_how_to_resume(tiny_run, capsys, monkeypatch):
    from expertize.modeling import MxdLayer

    tmp_path, tree = tiny_run
    calls = {"n": 0}
    forward = MxdLayer.forward

    def interrupted(self, x):
        calls["n"] += 1
        if calls["n"] == 20:  # mid-run, after the first checkpoint (every 8 steps, 2 layers a step)
            raise KeyboardInterrupt
        return forward(self, x)

    monkeypatch.setattr(MxdLayer, "forward", interrupted)
    recipe = _recipe(tmp_path, tree)
    code, _, err = _run(capsys, recipe)
    assert code == 130, err
    assert "interrupted" in err and "resume" in err and "Traceback" not in err, err
    monkeypatch.setattr(MxdLayer, "forward", forward)
    code, out, err = _run(capsys, recipe)
    assert code == 0, err
    assert "resuming" in (out + err), out + err


def test_a_layer_too_large_for_memory_is_refused_before_any_work(tiny_run, capsys):
    tmp_path, tree = tiny_run
    code, _, err = _run(capsys, _recipe(tmp_path, tree), "layer.num_experts=2000000000")
    assert code == 2 and "GiB" in err and "Traceback" not in err, err
    _assert_untouched(Path(tree["output_dir"]))


# -- 7. smaller things ---------------------------------------------------------------------------------------------


def test_a_finished_run_prints_its_key_metrics_and_a_loss_curve(tiny_run, capsys):
    tmp_path, tree = tiny_run
    code, out, err = _run(capsys, _recipe(tmp_path, tree), "data.train_tokens=2048")
    assert code == 0, err
    assert "ΔCE" in out and "FVU" in out and "dead" in out, out
    assert (Path(tree["output_dir"]) / "plots" / "loss.png").is_file()


@pytest.mark.slow  # 5-25 s (subprocesses or a whole upcycle): in CI's opt-in run, off the fast suite's 8 minutes
def test_an_expertize_folder_as_base_model_adds_layers_without_remote_code(tiny_run, capsys):
    tmp_path, tree = tiny_run
    first = dict(tree, layers=[0], output_dir=str(tmp_path / "first"))
    # 4 steps: the fixture's 5 warm-up steps would be refused (longer than the run)
    code, _, err = _run(capsys, _recipe(tmp_path, first, "first.yaml"), "data.train_tokens=1024",
                        "train.warmup_steps=auto")
    assert code == 0, err
    second = dict(tree, layers=[1], base_model=str(tmp_path / "first"), output_dir=str(tmp_path / "second"))
    code, _, err = _run(capsys, _recipe(tmp_path, second, "second.yaml"), "data.train_tokens=1024",
                        "train.warmup_steps=auto")
    assert code == 0, err
    assert "trust_remote_code" not in err
    config = json.loads((tmp_path / "second" / "config.json").read_text())
    assert sorted(config["sparse_layers"]) == ["0", "1"]
    assert math.isfinite(json.loads((tmp_path / "second" / "metrics.json").read_text())["ce"]["delta"])


def test_a_base_model_folder_without_config_is_named(tmp_path, capsys, tiny_run):
    _, tree = tiny_run
    (tmp_path / "empty").mkdir()
    code, _, err = _run(capsys, _recipe(tmp_path, dict(tree, base_model=str(tmp_path / "empty"))))
    assert code == 2 and "config.json" in err, err

