"""The token cache (`data.token_cache: DIR`): the train split's packed token ids kept on disk between runs, so that a
run whose data section, corpus and tokenizer match an earlier run's reads them instead of reading and tokenizing the
text again.

    DIR/tokens-<key>.bin     the packed sequences (S, T), int32, in stream order: exactly what
                             `iter_sequences(data, tokenizer, "train")` yields, with no budget applied beyond S
    DIR/tokens-<key>.json    what produced them (`token_identity`), S, T and whether the train split ran out

The key is the sha256 of `token_identity`, keyed like the activation cache (data/cache.py's `stream_identity`: every
data field that decides the train stream, the corpus files' resolved paths and sizes) plus each corpus file's
modification time and the tokenizer's fingerprint (its serialized fast tokenizer, or its vocabulary, with its class
and special tokens). So a changed tokenizer or an edited corpus file gives another key and is never served stale
ids; the budget is not in the key: an entry holding at least the sequences a run needs (or the whole split) serves
it from the front, a longer run writes a longer entry.

Writing: on a miss the run tokenizes as usual (in the background reading thread, data/activations.py) and its stream
is copied into `tokens-<key>.<pid>.partial` as it is read; when the stream has been read to its end the manifest is
written and the file renamed into place. A run that stops earlier (interrupted, resumed mid-stream) writes nothing.
Under data parallelism only rank 0 writes; every rank reads.
"""

import contextlib
import hashlib
import json
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from ..errors import ExpertizeWarning
from ..recipe.data import DataConfig, token_budget_to_sequences
from .text import iter_sequences, resolve_paths

TOKEN_CACHE_FORMAT = 1
READ_BLOCK_SEQUENCES = 4096
"""Sequences read from the memory map and converted at once (a few MiB)."""


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what decides the tokenizer's ids: its serialized fast tokenizer (vocabulary, merges, normalizer,
    pre-tokenizer) or, for a slow one, its vocabulary; with its class and special token ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    specials = {"class": type(tokenizer).__name__, "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id,
                "special_ids": sorted(int(i) for i in tokenizer.all_special_ids if i is not None)}
    return hashlib.sha256((body + json.dumps(specials, sort_keys=True)).encode("utf-8")).hexdigest()


def token_identity(data: DataConfig, tokenizer) -> dict:
    """What decides the packed train stream: `stream_identity(data)` (activation cache), the corpus files'
    modification times (an edit of the same size changes them), and the tokenizer's fingerprint."""
    from .cache import stream_identity

    files = resolve_paths(data.paths) + resolve_paths(data.eval_paths) if data.paths else []
    return {
        "format": TOKEN_CACHE_FORMAT,
        "stream": stream_identity(data),
        "modified_ns": [os.stat(path).st_mtime_ns for path in files],
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }


def token_cache_key(data: DataConfig, tokenizer) -> str:
    identity = json.dumps(token_identity(data, tokenizer), sort_keys=True)
    return hashlib.sha256(identity.encode("utf-8")).hexdigest()[:32]


def train_sequences(data: DataConfig, tokenizer, *, write: bool = True) -> Callable[[int], Iterator[torch.Tensor]]:
    """`start -> the train split's packed sequences (T,) from sequence `start` on`, up to data.train_tokens: from
    data.token_cache when it holds them, else `iter_sequences` (copied into the cache when `write` and data.token_cache
    is set). The same sequences either way."""
    if data.token_cache is None:
        return lambda start: iter_sequences(data, tokenizer, split="train", start_sequence=start)
    folder = Path(data.token_cache)
    key = token_cache_key(data, tokenizer)
    wanted = token_budget_to_sequences(data.train_tokens, data.context_length)
    entry = _read_entry(folder, key, data.context_length)
    if entry is not None and (entry["sequences"] >= wanted or entry["exhausted"]):
        return lambda start: _cached(folder, key, entry, data, wanted, start)
    return lambda start: _tokenized(data, tokenizer, folder, key, wanted, start, write=write)


def _read_entry(folder: Path, key: str, context_length: int) -> dict | None:
    """The manifest of entry `key` when it and its ids are complete and consistent, else None (a miss)."""
    try:
        entry = json.loads((folder / f"tokens-{key}.json").read_text(encoding="utf-8"))
        size = (folder / f"tokens-{key}.bin").stat().st_size
    except (OSError, ValueError):
        return None
    if entry.get("context_length") != context_length or size != entry.get("sequences", -1) * context_length * 4:
        return None  # truncated or foreign: tokenize again (and rewrite it)
    return entry


def _cached(folder: Path, key: str, entry: dict, data: DataConfig, wanted: int, start: int) -> Iterator[torch.Tensor]:
    t, available = data.context_length, entry["sequences"]
    stop = min(wanted, available)
    if stop > start:
        ids = np.memmap(folder / f"tokens-{key}.bin", dtype=np.int32, mode="r", shape=(available, t))
        for first in range(start, stop, READ_BLOCK_SEQUENCES):
            block = torch.from_numpy(ids[first : min(first + READ_BLOCK_SEQUENCES, stop)].astype(np.int64))  # (b, T)
            yield from block  # (T,) each
    if available < wanted:  # the split ran out when the entry was written: the same warning as reading the text
        warnings.warn(
            f"the train documents give only {available:,} sequences of {t} tokens ({available * t:,} tokens), fewer "
            f"than data.train_tokens={data.train_tokens:,} ({wanted:,} sequences); add text, lower data.train_tokens, "
            "or change data.eval_fraction",
            ExpertizeWarning,
            stacklevel=2,
        )


def _tokenized(
    data: DataConfig, tokenizer, folder: Path, key: str, wanted: int, start: int, *, write: bool
) -> Iterator[torch.Tensor]:
    """The live stream from `start`; from the first sequence and with `write`, copied into the cache and committed
    once the stream has been read to its end. The cache is a convenience: a failed write (a full disk, a read-only
    folder) warns once and the run goes on without it."""
    stream = iter_sequences(data, tokenizer, split="train", start_sequence=start)
    if not write or start:
        yield from stream
        return
    writer = _EntryWriter(folder, key)
    complete = False
    try:
        for seq in stream:
            writer.add(seq)
            yield seq
        complete = True
    finally:
        writer.finish(complete, data, tokenizer, wanted)


class _EntryWriter:
    """Appends sequences to `tokens-<key>.<pid>.partial`; `finish` commits the entry or removes the partial file."""

    def __init__(self, folder: Path, key: str) -> None:
        self.folder, self.key, self.count = folder, key, 0
        self.partial = folder / f"tokens-{key}.{os.getpid()}.partial"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self.out = open(self.partial, "wb")
        except OSError as e:
            self.out = self._failed(e)

    def add(self, seq: torch.Tensor) -> None:
        if self.out is None:
            return
        try:
            self.out.write(seq.to(torch.int32).numpy().tobytes())
            self.count += 1
        except OSError as e:
            self.out = self._failed(e)

    def finish(self, complete: bool, data: DataConfig, tokenizer, wanted: int) -> None:
        if self.out is None:
            return
        try:
            self.out.close()
            if not (complete and self.count):
                self.partial.unlink(missing_ok=True)
                return
            entry = {"format": TOKEN_CACHE_FORMAT, "key": self.key, "context_length": data.context_length,
                     "sequences": self.count, "exhausted": self.count < wanted,
                     "identity": token_identity(data, tokenizer)}
            os.replace(self.partial, self.folder / f"tokens-{self.key}.bin")
            manifest = self.folder / f"tokens-{self.key}.json.{os.getpid()}.partial"
            manifest.write_text(json.dumps(entry, indent=1), encoding="utf-8")
            os.replace(manifest, self.folder / f"tokens-{self.key}.json")  # last: an entry without it is a miss
        except OSError as e:
            self._failed(e)

    def _failed(self, error: OSError) -> None:
        """Stop writing, remove what was written, say so once; the run keeps its live stream."""
        if getattr(self, "out", None) is not None:
            self.out.close()
        with contextlib.suppress(OSError):  # e.g. the folder could not be made: there is nothing to remove
            self.partial.unlink(missing_ok=True)
        warnings.warn(f"data.token_cache: could not write {self.folder} ({error}); this run's token ids are not "
                      "kept (the run itself is unaffected)", ExpertizeWarning, stacklevel=2)
        return None
