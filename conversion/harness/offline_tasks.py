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

import bisect
import importlib.resources
import json
import math
import os
import random
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

__all__ = [
    "BUNDLED_TASKS",
    "bundled_tasks_dir",
    "byte_bound",
    "cloze_items",
    "model_token_limit",
    "read_documents",
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


TokenCounter = Callable[[list[str]], list[int]]
"""Token counts of a batch of strings, as the model that will score the tasks counts them."""


def byte_bound(texts: list[str]) -> list[int]:
    """An upper bound on any byte-level or byte-fallback tokenizer's token count: UTF-8 bytes + 1 (a BOS/space
    token); for `--max-tokens` without a model to count with."""
    return [len(text.encode("utf-8")) + 1 for text in texts]


class _Candidates:
    """The distractor pool: every unit text with the documents holding it, grouped by length (characters), so an
    item finds the units closest in length to its answer by walking outward from that length (the old scan of the
    whole pool for every item made `expertize tasks` quadratic in the number of documents)."""

    def __init__(self, units: list[list[str]], eligible: Callable[[str], bool]) -> None:
        self.owners: dict[str, set[int]] = {}
        for i, doc_units in enumerate(units):
            for u in doc_units:
                if eligible(u):
                    self.owners.setdefault(u, set()).add(i)
        by_length: dict[int, list[str]] = {}
        for u in self.owners:
            by_length.setdefault(len(u), []).append(u)
        self.by_length = {n: sorted(texts) for n, texts in by_length.items()}
        self.lengths = sorted(self.by_length)

    def closest(self, doc: int, answer: str, context: list[str], wanted: int) -> list[str]:
        """The first `wanted` units of other documents (not the answer, not in the context) in order of
        (|length - answer's length|, text); all of them when there are fewer."""
        target, out = len(answer), []
        right = bisect.bisect_left(self.lengths, target)
        left = right - 1
        while len(out) < wanted and (left >= 0 or right < len(self.lengths)):
            d_left = target - self.lengths[left] if left >= 0 else math.inf
            d_right = self.lengths[right] - target if right < len(self.lengths) else math.inf
            level: list[str] = []
            if d_left <= d_right:
                level += self.by_length[self.lengths[left]]
                left -= 1
            if d_right <= d_left:
                level += self.by_length[self.lengths[right]]
                right += 1
            for u in sorted(level):  # ties in distance: by text (deterministic)
                if u != answer and u not in context and self.owners[u] != {doc}:
                    out.append(u)
                    if len(out) == wanted:
                        break
        return out


def cloze_items(
    documents: Sequence[str],
    *,
    unit: Unit = "auto",
    n_choices: int = 4,
    seed: int = 0,
    min_units: int = 3,
    max_context_units: int = 8,
    max_items: int | None = None,
    max_tokens: int | None = None,
    count_tokens: TokenCounter | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[dict]:
    """Multiple-choice items {"context", "choices", "label", "doc_index"}: which unit comes next in a document?

    Documents with fewer than `min_units` units give no item; the context keeps at most the `max_context_units`
    units before the cut (short enough for small context windows). `max_tokens` (a model's context length): every
    item fits it whole, context + delimiter + any choice, counted by `count_tokens` (default `byte_bound`): a unit
    longer than half of it is never a choice, and the context keeps only the last units that fit; a document whose
    item cannot fit gives none. `progress(n)` is called after every n documents.
    """
    if n_choices < 2:
        raise ValueError(f"n_choices must be >= 2 (the true continuation and a distractor), got {n_choices}")
    if min_units < 2:
        raise ValueError(f"min_units must be >= 2 (a context and a continuation), got {min_units}")
    if max_context_units < 1:
        raise ValueError(f"max_context_units must be >= 1, got {max_context_units}")
    if max_tokens is not None and max_tokens < 4:
        raise ValueError(f"max_tokens must be >= 4 (a context and a continuation), got {max_tokens}")
    unit = _auto_unit(documents) if unit == "auto" else unit
    joiner = "\n" if unit == "line" else " "  # also the task's target_delimiter
    units = [split_units(d, unit) for d in documents]
    fits = _Fit(units, joiner, max_tokens, count_tokens or byte_bound)
    pool = _Candidates(units, fits.choice)
    rng = random.Random(seed)
    items = []
    for i, doc_units in enumerate(units):
        if progress is not None:
            progress(1)
        if len(doc_units) < min_units:
            continue
        if max_items is not None and len(items) >= max_items:
            break
        cut = rng.randint(max(1, math.ceil(len(doc_units) / 3)), len(doc_units) - 1)
        answer = doc_units[cut]
        if not fits.choice(answer):
            continue
        context = doc_units[max(0, cut - max_context_units) : cut]
        candidates = pool.closest(i, answer, context, 10 * (n_choices - 1))
        if len(candidates) < n_choices - 1:
            raise ValueError(
                f"too little text for {n_choices}-way cloze items: only {len(candidates)} distractor "
                f"{unit}s from other documents; give more documents or lower n_choices"
            )
        distractors = rng.sample(candidates, n_choices - 1)  # closest in length first: length gives nothing away
        label = rng.randrange(n_choices)
        choices = distractors[:label] + [answer] + distractors[label:]
        context = fits.context(context, choices)
        if context:
            items.append({"context": joiner.join(context), "choices": choices, "label": label, "doc_index": i})
    items = fits.verified(items)
    if not items and max_tokens is not None and any(len(u) >= min_units for u in units):
        raise ValueError(
            f"no cloze item fits in max_tokens={max_tokens}: the {unit}s are too long for that context (a choice "
            f"may take at most {max_tokens // 2} tokens, beside a context); give a larger --max-tokens (a model with "
            "a longer context), or a text of shorter sentences or lines"
        )
    if not items:
        raise ValueError(
            f"no document has at least min_units={min_units} {unit}s; give longer documents, another --separator or "
            "--unit, or lower min_units"
        )
    return items


class _Fit:
    """Whether cloze items fit a context window of `max_tokens` (None: any length fits)."""

    def __init__(self, units: list[list[str]], joiner: str, max_tokens: int | None, count: TokenCounter) -> None:
        self.joiner, self.max_tokens, self.count = joiner, max_tokens, count
        self.tokens: dict[str, int] = {}
        if max_tokens is not None:
            texts = list(dict.fromkeys(u for doc_units in units for u in doc_units))
            self.tokens = dict(zip(texts, count([joiner + u for u in texts])))  # as the harness scores a choice

    def choice(self, u: str) -> bool:
        return self.max_tokens is None or self.tokens[u] <= self.max_tokens // 2

    def context(self, context: list[str], choices: list[str]) -> list[str]:
        """The last units of `context` that fit beside the longest choice (estimated from the units' counts)."""
        if self.max_tokens is None:
            return context
        room = self.max_tokens - max(self.tokens[c] for c in choices)
        kept = 0
        for k in range(1, len(context) + 1):
            if sum(self.tokens[u] for u in context[-k:]) > room:
                break
            kept = k
        return context[len(context) - kept :]

    def verified(self, items: list[dict]) -> list[dict]:
        """The items whose context + delimiter + every choice counts at most max_tokens, exactly (a unit's tokens
        can merge across the delimiter); an item over it loses context units from the front, or is dropped."""
        if self.max_tokens is None:
            return items
        out = []
        for item in items:
            context = item["context"].split(self.joiner) if self.joiner == "\n" else None
            while True:
                totals = self.count([item["context"] + self.joiner + c for c in item["choices"]])
                if max(totals) <= self.max_tokens:
                    out.append(item)
                    break
                # drop the first unit of the context (sentences: up to the first sentence end)
                rest = ("\n".join(context[1:]) if context is not None
                        else " ".join(split_units(item["context"], "sentence")[1:]))
                if context is not None:
                    context = context[1:]
                if not rest:
                    break
                item = {**item, "context": rest}
        return out


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
    max_tokens: int | None = None,
    count_tokens: TokenCounter | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Write the tasks `<name>_ppl` and `<name>_cloze` over `documents` into `output_dir`; returns their names.

    Both tasks also carry the tag `<name>` (so `--tasks <name>` runs both) and `tags`. `max_tokens` / `count_tokens`:
    every cloze item fits the scoring model's context whole (`cloze_items`); the perplexity task scores documents of
    any length (the harness slides its window). `progress(n)`: n more documents made into items.
    """
    if not _TASK_NAME.fullmatch(name):
        raise ValueError(f"task name {name!r}: use letters, digits and underscores, starting with a letter")
    documents = [d for d in documents if d.strip()]
    if not documents:
        raise ValueError(f"{source} holds no documents (it is empty or only whitespace)")
    unit = _auto_unit(documents) if unit == "auto" else unit
    items = cloze_items(
        documents, unit=unit, n_choices=n_choices, seed=seed, min_units=min_units, max_context_units=max_context_units,
        max_tokens=max_tokens, count_tokens=count_tokens, progress=progress,
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


_SEPARATORS = {"auto": "auto", "line": "line", "blank": "blank_line"}
"""`expertize tasks --separator` -> the corpus reader's document separator (data/documents.py)."""


def read_documents(text_file: str | os.PathLike, separator: Separator = "auto") -> list[str]:
    """The documents of a corpus file as every command reads them (data/documents.py: a .jsonl file's "text" field
    per line, a .parquet file's "text" column, a text file's lines or blank-line blocks), tidied for task files:
    trailing spaces and surrounding blank lines dropped."""
    from ..data.documents import DataError, corpus_config, corpus_file_problem, iter_documents

    path = Path(text_file)
    problem = corpus_file_problem(str(path))
    if problem is not None:
        raise FileNotFoundError(f"text file: {problem}; give one text file (.txt, .jsonl, .parquet; .gz / .bz2 / .xz "
                                "compressed text is read too), e.g. the held-out part of your corpus")
    if separator not in _SEPARATORS:
        raise ValueError(f"separator must be 'auto', 'line' or 'blank', got {separator!r}")
    try:
        cfg = corpus_config(str(path), separator=_SEPARATORS[separator], key="text file")
        raw = iter_documents(cfg, key="text file")
        documents = ["\n".join(line.rstrip() for line in doc.splitlines()).strip() for doc in raw]
    except DataError as e:
        raise ValueError(str(e)) from e
    return [d for d in documents if d]


def model_token_limit(model: str) -> tuple[TokenCounter, int]:
    """(a token counter with `model`'s tokenizer, its context length as lm-eval will use it) for a model folder or
    Hub id; an expertize folder loads through its remote code."""
    from transformers import AutoConfig, AutoTokenizer

    from ..surgery.families import model_positions

    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=True)
        tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {model!r}: cannot load its config and tokenizer ({e}); give a model folder") from e
    limit = model_positions(config)
    if limit is None and getattr(tokenizer, "model_max_length", 0) < 10**8:
        limit = tokenizer.model_max_length
    if limit is None:
        raise ValueError(f"--model {model!r} states no context length (max_position_embeddings in its config.json); "
                         "pass --max-tokens N")

    def count(texts: list[str]) -> list[int]:
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]]

    return count, int(limit)


def write_tasks_from_text(
    text_file: str | os.PathLike,
    output_dir: str | os.PathLike,
    name: str,
    *,
    separator: Separator = "auto",
    max_docs: int | None = None,
    show_progress: bool = False,
    **kwargs,
) -> list[str]:
    """`write_task_folder` over the documents of a corpus file (`read_documents`; the first `max_docs` of them when
    given), with a progress bar over the documents when `show_progress`; `kwargs` go to `write_task_folder`
    (max_tokens / count_tokens fit the items to a model)."""
    if max_docs is not None and max_docs < 1:
        raise ValueError(f"max_docs must be >= 1, got {max_docs}")
    documents = read_documents(text_file, separator)
    if max_docs is not None:
        documents = documents[:max_docs]
    if not show_progress:
        return write_task_folder(documents, output_dir, name, source=f"`{Path(text_file).name}`", **kwargs)
    from tqdm.auto import tqdm

    with tqdm(total=len(documents), desc="tasks: cloze items", unit="doc") as bar:
        return write_task_folder(documents, output_dir, name, source=f"`{Path(text_file).name}`",
                                 progress=bar.update, **kwargs)
