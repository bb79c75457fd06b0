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
import math
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from ..surgery.families import decoder_blocks, mlp_shape  # callers import decoder_blocks from here too

CPU_CAPTURE_SEQUENCES = 32
"""`train.capture_batch_sequences: auto` off a GPU: the fixed size of earlier versions (a CPU forward gains nothing
from larger batches)."""
MAX_CAPTURE_TOKENS = 65_536
"""`auto` never forwards more tokens at once: beyond this a GPU's matmuls at these widths are already large, and the
transient memory only grows."""
CAPTURE_MEMORY_FRACTION = 0.25
"""`auto` sizes the forward's transient activations to this fraction of the device's free memory: the rest stays
for the captured chunk, the layers' training and the allocator's fragmentation."""


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


def forward_bytes_per_sequence(config, context_length: int, itemsize: int) -> int:
    """An upper estimate of the transient memory one sequence of `context_length` tokens needs in a no-grad forward
    of the base model (`config`), elements of `itemsize` bytes: a block's residual, normed input, q/k/v, attention
    output and MLP hidden activations (8·d + 2·d_hidden per token, generous for the ones freed early) and, should the
    attention kernel materialize them, the heads' (T, T) scores."""
    shape = mlp_shape(config)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 1)
    per_token = 8 * shape.d_model + 2 * shape.d_hidden * (2 if shape.glu else 1)
    return (context_length * per_token + heads * context_length**2) * itemsize


def capture_batch_size(
    setting: "int | str", config, context_length: int, device: torch.device, *, itemsize: int = 4,
    free_bytes: int | None = None, max_sequences: int | None = None,
) -> int:
    """Sequences per capture forward for `train.capture_batch_sequences` = `setting`: a number is used as given;
    "auto" is CPU_CAPTURE_SEQUENCES off a CUDA GPU and, on one, the largest power of two such that the forward's
    transient memory (`forward_bytes_per_sequence`) fits in CAPTURE_MEMORY_FRACTION of the free memory
    (`free_bytes`, default: what the GPU reports now), at most MAX_CAPTURE_TOKENS tokens and `max_sequences` (a
    shuffle chunk), at least 1. A power of two divides the shuffle chunks of power-of-two budgets, so the capture
    batches stay aligned with them (data/cache.py: cached and live batches equal)."""
    if setting != "auto":
        return int(setting)
    if device.type != "cuda":
        return CPU_CAPTURE_SEQUENCES
    if free_bytes is None:
        free_bytes, _ = torch.cuda.mem_get_info(device)
    fits = int(free_bytes * CAPTURE_MEMORY_FRACTION) // forward_bytes_per_sequence(config, context_length, itemsize)
    limit = min(fits, MAX_CAPTURE_TOKENS // context_length, max_sequences or fits)
    return 2 ** int(math.log2(limit)) if limit >= 1 else 1


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
    also needs the model's output from the same pass. `precision="bf16"` (train.capture_precision) runs the forward
    under bf16 autocast; the pairs are still handed on in the model's dtype.
    """

    def __init__(self, model: nn.Module, layers: list[int], stop_early: bool = True, precision: str = "fp32") -> None:
        blocks = decoder_blocks(model)
        bad = [i for i in layers if not 0 <= i < len(blocks)]
        if bad:
            raise ValueError(f"layer(s) {bad} out of range: the model has {len(blocks)} layers (0..{len(blocks) - 1})")
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"capture precision must be 'fp32' or 'bf16', got {precision!r}")
        self.model, self.layers, self.stop_early, self.precision = model, sorted(layers), stop_early, precision
        self._mlps = {i: blocks[i].mlp for i in self.layers}
        self._captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last_logits: torch.Tensor | None = None

    def _hook(self, index: int):
        dtype = next(self.model.parameters()).dtype  # autocast may hand the MLP bf16 inputs and take bf16 outputs

        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            x = args[0]  # (B, T, d)
            self._captured[index] = (x.detach().reshape(-1, x.shape[-1]).to(dtype),
                                     output.detach().reshape(-1, output.shape[-1]).to(dtype))
            if self.stop_early and index == self.layers[-1]:
                raise _StopForward

        return hook

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        self._captured = {}
        handles = [mlp.register_forward_hook(self._hook(i)) for i, mlp in self._mlps.items()]
        autocast = torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")
        try:
            with autocast:
                out = self.model(input_ids=input_ids, use_cache=False)
            self.last_logits = out.logits
        except _StopForward:
            self.last_logits = None
        finally:
            for handle in handles:
                handle.remove()
        captured, self._captured = self._captured, {}
        return captured
