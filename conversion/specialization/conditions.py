"""Intervention conditions on one domain's evaluation text: per-document CE sums, base and under every condition.

A `Condition` ablates a set of units and / or steers units of the sparse layer. `condition_ce` runs one full forward
per batch of contexts (base CE, and the prefix record of suffix.py) and then each condition on the suffix only. The
intervention edits the code at `code_hook` exactly as `SparseLayer.intervene` edits it (the same masked_fill for
ablation, the same extra (unit, λ) pairs appended for steering), so every condition's CE is bit for bit the CE of a
full forward of the same batch under `layer.intervene(...)` (tests/test_suffix.py).

`stack=True` also stacks C conditions along the batch where `batch_size` rows allow (C = batch_size // rows of the
batch; only conditions of one shape share a pass: all ablation, or all steering the same number of units), each copy
edited separately. Fewer, larger passes (worth it on a GPU); but a matrix-multiply kernel may block a larger batch
differently, so stacked CEs equal the full forward's to float rounding (~1e-7 relative), not bit for bit.

CE sums are kept per document (the document of the predicted token), for the bootstrap over documents
(bootstrap.py): a predicted position t of a context predicts token t + 1 and belongs to that token's document.
"""

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .bootstrap import local_documents
from .suffix import PrefixBatch, SuffixRunner

__all__ = ["Condition", "DomainCE", "condition_ce", "per_copy_interventions"]


@dataclasses.dataclass(frozen=True)
class Condition:
    """An intervention on the sparse layer's code: `ablate` units (weight 0 where listed), `steer` (unit, λ) pairs
    (λ added to the unit at every position)."""

    ablate: tuple[int, ...] = ()
    steer: tuple[tuple[int, float], ...] = ()

    @property
    def shape(self) -> tuple[bool, int]:
        """Conditions of the same shape can share a stacked pass."""
        return bool(self.ablate), len(self.steer)

    @property
    def empty(self) -> bool:
        return not self.ablate and not self.steer


@contextlib.contextmanager
def per_copy_interventions(layer: nn.Module, conditions: list[Condition], rows: int) -> Iterator[None]:
    """While active, copy c of a stacked batch (code rows c·rows … c·rows + rows − 1) gets `conditions[c]`.
    The conditions must share one `shape`."""
    if len({c.shape for c in conditions}) != 1:
        raise ValueError("stacked conditions must have the same shape (all ablation, or the same number of steered "
                         "units)")
    C, U = len(conditions), layer.num_units
    ablate = torch.zeros(C, U, dtype=torch.bool)
    for c, condition in enumerate(conditions):
        ablate[c, list(condition.ablate)] = True
    steer_units = torch.tensor([[u for u, _ in c.steer] for c in conditions], dtype=torch.long)  # (C, S)
    steer_values = [[v for _, v in c.steer] for c in conditions]
    do_ablate, steered = conditions[0].shape

    def edit(module, args, code):
        index, weights = code.top_k_index, code.top_k_weights  # (C·rows, T, K) each
        copy = torch.arange(index.shape[0], device=index.device) // rows  # (C·rows,)
        if do_ablate:
            table = ablate.to(index.device)
            weights = weights.masked_fill(table[copy[:, None, None], index], 0.0)
        if steered:
            shape = (*index.shape[:-1], steered)
            extra = steer_units.to(index.device)[copy][:, None, :].expand(shape)  # (C·rows, T, S)
            values = torch.tensor(steer_values, dtype=weights.dtype, device=weights.device)[copy]  # (C·rows, S)
            index = torch.cat([index, extra], dim=-1)  # (C·rows, T, K + S)
            weights = torch.cat([weights, values[:, None, :].expand(shape)], dim=-1)
        return type(code)(index, weights)

    handle = layer.code_hook.register_forward_hook(edit)
    try:
        yield
    finally:
        handle.remove()


@dataclasses.dataclass
class DomainCE:
    """One domain's evaluation text: per-document sums over its predicted tokens (float64, on CPU)."""

    tokens: torch.Tensor
    """(n,) predicted tokens per document."""
    base: torch.Tensor
    """(n,) Σ CE without intervention."""
    conditions: torch.Tensor
    """(C, n) Σ CE under each condition."""

    @property
    def documents(self) -> int:
        return self.tokens.numel()


@torch.no_grad()
def condition_ce(
    runner: SuffixRunner, layer: nn.Module, sequences: torch.Tensor, documents: torch.Tensor,
    conditions: list[Condition], batch_size: int = 8, full_forward: bool = False, stack: bool = False,
    during_base: Callable[[int, torch.Tensor], contextlib.AbstractContextManager] | None = None, check: bool = True,
) -> DomainCE:
    """Per-document CE sums of `sequences` (S, T), documents (S, T) their tokens' document index, at base and under
    each condition (`stack`: see the module docstring). `during_base(first_row, input_ids)`: a context manager entered around each batch's full forward
    (e.g. to pool its code); `full_forward`: every condition as a full forward (the reference path, and the fallback where the
    replay check fails). `check`: verify the replay on the first batch (`SuffixRunner.check`; exactness is the
    model's property, so once per model is enough)."""
    local, n = local_documents(documents)
    targets = local[:, 1:]  # (S, T − 1) the document of each predicted token (never BOS)
    tokens = torch.zeros(n, dtype=torch.float64).index_add_(0, targets.reshape(-1),
                                                            torch.ones(targets.numel(), dtype=torch.float64))
    base = torch.zeros(n, dtype=torch.float64)
    sums = torch.zeros(len(conditions), n, dtype=torch.float64)
    groups: dict[tuple[bool, int], list[int]] = {}
    for i, condition in enumerate(conditions):
        if condition.empty:  # no intervention: the base CE itself
            continue
        groups.setdefault(condition.shape, []).append(i)
    checked = full_forward or not check or not groups
    for lo in range(0, sequences.shape[0], batch_size):
        batch = sequences[lo : lo + batch_size]
        B = batch.shape[0]
        doc = targets[lo : lo + B].reshape(-1)  # (B·(T − 1),)
        hook = during_base(lo, batch) if during_base is not None else contextlib.nullcontext()
        with hook:
            prefix, logits = runner.capture(batch)
        if not checked:
            runner.check(prefix, logits)
            checked = True
        base.index_add_(0, doc, SuffixRunner.token_ce(logits, prefix.input_ids).reshape(-1).double().cpu())
        del logits
        copies = max(1, batch_size // B) if stack else 1
        for members in groups.values():
            for at in range(0, len(members), copies):
                stack = members[at : at + copies]
                ce = _stacked_ce(runner, layer, prefix, [conditions[i] for i in stack], full_forward)  # (C, B·(T−1))
                for row, i in enumerate(stack):
                    sums[i].index_add_(0, doc, ce[row])
    for i, condition in enumerate(conditions):
        if condition.empty:
            sums[i] = base
    return DomainCE(tokens, base, sums)


def _stacked_ce(runner: SuffixRunner, layer: nn.Module, prefix: PrefixBatch, stack: list[Condition],
                full_forward: bool) -> torch.Tensor:
    """(C, B·(T − 1)) float64 token CE of the batch under each condition of `stack`, C copies in one pass."""
    B, C = prefix.input_ids.shape[0], len(stack)
    with per_copy_interventions(layer, stack, B):
        if full_forward:
            logits = runner.model(input_ids=prefix.input_ids.repeat(C, 1), use_cache=False).logits
        else:
            logits = runner.logits(prefix, copies=C)  # (C·B, T, V)
    return SuffixRunner.token_ce(logits, prefix.input_ids).double().cpu().reshape(C, -1)
