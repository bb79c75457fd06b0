"""Every command as careful as `upcycle` (issue 21): the shared rules of conversion/checks.py, case by case through
the CLI in-process (`cli.main`), each refused before any work with one line naming the fix (exit 2), or failing after
it with what was kept (exit 1), never with a traceback.

    devices          `--device cuda` on a CPU-only machine, `--device gpu0`: eval, inspect, specialize
    output places    a read-only output for upcycle, inspect, specialize, capture, eval, tasks, plot-sweep
    a full disk      a checkpoint write that fails with ENOSPC (or torch's "unexpected pos") keeps the last one
    counts           argparse types: --top-n 0, --left -3, --shard-tokens 0 / -5, ...
    positions        context lengths beyond the model's positions; a long --prompt is cut with a note
    model folders    a truncated model.safetensors, an unknown sparse kind
    eval --base      a base with another tokenizer is refused unless --force
"""

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from expertize.conversion.cli import main
from expertize.conversion.surgery.splice import save_model, splice
from expertize.modeling import TranscoderSpec, build_sparse_layer
from tests.conftest import D_MODEL, tiny_base_model, tiny_tokenizer, write_corpus

POSITIONS = 64  # tiny_base_config's n_positions: GPT-2's learned position embedding has no row beyond it


def _run(capsys, argv: list[str]) -> tuple[int, str]:
    """Exit code and stderr of `expertize ARGV` in-process (argparse's refusals exit through SystemExit)."""
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def _refused(capsys, argv, *fragments: str, code: int = 2) -> str:
    got, err = _run(capsys, argv)
    assert got == code, (argv, err)
    last = err.strip().splitlines()[-1]
    assert last.startswith("expertize "), err
    for fragment in fragments:
        assert fragment in last, (fragment, err)
    return last


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny GPT-2 expertize model (64 positions, one transcoder layer) and two corpora beside it."""
    tmp = tmp_path_factory.mktemp("checks")
    torch.manual_seed(0)
    layers = {0: build_sparse_layer(TranscoderSpec(d_in=D_MODEL, d_out=D_MODEL, num_latents=48, k=2))}
    save_model(splice(tiny_base_model("gpt2"), layers), tmp / "model", tiny_tokenizer())
    write_corpus(tmp / "a.txt", 80)
    write_corpus(tmp / "b.txt", 80)
    return tmp / "model"


def _corpora(folder: Path) -> list[str]:
    return ["--corpus", f"a={folder.parent / 'a.txt'}", "--corpus", f"b={folder.parent / 'b.txt'}"]


def _small_inspect(folder: Path) -> list[str]:
    return ["--tokens", "64", "--context-length", "16", "--no-progress"]


def _small_specialize(folder: Path) -> list[str]:
    return [*_corpora(folder), "--tokens", "64", "--eval-tokens", "32", "--context-length", "16"]


# -- devices ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["eval", "inspect", "specialize"])
@pytest.mark.parametrize("device, message", [
    ("cuda", "--device 'cuda' is not available: this machine has no usable CUDA GPU"),
    ("gpu0", "--device 'gpu0' is not a device; use one of auto, cpu, cuda, cuda:N or mps"),
])
def test_every_device_flag_is_resolved_like_train_device(folder, capsys, monkeypatch, command, device, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only machine, also on a GPU host
    extra = {
        "eval": ["--tasks", "expertize_shakespeare_ppl", "--limit", "2", "--no-base"],
        "inspect": ["--prompt", "hello"],
        "specialize": _small_specialize(folder),
    }[command]
    last = _refused(capsys, [command, folder, *extra, "--device", device], message)
    if device == "cuda":
        assert "this machine offers cpu. Use --device auto (or cpu)" in last


# -- output locations -------------------------------------------------------------------------------------------------


@pytest.fixture
def read_only(tmp_path, monkeypatch) -> Path:
    """A read-only folder. chmod does not stop root (CI and this machine run as root), so there the write probe is
    also refused for it, as a read-only mount would (checked by hand on a `mount -o ro` tmpfs)."""
    path = tmp_path / "ro"
    path.mkdir()
    path.chmod(0o555)
    if os.geteuid() == 0:
        from expertize.conversion import checks

        probe = checks._probe_write

        def refuse(where: Path) -> None:
            if Path(where).resolve().is_relative_to(path.resolve()):
                raise OSError(errno.EROFS, "Read-only file system", str(where))
            probe(where)

        monkeypatch.setattr(checks, "_probe_write", refuse)
    yield path
    path.chmod(0o755)


def _tiny_recipe(tiny_run, **data) -> tuple[Path, dict]:
    tmp_path, tree = tiny_run
    tree = {**tree, "data": {**tree["data"], **data}}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tree), encoding="utf-8")
    return recipe, tree


def test_a_read_only_output_is_refused_before_any_work_by_every_command(folder, tiny_run, read_only, capsys):
    recipe, _ = _tiny_recipe(tiny_run)
    target = read_only / "out"
    cases = {
        "upcycle": ["upcycle", recipe, "--set", f"output_dir={target}", "--no-progress"],
        "inspect": ["inspect", folder, *_corpora(folder), *_small_inspect(folder), "--output", target],
        "specialize": ["specialize", folder, *_small_specialize(folder), "--json", target / "s.json"],
        "capture": ["capture", recipe, "--output", target, "--no-progress"],
        "eval": ["eval", folder, "--tasks", "expertize_shakespeare_ppl", "--limit", "2", "--no-base",
                 "--output", target],
        "tasks": ["tasks", folder.parent / "a.txt", "--name", "mine", "--output", target],
        "plot-sweep": ["plot-sweep", folder, "--metric", "ce.delta", "--output", target / "s.png"],
    }
    for command, argv in cases.items():
        _refused(capsys, argv, f"'{target}", "cannot be written", "not writable", "choose a writable location")
    assert sorted(read_only.iterdir()) == []


def test_an_output_that_cannot_be_created_or_has_no_room_is_refused(folder, tiny_run, capsys, monkeypatch):
    recipe, tree = _tiny_recipe(tiny_run)
    a_file = folder.parent / "a.txt"
    _refused(capsys, ["inspect", folder, *_corpora(folder), *_small_inspect(folder), "--output", a_file / "x"],
             "cannot be created", "is a file, not a folder")
    _refused(capsys, ["specialize", folder, *_small_specialize(folder), "--json", folder],
             "--json", "is a folder; give a file name")
    # A disk with 1 kB free: the estimates (the sparse layers and their checkpoint; the cache's shards) do not fit.
    usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(p)._replace(free=1000))
    out = Path(tree["output_dir"])
    _refused(capsys, ["upcycle", recipe, "--no-progress"], "output_dir", "needs about", "MB free; free")
    _refused(capsys, ["capture", recipe, "--output", out.parent / "cache"], "--output", "needs about")
    assert not out.exists() and not (out.parent / "cache").exists()


# -- a full disk during upcycle ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("failure", ["enospc", "torch-unexpected-pos"])
def test_a_checkpoint_write_that_runs_out_of_space_keeps_the_last_checkpoint(tiny_run, capsys, monkeypatch, failure):
    from expertize.conversion.training import engine

    recipe, tree = _tiny_recipe(tiny_run, train_tokens=4096)  # 16 steps, checkpoints at 8 and 16
    save, writes = torch.save, []

    def full_disk(obj, f, *args, **kwargs):
        if str(getattr(f, "name", "")).endswith("state.pt.tmp"):
            writes.append(f.name)
            if len(writes) == 2:  # the checkpoint of step 16: half written, then the disk is full
                f.write(b"\0" * 1000)
                if failure == "enospc":
                    raise OSError(errno.ENOSPC, "No space left on device")
                # torch's own zip writer reports a full disk as this; the disk then has less room than a checkpoint
                usage = shutil.disk_usage
                monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(p)._replace(free=10_000))
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(engine.torch, "save", full_disk)
    checkpoint = Path(tree["output_dir"]) / "checkpoint"
    last = _refused(capsys, ["upcycle", recipe, "--no-progress"], code=1)
    assert f"no space left on {checkpoint}: free " in last and " MB and rerun to resume" in last, last
    assert f"the checkpoint of step 8 ({checkpoint / 'state.pt'}) is kept" in last, last
    assert torch.load(checkpoint / "state.pt", weights_only=False)["step"] == 8
    assert not (checkpoint / "state.pt.tmp").exists()
    monkeypatch.undo()  # room again: the same command resumes from step 8 and finishes
    code, err = _run(capsys, ["upcycle", recipe, "--no-progress"])
    assert code == 0 and "from step 8" in err, err
    assert (Path(tree["output_dir"]) / "metrics.json").is_file()


def test_any_write_that_finds_the_disk_full_after_the_checks_exits_1_in_one_line(folder, tmp_path, capsys,
                                                                                 monkeypatch):
    from expertize.conversion.harness import offline_tasks

    out = tmp_path / "tasks"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "mine_ppl.yaml"))

    monkeypatch.setattr(offline_tasks, "write_tasks_from_text", full)
    _refused(capsys, ["tasks", folder.parent / "a.txt", "--name", "mine", "--output", out],
             f"no space left on {out}: free some space and run the command again", code=1)


def test_a_directory_given_as_one_corpus_file_is_called_a_directory(folder, tmp_path, capsys):
    # It used to be "no such file" (inspect, specialize) or "does not exist" (tasks).
    corpora = folder.parent
    said = f"{str(corpora)!r} is a directory, not a file (it holds a.txt"
    _refused(capsys, ["tasks", corpora, "--name", "mine", "--output", tmp_path / "t"], "text file: " + said)
    _refused(capsys, ["inspect", folder, "--corpus", f"x={corpora}", "--output", tmp_path / "o"],
             "--corpus x: " + said, "repeat --corpus NAME=PATH for each file")
    _refused(capsys, ["specialize", folder, "--corpus", f"a={corpora}/a.txt", "--eval-corpus", f"a={corpora}"],
             "--eval-corpus a: " + said)
    assert not (tmp_path / "t").exists() and not (tmp_path / "o").exists()


# -- counts and windows -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, flag", [
    (["inspect", "M", "--prompt", "w1", "--top-n", "0"], "--top-n"),
    (["inspect", "M", "--prompt", "w1", "--left", "-3"], "--left"),
    (["inspect", "M", "--prompt", "w1", "--right", "-1"], "--right"),
    (["inspect", "M", "--prompt", "w1", "--tokens", "0"], "--tokens"),
    (["inspect", "M", "--prompt", "w1", "--per-token", "0"], "--per-token"),
    (["inspect", "M", "--prompt", "w1", "--vocab-top", "0"], "--vocab-top"),
    (["inspect", "M", "--prompt", "w1", "--batch-size", "0"], "--batch-size"),
    (["inspect", "M", "--prompt", "w1", "--context-length", "1"], "--context-length"),
    (["inspect", "M", "--prompt", "w1", "--layers", "0,-2"], "--layers"),
    (["capture", "quickstart", "--shard-tokens", "0"], "--shard-tokens"),
    (["capture", "quickstart", "--shard-tokens", "-5"], "--shard-tokens"),
    (["specialize", "M", "--probe-top", "0"], "--probe-top"),
    (["specialize", "M", "--probe-k", "1,0"], "--probe-k"),
    (["specialize", "M", "--batch-size", "-1"], "--batch-size"),
    (["specialize", "M", "--tokens", "1"], "--tokens"),
    (["specialize", "M", "--ratio", "0"], "--ratio"),
    (["eval", "M", "--tasks", "t", "--limit", "0"], "--limit"),
    (["eval", "M", "--tasks", "t", "--batch-size", "0"], "--batch-size"),
    (["eval", "M", "--tasks", "t", "--num-fewshot", "-1"], "--num-fewshot"),
    (["tasks", "x.txt", "--choices", "1"], "--choices"),
    (["tasks", "x.txt", "--max-docs", "0"], "--max-docs"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v[:1] + v[-2:]))
def test_counts_and_windows_are_refused_by_the_parser_with_the_flag_named(capsys, argv, flag):
    _refused(capsys, argv, f"argument {flag}: must be")


def test_capture_refuses_a_non_positive_shard_size_from_python_too(tiny_run):
    from expertize.conversion.capture import capture_activations
    from expertize.conversion.data.cache import CacheError
    from expertize.conversion.recipe import recipe_from_dict

    _, tree = tiny_run
    with pytest.raises(CacheError, match="--shard-tokens must be 1 or more"):
        capture_activations(recipe_from_dict(tree), tiny_run[0] / "cache", shard_tokens=0)


# -- context lengths --------------------------------------------------------------------------------------------------


def test_upcycle_refuses_a_context_longer_than_the_base_positions(tmp_path, capsys):
    """The issue's case: the quickstart's base has 128 positions."""
    out = tmp_path / "q"
    last = _refused(capsys, ["upcycle", "quickstart", "--set", "data.context_length=256", "--set",
                             f"output_dir={out}", "--no-progress"],
                    "data.context_length=256 is longer than base_model", "128 positions",
                    "use --set data.context_length=128 or less")
    assert "tiny-gpt2-shakespeare" in last and not out.exists()
    _refused(capsys, ["upcycle", "quickstart", "--set", "eval.continuation_tokens=200", "--set",
                      f"output_dir={out}", "--no-progress"], "eval.prompt_tokens + eval.continuation_tokens")


@pytest.mark.parametrize("command", ["inspect", "specialize"])
def test_inspect_and_specialize_refuse_a_context_longer_than_the_model_positions(folder, capsys, command):
    extra = [*_corpora(folder), "--output", folder.parent / "never"] if command == "inspect" else _corpora(folder)
    _refused(capsys, [command, folder, *extra, "--context-length", POSITIONS + 1],
             f"--context-length {POSITIONS + 1} is longer than", f"{POSITIONS} positions",
             f"use --context-length {POSITIONS} or less")


def test_a_long_prompt_is_cut_to_the_model_positions_with_a_note(folder, capsys):
    prompt = " ".join(f"w{i % 90}" for i in range(3 * POSITIONS))
    capsys.readouterr()
    assert main(["inspect", str(folder), "--prompt", prompt, "--per-token", "1"]) == 0
    out, err = capsys.readouterr()
    assert f"the prompt has {3 * POSITIONS + 1} tokens but the model reads at most {POSITIONS} positions" in err
    assert "Traceback" not in err
    rows = out.strip().splitlines()[2:]  # under the header and its rule: one row per token shown
    assert len(rows) == POSITIONS and rows[-1].split()[0] == str(POSITIONS - 1)


# -- damaged model folders --------------------------------------------------------------------------------------------


@pytest.fixture
def damaged(folder, tmp_path) -> Path:
    copy = tmp_path / "damaged"
    shutil.copytree(folder, copy)
    weights = copy / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # a download cut short
    return copy


@pytest.mark.parametrize("command", ["inspect", "specialize", "eval"])
def test_a_truncated_weights_file_is_named_as_damaged(damaged, folder, capsys, command):
    extra = {
        "inspect": ["--prompt", "hello"],
        "specialize": _small_specialize(folder),
        "eval": ["--tasks", "expertize_shakespeare_ppl", "--limit", "2", "--no-base"],
    }[command]
    _refused(capsys, [command, damaged, *extra], f"{damaged / 'model.safetensors'} is damaged", "cut short",
             "re-download it, or rerun the `expertize upcycle`")


def test_a_weights_file_without_a_whole_header_is_named_as_damaged(damaged, capsys):
    os.truncate(damaged / "model.safetensors", 20)
    _refused(capsys, ["inspect", damaged, "--prompt", "hello"], "model.safetensors is damaged", "header claims")


def test_an_unknown_sparse_kind_is_refused_before_loading(damaged, folder, capsys):
    shutil.copy(folder / "model.safetensors", damaged / "model.safetensors")
    config = json.loads((damaged / "config.json").read_text())
    config["sparse_layers"]["0"]["kind"] = "hologram"
    (damaged / "config.json").write_text(json.dumps(config))
    _refused(capsys, ["inspect", damaged, "--prompt", "hello"], "sparse layer 0", "unknown sparse layer kind",
             "newer expertize")


# -- eval --base with another tokenizer -------------------------------------------------------------------------------


def _other_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"v{i}" for i in range(95)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def test_eval_refuses_a_base_with_another_tokenizer_unless_forced(folder, tmp_path, capsys):
    from expertize.conversion.harness.folder_eval import check_same_tokenizer

    other = tmp_path / "other"
    tiny_base_model("gpt2").save_pretrained(other)
    _other_tokenizer().save_pretrained(other)
    _refused(capsys, ["eval", folder, "--tasks", "expertize_shakespeare_ppl", "--limit", "2", "--base", other,
                      "--output", tmp_path / "ev"],
             "has another tokenizer than the model", "not the model's base", "--force")
    assert not (tmp_path / "ev").exists()
    warnings = []
    check_same_tokenizer(tiny_tokenizer(), _other_tokenizer(), str(other), force=True, log=warnings.append)
    assert len(warnings) == 1 and "compared anyway (--force)" in warnings[0]
    check_same_tokenizer(tiny_tokenizer(), tiny_tokenizer(), "same", force=False, log=warnings.append)
    assert len(warnings) == 1


# -- variants: [] -----------------------------------------------------------------------------------------------------


def test_an_empty_variants_list_is_one_model_as_documented(tiny_run):
    """`variants: []` (or `--set variants=[]` on a sweep recipe) trains the recipe's own layer as one model."""
    from expertize.conversion.recipe import recipe_from_dict, recipe_to_dict

    _, tree = tiny_run
    sweep = {**tree, "variants": [{"name": "a"}, {"name": "b", "layer": {"k": 2}}]}
    one = recipe_from_dict(sweep, ["variants=[]"])
    assert one.variants == [] and "variants" not in recipe_to_dict(one)
    assert recipe_to_dict(one) == recipe_to_dict(recipe_from_dict(tree))
