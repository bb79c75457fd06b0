"""Shared by the speed benchmarks: round-robin timing, one training step, and the memory autograd saves."""

import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn


def round_robin_times(rows: dict[str, Callable[[], None]], warmup: int, repeats: int) -> dict[str, list[float]]:
    """Seconds of each timed call of each row. Rows alternate within every round, so that slow drifts of a shared
    machine hit every row alike; the first `warmup` rounds are not recorded."""
    times: dict[str, list[float]] = {name: [] for name in rows}
    for r in range(warmup + repeats):
        for name, run in rows.items():
            t0 = time.perf_counter()
            run()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def train_step(
    module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, proj: torch.Tensor | None = None
) -> None:
    """One training step's compute: forward, then backward of the output's sum (or of its product with `proj`)."""
    for p in module.parameters():
        p.grad = None
    x.grad = None
    out = fn(x)
    (out if proj is None else out * proj).sum().backward()


def saved_megabytes(
    module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> tuple[float, torch.Tensor]:
    """MB of distinct tensors autograd saves for backward, other than parameters and the input; and the output."""
    exclude = {p.untyped_storage().data_ptr() for p in module.parameters()} | {x.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    return sum(saved.values()) / 2**20, out.detach()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously), so that a host clock times it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Seconds(NamedTuple):
    """Wall-clock seconds, and the CPU seconds of this process (all its threads) over the same span: on a machine
    shared with other jobs the CPU time is the steadier of the two (it does not count time spent waiting for a core),
    though it counts multi-threaded arithmetic once per thread."""

    wall: float
    cpu: float

    def __add__(self, other: "Seconds") -> "Seconds":  # type: ignore[override]
        return Seconds(self.wall + other.wall, self.cpu + other.cpu)

    def __mul__(self, factor: float) -> "Seconds":  # type: ignore[override]
        return Seconds(self.wall * factor, self.cpu * factor)


def timed(device: torch.device, run: Callable[[], object]) -> tuple[Seconds, object]:
    """(seconds, result) of `run()`, the device synchronized before and after."""
    synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    synchronize(device)
    return Seconds(time.perf_counter() - wall, time.process_time() - cpu), result
