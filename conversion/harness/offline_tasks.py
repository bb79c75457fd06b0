"""Offline lm-evaluation-harness tasks from any text: a perplexity task and a cloze multiple-choice task.

    text ─► documents (one per line, or blocks separated by blank lines)
         ─► <name>_text.jsonl  {"text"}                        ─► task <name>_ppl    (loglikelihood_rolling:
                                                                   word_perplexity, byte_perplexity, bits_per_byte)
         ─► units (sentences of prose, or lines of verse and dialogue)
         ─► <name>_cloze.jsonl {"context", "choices", "label"} ─► task <name>_cloze  (multiple_choice: acc, acc_norm)
         ─► <name>_ppl.yaml, <name>_cloze.yaml, task_data.py (the loader, copied next to them)

A cloze item is the start of a document (its first `cut` units, `cut` drawn from the document's last two thirds),
the true next unit, and `n_choices - 1` distractor units from *other* documents, drawn among the units closest in
length to the true one so that length alone does not give the answer away. One seeded RNG draws everything, so the
same text, settings and seed give the same files.

The folder is self-contained (YAML + JSON lines + a loader that imports only `datasets`): point
`expertize eval --include-path` or the harness's own `lm_eval --include_path` at it. The package ships folders made
this way in `BUNDLED_TASKS_DIR` (see the README.md there); `expertize eval` always includes them.
"""

import importlib.resources
import json
import math
import os
import random
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

__all__ = [
    "BUNDLED_TASKS",
    "bundled_tasks_dir",
    "cloze_items",
    "split_documents",
    "split_units",
    "write_task_folder",
    "write_tasks_from_text",
]

BUNDLED_TASKS = (
    "expertize_stories_ppl",
    "expertize_stories_cloze",
    "expertize_shakespeare_ppl",
    "expertize_shakespeare_cloze",
)
"""Tasks shipped with the package (in `bundled_tasks_dir()`), always available to `expertize eval`."""

LOADER_FILE = "task_data.py"
_TASK_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
# A sentence ends at . ! or ? (optionally followed by a closing quote) before whitespace.
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"'\u201d\u2019]))\s+")
_TERMINAL = re.compile(r"[.!?][\"'\u201d\u2019]?$")

Separator = Literal["auto", "line", "blank"]
Unit = Literal["auto", "sentence", "line"]


def bundled_tasks_dir() -> Path:
    """The package's offline task folder (an `--include_path` for the harness)."""
    return Path(str(importlib.resources.files("expertize.conversion.harness").joinpath("lm_eval_tasks")))


# ----------------------------------------------------------------------------------------------------------------
# Text -> documents -> units


def split_documents(text: str, separator: Separator = "auto") -> list[str]:
    """Documents of `text`: one per non-empty line ("line"), or blocks separated by blank lines ("blank").

    "auto" picks "blank" when the text has blank-line separated blocks of several lines (plays, poems, wiki
    paragraphs), else "line" (one story per line).
    """
    text = text.replace("\r\n", "\n")
    blocks = [b.strip("\n") for b in re.split(r"\n\s*\n", text) if b.strip()]
    if separator == "auto":
        separator = "blank" if len(blocks) > 1 and any("\n" in b for b in blocks) else "line"
    if separator == "blank":
        return [b for b in ("\n".join(line.rstrip() for line in b.split("\n")) for b in blocks) if b.strip()]
    if separator == "line":
        return [line.strip() for line in text.split("\n") if line.strip()]
    raise ValueError(f"separator must be 'auto', 'line' or 'blank', got {separator!r}")


def split_units(document: str, unit: Literal["sentence", "line"]) -> list[str]:
    """Sentences of prose (a trailing fragment without end punctuation is dropped) or non-empty lines."""
    if unit == "line":
        return [line.strip() for line in document.split("\n") if line.strip()]
    if unit == "sentence":
        sentences = [s.strip() for s in _SENTENCE_END.split(" ".join(document.split())) if s.strip()]
        if sentences and not _TERMINAL.search(sentences[-1]):
            sentences.pop()  # e.g. a story sampled up to a token limit stops mid-sentence
        return sentences
    raise ValueError(f"unit must be 'sentence' or 'line', got {unit!r}")


def _auto_unit(documents: Sequence[str]) -> Literal["sentence", "line"]:
    multi_line = sum(1 for d in documents if d.count("\n") >= 1)
    return "line" if multi_line * 2 >= len(documents) else "sentence"


# ----------------------------------------------------------------------------------------------------------------
# Cloze items


def cloze_items(
    documents: Sequence[str],
    *,
    unit: Unit = "auto",
    n_choices: int = 4,
    seed: int = 0,
    min_units: int = 3,
    max_context_units: int = 8,
    max_items: int | None = None,
) -> list[dict]:
    """Multiple-choice items {"context", "choices", "label", "doc_index"}: which unit comes next in a document?

    Documents with fewer than `min_units` units give no item; the context keeps at most the `max_context_units`
    units before the cut (short enough for small context windows).
    """
    if n_choices < 2:
        raise ValueError(f"n_choices must be >= 2 (the true continuation and a distractor), got {n_choices}")
    if min_units < 2:
        raise ValueError(f"min_units must be >= 2 (a context and a continuation), got {min_units}")
    if max_context_units < 1:
        raise ValueError(f"max_context_units must be >= 1, got {max_context_units}")
    unit = _auto_unit(documents) if unit == "auto" else unit
    units = [split_units(d, unit) for d in documents]
    pool = [(i, u) for i, doc_units in enumerate(units) for u in dict.fromkeys(doc_units)]  # (doc index, unit)
    rng = random.Random(seed)
    items = []
    for i, doc_units in enumerate(units):
        if len(doc_units) < min_units:
            continue
        if max_items is not None and len(items) >= max_items:
            break
        cut = rng.randint(max(1, math.ceil(len(doc_units) / 3)), len(doc_units) - 1)
        answer = doc_units[cut]
        context = doc_units[max(0, cut - max_context_units) : cut]
        candidates = sorted(
            {u for j, u in pool if j != i and u != answer and u not in context},
            key=lambda u: (abs(len(u) - len(answer)), u),  # closest in length first; ties by text (deterministic)
        )
        if len(candidates) < n_choices - 1:
            raise ValueError(
                f"too little text for {n_choices}-way cloze items: only {len(candidates)} distractor "
                f"{unit}s from other documents; give more documents or lower n_choices"
            )
        distractors = rng.sample(candidates[: 10 * (n_choices - 1)], n_choices - 1)
        label = rng.randrange(n_choices)
        choices = distractors[:label] + [answer] + distractors[label:]
        joiner = "\n" if unit == "line" else " "
        items.append({"context": joiner.join(context), "choices": choices, "label": label, "doc_index": i})
    if not items:
        raise ValueError(
            f"no document has at least min_units={min_units} {unit}s; give longer documents, another --separator or "
            "--unit, or lower min_units"
        )
    return items


# ----------------------------------------------------------------------------------------------------------------
# Task folders


def _ppl_yaml(name: str, tags: list[str], source: str, n_docs: int) -> str:
    return f"""\
# Perplexity of {n_docs} documents of {source}; generated by expertize (expertize.conversion.harness.offline_tasks).
task: {name}_ppl
tag: {json.dumps(tags)}
custom_dataset: !function task_data.load_jsonl
dataset_kwargs:
  data_file: {name}_text.jsonl
test_split: test
output_type: loglikelihood_rolling
num_fewshot: 0
doc_to_text: ""
doc_to_target: text
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
metadata:
  version: 1.0
"""


def _cloze_yaml(name: str, tags: list[str], source: str, n_items: int, n_choices: int, unit: str) -> str:
    return f"""\
# {n_items} {n_choices}-way cloze items ("which {unit} comes next?") from {source}; generated by expertize
# (expertize.conversion.harness.offline_tasks). acc sums the log-likelihood of each choice; acc_norm divides it by the
# choice's length in bytes.
task: {name}_cloze
tag: {json.dumps(tags)}
custom_dataset: !function task_data.load_jsonl
dataset_kwargs:
  data_file: {name}_cloze.jsonl
test_split: test
fewshot_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: {json.dumps(chr(10) if unit == "line" else " ")}
fewshot_delimiter: "\\n\\n"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


def write_task_folder(
    documents: Sequence[str],
    output_dir: str | os.PathLike,
    name: str,
    *,
    source: str = "a local text",
    unit: Unit = "auto",
    n_choices: int = 4,
    seed: int = 0,
    min_units: int = 3,
    max_context_units: int = 8,
    tags: Sequence[str] = (),
    overwrite: bool = False,
) -> list[str]:
    """Write the tasks `<name>_ppl` and `<name>_cloze` over `documents` into `output_dir`; returns their names.

    Both tasks also carry the tag `<name>` (so `--tasks <name>` runs both) and `tags`.
    """
    if not _TASK_NAME.fullmatch(name):
        raise ValueError(f"task name {name!r}: use letters, digits and underscores, starting with a letter")
    documents = [d for d in documents if d.strip()]
    if not documents:
        raise ValueError(f"{source} holds no documents (it is empty or only whitespace)")
    unit = _auto_unit(documents) if unit == "auto" else unit
    items = cloze_items(
        documents, unit=unit, n_choices=n_choices, seed=seed, min_units=min_units, max_context_units=max_context_units
    )
    out = Path(output_dir)
    files = [f"{name}_ppl.yaml", f"{name}_cloze.yaml", f"{name}_text.jsonl", f"{name}_cloze.jsonl"]
    clash = [f for f in files if (out / f).exists()]
    if clash and not overwrite:
        raise FileExistsError(f"{out} already holds {', '.join(clash)}; choose another name or folder, or overwrite")
    out.mkdir(parents=True, exist_ok=True)
    all_tags = list(dict.fromkeys([name, *tags]))
    _write_jsonl(out / f"{name}_text.jsonl", [{"text": d} for d in documents])
    _write_jsonl(out / f"{name}_cloze.jsonl", items)
    (out / f"{name}_ppl.yaml").write_text(_ppl_yaml(name, all_tags, source, len(documents)), encoding="utf-8")
    (out / f"{name}_cloze.yaml").write_text(
        _cloze_yaml(name, all_tags, source, len(items), n_choices, unit), encoding="utf-8"
    )
    loader = bundled_tasks_dir() / LOADER_FILE
    if (out / LOADER_FILE).resolve() != loader.resolve():
        shutil.copyfile(loader, out / LOADER_FILE)
    return [f"{name}_ppl", f"{name}_cloze"]


def write_tasks_from_text(
    text_file: str | os.PathLike,
    output_dir: str | os.PathLike,
    name: str,
    *,
    separator: Separator = "auto",
    max_docs: int | None = None,
    **kwargs,
) -> list[str]:
    """`write_task_folder` over the documents of a UTF-8 text file (the first `max_docs` of them when given)."""
    path = Path(text_file)
    if not path.is_file():
        raise FileNotFoundError(f"text file {str(path)!r} does not exist")
    documents = split_documents(path.read_text(encoding="utf-8"), separator)
    if max_docs is not None:
        if max_docs < 1:
            raise ValueError(f"max_docs must be >= 1, got {max_docs}")
        documents = documents[:max_docs]
    return write_task_folder(documents, output_dir, name, source=f"`{path.name}`", **kwargs)
