"""The activation cache's format: the target MLPs' (input, output) pairs captured once, many runs trained from disk.

    expertize capture RECIPE --output DIR      ->  DIR/cache.json + DIR/shard-00000.safetensors, ...
                                                   (the command: conversion/capture.py; its shards and manifest: here)
    data: {activation_cache: DIR}              ->  `upcycle` reads the pairs instead of running the base model

What is stored: the train stream of the recipe's data section (`iter_sequences(data, tokenizer, "train")`, the same
ceil(train_tokens / T) packed sequences a live run captures), in stream order, before any shuffle. Shard i holds
whole consecutive sequences: `layer.{L}.x` / `layer.{L}.y` (sequences * T, d) for every captured layer L and
`input_ids` (sequences, T) int32 (so the excluded special positions can be recomputed: the cache does not depend
on data.exclude_special_positions). `cache.json`, the manifest, records what produced the pairs (base model,
revision, base dtype, layers, the resolved data section, the corpus files and sizes), the shards (sequences, bytes,
sha256) and the versions; recorded but never compared: which base blocks the capture loaded (`base_loaded`) and how
many processes wrote the shards (`processes`). A multi-process capture's shards (`shard-r<rank>-<i>`, each rank a
contiguous run of the stream) are listed rank after rank, so the manifest's shards are the stream in order whoever
wrote them.

Deterministic training from a cache: `CachedActivationBatches` is `ActivationBatches` with its `_rows` (a chunk's
rows in stream order) read from the shards instead of captured, so the chunking, the seeded per-chunk permutation,
the step windows, the excluded positions, the data-parallel split and the exact resume by step are the same code.
Hence a run from a float32 cache of a float32 base sees bit-identical batches to the live run whenever each
sequence's capture does not depend on which sequences share its forward batch: exactly so on one process when the
shuffle chunk (`chunk_sequences`) is a multiple of `train.capture_batch_sequences` (the capture batches are then
the same; the quickstart and the tests), otherwise equal to float rounding of the base forward. A bfloat16 / float16
cache of a float32 base is rounded once, at capture.

Integrity: every shard's size is checked against cache.json when the cache is opened (before any work), and its
sha256 the first time a run opens it (one sequential read, next to the reads training does anyway); a shard that
fails either check is named (`CacheCorrupted`) instead of surfacing later as a diverged loss or, worse, as a run that
trains on damaged pairs without a sign.

Refusals, before any work: a folder without `cache.json` (an interrupted capture writes into a hidden staging
folder renamed into place only when complete, so it never leaves one), and a manifest that does not match the
recipe (another base model / revision / dtype, a missing layer, another data section or corpus, a smaller token
budget) -> `CacheMismatch` naming the fields and the fix.
"""

import bisect
import dataclasses
import hashlib
import json
import os
from collections.abc import Collection
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ..errors import ExpertizeError, RunFailed
from .activations import ActivationBatches, Batch, to_device
from .mlp_pairs import kept_positions
from .documents import file_format
from ..recipe.data import token_budget_to_sequences
from .text import resolve_paths, stream_sequences

__all__ = [
    "CACHE_MANIFEST", "STORAGE_DTYPES", "ActivationCache", "CacheCorrupted", "CacheError", "CacheMismatch",
    "CachedActivationBatches",
    "ShardWriter", "cache_manifest", "cached_batches", "open_matching_cache",
]

CACHE_MANIFEST = "cache.json"
CACHE_FORMAT = 1
STORAGE_DTYPES = ("float32", "bfloat16", "float16")
SHARD_BYTES = 256 * 2**20
"""Default shard size (whole sequences, at least one): a shard is read whole into memory only by `capture`."""
NOT_COMPARED = ("paths", "eval_paths", "train_tokens", "eval_tokens", "exclude_special_positions", "activation_cache",
                "token_cache", "streaming")
"""data fields a cache need not match: paths and eval_paths are compared as resolved files and sizes (`corpus`),
train_tokens as coverage; eval_tokens does not touch the train stream, excluded positions are recomputed from the
stored token ids, the cache folders name themselves, and streaming changes how a hub dataset is read, not what it
holds. Every other (and any future) data field must be equal."""
LEGACY_BASE = {"capture_precision": "fp32"}
"""Values of base-identity keys that caches written before the key existed were captured with."""
LEGACY_STREAM = {"document_marker": "eos", "eval_split": "documents"}
"""Values of data fields that caches written before the field existed were read with (issue 39's readings)."""


class CacheError(ExpertizeError):
    """An activation cache cannot be written or read (missing, incomplete, already there); the message says the fix."""


class CacheMismatch(CacheError):
    """The cache was captured for another base model, other layers or another data section than the recipe's."""


class CacheCorrupted(CacheError, RunFailed):
    """A shard's content no longer matches the sha256 cache.json recorded at capture (overwritten, damaged on disk or
    in a copy). Found when a run first reads the shard, so it exits 1 (work had started) with its checkpoint kept."""


def _shard_name(index: int, rank: int | None = None) -> str:
    """shard-00003.safetensors; a multi-process capture's rank 1: shard-r001-00003.safetensors (names sort in stream
    order either way)."""
    return f"shard-{index:05d}.safetensors" if rank is None else f"shard-r{rank:03d}-{index:05d}.safetensors"


# ----------------------------------------------------------------------------------------------------------------
# What identifies a cache


def _base_identity(recipe) -> dict[str, Any]:
    """What produced the pairs on the base model's side: the model, its revision and dtype, and the precision of its
    capture forward (train.capture_precision: a bf16-autocast capture gives other pairs)."""
    path = Path(os.path.expanduser(recipe.base_model))
    model = str(path.resolve()) if path.exists() else recipe.base_model
    return {"base_model": model, "base_revision": recipe.base_revision, "dtype": recipe.dtype,
            "capture_precision": recipe.train.capture_precision}


def stream_identity(data) -> dict[str, Any]:
    """The data fields that decide the train stream's sequences (see NOT_COMPARED) and the corpus files' sizes."""
    fields = {f.name: getattr(data, f.name) for f in dataclasses.fields(data) if f.name not in NOT_COMPARED}
    fields["corpus"] = [_corpus_file(p, data.source) for p in resolve_paths(data.paths)] if data.paths else []
    # Held-out files decide the train stream too: a train document identical to a held-out one is left out.
    fields["corpus"] += [_corpus_file(p, data.source) for p in resolve_paths(data.eval_paths)]
    return json.loads(json.dumps(fields))  # what the manifest holds after a round trip (tuples -> lists)


def _corpus_file(path: str, source: str) -> dict[str, Any]:
    """A corpus file's identity: its resolved path and size, and how it is read when that is not data.source (a
    .jsonl file under source: text; caches captured before the format followed the file read it as text)."""
    entry: dict[str, Any] = {"file": str(Path(path).resolve()), "bytes": os.path.getsize(path)}
    if file_format(path, source) != source:
        entry["read_as"] = file_format(path, source)
    return entry


# ----------------------------------------------------------------------------------------------------------------
# Writing


class ShardWriter:
    """Collects captured batches on the CPU and writes them as shards of `per_shard` whole sequences."""

    def __init__(self, folder: Path, layers: list[int], dtype: torch.dtype, per_shard: int, *,
                 first_sequence: int = 0, rank: int | None = None) -> None:
        """`first_sequence`: the stream index of the first sequence added (a process's share of a multi-process
        capture starts there); `rank`: that process's rank, in its shards' names so that no two processes' shards
        collide (None: a one-process capture's names)."""
        self.folder, self.layers, self.dtype, self.per_shard = folder, layers, dtype, per_shard
        self.first_sequence, self.rank = first_sequence, rank
        self.ids: list[torch.Tensor] = []  # (B, T) each
        self.pairs: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in layers}
        self.shards: list[dict[str, Any]] = []
        self.sequences = 0

    def add(self, input_ids: torch.Tensor, pairs: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """input_ids (B, T); pairs layer -> (x, y), each (B*T, d) in the base model's dtype."""
        self.ids.append(input_ids.cpu())
        for i in self.layers:
            x, y = pairs[i]
            stored = x.to("cpu", self.dtype), y.to("cpu", self.dtype)
            if x.dtype != self.dtype and not all(torch.isfinite(t).all() for t in stored):  # a narrower dtype
                raise CacheError(
                    f"layer {i}'s activations overflow {self.dtype} (values beyond its range became inf); capture "
                    "with --dtype bfloat16 or float32"
                )
            self.pairs[i].append(stored)
        while sum(len(b) for b in self.ids) >= self.per_shard:
            self._write(self.per_shard)

    def close(self) -> None:
        if self.ids:
            self._write(sum(len(b) for b in self.ids))

    def _write(self, n: int) -> None:
        """Write the first `n` buffered sequences as the next shard."""
        ids = torch.cat(self.ids)  # (S, T)
        t = ids.shape[1]
        tensors = {"input_ids": ids[:n].to(torch.int32).contiguous()}
        self.ids = [ids[n:]] if len(ids) > n else []
        for i in self.layers:
            x = torch.cat([a for a, _ in self.pairs[i]])  # (S*T, d_in)
            y = torch.cat([b for _, b in self.pairs[i]])  # (S*T, d_out)
            tensors[f"layer.{i}.x"], tensors[f"layer.{i}.y"] = x[: n * t].contiguous(), y[: n * t].contiguous()
            self.pairs[i] = [(x[n * t :], y[n * t :])] if len(ids) > n else []
        from safetensors.torch import save_file

        path = self.folder / _shard_name(len(self.shards), self.rank)
        first = self.first_sequence + self.sequences
        save_file(tensors, str(path), metadata={"first_sequence": str(first), "sequences": str(n)})
        self.shards.append({"file": path.name, "sequences": n, "tokens": n * t, "bytes": path.stat().st_size,
                            "sha256": _sha256(path)})
        self.sequences += n


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def cache_manifest(recipe, layers: list[int], *, d_model: int, storage_dtype: str, device, shards: list[dict],
                   wanted: int, capture_batch_sequences: int, base_loaded: dict[str, Any] | None = None,
                   processes: int = 1) -> dict[str, Any]:
    """cache.json of a finished capture: what produced the pairs (compared by `ActivationCache.mismatches`), the
    `shards` written (ShardWriter.shards; of every process, in stream order), whether the train split ran out before
    the `wanted` sequences, and the sequences per capture forward (as resolved from train.capture_batch_sequences).

    Recorded, never compared (a cache's pairs do not depend on them, and caches without them still open):
    `base_loaded`, which of the base model's blocks were loaded ({"blocks": [0, L], "of": N, "head": bool}), and the
    `processes` that wrote the shards."""
    from expertize import __version__
    from importlib import metadata

    data, t = recipe.data, recipe.data.context_length
    sequences = sum(shard["sequences"] for shard in shards)
    return {
        "format": CACHE_FORMAT,
        "expertize": __version__,
        "packages": {name: metadata.version(name) for name in ("torch", "transformers", "safetensors")},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base": _base_identity(recipe),
        "layers": layers,
        "d_model": d_model,
        "storage_dtype": storage_dtype,
        "device": str(device),
        "capture_batch_sequences": capture_batch_sequences,
        "stream": stream_identity(data),
        "data": {k: v for k, v in dataclasses.asdict(data).items() if k != "activation_cache"},
        "context_length": t,
        "train_tokens": data.train_tokens,
        "sequences": sequences,
        "tokens": sequences * t,
        "exhausted": sequences < wanted,
        "shards": shards,
        **({"base_loaded": base_loaded} if base_loaded is not None else {}),
        "processes": processes,
    }


# ----------------------------------------------------------------------------------------------------------------
# Reading


class ActivationCache:
    """A complete cache folder: its manifest and random access to whole sequences."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        fix = (f"write it with `expertize capture RECIPE --output {self.folder}`, or remove data.activation_cache "
               "to capture while training")
        if not self.folder.is_dir():
            raise CacheError(f"data.activation_cache: there is no folder {self.folder}; {fix}")
        manifest = self.folder / CACHE_MANIFEST
        if not manifest.is_file():
            raise CacheError(
                f"data.activation_cache: {self.folder} holds no {CACHE_MANIFEST}, so it is not a complete activation "
                f"cache (an interrupted capture); delete it and {fix}"
            )
        self.manifest = json.loads(manifest.read_text(encoding="utf-8"))
        if self.manifest.get("format") != CACHE_FORMAT:
            raise CacheError(
                f"data.activation_cache: {self.folder} has cache format {self.manifest.get('format')!r}, this "
                f"expertize reads format {CACHE_FORMAT}; capture it again ({fix})"
            )
        for shard in self.manifest["shards"]:
            path = self.folder / shard["file"]
            if not path.is_file():
                raise CacheError(f"data.activation_cache: shard {path} is missing; delete the cache and {fix}")
            if path.stat().st_size != shard["bytes"]:
                raise CacheError(
                    f"data.activation_cache: shard {path} is damaged: {path.stat().st_size:,} bytes where cache.json "
                    f"recorded {shard['bytes']:,} (truncated or overwritten); delete the cache and {fix}"
                )
        self._fix = fix
        self._verified: set[int] = set()
        self.context_length = self.manifest["context_length"]
        self.layers = list(self.manifest["layers"])
        self.sequences = self.manifest["sequences"]
        counts = [s["sequences"] for s in self.manifest["shards"]]
        self._starts = [sum(counts[:i]) for i in range(len(counts))]  # first sequence of each shard
        self._open: dict[int, Any] = {}

    def mismatches(self, recipe, layer_ids: Collection[int], world_size: int = 1) -> list[str]:
        """What differs between the cache and the recipe, one line each (empty: the cache serves this recipe, on
        `world_size` processes)."""
        m, out = self.manifest, []
        for key, want in _base_identity(recipe).items():
            have = m["base"].get(key, LEGACY_BASE.get(key))
            if have != want:
                name = f"train.{key}" if key in LEGACY_BASE else key
                out.append(f"{name} (cache: {have!r}, recipe: {want!r})")
        missing = sorted(set(layer_ids) - set(self.layers))
        if missing:
            out.append(f"layers (the cache holds {self.layers}, the recipe also needs {missing})")
        want = stream_identity(recipe.data)
        for key in sorted(set(want) | set(m["stream"])):
            have = m["stream"].get(key, LEGACY_STREAM.get(key))
            if have != want.get(key):
                name = ("data.paths (the corpus files or their sizes, data.eval_paths' too)" if key == "corpus"
                        else f"data.{key}")
                out.append(f"{name} (cache: {have!r}, recipe: {want.get(key)!r})")
        t = recipe.data.context_length
        needed = stream_sequences(recipe.data.train_tokens, t, world_size)
        if self.sequences < needed and not m["exhausted"]:
            processes = f" on {world_size} processes" if needed > token_budget_to_sequences(recipe.data.train_tokens, t) else ""
            out.append(f"data.train_tokens (the cache holds {m['tokens']:,} tokens, the recipe needs "
                       f"{needed * t:,}{processes})")
        return out

    def check_matches(self, recipe, layer_ids: Collection[int], world_size: int = 1) -> None:
        differs = self.mismatches(recipe, layer_ids, world_size)
        if differs:
            raise CacheMismatch(
                f"the activation cache {self.folder} was not captured for this recipe; it differs in: "
                f"{'; '.join(differs)}. Capture it again with `expertize capture RECIPE --output DIR` (a new DIR) and "
                "point data.activation_cache at it, or remove data.activation_cache to capture while training"
            )

    def verify_shard(self, index: int) -> None:
        """CacheCorrupted when shard `index`'s sha256 differs from cache.json's (checked once per shard)."""
        if index in self._verified:
            return
        shard = self.manifest["shards"][index]
        path = self.folder / shard["file"]
        digest = _sha256(path)
        if digest != shard["sha256"]:
            raise CacheCorrupted(
                f"data.activation_cache: shard {path} is damaged: its sha256 is {digest[:12]}..., cache.json "
                f"recorded {shard['sha256'][:12]}... (same size: overwritten in place or corrupted on disk), so its "
                f"activations cannot be trusted. Delete {self.folder} and {self._fix}; the run's checkpoint is "
                "kept, so the same command then resumes"
            )
        self._verified.add(index)

    def _shard(self, index: int):
        if index not in self._open:
            from safetensors import safe_open

            self.verify_shard(index)
            if len(self._open) >= 4:  # memory maps of the shards in use, not of the whole cache
                self._open.pop(next(iter(self._open)))
            self._open[index] = safe_open(str(self.folder / self.manifest["shards"][index]["file"]), framework="pt")
        return self._open[index]

    def read(
        self, sequences: list[int], layers: list[int], device: torch.device, dtype: torch.dtype
    ) -> tuple[Batch, torch.Tensor]:
        """The rows of `sequences` (ascending indices) at `layers`, in that order: (layer -> (x, y), each
        (len * T, d), on `device` in `dtype`; input_ids (len, T) long, on the host)."""
        t = self.context_length
        parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in layers}
        ids = []
        by_shard: dict[int, list[int]] = {}
        for s in sequences:
            by_shard.setdefault(bisect.bisect_right(self._starts, s) - 1, []).append(s)
        for index, wanted in by_shard.items():
            local = torch.tensor(wanted) - self._starts[index]  # (n,) sequence indices inside the shard
            lo, hi = int(local[0]), int(local[-1]) + 1  # read the contiguous range, keep the wanted ones
            pick = local - lo  # (n,)
            f = self._shard(index)
            ids.append(f.get_slice("input_ids")[lo:hi][pick])  # (n, T)

            def rows(key: str) -> torch.Tensor:
                block = f.get_slice(key)[lo * t : hi * t]  # ((hi - lo) * T, d)
                return block.view(hi - lo, t, -1)[pick].reshape(-1, block.shape[-1])  # (n * T, d)

            for i in layers:
                parts[i].append((rows(f"layer.{i}.x"), rows(f"layer.{i}.y")))
        data = {
            i: (to_device(torch.cat([x for x, _ in ps]), device).to(dtype),
                to_device(torch.cat([y for _, y in ps]), device).to(dtype))
            for i, ps in parts.items()
        }
        return data, torch.cat(ids).long()


class CachedActivationBatches(ActivationBatches):
    """`ActivationBatches` over a cache: the same chunks, shuffle, steps, exclusions, ranks and resume; the rows come
    from the shards (cast to `dtype`, the base model's, as a live capture yields them)."""

    def __init__(self, cache: ActivationCache, layers: list[int], *, num_sequences: int, dtype: torch.dtype,
                 **settings) -> None:
        """`settings`: ActivationBatches' keywords (context_length, tokens_per_step, shuffle_buffer_tokens, seed,
        device, rank, world_size, exclude_token_ids); the stream is the cache's first `num_sequences` sequences."""
        total = min(num_sequences, cache.sequences)
        super().__init__(None, lambda start: iter(range(start, total)), capture_batch_sequences=1, **settings)
        self.cache, self.layers, self.dtype = cache, sorted(layers), dtype

    prefetch_sequences = False  # the stream is sequence indices; the rows are read by `_rows`

    def _rows(self, mine: list[int]) -> tuple[Batch, torch.Tensor | None]:
        data, input_ids = self.cache.read(mine, self.layers, self.device, self.dtype)
        return data, kept_positions(input_ids, self.exclude_token_ids)


def open_matching_cache(recipe, layer_ids: Collection[int], world_size: int = 1) -> ActivationCache | None:
    """The cache named by data.activation_cache, checked against the recipe run on `world_size` processes
    (CacheError / CacheMismatch); None when the recipe captures while training."""
    if recipe.data.activation_cache is None or not recipe.train.distill:
        return None
    cache = ActivationCache(recipe.data.activation_cache)
    cache.check_matches(recipe, layer_ids, world_size)
    return cache


def cached_batches(
    cache: ActivationCache, recipe, base, tokenizer, layer_ids: list[int], total_steps: int, device: torch.device,
    *, rank: int = 0, world_size: int = 1,
) -> CachedActivationBatches:
    """`streams.activation_batches`' stream, read from `cache` (same arguments after it)."""
    from .mlp_pairs import excluded_token_ids

    train, data = recipe.train, recipe.data
    return CachedActivationBatches(
        cache, layer_ids,
        num_sequences=stream_sequences(data.train_tokens, data.context_length, world_size),
        dtype=next(base.parameters()).dtype,
        context_length=data.context_length,
        tokens_per_step=train.tokens_per_step,
        shuffle_buffer_tokens=min(train.shuffle_buffer_tokens, total_steps * train.tokens_per_step),
        seed=train.seed,
        device=device,
        rank=rank,
        world_size=world_size,
        exclude_token_ids=excluded_token_ids(data, tokenizer),
    )
