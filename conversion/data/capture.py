"""Capture (MLP input, MLP output) pairs at the target layers of a causal LM with forward hooks.

One forward pass serves every target layer, and it stops right after the last target MLP (nothing above it is
needed). The hooks sit on the `.mlp` module itself, so what is captured is exactly what the MLP reads and writes:
GPT-2's `ln_2` output -> Conv1D MLP output, GPT-NeoX's `post_attention_layernorm` output (parallel residual) -> MLP
output, Llama's `post_attention_layernorm` output -> gated MLP output.

Every position is captured; `kept_positions` marks those that count for the distillation loss and the reconstruction
metrics (all but special tokens by default, `data.exclude_special_positions`): the model needs the whole sequence,
the losses only the positions that matter.
"""

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from ..surgery.families import decoder_blocks  # callers import it from here too


def excluded_token_ids(data, tokenizer) -> list[int]:
    """Token ids whose positions the distillation loss and the reconstruction metrics leave out: the tokenizer's
    special tokens (`all_special_ids`: BOS, EOS, PAD, UNK, ...) when `data.exclude_special_positions` (a DataConfig),
    else none. Sorted, without duplicates (GPT-2's BOS = EOS = PAD)."""
    if not data.exclude_special_positions:
        return []
    return sorted({int(i) for i in tokenizer.all_special_ids if i is not None})


def kept_positions(input_ids: torch.Tensor, excluded_ids) -> torch.Tensor | None:
    """(B, T) token ids -> (B*T,) bool, True where the token is not one of `excluded_ids`, in the order of the rows
    `MlpCapture` returns; None when nothing is excluded (every position counts)."""
    if not len(excluded_ids):
        return None
    excluded = torch.as_tensor(list(excluded_ids), dtype=input_ids.dtype, device=input_ids.device)
    return ~torch.isin(input_ids.reshape(-1), excluded)  # (B*T,)


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
