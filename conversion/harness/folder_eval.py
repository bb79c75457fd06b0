"""Benchmarks of saved model folders and recipes with lm-evaluation-harness (the runs themselves: harness.py).

    expertize eval MODEL_DIR --tasks ...   `evaluate_model_folder`:
        check the folder (config, weights, kinds), the device, the output folders and that the base shares the
        model's tokenizer ─► resolve the tasks ─► load the model (our classes) and its base (--base, else the one
        the folder records) in one dtype on one device ─► harness.compare_on_tasks ─► MODEL_DIR/metrics.json
        ["lm_eval"] ─► README.md regenerated (model_folder.refresh_model_card)
    recipe eval.lm_eval_tasks              `LmEvalPlan`: tasks checked before training, then the same comparison on
                                           the in-memory base and spliced models inside `expertize upcycle`
"""

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..checks import check_local_weights, check_output_location, resolve_device
from ..publishing.run_folder import LM_EVAL
from .offline import check_task_data_offline
from .runner import HarnessError, HarnessSettings, Log, compare_on_tasks, resolve_tasks

__all__ = ["RECORDED", "LmEvalPlan", "evaluate_model_folder", "lm_eval_record"]

RECORDED = "recorded"
"""`base=RECORDED`: the base model recorded in the folder (provenance.json, else recipe.resolved.yaml)."""


def lm_eval_record(comparison: Mapping[str, Any], output_dir: Path, model_dir: Path) -> dict[str, dict[str, Any]]:
    """The per-task entries kept in metrics.json["lm_eval"]["tasks"]: the comparison plus the settings and files
    behind it (paths relative to the model folder when the output lies inside it)."""
    def where(relative: str) -> str:
        path = (output_dir / relative).resolve()
        return os.path.relpath(path, model_dir.resolve()) if path.is_relative_to(model_dir.resolve()) else str(path)

    settings = comparison["settings"]
    files = comparison["files"]
    return {
        task: {
            **{k: v for k, v in entry.items() if k != "metrics"},
            "limit": settings["limit"],
            "batch_size": settings["batch_size"],
            "seed": settings["seed"],
            "lm_eval_version": settings.get("lm_eval_version"),
            "base": comparison["base"],
            "results_files": {role: where(f["results"]) for role, f in files.items()},
            "metrics": entry["metrics"],
        }
        for task, entry in comparison["tasks"].items()
    }


OUTPUT_BYTES = 1_000_000
"""What `expertize eval` writes at least (results, comparison files and plot); the per-document samples grow with
the tasks and --limit, so this is a floor, not an estimate of them."""


def _base_tokenizer(base: str):
    """The base's tokenizer, after checking the base can be found (and its local weights read); loading it first
    lets the vocabulary check run before either model is loaded."""
    from transformers import AutoTokenizer

    path = Path(base)
    if not path.exists() and (path.is_absolute() or base.startswith(".") or base.count("/") > 1):
        raise HarnessError(
            f"the base model folder {base!r} does not exist (the model folder records it relative to where it was "
            "made, or it moved); pass --base with its current location, or --no-base to evaluate the model alone"
        )
    check_local_weights(base)
    try:
        # A local folder is the user's own (it may be an expertize model: remote code); a Hub id is not trusted.
        return AutoTokenizer.from_pretrained(base, trust_remote_code=path.is_dir())
    except OSError as e:
        raise HarnessError(
            f"cannot load the base model {base!r}: {e}; pass --base with a local folder (offline machines cannot "
            "reach the Hub), or --no-base to evaluate the model alone"
        ) from None


def _load_base(base: str, dtype, device):
    from ..surgery.splice import load_base_model

    try:
        model = load_base_model(base, dtype=dtype)
    except OSError as e:
        raise HarnessError(
            f"cannot load the base model {base!r}: {e}; pass --base with a local folder (offline machines cannot "
            "reach the Hub), or --no-base to evaluate the model alone"
        ) from None
    return model.to(device).eval()


def check_same_tokenizer(tokenizer, base_tokenizer, base: str, *, force: bool, log: Log) -> None:
    """Refuse (unless `force`) a base whose vocabulary differs from the model's: it is not the model's base, so
    Δ = model − base is not what the sparse layers cost, and token-level numbers (token perplexity) do not compare
    across tokenizers. Bits per byte, word perplexity and accuracy do, which is what `force` is for."""
    ours, theirs = tokenizer.get_vocab(), base_tokenizer.get_vocab()
    if ours == theirs:
        return
    differ = len(set(ours.items()) ^ set(theirs.items())) // 2 or abs(len(ours) - len(theirs))
    what = (
        f"the base {base!r} has another tokenizer than the model ({len(theirs):,} vs {len(ours):,} vocabulary "
        f"entries, about {differ:,} differ), so it is not the model's base"
    )
    if not force:
        raise HarnessError(
            f"{what}; pass the model's own base with --base (or leave --base out: the folder records it), or add "
            "--force to compare anyway (bits per byte, word perplexity and accuracy compare across tokenizers; token "
            "perplexity does not)"
        )
    log(f"warning: {what}; compared anyway (--force): read bits per byte, word perplexity and accuracy only")


def evaluate_model_folder(
    model_dir: str | os.PathLike,
    settings: HarnessSettings,
    *,
    base: str | None = RECORDED,
    output_dir: str | os.PathLike | None = None,
    device: str = "auto",
    dtype: str = "float32",
    update_card: bool = True,
    log: Log | None = None,
    verbose: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """`expertize eval`: the harness on a saved expertize model and its base, side by side.

    base: a Hub id or folder, RECORDED (default: the base the folder records), or None (the model alone).
    output_dir: default MODEL_DIR/lm_eval. With `update_card`, the per-task results are merged into
    MODEL_DIR/metrics.json["lm_eval"]["tasks"] (a task evaluated again replaces its entry) and README.md is
    regenerated from the folder. A base whose tokenizer differs from the model's is refused unless `force`
    (`check_same_tokenizer`). Returns the comparison dict (see `compare_on_tasks`).
    """
    import torch
    from transformers import AutoTokenizer

    from ..publishing.model_folder import check_model_folder, read_metrics, recorded_base_model, refresh_model_card, write_metrics
    from ..surgery.splice import load_expertize_model

    log = log or (lambda message: None)
    model_dir = Path(model_dir)
    check_model_folder(model_dir)  # config, weights (not truncated), sparse kinds
    if dtype not in ("float32", "bfloat16", "float16"):
        raise HarnessError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    device = str(resolve_device(device, "--device"))
    output_dir = Path(output_dir) if output_dir is not None else model_dir / LM_EVAL
    check_output_location(output_dir, what="--output", need_bytes=OUTPUT_BYTES)
    if update_card:  # metrics.json and README.md are rewritten in place
        check_output_location(model_dir, what="MODEL_DIR (its metrics.json and README.md; --no-card leaves them)")
    if base == RECORDED:
        base = recorded_base_model(model_dir)
        if base is None:
            log(f"{model_dir} records no base model: evaluating the model alone (name one with --base)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    base_tokenizer = None
    if base is not None:
        base_tokenizer = _base_tokenizer(base)
        check_same_tokenizer(tokenizer, base_tokenizer, base, force=force, log=log)
    task_manager, tasks = resolve_tasks(settings.tasks, settings.include_paths)
    check_task_data_offline(task_manager, tasks, HarnessError)  # before any model is loaded or folder made

    torch_dtype = getattr(torch, dtype)
    base_model = None if base is None else _load_base(base, torch_dtype, device)
    model = load_expertize_model(model_dir, dtype=torch_dtype).to(device).eval()
    comparison = compare_on_tasks(
        model, tokenizer, base_model, base_tokenizer, settings, output_dir,
        model_name=str(model_dir), base_name=base, task_manager=task_manager, tasks=tasks,
        extra_settings={"dtype": dtype, "device": device}, log=log, verbose=verbose,
    )
    if update_card:
        metrics = read_metrics(model_dir)
        lm_eval = metrics.setdefault("lm_eval", {})
        lm_eval["tasks"] = {**(lm_eval.get("tasks") or {}), **lm_eval_record(comparison, output_dir, model_dir)}
        write_metrics(model_dir, metrics)
        if base is None and recorded_base_model(model_dir) is None:
            log(f"{model_dir}/README.md not regenerated: no base model is known for the card (pass --base)")
        else:
            refresh_model_card(model_dir, base_model=base)
    return comparison


# ----------------------------------------------------------------------------------------------------------------
# Inside `expertize upcycle` (recipe section eval: lm_eval_*)


@dataclasses.dataclass
class LmEvalPlan:
    """The lm-eval runs a recipe asks for, with its task names already checked (before any training)."""

    settings: HarnessSettings
    task_manager: Any
    tasks: list[str]

    @classmethod
    def from_eval_config(cls, cfg) -> "LmEvalPlan | None":
        """None when the recipe's `eval.lm_eval_tasks` is empty; an unknown task raises HarnessError now."""
        if not cfg.lm_eval_tasks:
            return None
        settings = HarnessSettings(
            tasks=list(cfg.lm_eval_tasks),
            num_fewshot=cfg.lm_eval_num_fewshot,
            limit=cfg.lm_eval_limit,
            batch_size=cfg.lm_eval_batch_size,
            include_paths=list(cfg.lm_eval_include_paths),
        )
        try:
            task_manager, tasks = resolve_tasks(settings.tasks, settings.include_paths)
            check_task_data_offline(task_manager, tasks, HarnessError)  # before training, not after
        except HarnessError as e:
            raise HarnessError(f"eval.lm_eval_tasks: {e}") from None
        return cls(settings, task_manager, tasks)

    def run(
        self, model, base, tokenizer, model_dir: Path, *, device, model_name: str, base_name: str,
        log: Log | None = None,
    ) -> dict:
        """Both models in float32 on `device`, the harness's files under model_dir/lm_eval (model_dir may be a
        staging folder: recorded paths are relative to it); returns the metrics.json["lm_eval"] section."""
        model, base = model.to(device).float().eval(), base.to(device).float().eval()
        output_dir = Path(model_dir) / LM_EVAL
        comparison = compare_on_tasks(
            model, tokenizer, base, tokenizer, self.settings, output_dir,
            model_name=model_name, base_name=base_name, task_manager=self.task_manager, tasks=self.tasks,
            extra_settings={"dtype": "float32", "device": str(device)}, log=log,
        )
        return {"tasks": lm_eval_record(comparison, output_dir, Path(model_dir))}
