"""Which corpus files a data section names and how each is read, by its name: glob expansion and existence
(`resolve_paths`), the format a name fixes (`file_format`), compressed files read as they are and archives refused
(`COMPRESSED`, `archive_check`). The recipe checks its paths with these before any work; data/documents.py reads
the files. Errors name the setting or flag that gave the file (`key`) and the fix.
"""

import bz2
import glob
import gzip
import lzma
import os

from ..errors import DataError


def resolve_paths(paths: list[str], key: str = "data.paths") -> list[str]:
    """Expand glob patterns (sorted) and check that every file exists; keeps the order of `paths`. Errors name
    `key`, the setting that lists them."""
    files = []
    for path in paths:
        if glob.has_magic(path):
            matches = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
            if not matches:
                raise FileNotFoundError(
                    f"{key}: the pattern {path!r} matches no file (relative to {os.getcwd()!r}); "
                    "fix the pattern or the working directory"
                )
            for match in matches:
                archive_check(match, key)
            files.extend(matches)
        elif os.path.isdir(path):
            raise IsADirectoryError(
                f"{key}: {path!r} is a directory; list its files or use a glob such as "
                f"{os.path.join(path, '*.txt')!r}"
            )
        elif not os.path.isfile(path):
            raise FileNotFoundError(
                f"{key}: no such file {path!r} (relative to {os.getcwd()!r}); "
                "fix the path, give an absolute path, or use a glob pattern"
            )
        else:
            archive_check(path, key)
            files.append(path)
    return files


COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
"""Compressed text read as it is decompressed (standard library): the file's format is the rest of its name."""

_ARCHIVES = (  # (magic bytes, name suffixes, what it is, how to decompress it); the readable ones first
    (b"\x1f\x8b", (".gz",), "gzip-compressed", "gunzip -k FILE"),
    (b"BZh", (".bz2",), "bzip2-compressed", "bunzip2 -k FILE"),
    (b"\xfd7zXZ\x00", (".xz",), "xz-compressed", "unxz -k FILE"),
    (b"\x28\xb5\x2f\xfd", (".zst", ".zstd"), "zstd-compressed", "zstd -d FILE"),
    (b"PK\x03\x04", (".zip",), "a zip archive", "unzip FILE"),
    (b"7z\xbc\xaf\x27\x1c", (".7z",), "a 7-Zip archive", "7z x FILE"),
    (None, (".tar", ".tgz", ".tbz2", ".txz"), "a tar archive", "tar -xf FILE"),
)


def archive_check(path: str, key: str = "data.paths") -> None:
    """Refuse, by its name, a compressed file that cannot be read as it is (zstd, zip, 7z, tar), saying how to
    decompress it; `.gz` / `.bz2` / `.xz` files are read (`COMPRESSED`)."""
    name = path.lower()
    for _, suffixes, what, command in _ARCHIVES:
        if name.endswith(suffixes) and not name.endswith(tuple(COMPRESSED)):
            raise DataError(
                f"{key}: {path!r} is {what}; decompress it ({command}) and give the file inside it (.gz, .bz2 and "
                ".xz files are read as they are)"
            )


def compressed_as(path: str) -> tuple[str, str] | None:
    """(what, how to decompress) when the file's first bytes are those of a compressed file or archive."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return None
    return next(((what, command) for magic, _, what, command in _ARCHIVES if magic and head.startswith(magic)), None)


FORMAT_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
"""File names whose format is fixed by the name, whatever data.source says (any other name: data.source's)."""


def file_format(path: str, source: str = "text", key: str = "data.paths") -> str:
    """How a local corpus file is read: "jsonl" or "parquet" when its name says so (`FORMAT_SUFFIXES`; a compressed
    file's name without its `.gz`), else `source` (text by default). A name that contradicts an explicit jsonl /
    parquet source is refused (DataError), and so is a compressed parquet file (parquet compresses inside)."""
    stem, suffix = os.path.splitext(path)
    compressed = suffix.lower() in COMPRESSED
    named = FORMAT_SUFFIXES.get(os.path.splitext(stem if compressed else path)[1].lower())
    if compressed and (named == "parquet" or source == "parquet"):
        raise DataError(f"{key}: {path!r} is a compressed parquet file; decompress it (parquet files compress their "
                        "columns inside)")
    if named is None or named == source:
        return source
    if source != "text":
        raise DataError(
            f"{key}: {path!r} is a {named} file by its name, but data.source is {source!r}; set data.source to "
            f"{named!r}, or list files of one format"
        )
    return named  # the default source: the file's own format
