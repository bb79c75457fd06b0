"""lm-evaluation-harness runs: an expertize model next to its base model, same tasks and settings, side by side.

    model (+ base) ─► lm_eval HFLM over each preloaded model (same batch size, dtype, device, seeds, limit, shots)
                   ─► lm_eval.simple_evaluate(tasks, TaskManager(our offline tasks + include paths [+ the harness's]))
                   ─► OUT/model/results_<date>.json, samples_<task>_<date>.jsonl    the harness's own files, as its CLI
                      OUT/base/results_<date>.json, samples_<task>_<date>.jsonl    writes them with --log_samples
                   ─► OUT/comparison.json, comparison.md, comparison.png          each metric, its stderr, base and Δ

Saved model folders (`expertize eval`) and recipes (`eval.lm_eval_tasks` in `expertize upcycle`) reach it
through conversion/benchmark.py.

Task names are the harness's (any task it knows, e.g. hellaswag, which it downloads on first use), plus the offline
tasks shipped in `expertize.conversion.harness.offline_tasks.bundled_tasks_dir()`, plus tasks under `include_paths`.
"""

import contextlib
import dataclasses
import difflib
import fnmatch
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ExpertizeError
from ..progress import quiet_lm_eval
from ..publishing.run_folder import write_json, write_text
from .offline import hub_dataset
from .offline_tasks import bundled_tasks_dir

__all__ = [
    "HarnessError",
    "HarnessSettings",
    "compare_results",
    "compare_on_tasks",
    "comparison_markdown",
    "plot_comparison",
    "resolve_tasks",
    "run_harness",
]

Log = Callable[[str], None]


class HarnessError(ExpertizeError, ValueError):
    """Bad lm-eval input (unknown task, missing include path, ...); the message names it and the fix."""


@dataclasses.dataclass
class HarnessSettings:
    """One set of lm-eval settings, applied identically to the model and its base."""

    tasks: list[str]
    """Task, group or tag names (glob patterns such as "expertize_*" allowed)."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt; None: each task's default (0 for ours)."""
    limit: int | float | None = None
    """Documents per task (a fraction when < 1); None: all. For smoke tests only: partial results."""
    batch_size: int = 8
    """Requests per forward pass."""
    seed: int | None = None
    """Sets the harness's four seeds (python, numpy, torch, few-shot sampling); None: the harness's defaults."""
    include_paths: list[str] = dataclasses.field(default_factory=list)
    """Extra folders of task YAMLs (our offline tasks are always included)."""
    log_samples: bool = True
    """Keep every per-document request and response (samples_<task>_<date>.jsonl)."""

    def __post_init__(self) -> None:
        self.tasks = list(dict.fromkeys(t.strip() for t in self.tasks if t.strip()))
        if not self.tasks:
            raise HarnessError("no tasks given; name at least one, e.g. --tasks expertize_stories_ppl,hellaswag")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise HarnessError(f"num_fewshot must be >= 0, got {self.num_fewshot}")
        if self.limit is not None and not self.limit > 0:
            raise HarnessError(f"limit must be > 0 (documents per task, or a fraction < 1), got {self.limit}")
        if self.batch_size < 1:
            raise HarnessError(f"batch_size must be >= 1, got {self.batch_size}")
        for path in self.include_paths:
            if not Path(path).is_dir():
                raise HarnessError(f"include path {path!r} is not a folder (it should hold task YAML files)")

    def seeds(self) -> dict[str, int]:
        if self.seed is None:
            return {}
        return {name: self.seed for name in ("random_seed", "numpy_random_seed", "torch_random_seed",
                                             "fewshot_random_seed")}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------------------------
# Tasks


def resolve_tasks(tasks: Sequence[str], include_paths: Sequence[str] = ()) -> tuple[Any, list[str]]:
    """A `TaskManager` that knows every name in `tasks`, and the names (glob patterns expanded).

    Indexing the harness's ~15,000 built-in tasks takes seconds, so it is skipped when our offline tasks and the
    include paths cover the request. An unknown name raises HarnessError with the closest known names.
    """
    from lm_eval.tasks import TaskManager

    paths = [str(bundled_tasks_dir()), *map(str, include_paths)]
    manager = TaskManager(include_path=paths, include_defaults=False)
    names, unknown = _match(manager, tasks)
    if unknown:
        manager = TaskManager(include_path=paths, include_defaults=True)
        names, unknown = _match(manager, tasks)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3, cutoff=0.6)
            hints.append(f"{name!r}" + (f" (did you mean {', '.join(map(repr, close))}?)" if close else ""))
        raise HarnessError(
            f"unknown lm-eval task(s) {', '.join(hints)}; list the harness's tasks with `lm_eval ls tasks`, "
            f"ours with `expertize tasks --list`, or add a folder of task YAMLs with --include-path"
        )
    return manager, names


def _match(manager, tasks: Sequence[str]) -> tuple[list[str], list[str]]:
    names, unknown = [], []
    known = set(manager.all_tasks)
    for task in tasks:
        if any(c in task for c in "*?["):
            matched = fnmatch.filter(manager.all_tasks, task)
            (names.extend(matched) if matched else unknown.append(task))
        elif task in known or (task.endswith((".yaml", ".yml")) and Path(task).is_file()):
            names.append(task)
        else:
            unknown.append(task)
    return list(dict.fromkeys(names)), unknown


# ----------------------------------------------------------------------------------------------------------------
# One harness run


@contextlib.contextmanager
def _harness_logging(verbose: bool) -> Iterator[None]:
    """The harness logs a warning per truncated request and per defaulted setting: keep its errors only unless
    `verbose` (its progress bars stay)."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.INFO if verbose else logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _quiet_git_hash() -> Iterator[None]:
    """lm-eval records the working directory's git commit (`git describe`, evaluator.get_git_commit_hash) and lets
    git's stderr through: outside a checkout `expertize eval` printed "fatal: not a git repository". Its own
    function still runs (the record is the same: the commit, or its fallback, None outside a checkout), with the
    file descriptor git inherits as stderr pointed at /dev/null for the call."""
    from lm_eval import evaluator

    original = getattr(evaluator, "get_git_commit_hash", None)
    if original is None:
        yield
        return

    def quiet():
        import sys

        with contextlib.suppress(Exception):
            sys.stderr.flush()
        try:
            saved = os.dup(2)
        except OSError:  # no file descriptor 2 to inherit: nothing to quiet
            return original()
        try:
            with open(os.devnull, "wb") as devnull:
                os.dup2(devnull.fileno(), 2)
            return original()
        finally:
            os.dup2(saved, 2)
            os.close(saved)

    evaluator.get_git_commit_hash = quiet
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original


def run_harness(
    model,
    tokenizer,
    settings: HarnessSettings,
    *,
    task_manager,
    tasks: Sequence[str],
    output_dir: str | os.PathLike,
    name: str,
    verbose: bool = False,
) -> tuple[dict, dict[str, Any]]:
    """Run the harness on one preloaded causal LM; returns (results without samples, the files it wrote).

    The files are the harness CLI's `--output_path --log_samples` files: `output_dir/results_<date>.json` and
    `output_dir/samples_<task>_<date>.jsonl`. `name` is recorded as the model's name (config.model_args.pretrained).
    """
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.models.huggingface import HFLM

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    # A ".json" output_path makes the tracker write <output_dir>/results_<date>.json and the samples next to it.
    tracker = EvaluationTracker(output_path=str(output_dir / "results.json"))
    with _harness_logging(verbose), quiet_lm_eval(), _quiet_git_hash():  # quiet_lm_eval: no bars (--no-progress)
        lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=settings.batch_size)
        results = lm_eval.simple_evaluate(
            model=lm,
            model_args={"pretrained": name, "dtype": str(model.dtype).removeprefix("torch.")},
            tasks=list(tasks),
            num_fewshot=settings.num_fewshot,
            batch_size=settings.batch_size,
            device=str(model.device),
            limit=settings.limit,
            log_samples=settings.log_samples,
            evaluation_tracker=tracker,
            task_manager=task_manager,
            **settings.seeds(),
        )
        samples = results.pop("samples", None)
        before = set(output_dir.glob("results_*.json"))
        tracker.save_results_aggregated(results=results, samples=samples)
        written = sorted(set(output_dir.glob("results_*.json")) - before)
        if not written:  # the tracker logs and swallows write errors
            raise OSError(f"lm-eval did not write its results into {output_dir}; check that the folder is writable")
        files: dict[str, Any] = {"results": str(written[-1]), "samples": []}
        if samples is not None:
            for task in results["configs"]:
                tracker.save_results_samples(task_name=task, samples=samples[task])
                files["samples"].append(str(output_dir / f"samples_{task}_{tracker.date_id}.jsonl"))
    return results, files


# ----------------------------------------------------------------------------------------------------------------
# Side by side


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _metrics_of(task_results: Mapping[str, Any]) -> dict[str, tuple[float | None, float | None]]:
    """{"acc,none": (value, stderr)} from one task's lm-eval results ("N/A" stderr -> None). Metric keys are
    "metric,filter"; the other keys (alias, name, sample_len) have no comma."""
    out = {}
    for key, value in task_results.items():
        if "," not in key or "_stderr," in key:
            continue
        metric, _, filt = key.partition(",")
        out[key] = (_number(value), _number(task_results.get(f"{metric}_stderr,{filt}")))
    return out


def compare_results(model_results: Mapping[str, Any], base_results: Mapping[str, Any] | None) -> dict[str, Any]:
    """task -> {"n_shot", "n_samples", "n_documents", "version", "dataset", "local", "metrics": {metric: {"value",
    "stderr", "base_value", "base_stderr", "delta", "higher_is_better"}}} from two `simple_evaluate` results (base
    optional). "dataset": the Hub dataset the task reads (None: local data); "local": whether its data is local (a
    task made from local text is not a public benchmark), None for a group, whose results aggregate its tasks'."""
    tasks = {}
    configs = model_results.get("configs", {})
    for task, task_results in model_results["results"].items():
        base_task = (base_results or {}).get("results", {}).get(task, {})
        base_metrics = _metrics_of(base_task)
        better = model_results.get("higher_is_better", {}).get(task, {})
        metrics = {}
        for key, (value, stderr) in _metrics_of(task_results).items():
            base_value, base_stderr = base_metrics.get(key, (None, None))
            metrics[key] = {
                "value": value,
                "stderr": stderr,
                "base_value": base_value,
                "base_stderr": base_stderr,
                "delta": value - base_value if value is not None and base_value is not None else None,
                "higher_is_better": better.get(key.partition(",")[0]),
            }
        n_samples = model_results.get("n-samples", {}).get(task, {})
        tasks[task] = {
            "n_shot": model_results.get("n-shot", {}).get(task),
            "n_samples": n_samples.get("effective"),
            "n_documents": n_samples.get("original"),
            "version": model_results.get("versions", {}).get(task),
            "dataset": hub_dataset(configs[task]) if task in configs else None,
            "local": hub_dataset(configs[task]) is None if task in configs else None,
            "metrics": metrics,
        }
    return tasks


def _fmt(x: float | None, stderr: float | None = None) -> str:
    if x is None:
        return "—"
    text = f"{x:.4f}" if 1e-3 <= abs(x) < 1e6 or x == 0 else f"{x:.3e}"
    return text + (f" ± {stderr:.4f}" if stderr is not None else "")


def comparison_markdown(comparison: Mapping[str, Any]) -> str:
    """The side-by-side table (Markdown) of a comparison dict (`compare_on_tasks`'s return value)."""
    base, model = comparison.get("base") or "base (not run)", comparison["model"]
    lines = [
        f"model: `{model}`  ",
        f"base: `{base}`  ",
        "settings: " + ", ".join(f"{k}={v}" for k, v in comparison["settings"].items() if k != "tasks"),
        "",
        "| task | metric | docs | shots | base | model | Δ (model − base) |",
        "|---|---|---|---|---|---|---|",
    ]
    for task, entry in comparison["tasks"].items():
        for key, m in entry["metrics"].items():
            arrow = {True: " ↑", False: " ↓"}.get(m["higher_is_better"], "")
            delta = f"{m['delta']:+.4f}" if m["delta"] is not None else "—"
            docs = f"{entry['n_samples']}" if entry["n_samples"] is not None else "—"
            lines.append(
                f"| {task} | {key}{arrow} | {docs} | {entry['n_shot']} | {_fmt(m['base_value'], m['base_stderr'])} "
                f"| {_fmt(m['value'], m['stderr'])} | {delta} |"
            )
    return "\n".join(lines) + "\n"


def plot_comparison(comparison: Mapping[str, Any], path: str | os.PathLike, max_panels: int = 24) -> Path:
    """One bar pair (base, model) per task metric, with ±stderr whiskers; PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(task, key, m) for task, e in comparison["tasks"].items() for key, m in e["metrics"].items()]
    panels = panels[:max_panels]
    cols = min(4, max(1, len(panels)))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False)
    for ax, (task, key, m) in zip(axes.flat, panels):
        values = [m["base_value"], m["value"]]
        errors = [m["base_stderr"] or 0.0, m["stderr"] or 0.0]
        ax.bar([0, 1], [v if v is not None else 0.0 for v in values], yerr=errors, color=["#999999", "#1f77b4"],
               capsize=4)
        ax.set_xticks([0, 1], ["base", "model"])
        arrow = {True: " (↑ better)", False: " (↓ better)"}.get(m["higher_is_better"], "")
        ax.set_title(f"{task}\n{key}{arrow}", fontsize=8)
        for x, v in enumerate(values):
            if v is not None:
                ax.annotate(f"{v:.4g}", (x, v), ha="center", va="bottom", fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def compare_on_tasks(
    model,
    tokenizer,
    base,
    base_tokenizer,
    settings: HarnessSettings,
    output_dir: str | os.PathLike,
    *,
    model_name: str,
    base_name: str | None,
    task_manager=None,
    tasks: Sequence[str] | None = None,
    extra_settings: Mapping[str, Any] | None = None,
    log: Log | None = None,
    verbose: bool = False,
) -> dict[str, Any]:
    """Run the harness on `model` and (unless `base` is None) on `base` with identical settings; write the
    harness's files under output_dir/model and output_dir/base and the side-by-side comparison.json / .md / .png.

    Returns the comparison dict: {"model", "base", "settings", "tasks" (see `compare_results`), "files"}; file paths
    are relative to output_dir. `extra_settings` (e.g. dtype, device) are recorded with the settings.
    """
    log = log or (lambda message: None)
    output_dir = Path(output_dir)
    if task_manager is None or tasks is None:
        task_manager, tasks = resolve_tasks(settings.tasks, settings.include_paths)
    created = not output_dir.exists()
    try:
        return _compare_on_tasks(
            model, tokenizer, base, base_tokenizer, settings, output_dir, model_name=model_name, base_name=base_name,
            task_manager=task_manager, tasks=tasks, extra_settings=extra_settings, log=log, verbose=verbose,
        )
    except BaseException:
        if created:  # a failed first run leaves no empty or half-written folder behind
            import shutil

            shutil.rmtree(output_dir, ignore_errors=True)
        raise


def _compare_on_tasks(
    model, tokenizer, base, base_tokenizer, settings, output_dir: Path, *, model_name, base_name, task_manager,
    tasks, extra_settings, log: Log, verbose: bool,
) -> dict[str, Any]:
    runs = [("model", model, tokenizer, model_name)]
    if base is not None:
        runs.append(("base", base, base_tokenizer, base_name))
    results, files = {}, {}
    for step, (role, lm_model, lm_tokenizer, name) in enumerate(runs, start=1):
        log(f"[{step}/{len(runs)}] {role} {name}: lm-eval {', '.join(tasks)}")
        results[role], written = run_harness(
            lm_model, lm_tokenizer, settings, task_manager=task_manager, tasks=tasks,
            output_dir=output_dir / role, name=name, verbose=verbose,
        )
        files[role] = {
            "results": os.path.relpath(written["results"], output_dir),
            "samples": [os.path.relpath(p, output_dir) for p in written["samples"]],
        }
    comparison = {
        "model": model_name,
        "base": base_name if base is not None else None,
        "settings": settings.to_dict()
        | dict(extra_settings or {})
        | {"lm_eval_version": results["model"].get("lm_eval_version")},
        "tasks": compare_results(results["model"], results.get("base")),
        "files": files,
    }
    write_json(output_dir / "comparison.json", comparison)  # strict JSON, like every record expertize writes
    write_text(output_dir / "comparison.md", comparison_markdown(comparison))
    plot_comparison(comparison, output_dir / "comparison.png")
    return comparison
