"""Shared by the benchmarks that drive `expertize upcycle`: run a recipe tree, or reuse its finished output folder."""

import json
import time
import warnings
from pathlib import Path


def run_upcycle(tree: dict, source: str) -> tuple[dict, float | None, list[str]]:
    """Run (or reuse) one upcycle of the recipe `tree`; returns (metrics, seconds or None when reused, the distinct
    warnings raised). A finished folder of a *different* recipe is an error, never silently reused."""
    from expertize.conversion.recipe import recipe_from_dict, recipe_to_dict
    from expertize.conversion.publishing.run_folder import METRICS, RunFolder
    from expertize.conversion.upcycle import upcycle

    recipe = recipe_from_dict(tree, source=source)
    out = Path(recipe.output_dir)
    if (out / METRICS).exists():
        if RunFolder(out).finished_recipe_differs(recipe_to_dict(recipe)):
            raise SystemExit(f"{out} holds a finished run of a different recipe; remove it or choose another --out")
        return json.loads((out / METRICS).read_text(encoding="utf-8")), None, []
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        upcycle(recipe, progress=False)
    seconds = time.perf_counter() - start
    return json.loads((out / METRICS).read_text(encoding="utf-8")), seconds, _distinct_warnings(caught)


def load_rows(paths: str, key) -> tuple[list[dict], str]:
    """The rows of comma-separated rows.json files (a benchmark's --from-rows) and their budget lines joined; a row
    whose `key(row)` an earlier file already gave is read once (a run folder listed twice). A rows.partial.json (the
    rows an unfinished benchmark has so far: a plain list) reads as such, its budget line saying so."""
    rows, seen, budgets = [], set(), []
    for path in paths.split(","):
        saved = json.loads(Path(path).read_text(encoding="utf-8"))
        if isinstance(saved, list):
            saved = {"rows": saved, "budget": f"{path}: the rows of an unfinished run ({len(saved)} so far)"}
        budgets.append(saved["budget"])
        for r in saved["rows"]:
            if key(r) not in seen:
                seen.add(key(r))
                rows.append(r)
    return rows, "; ".join(dict.fromkeys(budgets))


def _distinct_warnings(caught: list) -> list[str]:
    """The distinct messages of recorded warnings, "Category: message", in order."""
    messages = []
    for w in caught:
        message = f"{w.category.__name__}: {w.message}"
        if message not in messages:
            messages.append(message)
    return messages


def text_data(
    corpus: Path, separator: str, context_length: int, train_tokens: int, eval_tokens: int, seed: int
) -> dict:
    """The recipe `data:` section the benchmarks use: one local text file, 10% of its documents held out."""
    return {
        "source": "text",
        "paths": [str(corpus)],
        "document_separator": separator,
        "context_length": context_length,
        "train_tokens": train_tokens,
        "eval_tokens": eval_tokens,
        "eval_fraction": 0.1,
        "shuffle_documents": True,
        "seed": seed,
    }


def run_variants(tree: dict, source: str) -> tuple[dict[str, dict], float | None]:
    """Run the recipe `tree`, which has a `variants:` list, as one `expertize upcycle` (all variants trained on one
    activation stream, one folder each under output_dir); returns ({variant name: metrics}, seconds, or None when
    every variant was already finished). Finished variants of the same recipe are reused by `upcycle` itself; one
    of a different recipe is an error there."""
    from expertize.conversion.publishing.run_folder import METRICS
    from expertize.conversion.recipe import recipe_from_dict
    from expertize.conversion.upcycle import upcycle

    recipe = recipe_from_dict(tree, source=source)
    names = [variant.name for variant in recipe.variants]
    out = Path(recipe.output_dir)
    finished = all((out / name / METRICS).exists() for name in names)
    start = time.perf_counter()
    upcycle(recipe, progress=False)
    seconds = None if finished else time.perf_counter() - start
    return {name: json.loads((out / name / METRICS).read_text(encoding="utf-8")) for name in names}, seconds


def run_variants_caught(
    tree: dict, source: str, log=None
) -> tuple[dict[str, dict], float | None, list[str], BaseException | None]:
    """`run_variants`, for benchmarks that report a failure in their table instead of stopping: returns ({variant
    name: metrics} of the variants that have a finished folder, seconds (None when every variant was already
    finished), the distinct warnings raised (like `run_upcycle`), the exception that ended the run or None).

    A variant that diverges stops alone and the others are published (`upcycle` then raises RunFailed naming it),
    so after an error the finished variants are still returned; a variant missing from the result failed. `log`
    receives `upcycle`'s one-line status messages (e.g. print)."""
    from expertize.conversion.publishing.run_folder import METRICS, RunFolder
    from expertize.conversion.recipe import recipe_from_dict, recipe_to_dict, variant_recipes
    from expertize.conversion.upcycle import upcycle

    recipe = recipe_from_dict(tree, source=source)
    names = [variant.name for variant in recipe.variants]
    out = Path(recipe.output_dir)
    finished = all((out / name / METRICS).exists() for name in names)
    error = None
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            upcycle(recipe, progress=False, log=log)
        except Exception as e:  # the caller reports it beside the variants that did finish
            error = e
    seconds = None if finished else time.perf_counter() - start
    messages = _distinct_warnings(caught)
    metrics = {}
    for name, variant in variant_recipes(recipe, source=source):
        folder = Path(variant.output_dir)
        # Only a folder finished by *this* recipe counts: after an error (e.g. a name taken by another recipe's
        # finished run) a stale folder must not pass for this variant's result.
        if (folder / METRICS).exists() and not RunFolder(folder).finished_recipe_differs(recipe_to_dict(variant)):
            metrics[name] = json.loads((folder / METRICS).read_text(encoding="utf-8"))
    return metrics, seconds, messages, error
