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
from collections.abc import Iterable, Iterator

import torch

from ..data.text import DataError, iter_documents
from ..recipe.data import DataConfig
from ..inspection.corpora import _data_config
from .errors import SpecializationError

__all__ = [
    "content_mask", "in_eval", "pack_documents", "pack_with_documents", "read_documents", "split_documents",
]


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


def read_documents(name: str, path: str, flag: str = "--corpus") -> list[str]:
    """The documents of a .txt / .jsonl / .parquet corpus (as `expertize inspect` reads them); errors about the file
    name `flag` and the corpus."""
    key = f"{flag} {name}"
    try:
        docs = list(iter_documents(_data_config(str(path), 8, key), key=key))
    except DataError as e:  # a file's problem names the flag already
        raise SpecializationError(str(e) if str(e).startswith(key) else f"corpus {name!r}: {e}") from e
    if not docs:
        raise SpecializationError(f"corpus {name!r} ({path}) has no non-empty document; give a file with text")
    return docs


def pack_documents(
    name: str, docs: list[str], tokenizer, tokens: int, context_length: int, document_tokens: int | None = None,
    reading=None,
) -> torch.LongTensor:
    """The first ceil(tokens / context_length) packed sequences of `docs`: (S, T); see `pack_with_documents`."""
    return pack_with_documents(name, docs, tokenizer, tokens, context_length, document_tokens, reading)[0]


def pack_with_documents(
    name: str, docs: list[str], tokenizer, tokens: int, context_length: int, document_tokens: int | None = None,
    reading=None,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The first ceil(tokens / context_length) packed sequences of `docs` (in order, unshuffled), packed as upcycle
    packs them (`data.text`: EOS after every document, or BOS before it, and BOS first in every sequence, as
    `reading` says: data/run_reading.TextReading, None: the defaults), and which document each token comes from:
    ((S, T) token ids, (S, T) document index into `docs`, -1 on a sequence's leading BOS).

    `document_tokens`: each document contributes at most its first that many tokens (and its EOS), so a budget
    spreads over more documents (None: whole documents). Sequences are packed within one domain and one side of
    the split, so every context has one domain label; the document index is what the confidence intervals resample
    (bootstrap.py)."""
    from ..data.run_reading import TextReading
    from ..data.text import _document_tokens, _pack, inserted_token_id, resolve_add_bos

    if document_tokens is not None and document_tokens < 1:
        raise SpecializationError(f"document tokens must be at least 1, got {document_tokens}; or give None (whole "
                                  "documents)")
    # The documents are already in memory: a hub-source config is only read for the reading and context_length.
    cfg = (reading or TextReading()).apply(DataConfig(source="hub", name="in-memory", paths=[],
                                                      context_length=context_length))
    bos = tokenizer.bos_token_id if resolve_add_bos(cfg, tokenizer) else None
    marker = inserted_token_id(cfg.document_marker, tokenizer)
    content = context_length - (bos is not None)
    lengths: list[int] = []

    def capped() -> Iterator[list[int]]:
        for ids in _document_tokens(docs, tokenizer, cfg.document_marker):
            if document_tokens is not None and len(ids) - (marker is not None) > document_tokens:
                if marker is None:
                    ids = ids[:document_tokens]
                elif cfg.document_marker == "bos":  # [BOS] + the first document_tokens tokens
                    ids = ids[: document_tokens + 1]
                else:  # the first document_tokens tokens + [EOS]
                    ids = ids[:document_tokens] + [marker]
            lengths.append(len(ids))
            yield ids

    wanted = math.ceil(tokens / context_length)
    sequences = list(itertools.islice(_pack(capped(), content, bos), wanted))
    if not sequences:
        raise SpecializationError(
            f"corpus {name!r}: its documents on this side of the split do not fill one sequence of {context_length} "
            "tokens; add text, lower --context-length or change --eval-fraction"
        )
    # The same packing of a stream that holds each token's document index instead of the token (-1 for BOS).
    owners = _pack(([d] * n for d, n in enumerate(lengths)), content, None if bos is None else -1)
    documents = list(itertools.islice(owners, len(sequences)))
    return torch.tensor(sequences, dtype=torch.long), torch.tensor(documents, dtype=torch.long)  # (S, T) each


def content_mask(input_ids: torch.Tensor, special_ids: Iterable[int]) -> torch.Tensor:
    """(S, T) bool: True on content tokens, False on special tokens (BOS, EOS, padding)."""
    special = torch.tensor(sorted(set(int(i) for i in special_ids)), dtype=input_ids.dtype)
    return ~torch.isin(input_ids, special)
