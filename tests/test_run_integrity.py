"""A run can never be lost, mixed or misdiagnosed (issue 23): the run folder's identity does not depend on how
output_dir is spelled, a second run on a folder in use is refused, a damaged activation cache is named, one corpus
reader serves every command, and the own-text evaluation flow of docs/tasks.md works on the quickstart model."""

import json
import os
import shutil
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


@pytest.mark.slow  # two upcycle processes (~8 s)
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
    from expertize.conversion.capture import capture_activations

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


# -- 4. one corpus reader -----------------------------------------------------------------------------------------


def test_every_command_reads_a_jsonl_corpus_as_json_lines(tmp_path):
    """A .jsonl file is parsed as JSON lines with a text field by upcycle's data section (default source: text),
    `expertize tasks`, `inspect` and `specialize` alike. Before: upcycle trained on the raw {"text": ...} lines and
    `tasks` made items of JSON syntax, while inspect and specialize parsed it."""
    from expertize.conversion.data.text import iter_documents
    from expertize.conversion.recipe.data import DataConfig
    from expertize.conversion.harness.offline_tasks import read_documents
    from expertize.conversion.inspection.corpora import _data_config
    from expertize.conversion.specialization.splits import read_documents as specialize_documents

    texts = [f"Story {i} begins. It goes on for a while. Then it ends." for i in range(6)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)), "utf-8")
    readers = {
        "upcycle": lambda: list(iter_documents(DataConfig(paths=[str(corpus)]))),
        "tasks": lambda: read_documents(corpus),
        "inspect": lambda: list(iter_documents(_data_config(str(corpus), 16))),
        "specialize": lambda: specialize_documents("c", str(corpus)),
    }
    for command, read in readers.items():
        assert read() == texts, command
    # A name that contradicts an explicit other format is refused with the fix; a broken line is named.
    with pytest.raises(ValueError, match=r"corpus.jsonl' is a jsonl file by its name, but data.source is 'parquet'; "
                                         r"set data.source to 'jsonl'"):
        DataConfig(source="parquet", paths=[str(corpus)])
    corpus.write_text('{"text": "fine"}\nnot json\n', "utf-8")
    for command, read in readers.items():
        with pytest.raises(ValueError, match=r"corpus.jsonl:2 is not valid JSON"):
            read()


# -- 5. the own-text evaluation flow (docs/tasks.md) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The quickstart recipe (its real tiny GPT-2, 128 positions) trained on a small budget."""
    from tests.conftest import shared_data_dir

    data = shared_data_dir()
    os.environ.setdefault("EXPERTIZE_DATA", str(data))
    out = tmp_path_factory.mktemp("qs") / "quickstart"
    assert cli_main(["upcycle", "quickstart", "--no-progress", "--set", f"output_dir={out}",
                     "--set", "data.train_tokens=8192", "--set", "data.eval_tokens=2048",
                     "--set", "train.warmup_steps=auto",  # 8 steps: the quickstart's 50 would be refused
                     "--set", "eval.generation_prompts=4"]) == 0
    return out, data


@pytest.mark.slow  # 5-25 s (subprocesses or a whole upcycle): in CI's opt-in run, off the fast suite's 8 minutes
def test_readme_own_text_evaluation_flow_on_the_quickstart_model(quickstart, tmp_path, capsys):
    """`expertize tasks wikitext2_test.raw --name wiki --output my_tasks --model runs/quickstart` then `expertize eval
    runs/quickstart --tasks wiki_ppl,wiki_cloze --include-path my_tasks`: every cloze item fits the model's 128
    positions and the evaluation runs. Before: a bare AssertionError from lm-eval (a continuation of 149 tokens in
    the 8th item, doc 16); 1,359 of 1,509 items did not fit."""
    from transformers import AutoTokenizer

    model, data = quickstart
    wiki, tasks = data / "corpora" / "wikitext2_test.raw", tmp_path / "my_tasks"
    assert cli_main(["tasks", str(wiki), "--name", "wiki", "--output", str(tasks), "--model", str(model),
                     "--max-docs", "20", "--no-progress"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
    items = [json.loads(line) for line in (tasks / "wiki_cloze.jsonl").read_text().splitlines()]
    assert len(items) >= 4
    for item in items:
        lengths = [len(tokenizer(item["context"] + " " + choice)["input_ids"]) for choice in item["choices"]]
        assert max(lengths) <= 128, (item["doc_index"], lengths)
    capsys.readouterr()
    assert cli_main(["eval", str(model), "--tasks", "wiki_ppl,wiki_cloze", "--include-path", str(tasks),
                     "--output", str(tmp_path / "lm_eval"), "--device", "cpu", "--no-card"]) == 0
    out = capsys.readouterr().out
    assert "wiki_cloze" in out and "wiki_ppl" in out
    # What cannot fit is refused, naming the limit.
    assert cli_main(["tasks", str(wiki), "--name", "tiny", "--output", str(tmp_path / "t"), "--max-tokens", "4",
                     "--max-docs", "20", "--no-progress"]) == 2
    assert "no cloze item fits in max_tokens=4: the sentences are too long" in capsys.readouterr().err


def test_tasks_is_linear_in_the_number_of_documents(capsys):
    """`expertize tasks` on the 4,096-line story file takes well under a second of cloze building (before: each
    item scanned the whole distractor pool, 4x per doubling: ~15 s for 1,500 stories, minutes for 4,096)."""
    from tests.conftest import shared_data_dir
    from expertize.conversion.harness.offline_tasks import cloze_items, read_documents

    documents = read_documents(shared_data_dir() / "corpora" / "stories260k_samples.txt")
    assert len(documents) == 4096
    timings = {}
    for n in (1024, 2048, 4096):
        start = time.perf_counter()
        items = cloze_items(documents[:n], seed=0)
        timings[n] = time.perf_counter() - start
        assert len(items) > n // 2
    with capsys.disabled():
        print("\nexpertize tasks, cloze items vs documents: "
              + ", ".join(f"{n:,} docs {t:.2f} s" for n, t in timings.items()))
    assert timings[4096] < 5.0, timings


# -- 7. push uploads the model ------------------------------------------------------------------------------------


@pytest.mark.slow  # the quickstart upcycle of its fixture (~10 s): in CI's opt-in run
def test_push_leaves_reports_out_and_names_a_packaged_base_portably(quickstart):
    """An inspect/ report written into the model folder (docs/inspect.md's example) is not uploaded unless asked; the
    card names the packaged base `${EXPERTIZE_ASSETS}/tiny-gpt2-shakespeare`. Before: inspect/ (11 MB) went up and
    the card named /abs/path/expertize/assets/tiny-gpt2-shakespeare."""
    from expertize.conversion.publishing.local_paths import public_tree
    from expertize.conversion.publishing.model_folder import render_card_from_folder
    from expertize.conversion.publishing.push import files_to_upload, left_out

    model, _ = quickstart
    report = model / "inspect"
    report.mkdir(exist_ok=True)
    (report / "index.html").write_text("<html></html>", "utf-8")
    (report / "layer_2.json").write_text("{}", "utf-8")
    try:
        files = files_to_upload(model)
        assert not any(f.startswith("inspect/") for f in files)
        assert {"model.safetensors", "config.json", "metrics.json", "README.md"} <= set(files)
        assert any(f.startswith("plots/") for f in files)
        assert "inspect/index.html" in files_to_upload(model, include_reports=True)
        assert left_out(model) == {"inspect/": 15}
    finally:
        shutil.rmtree(report)
    assets = "${EXPERTIZE_ASSETS}/tiny-gpt2-shakespeare"
    for public in (False, True):
        card = str(render_card_from_folder(model, public=public))
        assert assets in card and "/assets/tiny-gpt2-shakespeare" not in card.replace(assets, ""), public
        assert "base_model:" not in card.split("---")[1]  # not a Hub id: no base_model metadata
    provenance = json.loads((model / "provenance.json").read_text())
    assert public_tree(provenance, [model])["base_model"] == assets


# -- 6. long commands show progress -------------------------------------------------------------------------------


def test_capture_specialize_and_tasks_draw_progress_bars(tiny_run, capsys):
    """capture, specialize and tasks draw a bar to completion, as upcycle does (before: nothing for 30 s to
    minutes); --no-progress silences them."""
    import torch

    from expertize.conversion.surgery.splice import save_model
    from tests.conftest import tiny_tokenizer
    from tests.test_specialization import domain_model

    tmp_path, tree = tiny_run
    tree["data"]["train_tokens"] = 256 * 8
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tree), encoding="utf-8")
    model_dir = tmp_path / "model"
    save_model(domain_model().float(), model_dir, tiny_tokenizer())
    gen, corpora = torch.Generator().manual_seed(0), []
    for name, words in (("low", range(0, 45)), ("high", range(45, 95))):
        lines = [" ".join(f"w{words[int(i)]}" for i in torch.randint(0, len(words), (12,), generator=gen)) + "."
                 for _ in range(80)]
        (tmp_path / f"{name}.txt").write_text("\n".join(lines), encoding="utf-8")
        corpora += ["--corpus", f"{name}={tmp_path / f'{name}.txt'}"]
    lines = (tmp_path / "corpus.txt").read_text().splitlines()[:200]
    text = tmp_path / "blocks.txt"  # documents of four lines: items ask for the next line
    text.write_text("\n\n".join("\n".join(lines[i : i + 4]) for i in range(0, 200, 4)), encoding="utf-8")
    commands = {
        "capture: 100%": ["capture", str(recipe), "--output", str(tmp_path / "cache")],
        "specialize: 100%": ["specialize", str(model_dir), *corpora, "--context-length", "16", "--tokens", "96",
                             "--eval-tokens", "64", "--probe-k", "1", "--probe-top", "4"],
        "tasks: cloze items: 100%": ["tasks", str(text), "--name", "c", "--output", str(tmp_path / "tasks")],
    }
    for bar, argv in commands.items():
        assert cli_main(argv) == 0, argv
        assert bar in capsys.readouterr().err, bar
    assert cli_main(["tasks", str(text), "--name", "d", "--output", str(tmp_path / "tasks"), "--no-progress",
                     "--max-tokens", "512"]) == 0
    assert "cloze items" not in capsys.readouterr().err


# -- 8. results a newcomer can read -------------------------------------------------------------------------------


def test_a_small_dead_fraction_is_read_out_as_it_is():
    """0.2 % dead used to print as "0% dead is good"; a fraction is shown to three significant digits."""
    from expertize.conversion.evaluation.reading import reading_lines
    from expertize.conversion.publishing.metrics_schema import Metrics

    lines = reading_lines(Metrics.from_dict({"layers": {"2": {"dead_fraction": 0.00195}, "3": {"dead_fraction": 0.5},
                                                        "4": {"dead_fraction": 0.0}}}))
    assert [line.split(" dead is ")[0] for line in lines] == ["layer 2: 0.195 %", "layer 3: 50 %", "layer 4: 0 %"]


@pytest.mark.slow  # the quickstart upcycle of its fixture (~10 s): in CI's opt-in run, off the fast suite's 8 minutes
def test_the_summary_says_what_good_and_bad_values_look_like(quickstart):
    """The end of `expertize upcycle` grades ΔCE, FVU and dead units against stated bounds and explains the greedy
    match. Before: "greedy continuations identical to base: 0.00%" and "dead 49%" with no word on either."""
    from expertize.conversion.evaluation.reading import GRADES
    from expertize.conversion.upcycle import upcycle_summary

    model, _ = quickstart
    metrics = json.loads((model / "metrics.json").read_text())
    summary = upcycle_summary(model)
    assert "expertize: how to read these:" in summary
    delta, dead = metrics["ce"]["delta"], metrics["layers"]["2"]["dead_fraction"]
    grade = "good" if delta < GRADES["ΔCE"][0] else "poor" if delta > GRADES["ΔCE"][1] else "fair"
    assert f"ΔCE {delta:+.3f} nats is {grade}: " in summary and "0 = lossless" in summary
    assert f"layer 2: {dead * 100:.3g} % dead is " in summary and "a few % is healthy" in summary
    curve = metrics["generation"]["match_curve"]
    agree = next((i for i, share in enumerate(curve) if share < 0.5), len(curve))
    assert f"whole {len(curve)}-token continuation equals the base's" in summary
    assert f"at least half agree for the first {agree} token(s)" in summary


def test_dead_grade_poor_exactly_when_the_health_warning_fires():
    """One dead-unit bound: the summary's "poor" grade and the code-health WARNING agree on every dead fraction (they
    were 20 % and 10 %, so a 15 %-dead run was graded "fair" under a warning)."""
    from expertize.conversion.evaluation.health import code_health
    from expertize.conversion.evaluation.reading import _grade

    for dead in (0.0, 0.04, 0.06, 0.0999, 0.1, 0.1001, 0.15, 0.25, 0.9):
        warned = any(w.startswith("dead:") for w in code_health(
            dead_fraction=dead, l0=32.0, k=32, effective_units=None, num_units=1000))
        assert (_grade("dead", dead) == "poor") == warned, dead
