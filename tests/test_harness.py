"""lm-evaluation-harness: `expertize eval` side by side, its numbers against the harness's own entry points (Python
API and CLI with remote code), offline tasks, the card it regenerates, sweep plots, and the recipe hook in upcycle."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import ModelCard

from expertize.conversion.cli import main as cli_main
from expertize.conversion.harness.runner import HarnessError, HarnessSettings, resolve_tasks
from expertize.conversion.harness.offline_tasks import (
    BUNDLED_TASKS,
    bundled_tasks_dir,
    cloze_items,
    split_documents,
    split_units,
    write_tasks_from_text,
)
from expertize.conversion.surgery.splice import save_model, splice
from expertize.conversion.evaluation.sweep import plot_sweep, sweep_points
from expertize.modeling import MuMoECPSpec, MxdLayer, MxdSpec, TranscoderSpec
from tests.conftest import D_HIDDEN, D_MODEL, run_isolated, tiny_base_model, tiny_tokenizer

LIMIT = 6


def _speeches(path: Path, n_docs: int = 40, seed: int = 0) -> Path:
    """Blank-line separated documents of 3-6 lines of tiny-tokenizer words (every word is in its vocabulary)."""
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n_docs):
        lines = []
        for _ in range(int(torch.randint(3, 7, (1,), generator=gen))):
            words = torch.randint(0, 90, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen)
            lines.append(" ".join(f"w{int(w)}" for w in words))
        docs.append("\n".join(lines))
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Llama base, the same base with an MxD layer at layer 1 (provenance records the base), and a task
    folder made by `expertize tasks` from text in the tiny tokenizer's vocabulary."""
    root = tmp_path_factory.mktemp("harness")
    tokenizer = tiny_tokenizer()
    base = root / "base"
    tiny_base_model("llama").save_pretrained(base)
    tokenizer.save_pretrained(base)
    spec = MxdSpec(d_in=D_MODEL, d_out=D_MODEL, d_hidden=D_HIDDEN, num_experts=16, k=4, activation="silu",
                   encoder="glu")
    torch.manual_seed(1)
    model = save_model(splice(tiny_base_model("llama"), {1: MxdLayer(spec)}), root / "model", tokenizer=tokenizer)
    (model / "provenance.json").write_text(json.dumps({"base_model": str(base)}), encoding="utf-8")
    tasks = root / "tasks"
    assert cli_main(["tasks", str(_speeches(root / "speeches.txt")), "--name", "tiny", "--output", str(tasks)]) == 0
    return root, base, model, tasks


def _eval(model: Path, tasks: Path, out: Path, *extra: str) -> int:
    return cli_main(["eval", str(model), "--tasks", "tiny_ppl,tiny_cloze", "--include-path", str(tasks),
                     "--limit", str(LIMIT), "--batch-size", "4", "--device", "cpu", "--output", str(out), *extra])


def _direct(pretrained: Path, tasks: Path) -> dict:
    """The harness's own Python entry point on a folder: `simple_evaluate(model="hf", model_args=...)`."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={pretrained},trust_remote_code=True,dtype=float32", device="cpu",
        batch_size=4, tasks=["tiny_ppl", "tiny_cloze"], limit=LIMIT, log_samples=False,
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
    )["results"]


@pytest.mark.slow  # lm-eval twice
def test_eval_side_by_side_equals_the_harness_run_directly(folders, capsys):
    root, base, model, tasks = folders
    out = root / "eval"
    assert _eval(model, tasks, out) == 0
    table = capsys.readouterr().out

    # The harness's own files for both models, and the side-by-side table / JSON / plot.
    for role in ("model", "base"):
        results = list((out / role).glob("results_*.json"))
        assert len(results) == 1, results
        for task in ("tiny_ppl", "tiny_cloze"):
            (samples,) = (out / role).glob(f"samples_{task}_*.jsonl")
            assert len(samples.read_text().splitlines()) == LIMIT
    assert (out / "comparison.png").stat().st_size > 1000
    assert (out / "comparison.md").read_text() in table
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["base"] == str(base)
    assert comparison["settings"]["limit"] == LIMIT and comparison["settings"]["batch_size"] == 4

    # Every number equals the harness's own run on each folder (the model through remote code).
    for role, pretrained in (("model", model), ("base", base)):
        direct = _direct(pretrained, tasks)
        suffix = "" if role == "model" else "base_"
        for task in ("tiny_ppl", "tiny_cloze"):
            metrics = comparison["tasks"][task]["metrics"]
            expected = {k for k in direct[task] if "," in k and "_stderr," not in k}
            assert set(metrics) == expected
            for key, m in metrics.items():
                assert m[f"{suffix}value"] == pytest.approx(direct[task][key], rel=1e-9, abs=1e-12), (role, key)
    ppl = comparison["tasks"]["tiny_ppl"]["metrics"]["word_perplexity,none"]
    assert ppl["value"] != ppl["base_value"]  # the MxD layer changes the model: two different runs
    assert ppl["delta"] == pytest.approx(ppl["value"] - ppl["base_value"])
    assert ppl["higher_is_better"] is False
    acc = comparison["tasks"]["tiny_cloze"]["metrics"]["acc,none"]
    assert acc["stderr"] > 0 and acc["higher_is_better"] is True
    assert comparison["tasks"]["tiny_cloze"]["n_samples"] == LIMIT
    row = f"| tiny_ppl | word_perplexity,none ↓ | {LIMIT} | 0 | {ppl['base_value']:.4f} | {ppl['value']:.4f} |"
    assert row in table

    # Recorded in the model folder, and the regenerated card carries the table and the model-index.
    recorded = json.loads((model / "metrics.json").read_text())["lm_eval"]["tasks"]
    assert recorded["tiny_ppl"]["metrics"] == comparison["tasks"]["tiny_ppl"]["metrics"]
    assert recorded["tiny_ppl"]["results_files"]["model"].startswith(str(out))
    # The tasks read local files (made by `expertize tasks`): recorded as such, marked "(local)" in the card's table
    # and kept out of its model-index (which lists public benchmarks by their Hub dataset).
    assert all(recorded[t]["local"] is True and recorded[t]["dataset"] is None for t in ("tiny_ppl", "tiny_cloze"))
    card = ModelCard.load(model / "README.md")
    assert card.data.base_model == str(base)
    assert not card.data.eval_results
    text = (model / "README.md").read_text()
    assert f"| task | metric | {base.name} | this model | Δ |" in text  # a name, not a path, as the header
    assert f"| `tiny_cloze` (local) | `acc,none` | {acc['base_value']:.4f} ± {acc['base_stderr']:.4f} | " in text
    assert f"`tiny_ppl`: 0-shot, {LIMIT} of 40 documents, limit {LIMIT}: a smoke test" in text


@pytest.mark.slow  # lm-eval's own CLI in a subprocess (~25 s)
def test_lm_eval_cli_runs_the_folder_through_remote_code(folders, tmp_path):
    """`lm_eval run --model hf --model_args pretrained=DIR,trust_remote_code=True` on our folder and tasks (one
    --include_path, as the CLI takes, plus a shipped task by its YAML path), in a process that cannot import
    expertize, gives the numbers `expertize eval` gives."""
    root, _, model, tasks = folders
    out = tmp_path / "cli"
    run_isolated(
        f"""
        import sys
        from lm_eval.__main__ import cli_evaluate
        sys.argv = ["lm_eval", "run", "--model", "hf",
                    "--model_args", "pretrained={model},trust_remote_code=True,dtype=float32",
                    "--tasks", "tiny_ppl,{bundled_tasks_dir() / 'expertize_stories_cloze.yaml'}",
                    "--include_path", "{tasks}",
                    "--device", "cpu", "--batch_size", "4", "--limit", "3",
                    "--output_path", "{out}", "--log_samples"]
        cli_evaluate()
        import transformers_modules  # the model class came from the folder's copied files
        """,
        tmp_path,
    )
    (results_file,) = out.rglob("results_*.json")
    cli = json.loads(results_file.read_text())["results"]
    assert {p.name.split("_2")[0] for p in out.rglob("samples_*.jsonl")} == {
        "samples_tiny_ppl", "samples_expertize_stories_cloze"}

    ours = root / "eval_cli_reference"
    assert cli_main(["eval", str(model), "--tasks", "tiny_ppl,expertize_stories_cloze", "--include-path", str(tasks),
                     "--limit", "3", "--batch-size", "4", "--device", "cpu", "--output", str(ours), "--no-base",
                     "--no-card"]) == 0
    comparison = json.loads((ours / "comparison.json").read_text())
    for task in ("tiny_ppl", "expertize_stories_cloze"):
        for key, m in comparison["tasks"][task]["metrics"].items():
            assert m["value"] == pytest.approx(cli[task][key], rel=1e-9, abs=1e-12), (task, key)
            assert m["base_value"] is None
    assert not (ours / "base").exists()


@pytest.mark.slow  # subprocesses (~13 s)
def test_eval_errors_exit_2(folders, tmp_path, capsys):
    root, base, model, tasks = folders
    # A typo in an offline task: the closest names are suggested.
    assert cli_main(["eval", str(model), "--tasks", "expertize_stories_clozee", "--no-base"]) == 2
    err = capsys.readouterr().err
    assert "expertize eval: error: unknown lm-eval task(s) 'expertize_stories_clozee'" in err
    assert "did you mean 'expertize_stories_cloze'" in err
    # Not an expertize model: the base folder is a plain Llama.
    assert cli_main(["eval", str(base), "--tasks", "expertize_stories_ppl"]) == 2
    err = capsys.readouterr().err
    assert "holds a 'llama' model, not an expertize model" in err and "expertize upcycle" in err
    assert cli_main(["eval", str(tmp_path / "nowhere"), "--tasks", "expertize_stories_ppl"]) == 2
    assert "is not a folder" in capsys.readouterr().err
    # A recorded base folder that moved.
    moved = tmp_path / "moved_model"
    save_model(splice(tiny_base_model("llama"), {}), moved, tokenizer=tiny_tokenizer())
    (moved / "provenance.json").write_text(json.dumps({"base_model": str(tmp_path / "gone")}), encoding="utf-8")
    assert cli_main(["eval", str(moved), "--tasks", "expertize_stories_ppl", "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert f"the base model folder {str(tmp_path / 'gone')!r} does not exist" in err and "pass --base" in err
    assert cli_main(["eval", str(model), "--tasks", "tiny_ppl", "--include-path", str(tmp_path / "no_tasks")]) == 2
    assert "is not a folder (it should hold task YAML files)" in capsys.readouterr().err


def test_eval_outside_a_git_checkout_prints_no_git_error(folders, tmp_path, capfd, monkeypatch):
    """lm-eval records the working directory's commit with `git describe`; outside a checkout git's "fatal: not a git
    repository" reached the terminal (it writes to the file descriptor, so capfd, not capsys, sees it)."""
    import shutil
    import subprocess

    root, base, model, tasks = folders
    model = Path(shutil.copytree(model, tmp_path / "model"))  # eval records into the folder: the module's stays as it is
    work = tmp_path / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no checkout above it either
    assert subprocess.run(["git", "rev-parse"], capture_output=True).returncode != 0  # not a checkout, as a user's
    capfd.readouterr()
    assert cli_main(["eval", str(model), "--tasks", "tiny_ppl", "--include-path", str(tasks), "--limit", "2",
                     "--batch-size", "4", "--device", "cpu", "--no-base", "--no-card"]) == 0
    err = capfd.readouterr().err
    assert "fatal" not in err and "not a git repository" not in err, err
    (results,) = (model / "lm_eval" / "model").glob("results_*.json")
    assert json.loads(results.read_text())["git_hash"] is None  # lm-eval's record, unchanged: no commit here


@pytest.mark.slow  # a subprocess (~20 s)
def test_eval_of_a_hub_task_offline_fails_before_writing_anything(folders, tmp_path, capsys, monkeypatch):
    """HF_HUB_OFFLINE with a task whose dataset is on the Hub (and not cached): one clear line, exit 2, and no
    output folder left behind (neither --output nor MODEL_DIR/lm_eval)."""
    import datasets.config
    import huggingface_hub.constants

    root, base, model, tasks = folders
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty_hub_cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty_datasets_cache")
    before = sorted(p.name for p in model.iterdir())
    out = tmp_path / "hellaswag_out"
    assert cli_main(["eval", str(model), "--tasks", "hellaswag", "--output", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "expertize eval: error: offline mode is on" in err and "hellaswag (dataset Rowan/hellaswag)" in err
    assert "expertize tasks --list" in err and "Traceback" not in err
    assert not out.exists() and sorted(p.name for p in model.iterdir()) == before
    # The same check guards a recipe's eval.lm_eval_tasks before any training.
    from expertize.conversion.harness.folder_eval import LmEvalPlan
    from expertize.conversion.recipe.schema import EvalConfig

    with pytest.raises(HarnessError, match=r"eval.lm_eval_tasks: offline mode is on .*hellaswag"):
        LmEvalPlan.from_eval_config(EvalConfig(lm_eval_tasks=["hellaswag"]))
    # Offline tasks need no network: no error.
    assert LmEvalPlan.from_eval_config(EvalConfig(lm_eval_tasks=["expertize_stories_ppl"])) is not None
    # One rule says which tasks read a Hub dataset (the offline check, the records and the card's model-index).
    from expertize.conversion.harness.offline import hub_dataset

    assert hub_dataset({"dataset_path": "Rowan/hellaswag"}) == "Rowan/hellaswag"
    assert hub_dataset({"dataset_path": "json", "dataset_kwargs": {"data_files": "x.jsonl"}}) is None
    assert hub_dataset({"custom_dataset": "def load_jsonl(...)", "dataset_kwargs": {"data_file": "x.jsonl"}}) is None
    assert hub_dataset({"dataset_path": str(tmp_path)}) is None  # a local folder


def test_offline_task_generation(tmp_path):
    text = _speeches(tmp_path / "t.txt", n_docs=30, seed=3)
    names = write_tasks_from_text(text, tmp_path / "a", "demo", seed=5)
    assert names == ["demo_ppl", "demo_cloze"]
    write_tasks_from_text(text, tmp_path / "b", "demo", seed=5)
    write_tasks_from_text(text, tmp_path / "c", "demo", seed=6)
    files = ["demo_ppl.yaml", "demo_cloze.yaml", "demo_text.jsonl", "demo_cloze.jsonl", "task_data.py"]
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)  # seeded
    assert (tmp_path / "a" / "demo_cloze.jsonl").read_text() != (tmp_path / "c" / "demo_cloze.jsonl").read_text()

    documents = split_documents(text.read_text())
    assert len(documents) == 30
    rows = [json.loads(line) for line in (tmp_path / "a" / "demo_cloze.jsonl").read_text().splitlines()]
    assert len(rows) == 30  # every document has >= 3 lines
    for row in rows:
        lines = split_units(documents[row["doc_index"]], "line")
        answer = row["choices"][row["label"]]
        position = lines.index(answer)
        assert row["context"] == "\n".join(lines[max(0, position - 8) : position])  # the true next line
        assert len(row["choices"]) == 4 and len(set(row["choices"])) == 4
        for i, choice in enumerate(row["choices"]):
            if i != row["label"]:
                assert choice not in lines  # distractors come from other documents
    assert len({row["label"] for row in rows}) > 1
    cfg = yaml.safe_load((tmp_path / "a" / "demo_cloze.yaml").read_text().replace("!function ", ""))
    assert cfg["output_type"] == "multiple_choice" and cfg["target_delimiter"] == "\n" and cfg["tag"] == ["demo"]

    prose = ["One day a cat sat. It was warm. The sun was out. Then it rained", "A dog ran. It barked! Then it slept."]
    assert split_units(prose[0], "sentence") == ["One day a cat sat.", "It was warm.", "The sun was out."]
    assert [len(item["choices"]) for item in cloze_items(prose, unit="sentence")] == [4, 4]
    with pytest.raises(ValueError, match="too little text for 5-way cloze items: only 3 distractor sentences"):
        cloze_items(prose, unit="sentence", n_choices=5)
    with pytest.raises(FileExistsError, match="already holds demo_ppl.yaml"):
        write_tasks_from_text(text, tmp_path / "a", "demo")
    with pytest.raises(ValueError, match="task name '1bad'"):
        write_tasks_from_text(text, tmp_path / "d", "1bad")


def test_bundled_tasks_are_indexed_and_well_formed():
    manager, names = resolve_tasks(["expertize_offline"])
    assert set(BUNDLED_TASKS) <= set(manager.all_tasks) and names == ["expertize_offline"]
    _, names = resolve_tasks(["expertize_*_cloze"])
    assert names == ["expertize_shakespeare_cloze", "expertize_stories_cloze"]
    folder = bundled_tasks_dir()
    for name in ("expertize_stories", "expertize_shakespeare"):
        rows = [json.loads(line) for line in (folder / f"{name}_cloze.jsonl").read_text().splitlines()]
        assert len(rows) >= 40 and all(0 <= r["label"] < len(r["choices"]) == 4 for r in rows)
        assert sum(len(line) for line in (folder / f"{name}_text.jsonl").read_text().splitlines()) < 64_000
    with pytest.raises(ValueError, match="no tasks given"):
        HarnessSettings(tasks=[" "])


def _fake_folder(root: Path, name: str, spec, metrics: dict) -> Path:
    """A folder with what the sweep reads: config.json (sparse_layers) and metrics.json (+ the files a model
    folder must have, empty: the sweep never loads weights)."""
    folder = root / name
    folder.mkdir()
    auto_map = {"AutoConfig": "configuration_expertize.ExpertizeLlamaConfig",
                "AutoModelForCausalLM": "modeling_expertize.ExpertizeLlamaForCausalLM"}
    config = {"model_type": "expertize_llama", "auto_map": auto_map, "sparse_layers": {"1": spec.to_dict()}}
    (folder / "config.json").write_text(json.dumps(config))
    for file in ("model.safetensors", "configuration_expertize.py", "modeling_expertize.py"):
        (folder / file).touch()
    (folder / "metrics.json").write_text(json.dumps(metrics))
    return folder


def test_plot_sweep(tmp_path, monkeypatch):
    folders = []
    for k, ce, acc in ((2, 3.9, 0.30), (8, 3.6, 0.35), (4, 3.7, 0.33)):
        spec = MxdSpec(d_in=64, d_out=64, d_hidden=172, num_experts=256, k=k, encoder="glu", activation="silu")
        lm_eval = {"tasks": {"st_cloze": {"metrics": {"acc,none": {"value": acc, "base_value": 0.36}}}}}
        folders.append(_fake_folder(tmp_path, f"mxd{k}", spec, {"ce": {"base": 3.5, "spliced": ce}, "lm_eval": lm_eval,
                                                                "layers": {"1": {"fvu": ce / 10}}}))
    spec = TranscoderSpec(d_in=64, d_out=64, num_latents=2048, k=8)
    folders.append(_fake_folder(tmp_path, "tc8", spec, {"ce": {"base": 3.5, "spliced": 3.8}, "lm_eval": {
        "tasks": {"st_cloze": {"metrics": {"acc,none": {"value": 0.31, "base_value": 0.36}}}}}}))

    assert cli_main(["plot-sweep", *map(str, folders), "--metric", "ce.spliced", "--output",
                     str(tmp_path / "ce.png")]) == 0
    record = json.loads((tmp_path / "ce.json").read_text())
    assert (tmp_path / "ce.png").stat().st_size > 1000
    assert record["base_value"] == 3.5
    assert [(p["method"], p["k"], p["value"]) for p in record["points"]] == [
        ("mxd", 2, 3.9), ("mxd", 8, 3.6), ("mxd", 4, 3.7), ("transcoder", 8, 3.8)]

    path = plot_sweep(folders, "lm_eval:st_cloze:acc", tmp_path / "acc.png", x="active_parameters")
    points = json.loads(path.with_suffix(".json").read_text())["points"]
    assert [p["value"] for p in points] == [0.30, 0.35, 0.33, 0.31]
    assert points[0]["active_parameters"] < points[2]["active_parameters"] < points[1]["active_parameters"]
    assert json.loads(path.with_suffix(".json").read_text())["base_value"] == 0.36
    assert [p.value for p in sweep_points(folders[:3], "fvu")] == pytest.approx([0.39, 0.36, 0.37])

    with pytest.raises(ValueError, match="has no value for 'fvu'"):
        sweep_points(folders, "fvu")  # the transcoder folder has no per-layer metrics
    # Evaluated on another budget (another base value): plotted as a second evaluation with a base line of its own,
    # each labelled by its budget (before: refused, "compare like with like"); --no-base leaves the base lines out.
    (folders[3] / "metrics.json").write_text(json.dumps({"ce": {"base": 3.4, "spliced": 3.8}, "eval_tokens": 8192}))
    for folder in folders[:3]:
        (folder / "metrics.json").write_text(json.dumps({**json.loads((folder / "metrics.json").read_text()),
                                                         "eval_tokens": 32768}))
    assert cli_main(["plot-sweep", *map(str, folders), "--metric", "ce.spliced", "--output",
                     str(tmp_path / "mixed.png")]) == 0
    record = json.loads((tmp_path / "mixed.json").read_text())
    assert record["base_value"] is None and record["evaluations"] == [
        {"base_value": 3.5, "label": "32,768 eval tokens", "folders": [str(f) for f in folders[:3]]},
        {"base_value": 3.4, "label": "8,192 eval tokens", "folders": [str(folders[3])]}]
    import matplotlib.pyplot as plt

    seen = {}
    monkeypatch.setattr(plt, "close", lambda fig: seen.setdefault("labels", [
        line.get_label() for line in fig.axes[0].get_lines()]))
    plot_sweep(folders, "ce.spliced", tmp_path / "mixed2.png")
    assert seen.pop("labels") == ["mxd (32,768 eval tokens)", "base model (32,768 eval tokens)",
                                  "transcoder (8,192 eval tokens)", "base model (8,192 eval tokens)"]
    plot_sweep(folders, "ce.spliced", tmp_path / "nobase.png", base=False)
    assert seen.pop("labels") == ["mxd (32,768 eval tokens)", "transcoder (8,192 eval tokens)"]
    assert cli_main(["plot-sweep", *map(str, folders[:3]), "--metric", "ce.spliced", "--no-base", "--output",
                     str(tmp_path / "one.png")]) == 0
    assert seen.pop("labels") == ["mxd"]

    # μMoE has no top K: it is refused on the K axis (naming the folder and the fix) and plotted by active parameters
    mumoe = _fake_folder(tmp_path, "mumoe", MuMoECPSpec(d_in=64, d_out=64, d_hidden=172, num_experts=16, rank=8),
                         {"ce": {"base": 3.4, "spliced": 3.7}})
    with pytest.raises(ValueError, match=r"mumoe: its mumoe_cp layers choose no top K .* --x active_parameters"):
        plot_sweep([folders[3], mumoe], "ce.spliced", tmp_path / "k.png")
    path = plot_sweep([folders[3], mumoe], "ce.spliced", tmp_path / "ap.png", x="active_parameters")
    assert [p["k"] for p in json.loads(path.with_suffix(".json").read_text())["points"]] == [8, None]


@pytest.fixture
def tiny_recipe(tmp_path):
    base = tmp_path / "base"
    tiny_base_model("llama").save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    corpus = _speeches(tmp_path / "corpus.txt", n_docs=300, seed=1)
    assert cli_main(["tasks", str(corpus), "--name", "tiny", "--output", str(tmp_path / "tasks"), "--max-docs",
                     "30"]) == 0
    return {
        "base_model": str(base),
        "layers": [1],
        "layer": {"kind": "mxd", "k": 4, "num_experts": 32},
        "data": {"source": "text", "paths": [str(corpus)], "document_separator": "blank_line", "context_length": 16,
                 "train_tokens": 2048, "eval_tokens": 256, "eval_fraction": 0.1},
        "train": {"tokens_per_step": 256, "shuffle_buffer_tokens": 512, "capture_batch_sequences": 16,
                  "log_every": 4, "device": "cpu"},
        "eval": {"batch_sequences": 8, "generation_prompts": 2, "prompt_tokens": 3, "continuation_tokens": 3,
                 "lm_eval_tasks": ["tiny"], "lm_eval_limit": 4, "lm_eval_batch_size": 4,
                 "lm_eval_include_paths": [str(tmp_path / "tasks")]},
        "output_dir": str(tmp_path / "run"),
    }


@pytest.mark.slow  # an upcycle run and lm-eval (~15 s)
def test_upcycle_ends_with_an_lm_eval_table(tiny_recipe, tmp_path):
    from expertize.conversion.recipe import recipe_from_dict
    from expertize.conversion.upcycle import upcycle

    out = upcycle(recipe_from_dict(tiny_recipe), progress=False)
    metrics = json.loads((out / "metrics.json").read_text())
    tasks = metrics["lm_eval"]["tasks"]
    assert set(tasks) == {"tiny_ppl", "tiny_cloze"}
    for entry in tasks.values():
        assert entry["n_samples"] == 4 and entry["base"] == tiny_recipe["base_model"]
        for role, path in entry["results_files"].items():
            assert (out / path).is_file(), (role, path)  # relative to the published folder
        assert all(m["base_value"] is not None for m in entry["metrics"].values())
    assert metrics["recipe_summary"]["steps"] == 8
    text = (out / "README.md").read_text()
    assert "| `tiny_ppl` (local) | `word_perplexity,none` |" in text and "| `steps` | 8 |" in text
    assert all(entry["local"] is True for entry in tasks.values())  # made from local text: not a public benchmark
    assert not ModelCard.load(out / "README.md").data.eval_results
    assert (out / "lm_eval" / "comparison.md").is_file()

    # An unknown task is refused before any training.
    tiny_recipe["eval"]["lm_eval_tasks"] = ["tiny_pppl"]
    tiny_recipe["output_dir"] = str(tmp_path / "run2")
    with pytest.raises(ValueError, match=r"eval.lm_eval_tasks: unknown lm-eval task\(s\) 'tiny_pppl'"):
        upcycle(recipe_from_dict(tiny_recipe), progress=False)
    assert not (tmp_path / "run2").exists()


def test_recipe_lm_eval_settings_are_checked(tiny_recipe, tmp_path):
    from expertize.conversion.recipe import RecipeError, recipe_from_dict

    recipe = recipe_from_dict(tiny_recipe, ["eval.lm_eval_limit=0.5", "eval.lm_eval_num_fewshot=2"])
    assert recipe.eval.lm_eval_limit == 0.5 and recipe.eval.lm_eval_num_fewshot == 2
    with pytest.raises(RecipeError, match="eval.lm_eval_limit: must be > 0"):
        recipe_from_dict(tiny_recipe, ["eval.lm_eval_limit=0"])
    with pytest.raises(RecipeError, match="eval.lm_eval_include_paths: .* is not a folder"):
        recipe_from_dict(tiny_recipe, [f"eval.lm_eval_include_paths=[{tmp_path / 'none'}]"])


def test_plot_sweep_metric_names_come_from_the_schema(tmp_path):
    spec = MxdSpec(d_in=64, d_out=64, d_hidden=172, num_experts=256, k=4, encoder="glu", activation="silu")
    folder = _fake_folder(tmp_path, "mxd4", spec, {"ce": {"base": 3.5, "spliced": 3.7}, "future": {"x": 1.5}})
    with pytest.raises(ValueError, match=r"unknown metric 'ce.splcied' \(did you mean 'ce.spliced'"):
        sweep_points([folder], "ce.splcied")
    assert [p.value for p in sweep_points([folder], "future.x")] == [1.5]  # a newer expertize's metric still reads
