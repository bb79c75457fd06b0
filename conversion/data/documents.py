"""Reading documents from a corpus: local text / jsonl / parquet files or a datasets hub dataset. The one reader of
every command (`upcycle`'s data section, `capture`, `inspect`, `specialize`, `tasks`).

One document per line, per blank-line block or per file (text), per record (jsonl / parquet, `text_column`), in the
order of `data.paths` (globs sorted). A file's format follows its name (`file_format`): a `.jsonl` file is parsed as
JSON lines and a `.parquet` file as parquet even under the default `data.source: text`, so the raw `{"text": ...}`
syntax is never read as text; a name that contradicts an explicit other format is refused with the fix. Errors name
the file and the fix (`DataError`).
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import ExpertizeError

if TYPE_CHECKING:  # DataConfig (recipe/data.py) calls resolve_paths; only its type is needed here
    from ..recipe.data import DataConfig


class DataError(ExpertizeError, ValueError):
    """The corpus cannot give what the recipe asks of it (unreadable file, too little text, empty held-out split,
    a tokenizer that yields no tokens); the message names the fix."""


# ----------------------------------------------------------------------------------------------------------------
# Documents


def resolve_paths(paths: list[str]) -> list[str]:
    """Expand glob patterns (sorted) and check that every file exists; keeps the order of `paths`."""
    files = []
    for path in paths:
        if glob.has_magic(path):
            matches = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
            if not matches:
                raise FileNotFoundError(
                    f"data.paths: the pattern {path!r} matches no file (relative to {os.getcwd()!r}); "
                    "fix the pattern or the working directory"
                )
            files.extend(matches)
        elif os.path.isdir(path):
            raise IsADirectoryError(
                f"data.paths: {path!r} is a directory; list its files or use a glob such as "
                f"{os.path.join(path, '*.txt')!r}"
            )
        elif not os.path.isfile(path):
            raise FileNotFoundError(
                f"data.paths: no such file {path!r} (relative to {os.getcwd()!r}); "
                "fix the path, give an absolute path, or use a glob pattern"
            )
        else:
            files.append(path)
    return files


FORMAT_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
"""File names whose format is fixed by the name, whatever data.source says (any other name: data.source's)."""


def file_format(path: str, source: str = "text") -> str:
    """How a local corpus file is read: "jsonl" or "parquet" when its name says so (`FORMAT_SUFFIXES`), else
    `source` (text by default). A name that contradicts an explicit jsonl / parquet source is refused (DataError)."""
    named = FORMAT_SUFFIXES.get(os.path.splitext(path)[1].lower())
    if named is None or named == source:
        return source
    if source != "text":
        raise DataError(
            f"data.paths: {path!r} is a {named} file by its name, but data.source is {source!r}; set data.source to "
            f"{named!r}, or list files of one format"
        )
    return named  # the default source: the file's own format


def corpus_config(path: str, context_length: int = 128, separator: str = "auto") -> DataConfig:
    """The data section that reads one named corpus file as every command does: its format from its name
    (`file_format`); a text file's documents are lines, or blank-line blocks when `separator` is "auto" and the
    file has blocks of several lines (a play's speeches, poems) — detected from its first MiB — or as `separator`
    ("line" / "blank_line" / "file") says."""
    from ..recipe.data import DataConfig

    fmt = file_format(path)
    if fmt != "text":
        return DataConfig(source=fmt, paths=[path], context_length=context_length)
    if separator == "auto":
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(1 << 20).replace("\r\n", "\n")
        blocks = [b for b in re.split(r"\n\s*\n", head.strip("\n")) if b.strip()]
        separator = "blank_line" if len(blocks) > 1 and any("\n" in b.strip("\n") for b in blocks) else "line"
    return DataConfig(source="text", paths=[path], context_length=context_length, document_separator=separator)


def iter_documents(cfg: DataConfig) -> Iterator[str]:
    """Raw non-empty documents in file order (local sources) or stream order (hub)."""
    if cfg.source == "hub":
        yield from _hub_documents(cfg)
        return
    readers = {"text": _text_documents, "jsonl": _jsonl_documents, "parquet": _parquet_documents}
    try:
        files = resolve_paths(cfg.paths)
    except OSError as e:  # a file removed since the recipe was loaded
        raise DataError(str(e)) from e
    for path in files:
        read = readers[file_format(path, cfg.source)]
        try:
            yield from read(path, cfg)
        except UnicodeDecodeError as e:
            raise DataError(
                f"data.paths: {path!r} is not UTF-8 text ({e.reason} at byte {e.start:,}); convert it to UTF-8 "
                "(e.g. iconv -t UTF-8) or remove it from data.paths"
            ) from e
        except OSError as e:
            raise DataError(
                f"data.paths: cannot read {path!r} ({e.strerror or e}); check that it exists and is readable"
            ) from e


def _text_documents(path: str, cfg: DataConfig) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
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


def _jsonl_documents(path: str, cfg: DataConfig) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
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


def _parquet_documents(path: str, cfg: DataConfig) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(
            f"data.paths: {path!r} is not a readable parquet file ({e}); fix the file or set data.source to its format"
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
