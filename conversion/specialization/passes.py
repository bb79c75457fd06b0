"""Forward passes shared by masking, probing and steering: mean CE under an intervention by full forwards (the
reference of conditions.py's cheap path), and context-pooled codes.

Shapes: S sequences, T tokens per sequence, U units of the sparse layer, H hidden neurons of the dense MLP.
"""

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ..training.losses import next_token_ce
from .errors import SpecializationError

__all__ = ["CodePooler", "down_projection", "mean_ce", "pooled_codes", "pooled_dense"]

# The MLP's output projection per family: its input is the MLP's hidden activation (after act / GLU gating).
DOWN_PROJECTIONS = ("down_proj", "c_proj", "dense_4h_to_h", "fc2", "fc_out", "w2")


def _batches(sequences: torch.Tensor, batch_size: int):
    for lo in range(0, sequences.shape[0], batch_size):
        yield lo, sequences[lo : lo + batch_size]


@torch.no_grad()
def mean_ce(
    model: nn.Module, sequences: torch.Tensor, batch_size: int = 8, layer: nn.Module | None = None,
    steer: dict[int, float] | None = None, ablate: Iterable[int] = (),
) -> float:
    """Mean next-token CE (nats) of `model` over every predicted position of `sequences` (S, T), with `layer`'s
    units `ablate`d and / or `steer`ed (its `intervene` helper) for the duration of the pass."""
    device = next(model.parameters()).device
    total, count = 0.0, 0

    def run() -> None:
        nonlocal total, count
        for _, batch in _batches(sequences, batch_size):
            batch = batch.to(device)  # (B, T)
            ce = next_token_ce(model(input_ids=batch, use_cache=False).logits, batch)  # (B, T-1)
            total += float(ce.double().sum())
            count += ce.numel()

    model.eval()
    if layer is None:
        run()
    else:
        with layer.intervene(steer=steer, ablate=ablate):
            run()
    return total / max(count, 1)


def _pool(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over content tokens: values (B, T, F), mask (B, T) bool -> (B, F); a context with no content -> 0."""
    m = mask.to(values.dtype)[..., None]  # (B, T, 1)
    return (values * m).sum(1) / m.sum(1).clamp_min(1.0)


class CodePooler:
    """The sparse code of every forward seen while `recording()`, mean-pooled per context over its content tokens:
    the forwards' rows are the rows of `mask` (S, T) in order. `pooled` (S, U) float32 on CPU."""

    def __init__(self, layer: nn.Module, mask: torch.Tensor) -> None:
        self.layer, self.mask = layer, mask
        self.pooled = torch.zeros(mask.shape[0], layer.num_units)
        self.row = 0

    def _on_code(self, module, args, code) -> None:
        B, T, K = code.top_k_index.shape
        dense = torch.zeros(B * T, self.layer.num_units, device=code.top_k_weights.device)  # (B·T, U)
        dense.scatter_add_(1, code.top_k_index.reshape(-1, K), code.top_k_weights.reshape(-1, K).float())
        rows = self.mask[self.row : self.row + B].to(dense.device)
        self.pooled[self.row : self.row + B] = _pool(dense.view(B, T, -1), rows).cpu()
        self.row += B

    @contextlib.contextmanager
    def recording(self) -> Iterator["CodePooler"]:
        handle = self.layer.activation_hook.register_forward_hook(self._on_code)
        try:
            yield self
        finally:
            handle.remove()


@torch.no_grad()
def pooled_codes(
    model: nn.Module, layer: nn.Module, sequences: torch.Tensor, mask: torch.Tensor, batch_size: int = 8
) -> torch.Tensor:
    """(S, U) float32: each context's unit activations (listed at `layer.activation_hook`, 0 for unlisted units)
    mean-pooled over its content tokens (mask (S, T) True)."""
    device = next(model.parameters()).device
    pooler = CodePooler(layer, mask)
    model.eval()
    with pooler.recording():
        for _, batch in _batches(sequences, batch_size):
            model(input_ids=batch.to(device), use_cache=False)
    return pooler.pooled


def down_projection(mlp: nn.Module) -> nn.Module:
    """The dense MLP's output projection (its input is the hidden activation); an error naming the MLP otherwise."""
    for name in DOWN_PROJECTIONS:
        module = getattr(mlp, name, None)
        if isinstance(module, nn.Module):
            return module
    raise SpecializationError(
        f"cannot find the output projection of {type(mlp).__name__} (looked for {', '.join(DOWN_PROJECTIONS)}); "
        "the dense baseline needs the MLP's hidden activation: skip it (no base model) or add the name to "
        "DOWN_PROJECTIONS in conversion/specialization/passes.py"
    )


@torch.no_grad()
def pooled_dense(
    base_model: nn.Module, mlp: nn.Module, sequences: torch.Tensor, mask: torch.Tensor, batch_size: int = 8
) -> torch.Tensor:
    """(S, H) float32: the dense MLP's hidden neurons (the input of its down projection) mean-pooled per context."""
    device = next(base_model.parameters()).device
    seen: list = []
    handle = down_projection(mlp).register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    out = None
    try:
        base_model.eval()
        for lo, batch in _batches(sequences, batch_size):
            seen.clear()
            base_model(input_ids=batch.to(device), use_cache=False)
            hidden = seen[-1].float()  # (B, T, H)
            if out is None:
                out = torch.zeros(sequences.shape[0], hidden.shape[-1])
            out[lo : lo + batch.shape[0]] = _pool(hidden, mask[lo : lo + batch.shape[0]].to(hidden.device)).cpu()
    finally:
        handle.remove()
    return out
