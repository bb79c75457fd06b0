"""Up-front data checks: everything the corpus must give a run, verified before the folder is claimed or a step runs.

Without them a corpus shorter than the training budget trains on all of it and then fails, and an empty held-out
split surfaces only at the final evaluation. `check_data` needs the tokenizer but no model forward:

- local sources (text / jsonl / parquet): the held-out split must fill at least one sequence, and the train split
  is tokenized and packed exactly as training will read it (EOS after every document, BOS-led sequences of
  `context_length`, the ragged tail dropped), stopping as soon as the budget is covered, so a sufficient corpus
  costs only the tokenization of the budget (cheap next to capturing and training on it);
- source: hub (streamed): a full count would read the whole stream, so only the first documents are checked
  (readable, and tokenizing to tokens); the budget is checked while streaming (`ActivationBatches` and the
  healer raise `RunFailed` naming the step the text ran out at).

Documents that tokenize to zero tokens are reported as a tokenizer problem, not as "add text".
"""

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..recipe.data import DataConfig, token_budget_to_sequences
from .text import (
    DataError,
    _document_tokens,
    _pack,
    inserted_token_id,
    iter_documents,
    resolve_add_bos,
    resolve_paths,
    split_documents,
)

__all__ = ["DataReport", "check_data"]

PROBE_DOCUMENTS = 32
"""Documents tokenized first to tell a tokenizer that yields nothing from a short corpus (and, for a streamed
corpus, the only documents read up front)."""


@dataclass(frozen=True)
class DataReport:
    """What the corpus gives, as counted by `check_data` (sequences of `context_length` tokens, BOS included)."""

    context_length: int
    add_bos: bool
    train_sequences_needed: int
    """ceil(train_tokens / context_length): what the train stream yields."""
    train_sequences: int | None
    """Sequences the train split gives, counted up to `train_sequences_needed` (then the count stops); None for a
    streamed corpus (checked while streaming)."""
    eval_sequences_wanted: int
    eval_sequences: int | None
    """Held-out sequences, counted up to `eval_sequences_wanted`; fewer means a smaller eval set (with a warning at
    load time), never zero. None for a streamed corpus."""
    streamed: bool

    def summary(self) -> str:
        """One line for the run's log."""
        t = self.context_length
        if self.streamed:
            return (f"data: streamed corpus, first documents tokenize; the budget of {self.train_sequences_needed:,} "
                    f"sequences of {t} tokens is checked while streaming")
        return (f"data: train split covers {self.train_sequences:,} sequences of {t} tokens "
                f"({self.train_sequences * t:,} tokens), held-out split {self.eval_sequences:,} of "
                f"{self.eval_sequences_wanted:,} sequences")


class _TokenCounter:
    """Passes token lists through, counting documents and those that tokenized to nothing (EOS aside)."""

    def __init__(self, inserted: int | None) -> None:
        self.eos_tokens = int(inserted is not None)
        self.documents = self.empty = self.tokens = 0

    def __call__(self, token_lists: Iterable[list[int]]) -> Iterator[list[int]]:
        for ids in token_lists:
            self.documents += 1
            self.tokens += len(ids)
            self.empty += len(ids) == self.eos_tokens
            yield ids


def _count_sequences(docs: Iterable[str], tokenizer, bos: int | None, cfg: DataConfig, limit: int):
    """Sequences (up to `limit`) that `pack_sequences` makes of `docs`, and the counter of what was read.

    The packed-sequence count does not depend on the document order (packing only drops the final ragged tail),
    so the train split is counted without its shuffle: same number, no shuffle buffer to fill.
    """
    counter = _TokenCounter(inserted_token_id(cfg.document_marker, tokenizer))
    content_length = cfg.context_length - (bos is not None)
    sequences = _pack(counter(_document_tokens(docs, tokenizer, cfg.document_marker)), content_length, bos)
    return sum(1 for _ in itertools.islice(sequences, limit)), counter


def _broken_tokenizer(tokenizer, documents: int, where: str) -> DataError:
    return DataError(
        f"data: the tokenizer {type(tokenizer).__name__} ({tokenizer.name_or_path or 'unnamed'}) turns all "
        f"{documents:,} documents of {where} into zero tokens: the text is there, the tokenizer yields nothing. "
        "Check base_model's tokenizer files (tokenizer.json / vocab) or give a tokenizer that matches the model"
    )


def _probe(cfg: DataConfig, tokenizer, where: str) -> None:
    """The corpus opens, holds documents, and its first documents tokenize to at least one token."""
    try:
        first = list(itertools.islice(iter_documents(cfg), PROBE_DOCUMENTS))
    except DataError:
        raise
    except (OSError, ValueError) as e:  # datasets: DatasetNotFoundError (an OSError), connection, bad config
        if cfg.source != "hub":
            raise
        raise DataError(
            f"data: cannot read {where} ({type(e).__name__}: {e}); check data.name / data.config / data.split, "
            "the network, or HF_HUB_OFFLINE / HF_DATASETS_OFFLINE (offline, only a cached dataset can be read)"
        ) from e
    if not first:
        fix = ("check data.text_column" if cfg.source != "text" else "add text")
        raise DataError(f"data: {where} holds no document (no non-empty text); {fix} or fix data.paths / data.name")
    encoded = tokenizer(first, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    if not any(encoded):
        raise _broken_tokenizer(tokenizer, len(first), f"the first documents of {where}")


def _describe_corpus(cfg: DataConfig) -> str:
    if cfg.source == "hub":
        return f"the hub dataset {cfg.name!r} (config={cfg.config!r}, split={cfg.split!r})"
    try:
        files = resolve_paths(cfg.paths)
    except OSError as e:  # removed since the recipe was loaded
        raise DataError(str(e)) from e
    shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return f"data.paths ({shown})"


def _few_documents_fix(cfg: DataConfig, total_documents: int, remedy: str) -> str:
    """Advice for an empty split: the split is by whole documents, so the usual cause is too few of them. Every
    setting that resolves it is named: the separator, the tail split, held-out files, the fraction."""
    other_split = ("hold out the end of every document with data.eval_split: tail, give held-out files in "
                   "data.eval_paths")
    if cfg.source == "text" and cfg.document_separator == "blank_line":
        return ("with document_separator: blank_line a file without blank lines is one document; set "
                f"data.document_separator: line (one document per line), {other_split}, or {remedy}")
    if cfg.source == "text" and cfg.document_separator == "file":
        return ("each file is one document; hold out the end of every file with data.eval_split: tail (a raw "
                "stream's own split), give held-out files in data.eval_paths, set data.document_separator: line or "
                "blank_line, or add files")
    if total_documents < 1 / cfg.eval_fraction:
        return f"add documents, {other_split}, or {remedy}"
    return f"{remedy}, or change data.seed"


def _check_eval(cfg: DataConfig, tokenizer, bos: int | None, wanted: int, where: str) -> int:
    found, counter = _count_sequences(split_documents(cfg).eval(), tokenizer, bos, cfg, wanted)
    if found:
        return found
    if counter.documents and counter.empty == counter.documents:
        raise _broken_tokenizer(tokenizer, counter.documents, f"the held-out split of {where}")
    if cfg.eval_paths:
        raise DataError(
            f"data: the held-out files data.eval_paths ({', '.join(cfg.eval_paths)}) hold {counter.tokens:,} tokens "
            f"in {counter.documents:,} documents, less than one sequence of data.context_length={cfg.context_length}; "
            "add text to them or lower data.context_length"
        )
    total = sum(1 for _ in iter_documents(cfg))  # only on failure: the advice depends on it
    if not counter.documents:
        fix = _few_documents_fix(cfg, total, "raise data.eval_fraction")
        raise DataError(
            f"data: the held-out split is empty: {where} gives {total:,} document(s) "
            f"(data.document_separator={cfg.document_separator!r}) and none of them falls in the held-out fraction "
            f"data.eval_fraction={cfg.eval_fraction} (the split is by whole documents); {fix}"
        )
    raise DataError(
        f"data: the held-out split ({counter.documents:,} of {total:,} documents, data.eval_fraction="
        f"{cfg.eval_fraction}, data.seed={cfg.seed}) holds {counter.tokens:,} tokens, less than one sequence of "
        f"data.context_length={cfg.context_length}; add text, raise data.eval_fraction or lower data.context_length"
    )


def _check_train(
    cfg: DataConfig, tokenizer, bos: int | None, needed: int, train_tokens: int, key: str, where: str
) -> int:
    found, counter = _count_sequences(split_documents(cfg).train(), tokenizer, bos, cfg, needed)
    if found >= needed:
        return found
    if counter.documents and counter.empty == counter.documents:
        raise _broken_tokenizer(tokenizer, counter.documents, f"the train split of {where}")
    if not counter.documents and cfg.eval_paths:
        raise DataError(f"data: the train split is empty: every document of {where} also appears in the held-out "
                        "files data.eval_paths; train on other files than those you evaluate on")
    if not counter.documents:
        total = sum(1 for _ in iter_documents(cfg))
        fix = _few_documents_fix(cfg, total, "lower data.eval_fraction")
        raise DataError(
            f"data: the train split is empty: all {total:,} document(s) of {where} "
            f"(data.document_separator={cfg.document_separator!r}) fall in the held-out split "
            f"(data.eval_fraction={cfg.eval_fraction}, the split is by whole documents); {fix}"
        )
    t = cfg.context_length
    empty = (f"; {counter.empty:,} of its documents tokenize to zero tokens (check the tokenizer)"
             if counter.empty else "")
    lower = f"lower {key} to at most {found * t:,}" if found else "lower data.context_length"
    raise DataError(
        f"data: the train split holds only {found * t:,} tokens: its {counter.documents:,} documents of {where} "
        f"pack into {found:,} sequences of data.context_length={t}, fewer than the {needed:,} that "
        f"{key}={train_tokens:,} needs{empty}; {lower}, or add text to the corpus"
    )


def check_data(
    cfg: DataConfig,
    tokenizer,
    *,
    train_tokens: int | None = None,
    eval_tokens: int | None = None,
    train_key: str = "data.train_tokens",
) -> DataReport:
    """Check, before any training, that the corpus can give the run what it will read; raise `DataError` if not.

    `train_tokens` (default cfg.train_tokens) is the budget the train split must cover, as the train stream reads
    it: ceil(train_tokens / context_length) packed sequences. Pass the largest budget the run reads (distillation's
    data.train_tokens, healing's heal.tokens) and name its key in `train_key` for the message. `eval_tokens`
    (default cfg.eval_tokens) sizes the held-out set, which must hold at least one sequence.

    Raises DataError for: unreadable or missing files, a corpus with no document, a tokenizer that turns the
    documents into zero tokens, an empty held-out split, and (local sources) a train split that cannot cover the
    budget, naming how many tokens it holds. A streamed hub corpus is only probed (see the module docstring).
    """
    train_tokens = cfg.train_tokens if train_tokens is None else train_tokens
    eval_tokens = cfg.eval_tokens if eval_tokens is None else eval_tokens
    t = cfg.context_length
    bos = tokenizer.bos_token_id if resolve_add_bos(cfg, tokenizer) else None
    needed = token_budget_to_sequences(train_tokens, t)
    wanted = token_budget_to_sequences(eval_tokens, t)
    where = _describe_corpus(cfg)
    _probe(cfg, tokenizer, where)
    streamed = cfg.source == "hub"
    if streamed:
        return DataReport(t, bos is not None, needed, None, wanted, None, streamed=True)
    eval_sequences = _check_eval(cfg, tokenizer, bos, wanted, where)
    train_sequences = _check_train(cfg, tokenizer, bos, needed, train_tokens, train_key, where)
    return DataReport(t, bos is not None, needed, train_sequences, wanted, eval_sequences, streamed=False)
