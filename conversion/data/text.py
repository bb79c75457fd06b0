"""The data stage: stream text, split it by document, tokenize and pack it into fixed-length sequences.

    documents (text / jsonl / parquet files, or a datasets hub dataset)
      -> train/eval split by document (stable hash of (seed, document index)), or each document's tail held out
      -> seeded buffer shuffle of documents (train only)
      -> tokenize (no special tokens from the tokenizer), EOS after every document (or BOS before it:
         data.document_marker, the reading of llama2.c's models)
      -> pack into sequences of exactly `context_length` tokens: [BOS] + (T - 1) content tokens when BOS is on
      -> batches (B, T)

Nothing is padded: the ragged tail that does not fill a sequence is dropped, so every token is real text (or a
document separator / BOS) and no attention mask is needed. The whole stream is a pure function of (config,
tokenizer, corpus), so a run resumes by regenerating it and skipping the sequences it has already used
(`start_sequence`).

Shapes: S sequences, B batch, T = context_length.
"""

import hashlib
import itertools
import math
import random
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Literal

import torch

from ..errors import ExpertizeWarning
from ..recipe.data import DataConfig, token_budget_to_sequences
from .documents import DataError, iter_documents, resolve_paths

__all__ = [
    "DataError",
    "DocumentSplit",
    "batch_sequences",
    "document_in_eval",
    "iter_documents",
    "inserted_token_id",
    "iter_sequences",
    "load_eval_sequences",
    "pack_sequences",
    "resolve_add_bos",
    "resolve_paths",
    "shuffle_buffered",
    "split_documents",
    "stream_sequences",
    "stream_train_tokens",
]

Split = Literal["train", "eval"]
TOKENIZE_BATCH_DOCUMENTS = 256
"""Documents handed to the tokenizer per call (fast tokenizers are much quicker on batches)."""


# ----------------------------------------------------------------------------------------------------------------
# Train / eval split by document


def document_in_eval(index: int, seed: int, eval_fraction: float) -> bool:
    """Whether document `index` is held out: a stable hash of (seed, index), uniform in [0, 1), below eval_fraction.

    blake2b, not Python's `hash()`, which is salted per process.
    """
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < eval_fraction


@dataclass(frozen=True)
class DocumentSplit:
    """The corpus split by document; `train()` and `eval()` each return a fresh iterator over their documents."""

    cfg: DataConfig

    def train(self) -> Iterator[str]:
        return self.documents("train")

    def eval(self) -> Iterator[str]:
        return self.documents("eval")

    def documents(self, split: Split) -> Iterator[str]:
        _check_split(split)
        want_eval = split == "eval"
        if self.cfg.eval_paths:  # explicit held-out files: all of them eval, all of `paths` but their copies train
            held = replace(self.cfg, paths=self.cfg.eval_paths)
            if want_eval:
                yield from iter_documents(held, key="data.eval_paths")
                return
            seen = {_digest(doc) for doc in iter_documents(held, key="data.eval_paths")}
            yield from (doc for doc in iter_documents(self.cfg) if _digest(doc) not in seen)
            return
        if self.cfg.eval_split == "tail":  # every document's last eval_fraction (by characters) is held out
            for doc in iter_documents(self.cfg):
                cut = round(len(doc) * (1 - self.cfg.eval_fraction))
                part = doc[cut:] if want_eval else doc[:cut]
                if part.strip():
                    yield part
            return
        for index, doc in enumerate(iter_documents(self.cfg)):
            if document_in_eval(index, self.cfg.seed, self.cfg.eval_fraction) == want_eval:
                yield doc


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def split_documents(cfg: DataConfig) -> DocumentSplit:
    """Deterministic train/eval split by document: `split_documents(cfg).train()` / `.eval()`."""
    return DocumentSplit(cfg)


def _check_split(split: str) -> None:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")


# ----------------------------------------------------------------------------------------------------------------
# Tokens and packing


def stream_sequences(tokens: int, context_length: int, world_size: int = 1) -> int:
    """Packed sequences the distillation stream reads for a budget of `tokens`: ceil(tokens / T), rounded up to a
    multiple of the process count. Each data-parallel rank takes every world_size-th sequence and a step takes as
    many rows from each rank, so an uneven last group would leave the ranks short of the final step."""
    return math.ceil(token_budget_to_sequences(tokens, context_length) / world_size) * world_size


def stream_train_tokens(cfg: DataConfig, world_size: int = 1) -> int:
    """The train tokens distillation reads on `world_size` processes: `cfg.train_tokens` on one; on several, the
    whole sequences of `stream_sequences` (up to world_size - 1 sequences more, so every rank fills the last step).
    Preflight checks the corpus against it and the live capture reads it."""
    if world_size == 1:
        return cfg.train_tokens
    return stream_sequences(cfg.train_tokens, cfg.context_length, world_size) * cfg.context_length


def resolve_add_bos(cfg: DataConfig, tokenizer) -> bool:
    """Whether packed sequences start with BOS; add_bos=true with a tokenizer that has no BOS is an error."""
    has_bos = tokenizer.bos_token_id is not None
    if cfg.add_bos == "auto":
        return has_bos
    if cfg.add_bos and not has_bos:
        raise DataError(
            f"data.add_bos=true but the tokenizer {type(tokenizer).__name__} has no BOS token; "
            "set data.add_bos to 'auto' or false, or give the tokenizer a bos_token"
        )
    return bool(cfg.add_bos)


def shuffle_buffered(items: Iterable[str], buffer_size: int, seed: int) -> Iterator[str]:
    """Seeded streaming shuffle: each incoming item swaps out a random member of a `buffer_size` buffer."""
    rng = random.Random(seed)
    buffer: list[str] = []
    for item in items:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        i = rng.randrange(buffer_size)
        buffer[i], item = item, buffer[i]
        yield item
    rng.shuffle(buffer)
    yield from buffer


def inserted_token_id(marker: str, tokenizer) -> int | None:
    """The id the reading puts between documents (data.document_marker): the tokenizer's EOS (None when it has
    none: nothing is inserted) or its BOS, which must exist."""
    if marker == "eos":
        return tokenizer.eos_token_id
    if tokenizer.bos_token_id is None:
        raise DataError(f"data.document_marker=bos but the tokenizer {type(tokenizer).__name__} has no BOS token; "
                        "set data.document_marker: eos, or give the tokenizer a bos_token")
    return tokenizer.bos_token_id


def _document_tokens(docs: Iterable[str], tokenizer, marker: str = "eos") -> Iterator[list[int]]:
    """Token ids of each document (no special tokens from the tokenizer), followed by EOS when there is one
    (marker "eos"), or preceded by BOS (marker "bos")."""
    inserted = inserted_token_id(marker, tokenizer)
    docs = iter(docs)
    while batch := list(itertools.islice(docs, TOKENIZE_BATCH_DOCUMENTS)):
        encoded = tokenizer(batch, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        for ids in encoded:
            if inserted is None:
                yield ids
            else:
                yield [inserted] + ids if marker == "bos" else ids + [inserted]


def _pack(token_lists: Iterable[list[int]], content_length: int, bos: int | None) -> Iterator[list[int]]:
    """Concatenate token lists and cut them into [BOS] + `content_length` tokens; the ragged tail is dropped."""
    prefix = [] if bos is None else [bos]
    buffer: list[int] = []
    for ids in token_lists:
        buffer.extend(ids)
        if len(buffer) < content_length:
            continue
        cut = len(buffer) - len(buffer) % content_length
        for start in range(0, cut, content_length):
            yield prefix + buffer[start : start + content_length]
        del buffer[:cut]


def pack_sequences(
    docs: Iterable[str], tokenizer, cfg: DataConfig, split: Split = "train", start_sequence: int = 0
) -> Iterator[torch.LongTensor]:
    """Pack the documents of one split into sequences of exactly T = cfg.context_length tokens, each (T,).

    Train documents are shuffled with a seeded buffer (when cfg.shuffle_documents); eval documents keep their order.
    EOS (when the tokenizer has one) follows every document, or BOS precedes it (cfg.document_marker); with BOS on
    (cfg.add_bos), every sequence is [BOS] + (T - 1) tokens.
    No padding: the tail that does not fill a sequence is dropped. `start_sequence=n` yields exactly the sequences
    n, n+1, ... of the full stream (it regenerates and discards the first n), so a run can resume.
    """
    _check_split(split)
    if start_sequence < 0:
        raise ValueError(f"start_sequence must be >= 0, got {start_sequence}")
    if split == "train" and cfg.shuffle_documents:
        docs = shuffle_buffered(docs, cfg.shuffle_buffer_documents, cfg.seed)
    bos = tokenizer.bos_token_id if resolve_add_bos(cfg, tokenizer) else None
    content_length = cfg.context_length - (bos is not None)
    sequences = _pack(_document_tokens(docs, tokenizer, cfg.document_marker), content_length, bos)
    return (torch.tensor(ids, dtype=torch.long) for ids in itertools.islice(sequences, start_sequence, None))  # (T,)


def iter_sequences(
    cfg: DataConfig, tokenizer, split: Split = "train", start_sequence: int = 0
) -> Iterator[torch.LongTensor]:
    """The split's packed sequences (T,) from the configured corpus, up to its token budget.

    The train stream yields ceil(train_tokens / T) sequences, the eval stream ceil(eval_tokens / T); when the
    corpus runs out first it warns, naming both numbers.
    """
    _check_split(split)
    budget_tokens = cfg.train_tokens if split == "train" else cfg.eval_tokens
    num_sequences = token_budget_to_sequences(budget_tokens, cfg.context_length)
    docs = split_documents(cfg).documents(split)
    produced = start_sequence
    sequences = pack_sequences(docs, tokenizer, cfg, split, start_sequence)
    for seq in itertools.islice(sequences, max(num_sequences - start_sequence, 0)):
        produced += 1
        yield seq
    if produced < num_sequences:
        _warn_short(split, produced, num_sequences, cfg)


def _warn_short(split: str, produced: int, wanted: int, cfg: DataConfig) -> None:
    key = f"{split}_tokens"
    warnings.warn(
        f"the {split} documents give only {produced:,} sequences of {cfg.context_length} tokens "
        f"({produced * cfg.context_length:,} tokens), fewer than data.{key}={getattr(cfg, key):,} "
        f"({wanted:,} sequences); add text, lower data.{key}, or change data.eval_fraction",
        ExpertizeWarning,
        stacklevel=3,
    )


def batch_sequences(
    seqs: Iterable[torch.Tensor], batch_size: int, drop_last: bool = False
) -> Iterator[torch.LongTensor]:
    """Stack sequences (T,) into batches (B, T); the last batch may be smaller unless drop_last."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    seqs = iter(seqs)
    while batch := list(itertools.islice(seqs, batch_size)):
        if drop_last and len(batch) < batch_size:
            return
        yield torch.stack(batch)  # (B, T)


def load_eval_sequences(cfg: DataConfig, tokenizer) -> torch.LongTensor:
    """The held-out eval set (S, T), S = ceil(eval_tokens / T); the same for every method given (data, tokenizer).

    Fewer sequences (with a warning naming both numbers) when the held-out documents run out; none is an error.
    """
    wanted = token_budget_to_sequences(cfg.eval_tokens, cfg.context_length)
    docs = split_documents(cfg).eval()
    sequences = list(itertools.islice(pack_sequences(docs, tokenizer, cfg, "eval"), wanted))
    if not sequences:
        raise DataError(
            f"the held-out documents (data.eval_fraction={cfg.eval_fraction}, data.seed={cfg.seed}) do not fill a "
            f"single sequence of data.context_length={cfg.context_length} tokens; add text, raise data.eval_fraction, "
            "hold out the end of every document (data.eval_split: tail), give held-out files in data.eval_paths, "
            "or lower data.context_length"
        )
    if len(sequences) < wanted:
        _warn_short("eval", len(sequences), wanted, cfg)
    return torch.stack(sequences)  # (S, T)
