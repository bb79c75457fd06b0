"""`expertize inspect --output DIR` has an owner (conversion/inspection/output.py): a second inspect of a folder in use
is refused naming the first one's pid, another model's report is refused (replaced with --overwrite), a rerun of the
same model replaces its report whole, and a folder that is not a report is never written into."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from expertize.conversion.cli import main
from expertize.conversion.inspection.output import ReportFolder, ReportFolderTaken
from expertize.conversion.publishing.folder_lock import FolderLock
from expertize.conversion.surgery.splice import save_model, splice
from expertize.modeling import TranscoderSpec, build_sparse_layer
from tests.conftest import D_MODEL, tiny_base_model, tiny_tokenizer, write_corpus


def _model(path, layers):
    torch.manual_seed(0)
    sparse = {i: build_sparse_layer(TranscoderSpec(d_in=D_MODEL, d_out=D_MODEL, num_latents=64, k=2)) for i in layers}
    return save_model(splice(tiny_base_model("llama"), sparse), path, tiny_tokenizer())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Model A (sparse layers 0 and 1), model B (layer 0 only) and a corpus."""
    tmp = tmp_path_factory.mktemp("owners")
    write_corpus(tmp / "a.txt", 200)
    return _model(tmp / "A", [0, 1]), _model(tmp / "B", [0]), tmp / "a.txt"


def _argv(model, corpus, out, *extra):
    return ["inspect", str(model), "--corpus", f"a={corpus}", "--tokens", "256", "--context-length", "16",
            "--output", str(out), "--no-progress", *extra]


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_another_models_report_is_refused_and_replaced_only_with_overwrite(models, tmp_path, capsys):
    a, b, corpus = models
    out = tmp_path / "report"
    assert main(_argv(a, corpus, out)) == 0
    assert sorted(_files(out)) == ["index.html", "inspect.json", "layer_0.json", "layer_1.json"]
    assert json.loads((out / "inspect.json").read_text())["model"] == os.path.realpath(a)
    before = _files(out)
    capsys.readouterr()
    assert main(_argv(b, corpus, out)) == 2  # before: exit 0, and A's layer_1.json stayed beside B's report
    err = capsys.readouterr().err.strip()
    assert err == (f"expertize inspect: error: {out} holds the inspect report of another model "
                   f"({os.path.realpath(a)}); choose another --output, or pass --overwrite to replace that report")
    assert _files(out) == before  # untouched
    assert main(_argv(b, corpus, out, "--overwrite")) == 0
    assert sorted(_files(out)) == ["index.html", "inspect.json", "layer_0.json"]  # A's layer_1.json is gone
    assert json.loads((out / "inspect.json").read_text()) == {
        "model": os.path.realpath(b), "files": ["index.html", "layer_0.json"], "complete": True}
    assert json.loads((out / "layer_0.json").read_text())["model"] == "B"


def test_a_rerun_of_the_same_model_replaces_its_report_whole(models, tmp_path, monkeypatch):
    a, _, corpus = models
    out = tmp_path / "report"
    # (the folder records no base model: delphi's cache must name one)
    assert main(_argv(a, corpus, out, "--export", "delphi", "--base-model", "gpt2")) == 0
    assert (out / "delphi_cache").is_dir() and (out / "layer_1.json").is_file()
    (out / "notes.md").write_text("mine")  # a file of the user's beside the report is kept
    # Spelled differently (a relative path), fewer layers, no export: the old report's other files are removed.
    monkeypatch.chdir(a.parent)
    assert main(_argv("A", corpus, out, "--layers", "0")) == 0
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "inspect.json", "layer_0.json", "notes.md"]


def test_a_folder_that_is_not_a_report_is_never_written_into(models, tmp_path, capsys):
    a, _, corpus = models
    cases = []
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("x")
    cases.append((mine, "exists and is not an inspect report folder (it holds thesis.tex); choose another --output"))
    cases.append((a, f"{a} is a model folder; write the report into a folder of its own, e.g. --output "
                     f"{a / 'inspect'}"))
    old = tmp_path / "old"  # a report written before reports recorded their model
    old.mkdir()
    (old / "layer_0.json").write_text("{}")
    (old / "index.html").write_text("")
    cases.append((old, "holds an inspect report that does not record its model (index.html, layer_0.json"))
    for folder, message in cases:
        before = _files(folder)
        for extra in ((), ("--overwrite",)):
            capsys.readouterr()
            assert main(_argv(a, corpus, folder, *extra)) == 2
            err = capsys.readouterr().err.strip()
            assert message in err and "\n" not in err, err
            assert _files(folder) == before


@pytest.mark.slow  # two interpreters start one after the other: ~10 s
def test_two_concurrent_inspects_of_one_folder(models, tmp_path):
    """Two `expertize inspect` processes into one --output: the second is refused naming the first's pid (before:
    both exited 0 and the last one's files won)."""
    a, _, corpus = models
    out = tmp_path / "report"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "expertize", *_argv(a, corpus, out)]
    first = subprocess.Popen([*command, "--tokens", "3000"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lock = FolderLock(out)
        while first.poll() is None and not lock.is_held():
            time.sleep(0.01)
        assert first.poll() is None, f"the first inspect ended before it was seen holding {out}: {first.stderr.read()}"
        os.kill(first.pid, signal.SIGSTOP)  # it holds the folder for as long as the second one runs
        second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
        assert (out / "inspect.json").exists() is False  # the second wrote nothing
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode == 2, second.stderr
    assert second.stderr.strip().splitlines()[-1] == (
        f"expertize inspect: error: {out} is in use by another expertize command (pid {first.pid}, holding "
        f".expertize.lock); two reports written into one folder would mix their files. Wait for it to finish or stop "
        f"it (kill {first.pid}), or choose another --output")
    assert first.wait(timeout=240) == 0, first.stderr.read()
    assert json.loads((out / "inspect.json").read_text())["model"] == os.path.realpath(a)
    assert not (out / ".expertize.lock").exists()
    assert main(_argv(a, corpus, out)) == 0  # free again


def test_the_python_api_follows_the_same_rules(models, tmp_path):
    from expertize.conversion.inspection import InspectionSettings, inspect_folder

    a, b, corpus = models
    settings = InspectionSettings(tokens=64, context_length=16)
    stats_a = inspect_folder(a, {"a": str(corpus)}, settings)
    out = tmp_path / "report"
    assert [p.name for p in stats_a.write(out)] == ["index.html", "layer_0.json", "layer_1.json"]
    stats_a.write(out)  # the same model again: replaced
    stats_b = inspect_folder(b, {"a": str(corpus)}, settings)
    with pytest.raises(ReportFolderTaken, match="holds the inspect report of another model"):
        stats_b.write(out)
    assert [p.name for p in stats_b.write(out, overwrite=True)] == ["index.html", "layer_0.json"]
    assert not (out / "layer_1.json").exists()
    # Held by this process: another claim of the folder is refused too (the lock is per open file).
    with ReportFolder(out, str(b)).claimed():
        with pytest.raises(ReportFolderTaken, match=r"is in use by another expertize command \(pid "):
            stats_b.write(out)
