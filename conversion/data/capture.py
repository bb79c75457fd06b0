"""Capture (MLP input, MLP output) pairs at the target layers of a causal LM with forward hooks.

One forward pass serves every target layer, and it stops right after the last target MLP (nothing above it is
needed). The hooks sit on the `.mlp` module itself, so what is captured is exactly what the MLP reads and writes:
GPT-2's `ln_2` output -> Conv1D MLP output, GPT-NeoX's `post_attention_layernorm` output (parallel residual) -> MLP
output, Llama's `post_attention_layernorm` output -> gated MLP output.
"""

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from ..surgery.families import decoder_blocks  # callers import it from here too


class _StopForward(Exception):
    """Raised by the hook on the last target MLP to end the forward pass early."""


@contextlib.contextmanager
def replaced_mlps(model: nn.Module, modules: Mapping[int, nn.Module]) -> Iterator[nn.Module]:
    """Temporarily swap `.mlp` of the given decoder layers (for spliced evaluation without copying the model)."""
    blocks = decoder_blocks(model)
    saved = {i: blocks[i].mlp for i in modules}
    try:
        for i, module in modules.items():
            blocks[i].mlp = module
        yield model
    finally:
        for i, module in saved.items():
            blocks[i].mlp = module


class MlpCapture:
    """`capture(input_ids) -> {layer: (x, y)}` with x, y of shape (B*T, d_model), in the model's dtype.

    `stop_early=False` runs the whole forward (and returns the logits via `last_logits`), e.g. when the caller
    also needs the model's output from the same pass.
    """

    def __init__(self, model: nn.Module, layers: list[int], stop_early: bool = True) -> None:
        blocks = decoder_blocks(model)
        bad = [i for i in layers if not 0 <= i < len(blocks)]
        if bad:
            raise ValueError(f"layer(s) {bad} out of range: the model has {len(blocks)} layers (0..{len(blocks) - 1})")
        self.model, self.layers, self.stop_early = model, sorted(layers), stop_early
        self._mlps = {i: blocks[i].mlp for i in self.layers}
        self._captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last_logits: torch.Tensor | None = None

    def _hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            x = args[0]  # (B, T, d)
            self._captured[index] = (x.detach().reshape(-1, x.shape[-1]), output.detach().reshape(-1, output.shape[-1]))
            if self.stop_early and index == self.layers[-1]:
                raise _StopForward

        return hook

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        self._captured = {}
        handles = [mlp.register_forward_hook(self._hook(i)) for i, mlp in self._mlps.items()]
        try:
            out = self.model(input_ids=input_ids, use_cache=False)
            self.last_logits = out.logits
        except _StopForward:
            self.last_logits = None
        finally:
            for handle in handles:
                handle.remove()
        captured, self._captured = self._captured, {}
        return captured
