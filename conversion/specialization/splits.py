"""Document-level split for `expertize specialize`: which documents may fit things, which may only evaluate.

Every document of every domain corpus goes to exactly one side, decided by a seeded hash of its text:

    eval   when sha256(f"{seed}\\0{text}") / 2**256 < eval_fraction
    fit    otherwise

Training the sparse layer, assigning units to domains (masking), choosing steering units and fitting probes read
only *fit* documents; every ΔCE, F1 and steering effect is measured on *eval* documents. The decision depends on the
document's text alone (not on its position or on the other documents), so the same document lands on the same side in
every corpus order, every run and every tool that uses the same seed. Identical duplicate documents share a side.
"""

import hashlib
import itertools
import math
from collections.abc import Iterable

import torch

from ..data.text import DataConfig, DataError, iter_documents, pack_sequences
from ..inspection.corpora import _data_config
from .errors import SpecializationError

__all__ = ["content_mask", "in_eval", "pack_documents", "read_documents", "split_documents"]


def in_eval(text: str, seed: int, eval_fraction: float) -> bool:
    """Whether a document is held out for evaluation (see the module docstring)."""
    digest = hashlib.sha256(f"{seed}\0{text}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def split_documents(texts: Iterable[str], seed: int, eval_fraction: float) -> tuple[list[str], list[str]]:
    """(fit, eval) documents, each in input order."""
    if not 0 < eval_fraction < 1:
        raise SpecializationError(f"eval fraction must be strictly between 0 and 1, got {eval_fraction}; use e.g. 0.3")
    fit, held = [], []
    for text in texts:
        (held if in_eval(text, seed, eval_fraction) else fit).append(text)
    return fit, held


def read_documents(name: str, path: str) -> list[str]:
    """The documents of a .txt / .jsonl / .parquet corpus (as `expertize inspect` reads them)."""
    try:
        docs = list(iter_documents(_data_config(str(path), 8)))
    except DataError as e:
        raise SpecializationError(f"corpus {name!r}: {e}") from e
    if not docs:
        raise SpecializationError(f"corpus {name!r} ({path}) has no non-empty document; give a file with text")
    return docs


def pack_documents(name: str, docs: list[str], tokenizer, tokens: int, context_length: int) -> torch.LongTensor:
    """The first ceil(tokens / context_length) packed sequences of `docs` (in order, unshuffled): (S, T).

    Sequences are packed within one domain and one side of the split, so every context has one domain label."""
    # The documents are already in memory: a hub-source config is only read for context_length and add_bos.
    cfg = DataConfig(source="hub", name="in-memory", paths=[], context_length=context_length)
    wanted = math.ceil(tokens / context_length)
    sequences = list(itertools.islice(pack_sequences(iter(docs), tokenizer, cfg, "eval"), wanted))
    if not sequences:
        raise SpecializationError(
            f"corpus {name!r}: its documents on this side of the split do not fill one sequence of {context_length} "
            "tokens; add text, lower --context-length or change --eval-fraction"
        )
    return torch.stack(sequences)  # (S, T)


def content_mask(input_ids: torch.Tensor, special_ids: Iterable[int]) -> torch.Tensor:
    """(S, T) bool: True on content tokens, False on special tokens (BOS, EOS, padding)."""
    special = torch.tensor(sorted(set(int(i) for i in special_ids)), dtype=input_ids.dtype)
    return ~torch.isin(input_ids, special)
