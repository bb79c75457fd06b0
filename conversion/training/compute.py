"""How a run's arithmetic runs on its device: the speed settings of the recipe's `train:` section, checked up front
(`check_precision`), applied where they act, and recorded in provenance.json (`compute_record`) so that a run says
which arithmetic produced it.

    train.tf32                 fp32 matmuls on a CUDA GPU with TF32 tensor cores (compute capability 8.0 and up:
                               A100, H100, ...) run in TF32 while capturing and training (`matmul_precision`);
                               the evaluation always runs in full fp32. No effect on a CPU.
    train.capture_precision    "bf16": the base model's capture forward under bf16 autocast (data/mlp_pairs.py's
                               `MlpCapture`); the pairs are handed on in the base model's dtype
    train.capture_batch_sequences: auto   sequences per capture forward from the device's memory (data/mlp_pairs.py)
    train.compile              torch.compile of the sparse layers' forward (`compile_layers`)
    AdamW                      `fused=True` wherever torch has the fused kernel for the parameters' device (CUDA,
                               CPU): one kernel per step instead of a loop over parameters (`make_adamw`)
"""

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ..errors import ExpertizeError

FUSED_ADAMW_DEVICES = ("cuda", "cpu")
"""Devices whose parameters torch's AdamW steps with one fused kernel (torch >= 2.4 for the CPU)."""


def tf32_supported(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU with TF32 tensor cores (compute capability 8.0 or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def tf32_in_effect(device: torch.device, tf32: bool) -> bool:
    """Whether a run with `train.tf32 = tf32` multiplies fp32 matrices in TF32 on `device`."""
    return bool(tf32) and tf32_supported(device)


@contextlib.contextmanager
def matmul_precision(device: torch.device, tf32: bool) -> Iterator[bool]:
    """Run the block with TF32 fp32 matmuls on `device` when `tf32` and the GPU has them; yields whether it does, and
    restores the previous setting afterwards (the library never leaves a process-wide switch changed).

    torch >= 2.9 has a CUDA-only switch (`torch.backends.cuda.matmul.fp32_precision`); older versions the legacy
    `allow_tf32`. `torch.set_float32_matmul_precision` is not used: it also lets CPU matmuls drop precision on CPUs
    with bf16 units."""
    on = tf32_in_effect(device, tf32)
    if not on:
        yield False
        return
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")
    previous = matmul.fp32_precision if new_api else matmul.allow_tf32
    if new_api:
        matmul.fp32_precision = "tf32"
    else:
        matmul.allow_tf32 = True
    try:
        yield True
    finally:
        if new_api:
            matmul.fp32_precision = previous
        else:
            matmul.allow_tf32 = previous


def bf16_supported(device: torch.device) -> bool:
    """Whether bf16 autocast runs on `device`: the CPU, and CUDA GPUs with bf16 arithmetic (Ampere and later)."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return False


def check_precision(recipe, device: torch.device) -> None:
    """Refuse, before any work, a bf16 setting the device cannot run (train.precision, train.capture_precision)."""
    train = recipe.train
    for key, value in (("train.precision", train.precision), ("train.capture_precision", train.capture_precision)):
        if value == "bf16" and not bf16_supported(device):
            raise ExpertizeError(
                f"{key}=bf16 needs bf16 arithmetic, which {device} does not have (bf16 autocast runs on the CPU and "
                f"on CUDA GPUs of compute capability 8.0 and up); set {key}: fp32, or use such a device"
            )


def adamw_fused(params: Iterable[nn.Parameter], device: torch.device) -> bool:
    """Whether AdamW steps `params` with torch's fused kernel: every parameter a floating tensor on a device that has
    it (`FUSED_ADAMW_DEVICES`), the engine's device among them."""
    params = list(params)
    return (
        device.type in FUSED_ADAMW_DEVICES
        and bool(params)
        and all(p.is_floating_point() and p.device.type == device.type for p in params)
    )


def make_adamw(params: Iterable, *, lr: float, betas, weight_decay: float, device: torch.device):
    """torch's AdamW over `params`, fused where `adamw_fused` says so (the same update as the per-parameter loop up to
    float rounding: tests/test_compute.py bounds the difference). `params`: parameters, or groups `{"params": [...],
    "lr_scale": s}` whose learning rate is `s * lr` (a schedule scales every group alike); groups at scale 1 are
    merged, so without a scaled group the optimizer (and its state dict) is the one-group optimizer it always was."""
    groups = lr_groups(params)
    flat = [p for group in groups for p in group["params"]]
    fused = adamw_fused(flat, device)
    torch_groups = [{"params": group["params"], "lr": lr * group["lr_scale"]} for group in groups]
    return torch.optim.AdamW(
        torch_groups, lr=lr, betas=tuple(betas), weight_decay=weight_decay, **({"fused": True} if fused else {})
    )


def lr_groups(params: Iterable) -> list[dict]:
    """`params` (parameters or `{"params", "lr_scale"}` groups) as groups, scale-1 parameters first in one group
    (the engine's logged learning rate is the first group's), each other scale in its own, empty groups dropped."""
    by_scale: dict[float, list[nn.Parameter]] = {1.0: []}
    for item in params:
        if isinstance(item, dict):
            by_scale.setdefault(float(item.get("lr_scale", 1.0)), []).extend(item["params"])
        else:
            by_scale[1.0].append(item)
    return [{"params": ps, "lr_scale": scale} for scale, ps in by_scale.items() if ps]


def compile_layers(module: nn.Module, enabled: bool, backend: str = "inductor") -> nn.Module:
    """`module` with its forward compiled by torch.compile when `enabled`, else unchanged. Only the bound `forward` is
    replaced, so the parameters, state-dict keys and the submodules' hooks stay as they are.

    The sparse kernels' backward (modeling/sparse_kernels.py: an embedding_bag's own backward through
    `torch.autograd.grad`) is traced too, with dynamo's `trace_autograd_ops` set for the compiled call only (without
    it every `LinearReluTopK` would break the graph and run eagerly)."""
    if not enabled:
        return module
    compiled = torch.compile(module.forward, backend=backend)
    config = torch._dynamo.config
    traced_grads = hasattr(config, "trace_autograd_ops")  # older torch lacks it: the kernels then run eagerly

    def forward(*args, **kwargs):
        with config.patch(trace_autograd_ops=True) if traced_grads else contextlib.nullcontext():
            return compiled(*args, **kwargs)

    module.forward = forward
    return module


def compute_record(
    recipe, device: "torch.device | str", *, attention: str | None = None, capture_batch_sequences: int | None = None
) -> dict:
    """provenance.json's "compute": the arithmetic of the run's capture and training on `device` as it was in effect,
    not only as asked: TF32, the capture's and the layers' precision, the base model's dtype and attention kernel
    (`attention`: its config's `_attn_implementation`), the sequences per capture forward (`capture_batch_sequences`
    as resolved; None when the pairs came from an activation cache), AdamW's kernel and compilation."""
    device = torch.device(device)
    train = recipe.train
    return {
        "tf32": tf32_in_effect(device, train.tf32),
        "tf32_requested": train.tf32,
        "base_dtype": recipe.dtype,
        "capture_precision": train.capture_precision,
        "layer_precision": train.precision,
        "capture_batch_sequences": capture_batch_sequences,
        "attention": attention,
        "adamw": "fused" if device.type in FUSED_ADAMW_DEVICES else "per-parameter",
        "compile": train.compile,
    }
