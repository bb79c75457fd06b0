"""Named corpora for `expertize inspect`: `--corpus code=PATH` -> fixed-length token sequences per name.

A corpus is a UTF-8 `.txt` file (one document per line, or blocks separated by blank lines: detected from the file)
or a `.jsonl` file with a "text" field per line. Documents are read, tokenized, separated and packed exactly as
the training data (conversion/data/text.py, unshuffled; with the run's reading, data/run_reading.py), so every token
is real text and no padding is needed.
"""

import itertools
import math
import os
from pathlib import Path

import torch

from ..data.documents import corpus_config, corpus_file_problem
from ..data.run_reading import TextReading
from ..data.text import DataError, iter_documents, pack_sequences
from ..recipe.data import DataConfig
from ..errors import ExpertizeError

__all__ = ["InspectionError", "corpus_sequences", "parse_corpora"]


class InspectionError(ExpertizeError, ValueError):
    """`expertize inspect` cannot run on what it was given; the message names the problem and the fix."""


def parse_corpora(specs: list[str], flag: str = "--corpus") -> dict[str, str]:
    """`["code=a.txt", "wiki.jsonl"]` -> {"code": "a.txt", "wiki": "wiki.jsonl"} (a bare path is named by its stem);
    errors name `flag`."""
    corpora: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or os.path.exists(spec):  # a bare path (possibly containing '=')
            name, path = Path(spec).stem, spec
        name = name.strip()
        if not name or not path:
            raise InspectionError(f"{flag} {spec!r}: write NAME=PATH (e.g. {flag} code=code.txt) or just PATH")
        if name in corpora:
            raise InspectionError(f"{flag}: the name {name!r} is given twice; name each corpus differently")
        problem = corpus_file_problem(path)
        if problem is not None:
            raise InspectionError(
                f"{flag} {name}: {problem}; give one .txt or .jsonl file (.parquet, and .gz / .bz2 / .xz compressed "
                f"text, are read too), and repeat {flag} NAME=PATH for each file"
            )
        corpora[name] = path
    return corpora


def _data_config(path: str, context_length: int, key: str = "data.paths") -> DataConfig:
    return corpus_config(path, context_length, key=key)  # the one corpus reader of every command (data/documents.py)


def corpus_sequences(name: str, path: str, tokenizer, tokens: int, context_length: int,
                     reading: "TextReading | None" = None) -> torch.LongTensor:
    """The first ceil(tokens / context_length) packed sequences of a corpus: (S, context_length), read as `reading`
    says (data/run_reading.py: the run's BOS, document marker and separator; None: the defaults).

    Raises InspectionError for a corpus with no text, or too little text for a single sequence.
    """
    wanted = math.ceil(tokens / context_length)
    try:
        cfg = _data_config(path, context_length, key=f"--corpus {name}")
        if reading is not None:
            cfg = reading.apply(cfg)
        docs = iter_documents(cfg, key=f"--corpus {name}")
        first = next(docs, None)
        if first is None:
            raise InspectionError(
                f"corpus {name!r} ({path}) is empty: it has no non-empty document; give a file with text "
                "(.txt: one document per line or blank-line blocks; .jsonl: a \"text\" field per line)"
            )
        sequences = list(itertools.islice(pack_sequences(itertools.chain([first], docs), tokenizer, cfg, "eval"),
                                          wanted))
    except DataError as e:  # a file's problem names the flag already
        raise InspectionError(str(e) if str(e).startswith(f"--corpus {name}:") else f"corpus {name!r}: {e}") from e
    if not sequences:
        raise InspectionError(
            f"corpus {name!r} ({path}) does not fill one sequence of {context_length} tokens; add text or lower "
            "--context-length"
        )
    return torch.stack(sequences)  # (S, T)
