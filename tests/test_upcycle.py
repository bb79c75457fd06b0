"""`expertize upcycle` end to end on tiny local models: output folder, remote-code load, resume after SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from expertize.conversion.cli import main as cli_main
from expertize.conversion.recipe import recipe_from_dict
from expertize.conversion.upcycle import upcycle
from tests.conftest import run_isolated, shared_data_dir, write_corpus


def test_upcycle_writes_a_publishable_folder(tiny_run):
    tmp_path, tree = tiny_run
    out = upcycle(recipe_from_dict(tree), progress=False)
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "modeling_expertize.py", "tokenizer.json", "metrics.json",
            "recipe.resolved.yaml", "provenance.json", "README.md", "train_log.jsonl", "plots"} <= names
    assert "checkpoint" not in names and not any(n.startswith(".final") for n in names)
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["layers"]) == {"0", "1"}
    assert (metrics["train"]["steps"], metrics["train"]["tokens"]) == (48, 12_288)
    for layer in metrics["layers"].values():
        assert 0 <= layer["fvu"] < 1.0, layer  # learned something: better than predicting the mean
        assert layer["l0"] <= 4
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(4, 49, 4))
    assert log[-1]["loss"] < log[0]["loss"]
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["seed"] == 3
    assert torch.__version__.startswith(provenance["packages"]["torch"])
    assert provenance["packages"]["transformers"] and provenance["python"]
    assert "trust_remote_code=True" in (out / "README.md").read_text()
    assert list((out / "plots").glob("*.png"))

    # The folder loads through remote code alone, with the sparse layers at the recipe's layers.
    out_json = run_isolated(
        f"""
        import json
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)
        print(json.dumps([type(layer.mlp).__name__ for layer in model.model.layers]))
        """,
        tmp_path,
    )
    assert json.loads(out_json.strip().splitlines()[-1]) == ["MxdLayer", "MxdLayer"]

    # Run again (a notebook cell run twice, or the same command): the finished folder, untouched; before, the rerun
    # raised RunFolderTaken. Another recipe into it is refused, naming what differs.
    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    messages = []
    assert upcycle(recipe_from_dict(tree), progress=False, log=messages.append) == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp
    assert messages == [f"{out} holds this recipe's finished run; nothing to train (to train again, choose another "
                        "output_dir or delete that folder)"]
    with pytest.raises(FileExistsError, match=r"holds a finished run of a different recipe \(differs at train\.lr \("):
        upcycle(recipe_from_dict(tree, ["train.lr=0.5"]), progress=False)
    with pytest.raises(FileExistsError, match="already holds a finished run .*--restart only discards unfinished"):
        upcycle(recipe_from_dict(tree), progress=False, restart=True)


def _write_recipe(tmp_path: Path, tree: dict, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**tree, "output_dir": str(tmp_path / name)}), encoding="utf-8")
    return path


def _cli(recipe: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "expertize", "upcycle", str(recipe), "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True,
    )


@pytest.mark.slow  # three upcycle processes (~30 s)
def test_resume_after_sigkill_matches_an_uninterrupted_run(tiny_run):
    tmp_path, tree = tiny_run
    tree["train"].update(checkpoint_every=16, log_every=8)
    tree["data"]["train_tokens"] = 256 * 240
    tree["data"]["paths"] = [str(write_corpus(tmp_path / "big.txt", n_docs=4000))]
    tree["layer"]["options"] = {"random_k": True}  # the resumed run must also restore the RNG

    reference = _cli(_write_recipe(tmp_path, tree, "straight"))
    interrupted_recipe = _write_recipe(tmp_path, tree, "killed")
    proc = _cli(interrupted_recipe)
    state = tmp_path / "killed" / "checkpoint" / "state.pt"
    deadline = time.time() + 300
    while not state.exists():
        assert proc.poll() is None, f"the run ended before its first checkpoint: {proc.stderr.read()}"
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "metrics.json").exists(), "killed too late to test resuming"
    killed_at = torch.load(state, weights_only=False)["step"]
    assert 0 < killed_at < 240

    resumed = _cli(interrupted_recipe)
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()
    assert reference.wait(timeout=600) == 0, reference.stderr.read()

    straight = json.loads((tmp_path / "straight" / "metrics.json").read_text())
    again = json.loads((tmp_path / "killed" / "metrics.json").read_text())
    for layer in straight["layers"]:
        for key in ("nmse_paper", "fvu", "relative_mse", "l0"):
            assert again["layers"][layer][key] == pytest.approx(straight["layers"][layer][key], rel=1e-5, abs=1e-7)
    assert again["ce"]["spliced"] == pytest.approx(straight["ce"]["spliced"], rel=1e-6)
    log_a = (tmp_path / "straight" / "train_log.jsonl").read_text().splitlines()
    log_b = (tmp_path / "killed" / "train_log.jsonl").read_text().splitlines()
    assert len(log_a) == len(log_b) == 30
    for a, b in zip(log_a, log_b):
        assert json.loads(a)["step"] == json.loads(b)["step"]
        assert json.loads(a)["loss"] == pytest.approx(json.loads(b)["loss"], rel=1e-5)


def test_resume_refuses_a_different_recipe(tiny_run):
    tmp_path, tree = tiny_run
    out = Path(tree["output_dir"])
    (out / "checkpoint").mkdir(parents=True)
    first = recipe_from_dict(tree)
    from expertize.conversion.recipe import save_recipe

    save_recipe(first, out / "checkpoint" / "recipe.resolved.yaml")
    tree["train"]["lr"] = 1e-2
    with pytest.raises(ValueError, match=r"different recipe \(differs at train.lr \(the folder's run: "):
        upcycle(recipe_from_dict(tree), progress=False)


def test_cli_reports_recipe_errors(tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("base_model: x\nlayers: [0]\ntrian: {lr: 1}\n", encoding="utf-8")
    assert cli_main(["upcycle", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "expertize upcycle: error:" in err and "trian" in err and "train" in err


def test_quickstart_recipe_runs_on_the_real_checkpoint(tmp_path, capsys):
    data = shared_data_dir()
    os.environ.setdefault("EXPERTIZE_DATA", str(data))
    recipe = Path(__file__).parent.parent / "recipes" / "quickstart.yaml"
    code = cli_main(["upcycle", str(recipe), "--no-progress", "--set", f"output_dir={tmp_path / 'qs'}",
                     "--set", "data.train_tokens=16384", "--set", "data.eval_tokens=4096",
                     "--set", "eval.generation_prompts=4"])
    assert code == 0
    metrics = json.loads((tmp_path / "qs" / "metrics.json").read_text())
    assert metrics["ce"]["base"] < metrics["ce"]["mean_ablation"]
    # Issue 39: the shipped example reads its text as its base was trained (one raw stream, the base's own held-out
    # tenth), so it prints no warning about its reading (before: the EOS after every speech cost the base 20 nats
    # each and the run said so). The full-length run's health (dead units) is held by test_inspect_cli's quickstart.
    said = capsys.readouterr()
    assert not [line for line in (said.out + said.err).splitlines() if "warning: data:" in line.lower()], said


def test_the_quickstart_base_is_warned_about_the_old_reading_and_its_fix_reads_clean():
    """The reading the quickstart used before (an EOS after every speech, BOS-led sequences) is what the separator
    check condemns on the real base, and the reading its warning names, applied as written, is quiet."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from expertize.conversion.data.separators import check_separators
    from expertize.conversion.recipe import load_recipe

    recipe = load_recipe(Path(__file__).parent.parent / "recipes" / "quickstart.yaml")
    base = AutoModelForCausalLM.from_pretrained(recipe.base_model)
    tokenizer = AutoTokenizer.from_pretrained(recipe.base_model)
    old = replace(recipe.data, document_separator="blank_line", add_bos="auto", eval_split="documents")
    said = []
    check_separators(old, tokenizer, base, said.append)
    assert len(said) == 1 and "inserted after every blank-line block" in said[0]
    fix = "data.add_bos: false, data.document_separator: file and data.eval_split: tail"
    assert fix in said[0]
    applied = replace(old, add_bos=False, document_separator="file", eval_split="tail")
    assert applied == recipe.data  # the shipped recipe is the fix
    said.clear()
    check_separators(applied, tokenizer, base, said.append)
    assert said == []


@pytest.mark.slow  # a 2-process torchrun launch
def test_two_process_data_parallel_run_on_cpu(tiny_run):
    """The same command under a 2-process launch (gloo on CPU: torchrun, which Accelerate reads) trains and finishes."""
    tmp_path, tree = tiny_run
    tree["data"]["train_tokens"] = 256 * 24
    recipe = _write_recipe(tmp_path, tree, "ddp")
    torchrun = Path(sys.executable).parent / "torchrun"
    result = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", "-m", "expertize", "upcycle", str(recipe), "--no-progress"],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "ddp" / "metrics.json").read_text())
    assert (metrics["train"]["steps"], metrics["train"]["tokens"]) == (24, 256 * 24)
    assert all(layer["fvu"] < 1.0 for layer in metrics["layers"].values())
    assert result.stdout.count("expertize: wrote") == 1  # only the main process reports
