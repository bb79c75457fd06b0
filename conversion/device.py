"""`train.device` and every command's `--device`: which device to use, refused up front when the machine (or this
launch) does not have it. One resolver for every command, so a device is named, checked and refused the same way
everywhere (`expertize upcycle`, `capture`, `eval`, `inspect`, `specialize`):

    auto     cuda if available, else mps if available, else cpu
    cpu      the CPU
    cuda     the first visible GPU (under torchrun / accelerate launch: each process's local GPU)
    cuda:N   GPU N (single process only: a multi-process launch gives each rank its own GPU)
    mps      Apple silicon
"""

import os
import re
from contextlib import contextmanager

import torch

from .errors import ExpertizeError

CHOICES = "auto, cpu, cuda, cuda:N or mps"


def world_size() -> int:
    """Processes of this launch (torchrun / accelerate launch set WORLD_SIZE; 1 for a plain `python -m`)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def available_devices() -> str:
    """What this machine offers, in words, for error messages."""
    found = ["cpu"]
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        found.append(f"cuda (cuda:0 to cuda:{n - 1})" if n > 1 else "cuda (cuda:0)")
    if _mps_available():
        found.append("mps")
    return ", ".join(found)


def resolve_device(name: "str | torch.device", setting: str = "train.device") -> torch.device:
    """The `torch.device` for a device name; ExpertizeError (naming what is available and the fix) when this machine
    or this launch cannot provide it. `setting` is what the user wrote it in: a recipe key ("train.device") or a
    command-line flag ("--device"); messages name it and the fix in the same form."""
    if isinstance(name, torch.device):
        name = str(name)
    text = str(name).strip().lower()
    match = re.fullmatch(r"(auto|cpu|cuda|mps)(?::(\d+))?", text)
    if not match or (match[2] is not None and match[1] != "cuda"):
        raise ExpertizeError(f"{_named(setting, name)} is not a device; use one of {CHOICES}")
    kind, index = match[1], None if match[2] is None else int(match[2])
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "mps" if _mps_available() else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "mps":
        if not _mps_available():
            raise _unavailable(name, setting, "this machine has no usable Apple MPS device")
        if world_size() > 1:
            raise ExpertizeError(
                f"{_named(setting, name)}: MPS runs a single process, but this launch has {world_size()}; run "
                f"without torchrun / accelerate launch, or use {_use(setting, 'cpu')}"
            )
        return torch.device("mps")
    if not torch.cuda.is_available():
        raise _unavailable(name, setting, "this machine has no usable CUDA GPU (torch.cuda.is_available() is False)")
    count = torch.cuda.device_count()
    if world_size() > 1:
        if index is not None:
            raise ExpertizeError(
                f"{_named(setting, name)} names one GPU, but this launch has {world_size()} processes and each uses "
                f"its own local GPU; use {_use(setting, 'cuda')} (or auto), and choose GPUs with CUDA_VISIBLE_DEVICES"
            )
        return torch.device("cuda", local_rank() % count)
    if index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if index >= count:
        raise _unavailable(name, setting, f"this machine has {count} visible GPU{'s' if count != 1 else ''}")
    return torch.device("cuda", index)


def make_accelerator(device: torch.device):
    """An accelerate `Accelerator` whose `.device` is `device` (from `resolve_device`).

    Accelerate by itself picks "cpu" or its default device (cuda, i.e. the current GPU, or mps), so a single process
    is pinned here: the current CUDA device is set (so that bare "cuda" tensors land there too) and accelerate is
    told the exact device through ACCELERATE_TORCH_DEVICE, which it reads when its state is first created. Under a
    multi-process launch every rank already uses its local GPU (or the CPU with cpu=True).
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    cpu = device.type == "cpu"
    if world_size() > 1:
        accelerator = Accelerator(cpu=cpu)
    else:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if PartialState._shared_state and PartialState().device != device:
            # A previous run in this process (e.g. a test or a notebook) set up accelerate for another device.
            AcceleratorState._reset_state(reset_partial_state=True)
        with _env("ACCELERATE_TORCH_DEVICE", str(device)):
            accelerator = Accelerator(cpu=cpu)
    if accelerator.device.type != device.type or (
        device.index is not None and accelerator.device.index not in (None, device.index)
    ):
        raise ExpertizeError(
            f"accelerate chose {accelerator.device} instead of train.device={device}; check ACCELERATE_* environment "
            "variables and the accelerate config, or set train.device to match"
        )
    return accelerator


def _named(setting: str, name: object) -> str:
    """The value as the user wrote it: `train.device='gpu0'` (a recipe key), `--device 'gpu0'` (a flag)."""
    return f"{setting} {str(name)!r}" if setting.startswith("-") else f"{setting}={str(name)!r}"


def _use(setting: str, value: str) -> str:
    """The corrected setting, in the form the user gives it: `--device cpu`, or `--set train.device=cpu`."""
    return f"{setting} {value}" if setting.startswith("-") else f"--set {setting}={value}"


def _unavailable(name: object, setting: str, why: str) -> ExpertizeError:
    return ExpertizeError(
        f"{_named(setting, name)} is not available: {why}; this machine offers {available_devices()}. Use "
        f"{_use(setting, 'auto')} (or cpu) to run on what is here"
    )


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available() and mps.is_built())


@contextmanager
def _env(key: str, value: str):
    previous = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous
