"""`expertize capture RECIPE --output DIR`: capture a recipe's MLP inputs/outputs once into an activation cache
that many `upcycle` runs train from (data.activation_cache). The command: preflight's checks, the base model's
forwards over the train stream, a staging folder renamed into place when complete. The cache's format (shards,
manifest, reading, matching a recipe) is conversion/data/cache.py's.
"""

import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .checks import check_output_location
from .data.cache import CACHE_MANIFEST, SHARD_BYTES, STORAGE_DTYPES, CacheError, ShardWriter, cache_manifest
from .data.mlp_pairs import MlpCapture, capture_batch_size
from .data.text import batch_sequences
from .data.token_cache import train_sequences
from .preflight import plan_run
from .publishing.run_folder import write_json
from .recipe import Recipe
from .recipe.data import token_budget_to_sequences
from .surgery.splice import load_base_model
from .training.compute import matmul_precision

__all__ = ["capture_activations"]


def capture_activations(
    recipe: Recipe, output: str | os.PathLike | None = None, *, dtype: str | None = None,
    shard_tokens: int | None = None, log: Callable[[str], None] | None = None, progress: bool = False,
) -> Path:
    """Capture the recipe's train stream at its target layers into the cache folder `output` (default
    data.activation_cache), stored as `dtype` (default: the base model's, recipe.dtype); returns the folder.
    `progress`: a bar over the sequences (as upcycle's over steps) instead of a `log` line per shard.

    The base model runs in recipe.dtype on train.device under no_grad, with the recipe's capture precision, TF32
    setting and sequences per forward (train.capture_precision, tf32, capture_batch_sequences), as a live run. Shards
    of `shard_tokens` tokens (rounded up to whole sequences; default ~256 MiB)."""
    say = log or (lambda message: None)
    target = output if output is not None else recipe.data.activation_cache
    if target is None:
        raise CacheError("no cache folder: give --output DIR (or set data.activation_cache in the recipe)")
    output = Path(target)
    dtype = dtype or recipe.dtype
    if dtype not in STORAGE_DTYPES:
        raise CacheError(f"cache dtype must be one of {list(STORAGE_DTYPES)}, got {dtype!r}")
    if output.exists():
        raise CacheError(
            f"{output} already exists; a cache is never overwritten: choose another --output or delete the folder"
        )
    if not recipe.train.distill:
        raise CacheError("train.distill is false, so no run reads captured activations; nothing to capture")
    if shard_tokens is not None and shard_tokens < 1:
        raise CacheError(f"--shard-tokens must be 1 or more (tokens per shard file), got {shard_tokens}")
    plan = plan_run(recipe)  # the recipe's checks (base, layers, corpus budget), as `upcycle` makes them
    data, t = recipe.data, recipe.data.context_length
    wanted = token_budget_to_sequences(data.train_tokens, t)
    storage = getattr(torch, dtype)
    d = plan.shape.d_model  # the MLP reads and writes the residual width
    bytes_per_token = len(plan.layer_ids) * 2 * d * storage.itemsize + 4  # x and y per layer, int32 token id
    # The staging folder beside `output` receives every shard: writable, with room for them, before the base loads.
    check_output_location(output, what="--output", need_bytes=bytes_per_token * wanted * t)
    base = load_base_model(recipe.base_model, dtype=getattr(torch, recipe.dtype)).to(plan.device).eval()
    base.requires_grad_(False)
    per_forward = capture_batch_size(recipe.train.capture_batch_sequences, base.config, t, plan.device,
                                     itemsize=next(base.parameters()).element_size(), max_sequences=wanted)
    per_shard = (
        max(1, SHARD_BYTES // (bytes_per_token * t)) if shard_tokens is None else max(1, math.ceil(shard_tokens / t))
    )
    staging = output.parent / f".{output.name}.partial"
    if staging.exists():  # left by a capture killed before it finished
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        writer = ShardWriter(staging, plan.layer_ids, storage, per_shard)
        capture = MlpCapture(base, plan.layer_ids, precision=recipe.train.capture_precision)
        sequences = train_sequences(data, plan.tokenizer)(0)
        logged = 0
        with torch.no_grad(), matmul_precision(plan.device, recipe.train.tf32), \
                tqdm(total=wanted, desc="capture", unit="seq", disable=not progress) as bar:
            for input_ids in batch_sequences(sequences, per_forward):  # (B, T)
                writer.add(input_ids, capture(input_ids.to(plan.device)))
                bar.update(len(input_ids))
                if len(writer.shards) > logged:
                    logged = len(writer.shards)
                    bar.set_postfix_str(f"{logged} shard(s) written")
                    if not progress:
                        say(f"capture: {writer.sequences * t:,} / {wanted * t:,} tokens ({logged} shard(s))")
        writer.close()
        if not writer.sequences:
            raise CacheError("the train split gave no sequence; add text or lower data.context_length")
        manifest = cache_manifest(recipe, plan.layer_ids, d_model=d, storage_dtype=dtype, device=plan.device,
                                  writer=writer, wanted=wanted, capture_batch_sequences=per_forward)
        write_json(staging / CACHE_MANIFEST, manifest)  # last: a folder without it is incomplete
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    say(f"capture: wrote {manifest['tokens']:,} tokens of layer(s) {plan.layer_ids} as {dtype} to {output}")
    return output
