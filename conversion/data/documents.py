"""Reading documents from a corpus: local text / jsonl / parquet files or a datasets hub dataset. The one reader of
every command (`upcycle`'s data section, `capture`, `inspect`, `specialize`, `tasks`).

One document per line, per blank-line block or per file (text), per record (jsonl / parquet, `text_column`), in the
order of `data.paths` (globs sorted). A file's format follows its name (`file_format`): a `.jsonl` file is parsed as
JSON lines and a `.parquet` file as parquet even under the default `data.source: text`, so the raw `{"text": ...}`
syntax is never read as text; a name that contradicts an explicit other format is refused with the fix. A `.gz`,
`.bz2` or `.xz` file is decompressed while it is read (standard library), its format named by the rest of its name
(`wiki.jsonl.gz`); other archives (`.zst`, `.zip`, ...) are refused saying how to decompress them. Errors name the
file, the setting or flag that gave it (`key`: data.paths, data.eval_paths, --corpus NAME) and the fix (`DataError`).
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterator
from typing import Any

from ..errors import DataError
from ..recipe.data import DataConfig
from ..recipe.corpus_files import (
    COMPRESSED,
    archive_check,
    compressed_as,
    file_format,
    resolve_paths,
)


def corpus_file_problem(path: str) -> str | None:
    """Why `path`, named as one corpus file on the command line (`--corpus NAME=PATH`, `expertize tasks TEXT_FILE`),
    is not one: it does not exist, or it is a directory (naming a few of its files); None when it is a file."""
    if os.path.isdir(path):
        inside = sorted(name for name in os.listdir(path) if os.path.isfile(os.path.join(path, name)))
        shown = (f" (it holds {', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''})" if inside
                 else " (an empty one)")
        return f"{path!r} is a directory, not a file{shown}"
    if not os.path.isfile(path):
        return f"no such file {path!r} (relative to {os.getcwd()!r})"
    return None


def open_text(path: str, errors: str = "strict"):
    """A UTF-8 text stream of a corpus file (universal newlines), decompressed when its name says `COMPRESSED`."""
    opener = COMPRESSED.get(os.path.splitext(path)[1].lower(), open)
    return opener(path, "rt", encoding="utf-8", errors=errors)


def corpus_config(
    path: str, context_length: int = 128, separator: str = "auto", key: str = "data.paths"
) -> DataConfig:
    """The data section that reads one named corpus file as every command does: its format from its name
    (`file_format`); a text file's documents are lines, or blank-line blocks when `separator` is "auto" and the
    file has blocks of several lines (a play's speeches, poems) — detected from its first MiB — or as `separator`
    ("line" / "blank_line" / "file") says. Errors about the file name `key` (the flag that gave it)."""
    archive_check(path, key)
    fmt = file_format(path, key=key)
    if fmt != "text":
        return DataConfig(source=fmt, paths=[path], context_length=context_length)
    if separator == "auto":
        with open_text(path, errors="replace") as f:
            head = f.read(1 << 20).replace("\r\n", "\n")
        blocks = [b for b in re.split(r"\n\s*\n", head.strip("\n")) if b.strip()]
        separator = "blank_line" if len(blocks) > 1 and any("\n" in b.strip("\n") for b in blocks) else "line"
    return DataConfig(source="text", paths=[path], context_length=context_length, document_separator=separator)


def iter_documents(cfg: DataConfig, key: str = "data.paths") -> Iterator[str]:
    """Raw non-empty documents in file order (local sources) or stream order (hub). Errors about a file name `key`,
    the setting or flag that gave it (data.paths, data.eval_paths, --corpus NAME)."""
    if cfg.source == "hub":
        yield from _hub_documents(cfg)
        return
    readers = {"text": _text_documents, "jsonl": _jsonl_documents, "parquet": _parquet_documents}
    try:
        files = resolve_paths(cfg.paths, key)
    except OSError as e:  # a file removed since the recipe was loaded
        raise DataError(str(e)) from e
    for path in files:
        read = readers[file_format(path, cfg.source, key)]
        try:
            yield from read(path, cfg, key)
        except UnicodeDecodeError as e:
            compressed = None if path.lower().endswith(tuple(COMPRESSED)) else compressed_as(path)
            if compressed is not None:
                what, command = compressed
                raise DataError(
                    f"{key}: {path!r} is {what}, not text; decompress it ({command}) or, for gzip / bzip2 / xz, name "
                    "it with its .gz / .bz2 / .xz suffix so that it is read as it is"
                ) from e
            instead = f"remove it from {key}" if key.startswith("data.") else "give a UTF-8 file"
            raise DataError(
                f"{key}: {path!r} is not UTF-8 text ({e.reason} at byte {e.start:,}); convert it to UTF-8 "
                f"(iconv -f ITS_ENCODING -t UTF-8 FILE > FILE.utf8.txt) or {instead}"
            ) from e
        except (OSError, EOFError) as e:  # EOFError: a truncated .gz / .bz2 / .xz file
            raise DataError(
                f"{key}: cannot read {path!r} ({getattr(e, 'strerror', None) or e}); check that it exists, is "
                "readable and, if compressed, is complete"
            ) from e


def _text_documents(path: str, cfg: DataConfig, key: str) -> Iterator[str]:
    with open_text(path) as f:
        if cfg.document_separator == "file":
            text = f.read()
            if text.strip():
                yield text
        elif cfg.document_separator == "line":
            for line in f:
                line = line.rstrip("\r\n")
                if line.strip():
                    yield line
        else:  # blank_line: paragraphs
            paragraph: list[str] = []
            for line in itertools.chain(f, [""]):
                if line.strip():
                    paragraph.append(line)
                elif paragraph:
                    yield "".join(paragraph).rstrip("\r\n")
                    paragraph = []


def _jsonl_documents(path: str, cfg: DataConfig, key: str) -> Iterator[str]:
    with open_text(path) as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{line_number} is not valid JSON ({e}); a JSON-lines corpus (a .jsonl file, or "
                    "data.source: jsonl) holds one JSON object per line; fix the line, or rename a plain-text file "
                    "to .txt"
                ) from e
            text = _record_text(record, cfg.text_column, f"{path}:{line_number}")
            if text:
                yield text


def _parquet_documents(path: str, cfg: DataConfig, key: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(
            f"{key}: {path!r} is not a readable parquet file ({e}); fix the file or set data.source to its format"
        ) from e
    columns = parquet.schema_arrow.names
    if cfg.text_column not in columns:
        raise _missing_column_error(cfg.text_column, columns, path)
    for batch in parquet.iter_batches(columns=[cfg.text_column]):
        for text in batch.column(0).to_pylist():
            text = _check_text(text, cfg.text_column, path)
            if text:
                yield text


def _hub_documents(cfg: DataConfig) -> Iterator[str]:
    import datasets

    dataset = datasets.load_dataset(cfg.name, cfg.config, split=cfg.split, streaming=cfg.streaming)
    where = f"hub dataset {cfg.name!r} (config={cfg.config!r}, split={cfg.split!r})"
    for record in dataset:
        text = _record_text(record, cfg.text_column, where)
        if text:
            yield text


def _record_text(record: Any, column: str, where: str) -> str | None:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a record (JSON object), got {type(record).__name__}")
    if column not in record:
        raise _missing_column_error(column, list(record), where)
    return _check_text(record[column], column, where)


def _check_text(text: Any, column: str, where: str) -> str | None:
    if text is not None and not isinstance(text, str):
        raise DataError(
            f"{where}: column {column!r} holds {type(text).__name__}, not text; set data.text_column to a text column"
        )
    return text if text and text.strip() else None


def _missing_column_error(column: str, found: list[str], where: str) -> DataError:
    return DataError(
        f"{where}: no text column {column!r}; the columns found are {found}; set data.text_column to one of them"
    )
