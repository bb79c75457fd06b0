"""`expertize capture RECIPE --output DIR`: capture a recipe's MLP inputs/outputs once into an activation cache
that many `upcycle` runs train from (data.activation_cache). The command: preflight's checks, the base model's
forwards over the train stream, a staging folder renamed into place when complete. The cache's format (shards,
manifest, reading, matching a recipe) is conversion/data/cache.py's.

The base is loaded only as deep as the last target layer (surgery/trunk.py): the forward stops there anyway.

Under torchrun / accelerate launch (WORLD_SIZE > 1) the processes write one cache together: the stream's capture
batches are dealt out in contiguous runs, rank 0 the first, so every process forwards exactly the batches a
one-process capture would and the shards, listed rank after rank, hold the one-process stream in its order. Each
process writes its own shards into the shared staging folder; rank 0 writes the manifest and renames the folder
once every process has finished (a failure anywhere removes it).
"""

import itertools
import math
import os
import shutil
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .checks import check_output_location
from .data.cache import CACHE_MANIFEST, SHARD_BYTES, STORAGE_DTYPES, CacheError, ShardWriter, cache_manifest
from .data.mlp_pairs import MlpCapture, capture_batch_size
from .data.text import batch_sequences
from .data.token_cache import train_sequences
from .device import world_size
from .errors import RunFailed
from .preflight import plan_run
from .publishing.run_folder import write_json
from .recipe import Recipe
from .recipe.data import token_budget_to_sequences
from .surgery.trunk import load_base_trunk
from .training.compute import matmul_precision

__all__ = ["capture_activations"]

RANK_TIMEOUT = timedelta(days=2)
"""How long a process waits for the others (torch.distributed's 30 minutes would end a long capture whose ranks
finish minutes apart). A process that dies makes torchrun stop the others, so this is no hang in practice."""


def capture_activations(
    recipe: Recipe, output: str | os.PathLike | None = None, *, dtype: str | None = None,
    shard_tokens: int | None = None, log: Callable[[str], None] | None = None, progress: bool = False,
) -> Path:
    """Capture the recipe's train stream at its target layers into the cache folder `output` (default
    data.activation_cache), stored as `dtype` (default: the base model's, recipe.dtype); returns the folder.
    `progress`: a bar over the sequences (as upcycle's over steps) instead of a `log` line per shard.

    The base model runs in recipe.dtype on train.device under no_grad, with the recipe's capture precision, TF32
    setting and sequences per forward (train.capture_precision, tf32, capture_batch_sequences), as a live run. Shards
    of `shard_tokens` tokens (rounded up to whole sequences; default ~256 MiB). Under a multi-process launch every
    process calls this with the same arguments (module docstring); rank 0 logs."""
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
    # The recipe's checks (base, layers, placement, corpus budget), as `upcycle` makes them; not the layers'
    # training memory: a capture trains nothing (the cache does not depend on the layer: section).
    plan = plan_run(recipe, check_layer_memory=False)
    data, t = recipe.data, recipe.data.context_length
    wanted = token_budget_to_sequences(data.train_tokens, t)
    storage = getattr(torch, dtype)
    d = plan.shape.d_model  # the MLP reads and writes the residual width
    bytes_per_token = len(plan.layer_ids) * 2 * d * storage.itemsize + 4  # x and y per layer, int32 token id
    # The staging folder beside `output` receives every shard: writable, with room for them, before the base loads.
    check_output_location(output, what="--output", need_bytes=bytes_per_token * wanted * t)
    processes = world_size()
    setting, base_dtype = recipe.train.capture_batch_sequences, getattr(torch, recipe.dtype)
    if processes > 1:
        _check_launch(processes)
        if setting != "auto" or plan.device.type != "cuda":  # known before the base loads: refuse now
            per_forward = capture_batch_size(setting, plan.base_config, t, plan.device, max_sequences=wanted)
            _share(wanted, per_forward, 0, processes)
    per_shard = (
        max(1, SHARD_BYTES // (bytes_per_token * t)) if shard_tokens is None else max(1, math.ceil(shard_tokens / t))
    )
    with _Ranks(processes) as ranks:
        say = (log or (lambda message: None)) if ranks.rank == 0 else (lambda message: None)
        base, loaded = load_base_trunk(recipe.base_model, max(plan.layer_ids) + 1, dtype=base_dtype,
                                       placement=plan.placement)
        base = (base if plan.placement is not None else base.to(plan.device)).eval()  # a spread base stays put
        base.requires_grad_(False)
        per_forward = ranks.minimum(capture_batch_size(  # "auto" may differ by a GPU's free memory: agree
            setting, base.config, t, plan.device, itemsize=base_dtype.itemsize, max_sequences=wanted))
        first, stop = _share(wanted, per_forward, ranks.rank, processes)
        staging = output.parent / f".{output.name}.partial"
        if ranks.rank == 0:
            if staging.exists():  # left by a capture killed before it finished
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        ranks.barrier()  # the staging folder exists for every process
        try:
            failure = None
            try:
                writer = ShardWriter(staging, plan.layer_ids, storage, per_shard, first_sequence=first,
                                     rank=ranks.rank if processes > 1 else None)
                _capture_share(recipe, plan, base, writer, first, stop, per_forward, say=say,
                               progress=progress and ranks.rank == 0, write_token_cache=processes == 1)
                share = (writer.shards, first, stop)
            except Exception as err:  # the others must hear of it, and rank 0 then removes the staging folder
                if processes == 1:
                    raise
                failure, share = err, f"rank {ranks.rank}: {err}"
            shares = ranks.gather(share)
            if ranks.rank == 0 and failure is None:
                try:
                    manifest = _publish(staging, output, shares, lambda shards: cache_manifest(
                        recipe, plan.layer_ids, d_model=d, storage_dtype=dtype, device=plan.device, shards=shards,
                        wanted=wanted, capture_batch_sequences=per_forward, base_loaded=loaded, processes=processes))
                except Exception as err:
                    if processes == 1:
                        raise
                    failure = err
            if ranks.rank == 0 and failure is not None:  # now: once the others hear it, torchrun may stop us
                shutil.rmtree(staging, ignore_errors=True)
            verdict = ranks.broadcast(None if failure is None else _failed_message(failure, ranks.rank))  # rank 0's
            if failure is not None:
                raise failure
            if verdict is not None:
                raise CaptureFailed(verdict)
        except BaseException:
            if ranks.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            raise
    if ranks.rank == 0:
        say(f"capture: wrote {manifest['tokens']:,} tokens of layer(s) {plan.layer_ids} as {dtype} to {output}"
            + (f" from {processes} processes" if processes > 1 else ""))
    return output


def _capture_share(recipe: Recipe, plan, base, writer: ShardWriter, first: int, stop: int, per_forward: int, *,
                   say: Callable[[str], None], progress: bool, write_token_cache: bool) -> None:
    """Forward the stream's sequences [first, stop) in batches of `per_forward` and hand the pairs to `writer`.
    `write_token_cache`: only a one-process capture writes data.token_cache (it reads the whole stream; a share of
    it is not an entry)."""
    t = recipe.data.context_length
    capture = MlpCapture(base, plan.layer_ids, precision=recipe.train.capture_precision)
    sequences = train_sequences(recipe.data, plan.tokenizer, write=write_token_cache)(first)
    logged = 0
    with torch.no_grad(), matmul_precision(plan.device, recipe.train.tf32), \
            tqdm(total=stop - first, desc="capture", unit="seq", disable=not progress) as bar:
        for input_ids in batch_sequences(itertools.islice(sequences, stop - first), per_forward):  # (B, T)
            writer.add(input_ids, capture(input_ids.to(plan.device)))
            bar.update(len(input_ids))
            if len(writer.shards) > logged:
                logged = len(writer.shards)
                bar.set_postfix_str(f"{logged} shard(s) written")
                if not progress:
                    say(f"capture: {writer.sequences * t:,} / {(stop - first) * t:,} tokens ({logged} shard(s))")
    writer.close()


def _share(wanted: int, per_forward: int, rank: int, processes: int) -> tuple[int, int]:
    """The stream sequences [first, stop) process `rank` of `processes` captures: a contiguous run of whole capture
    batches (the one-process capture's batches, so each sequence is forwarded with the same neighbours)."""
    batches = math.ceil(wanted / per_forward)
    if batches < processes:
        raise CacheError(
            f"data.train_tokens gives {wanted:,} sequences, {batches} capture batch(es) of {per_forward} "
            f"(train.capture_batch_sequences), fewer than the {processes} processes: each process captures whole "
            "batches; launch fewer processes, lower train.capture_batch_sequences or raise data.train_tokens"
        )
    return (min(rank * batches // processes * per_forward, wanted),
            min((rank + 1) * batches // processes * per_forward, wanted))


def _publish(staging: Path, output: Path, shares: list, manifest_of: Callable[[list], dict]) -> dict[str, Any]:
    """Rank 0, once every process has finished: the manifest of the processes' shards (`shares`: gathered, in rank
    order) written into `staging`, renamed to `output`; returns the manifest."""
    shards = _stream_shards(shares, staging)
    if not shards:
        raise CacheError("the train split gave no sequence; add text or lower data.context_length")
    manifest = manifest_of(shards)
    write_json(staging / CACHE_MANIFEST, manifest)  # last: a folder without it is incomplete
    os.replace(staging, output)
    return manifest


def _stream_shards(shares: list, staging: Path) -> list[dict[str, Any]]:
    """Every process's shards, rank after rank (the stream's order), once each is found in `staging` as written;
    CacheError for a process that failed, a shard this process cannot see, or shares that do not join up."""
    failed = [share for share in shares if isinstance(share, str)]
    if failed:
        raise CaptureFailed(f"the capture failed on {'; '.join(failed)}; nothing was kept, run it again once fixed")
    shards, end = [], 0
    for rank, (written, first, stop) in enumerate(shares):
        count = sum(shard["sequences"] for shard in written)
        if count and first != end:  # an earlier share came up short (the split ran out) but this one did not
            raise CacheError(f"rank {rank} captured sequences from {first:,} but the stream before it ended at "
                             f"{end:,}: the processes read different train streams (another corpus or tokenizer?)")
        for shard in written:
            path = staging / shard["file"]
            if not path.is_file() or path.stat().st_size != shard["bytes"]:
                raise CacheError(
                    f"rank {rank}'s shard {shard['file']} is not in {staging} as rank 0 sees it: every process "
                    "must write to the same folder (--output on a file system all nodes share)"
                )
        shards += written
        end = first + count
    return shards


def _failed_message(failure: Exception, rank: int) -> str:
    if isinstance(failure, CaptureFailed):
        return str(failure)
    return f"the capture failed on rank {rank}: {failure}; nothing was kept, run it again once fixed"


def _check_launch(processes: int) -> None:
    missing = [key for key in ("RANK", "MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
    if missing:
        raise CacheError(
            f"WORLD_SIZE={processes} but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: "
            "launch a multi-process capture with `torchrun --nproc_per_node N -m expertize capture ...` (or "
            "accelerate launch), or unset WORLD_SIZE"
        )


class CaptureFailed(CacheError, RunFailed):
    """A multi-process capture that failed on some process after the work started; nothing is kept (exit 1)."""


class _Ranks:
    """This process's place among the capture's processes and the few collectives it needs. They carry small host
    objects, so they run on gloo whatever device captures (a group of its own when the launch set up another)."""

    def __init__(self, processes: int) -> None:
        self.processes, self.rank, self.group, self._owned = processes, 0, None, False

    def __enter__(self) -> "_Ranks":
        if self.processes > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
                self._owned = True
            elif dist.get_backend() != "gloo":
                self.group = dist.new_group(backend="gloo", timeout=RANK_TIMEOUT)
            self.rank = dist.get_rank()
        return self

    def __exit__(self, *exc) -> None:
        if self._owned:
            import torch.distributed as dist

            dist.destroy_process_group()

    def minimum(self, value: int) -> int:
        if self.processes == 1:
            return value
        import torch.distributed as dist

        tensor = torch.tensor([value])
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor)

    def barrier(self) -> None:
        if self.processes > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def gather(self, value: Any) -> list | None:
        """Every process's `value`, in rank order, on rank 0 (None elsewhere)."""
        if self.processes == 1:
            return [value]
        import torch.distributed as dist

        values = [None] * self.processes if self.rank == 0 else None
        dist.gather_object(value, values, dst=0, group=self.group)
        return values

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every process."""
        if self.processes == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
