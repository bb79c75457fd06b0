"""Cheap interventions, exactly: run the layers below the intervened one once, replay only the rest per condition.

An intervention on decoder block L's sparse layer (ablate units, steer a unit) leaves everything below block L
unchanged. So per batch of evaluation contexts one full forward records, with forward pre-hooks on blocks L…end,

    hidden    (B, T, d)   the residual stream entering block L
    calls     per block i >= L: the other arguments and keyword arguments the full forward passed it (causal mask,
              position ids, rotary `position_embeddings`, cache flags: whatever the family's forward builds)

and every condition then costs only blocks L…end, the final norm and the LM head (`families.lm_logits`: with the
family's logit soft cap, Gemma 2's). Replaying the recorded calls (rather than rebuilding masks and rotary embeddings
from a copy of each family's forward) is what makes it exact for every family, GPT-2's absolute positions, GPT-NeoX's
parallel residual, the rotary embeddings of the Llama-likes and Gemma's per-layer-type masks alike: the suffix
computes the same operations on the same tensors, so its logits are bit-for-bit the full forward's
(tests/test_suffix.py, every family; `SuffixRunner.check` verifies it again on each run's first batch).

Conditions can be stacked along the batch (`logits(prefix, copies=C)`: C copies of the batch, rows c·B … c·B + B − 1
for copy c), each copy with its own intervention (conditions.py). Recorded tensors whose first dimension is the batch
(B > 1; e.g. an eager attention mask (B, 1, T, T)) are repeated C times; batch-1 tensors broadcast as they are. A
stacked pass equals the full forward to float rounding only: a matrix-multiply kernel may block C·B rows differently
from B rows (measured: MxD's dense path on CPU, ~1e-7).
"""

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..training.losses import next_token_ce
from ..surgery.families import decoder_blocks, lm_logits
from .errors import SpecializationError

__all__ = ["PrefixBatch", "SuffixRunner"]


@dataclasses.dataclass
class PrefixBatch:
    """One batch of contexts, run once up to block L."""

    input_ids: torch.Tensor
    """(B, T) int64, on the model's device."""
    hidden: torch.Tensor
    """(B, T, d) the residual stream entering block L."""
    calls: list[tuple[tuple, dict]]
    """Per block L, L+1, …: (positional arguments after the hidden states, keyword arguments) of its call."""


def _repeat(value, batch: int, copies: int):
    """A recorded argument for `copies` stacked copies of a batch of `batch` rows (see the module docstring)."""
    if copies == 1:
        return value
    if isinstance(value, torch.Tensor):
        if batch > 1 and value.dim() >= 2 and value.shape[0] == batch:
            return value.repeat(copies, *([1] * (value.dim() - 1)))
        return value
    if isinstance(value, tuple):
        return tuple(_repeat(v, batch, copies) for v in value)
    if isinstance(value, list):
        return [_repeat(v, batch, copies) for v in value]
    if isinstance(value, dict):
        return {k: _repeat(v, batch, copies) for k, v in value.items()}
    return value


class SuffixRunner:
    """Full forwards that record the prefix of decoder block `layer`, and replays of blocks `layer`…end from it."""

    def __init__(self, model: nn.Module, layer: int) -> None:
        self.model, self.layer = model, layer
        self.blocks = decoder_blocks(model)
        if not 0 <= layer < len(self.blocks):
            raise SpecializationError(f"layer {layer} is not a decoder block of the model (0-{len(self.blocks) - 1})")
        self.device = next(model.parameters()).device

    @contextlib.contextmanager
    def recording(self) -> Iterator[Callable[[torch.Tensor], PrefixBatch]]:
        """Record the prefix of whatever forward of the model runs inside: the context yields `prefix(input_ids)`, the
        PrefixBatch of the last forward once it has run. For callers whose own forward carries other hooks too (the
        evaluation's MLP capture), so that one forward gives both."""
        calls: list[tuple[tuple, dict]] = []
        hidden: list[torch.Tensor] = []

        def record(module, args, kwargs):
            if module is self.blocks[self.layer]:  # a new forward starts at block L
                calls.clear()
                hidden.clear()
            if args:
                if not hidden:
                    hidden.append(args[0].clone())
                calls.append((tuple(args[1:]), dict(kwargs)))
            else:  # a family that passes the hidden states by name
                if not hidden:
                    hidden.append(kwargs["hidden_states"].clone())
                calls.append(((), {k: v for k, v in kwargs.items() if k != "hidden_states"}))

        def prefix(input_ids: torch.Tensor) -> PrefixBatch:
            if not hidden:
                raise SpecializationError(f"no forward of the model reached decoder block {self.layer} inside "
                                          "SuffixRunner.recording(): run the model before asking for its prefix")
            return PrefixBatch(input_ids.to(self.device), hidden[0], list(calls))

        handles = [b.register_forward_pre_hook(record, with_kwargs=True) for b in self.blocks[self.layer :]]
        try:
            yield prefix
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor) -> tuple[PrefixBatch, torch.Tensor]:
        """One full forward of `input_ids` (B, T): (its prefix record, its logits (B, T, V))."""
        input_ids = input_ids.to(self.device)
        with self.recording() as prefix:
            self.model.eval()
            logits = self.model(input_ids=input_ids, use_cache=False).logits
        return prefix(input_ids), logits

    @torch.no_grad()
    def logits(self, prefix: PrefixBatch, copies: int = 1) -> torch.Tensor:
        """Blocks `layer`…end, the final norm and the LM head (and the family's logit soft cap) on `copies` stacked
        copies of the batch: (copies·B, T, V)."""
        B = prefix.hidden.shape[0]
        h = prefix.hidden if copies == 1 else prefix.hidden.repeat(copies, 1, 1)  # (C·B, T, d)
        for block, (args, kwargs) in zip(self.blocks[self.layer :], prefix.calls):
            args, kwargs = _repeat(args, B, copies), _repeat(kwargs, B, copies)
            h = block(h, *args, **kwargs) if args or "hidden_states" not in kwargs else block(hidden_states=h, **kwargs)
            if isinstance(h, tuple):  # transformers 4.x blocks return (hidden_states, ...)
                h = h[0]
        return lm_logits(self.model, h)

    def check(self, prefix: PrefixBatch, logits: torch.Tensor) -> None:
        """The suffix replay of `prefix` must give the full forward's `logits` bit for bit; an error otherwise."""
        replay = self.logits(prefix)
        if not torch.equal(replay, logits):
            gap = float((replay.float() - logits.float()).abs().max())
            raise SpecializationError(
                f"replaying decoder blocks {self.layer}… of this {type(self.model).__name__} does not reproduce its "
                f"full forward (max |Δ logit| {gap:.3g}); the cheap-intervention path cannot be used for it: measure "
                "with full forwards (SpecializationSettings(full_forward=True), --full-forward)"
            )

    @staticmethod
    def token_ce(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """(rows, T − 1) float32 next-token CE; `input_ids` (B, T) is repeated to the logits' rows (stacked copies)."""
        copies = logits.shape[0] // input_ids.shape[0]
        return next_token_ce(logits, input_ids.repeat(copies, 1) if copies > 1 else input_ids)
