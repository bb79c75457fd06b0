"""The recipe's `data:` section (`DataConfig`): where the text comes from and how it becomes fixed-length token
sequences; conversion/data/ reads it (documents.py, text.py). Also the one rule that turns a token budget into
sequences (data.train_tokens, data.eval_tokens, heal.tokens).
"""

import math
from dataclasses import dataclass, field
from typing import Any

from .corpus_files import file_format, resolve_paths

__all__ = ["DOCUMENT_MARKERS", "DOCUMENT_SEPARATORS", "DataConfig", "EVAL_SPLITS", "LOCAL_SOURCES", "SOURCES",
           "token_budget_to_sequences"]

SOURCES = ("text", "jsonl", "parquet", "hub")
LOCAL_SOURCES = ("text", "jsonl", "parquet")
DOCUMENT_SEPARATORS = ("line", "blank_line", "file")
DOCUMENT_MARKERS = ("eos", "bos")
EVAL_SPLITS = ("documents", "tail")


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes fixed-length token sequences (recipe section `data:`)."""

    source: str = "text"
    """Kind of corpus: "text", "jsonl" or "parquet" (local files in `paths`), or "hub" (a datasets hub dataset).
    A `.jsonl` / `.parquet` file is read in its own format under the default "text" (recipe/corpus_files.file_format)."""

    paths: list[str] = field(default_factory=list)
    """Local files for the text/jsonl/parquet sources, read in the order given; glob patterns are expanded (sorted)."""

    name: str | None = None
    """Datasets hub name for source=hub, e.g. "Skylion007/openwebtext"."""

    config: str | None = None
    """Hub dataset config name (source=hub), e.g. "wikitext-103-raw-v1"."""

    split: str = "train"
    """Hub dataset split to read (source=hub); our train/eval split is made from its documents."""

    streaming: bool = True
    """source=hub: stream the dataset instead of downloading it first."""

    text_column: str = "text"
    """Column / JSON key holding the document text (jsonl, parquet and hub sources)."""

    document_separator: str = "line"
    """source=text: "line" (one document per non-empty line), "blank_line" (paragraphs separated by blank lines) or
    "file" (each file is one document)."""

    document_marker: str = "eos"
    """The token that marks where documents meet, as the base model was trained: "eos" (the tokenizer's EOS after
    every document: GPT-2, Pythia and most bases) or "bos" (the tokenizer's BOS before every document and no EOS:
    llama2.c's models such as stories260k). A base trained on one raw stream reads each file as one document:
    document_separator: file, add_bos: false (and eval_split: tail to hold out each file's end)."""

    context_length: int = 128
    """T: tokens per packed sequence, BOS included."""

    train_tokens: int = 1_000_000
    """Training budget in tokens; the train stream yields ceil(train_tokens / context_length) sequences."""

    eval_tokens: int = 100_000
    """Evaluation budget in tokens; the eval set holds ceil(eval_tokens / context_length) sequences."""

    eval_fraction: float = 0.05
    """Fraction of documents held out for evaluation, chosen by a stable hash of (seed, document index), so train
    and eval never share a document. Not used when `eval_paths` is given."""

    eval_split: str = "documents"
    """How `eval_fraction` holds text out: "documents" (whole documents, by the stable hash above) or "tail" (the
    last eval_fraction of every document, by characters: the split of a base trained on a raw stream, e.g. the
    first 90 % / last 10 % of a file as nanoGPT and the shipped tiny-gpt2-shakespeare were trained). Not used when
    `eval_paths` is given."""

    eval_paths: list[str] = field(default_factory=list)
    """Held-out files, read like `paths` (local sources): when given, the run evaluates on their documents and trains
    on every document of `paths` except one identical to a held-out document, instead of holding out `eval_fraction`
    of `paths`' documents ("evaluate on the text this model was not trained on")."""

    shuffle_documents: bool = True
    """Shuffle training documents with a seeded streaming buffer (the eval order is never shuffled)."""

    shuffle_buffer_documents: int = 10_000
    """Size of the streaming shuffle buffer, in documents."""

    add_bos: str | bool = "auto"
    """Start every packed sequence with the tokenizer's BOS token: "auto" (when the tokenizer has one: Llama,
    Pythia, GPT-2 whose BOS is '<|endoftext|>'), true or false."""

    seed: int = 0
    """Seed of the train/eval document split and of the document shuffle."""

    exclude_special_positions: bool = True
    """Leave the positions that hold a special token (the tokenizer's `all_special_ids`: BOS, EOS, PAD, ...) out of
    the distillation loss and of the reconstruction metrics (FVU, NMSE, MSE, L0, dead units): their activation
    outliers (e.g. the BOS attention sink) would dominate the squared error. CE and KL always cover every position."""

    activation_cache: str | None = None
    """A folder written by `expertize capture` (the train split's MLP inputs and outputs, conversion/data/cache.py):
    distillation reads its pairs instead of running the base model, once its manifest is checked against this
    recipe's base model, layers and data section (a mismatch is refused). null: capture while training."""

    token_cache: str | None = None
    """A folder keeping the train split's packed token ids between runs (conversion/data/token_cache.py): a run
    whose data section, corpus files (sizes and modification times) and tokenizer match an earlier run's reads its
    ids instead of reading and tokenizing the text; otherwise it tokenizes as usual and writes them there. Not part
    of the run's identity (the ids are the same either way). null: tokenize every run."""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data.source must be one of {list(SOURCES)}, got {self.source!r}")
        if isinstance(self.paths, str):
            raise ValueError(
                f"data.paths must be a list of files, got the string {self.paths!r}; write [{self.paths!r}]"
            )
        self.paths = list(self.paths)
        if self.source in LOCAL_SOURCES:
            if not self.paths:
                raise ValueError(f"data.source={self.source!r} reads local files, but data.paths is empty; list them")
            for path in resolve_paths(self.paths):  # raises on a missing file, naming it
                file_format(path, self.source)  # a .jsonl / .parquet name against another explicit format
        elif self.paths:
            raise ValueError(
                f"data.paths={self.paths} is only read by local sources {list(LOCAL_SOURCES)}, but data.source='hub'; "
                "remove data.paths or set data.source to the files' format"
            )
        if isinstance(self.eval_paths, str):
            raise ValueError(f"data.eval_paths must be a list of files, got the string {self.eval_paths!r}; write "
                             f"[{self.eval_paths!r}]")
        self.eval_paths = list(self.eval_paths or [])
        if self.eval_paths:
            if self.source not in LOCAL_SOURCES:
                raise ValueError(f"data.eval_paths is read like data.paths, by local sources {list(LOCAL_SOURCES)} "
                                 "only, but data.source='hub'; remove data.eval_paths or read local files")
            for path in resolve_paths(self.eval_paths, "data.eval_paths"):
                file_format(path, self.source, "data.eval_paths")
        if self.source == "hub" and not self.name:
            raise ValueError(
                "data.source='hub' needs data.name, the datasets hub name (e.g. 'Skylion007/openwebtext')"
            )
        if self.document_separator not in DOCUMENT_SEPARATORS:
            raise ValueError(
                f"data.document_separator must be one of {list(DOCUMENT_SEPARATORS)}, got {self.document_separator!r}"
            )
        if self.document_marker not in DOCUMENT_MARKERS:
            raise ValueError(f"data.document_marker must be one of {list(DOCUMENT_MARKERS)} (the token the base saw "
                             f"between documents), got {self.document_marker!r}")
        if self.eval_split not in EVAL_SPLITS:
            raise ValueError(f"data.eval_split must be one of {list(EVAL_SPLITS)}, got {self.eval_split!r}")
        if not self.text_column:
            raise ValueError("data.text_column must name the column holding the text, got an empty value")
        if not _is_int(self.context_length) or self.context_length < 2:
            raise ValueError(f"data.context_length must be an integer >= 2, got {self.context_length!r}")
        for key in ("train_tokens", "eval_tokens", "shuffle_buffer_documents"):
            value = getattr(self, key)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"data.{key} must be a positive integer, got {value!r}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(
                "data.eval_fraction must lie strictly between 0 and 1 (a fraction of documents), "
                f"got {self.eval_fraction!r}"
            )
        if not isinstance(self.exclude_special_positions, bool):
            raise ValueError(
                f"data.exclude_special_positions must be true or false, got {self.exclude_special_positions!r}"
            )
        if not (self.add_bos == "auto" or isinstance(self.add_bos, bool)):
            raise ValueError(f"data.add_bos must be 'auto', true or false, got {self.add_bos!r}")
        if self.activation_cache is not None and not (isinstance(self.activation_cache, str) and self.activation_cache):
            raise ValueError(
                f"data.activation_cache must be the folder written by `expertize capture` (or null), got "
                f"{self.activation_cache!r}"
            )
        if self.token_cache is not None and not (isinstance(self.token_cache, str) and self.token_cache):
            raise ValueError(f"data.token_cache must be a folder (or null), got {self.token_cache!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def token_budget_to_sequences(tokens: int, context_length: int) -> int:
    """Sequences of `context_length` tokens needed to cover `tokens` tokens (rounded up)."""
    return math.ceil(tokens / context_length)
