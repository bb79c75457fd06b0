"""What the evaluations of a recipe's variants share: the base model's forward and the ablated CE sums, computed
once per eval batch (AblationMemo), the base forward itself (base_pass), and the replay of the later forwards from
the prefix it recorded (Replay)."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from ..data.mlp_pairs import MlpCapture

BASE_MEMO_BYTES = 3 << 30
"""The base forwards' results (logits and MLP pairs) an AblationMemo keeps for the next variant, at most."""


class AblationMemo:
    """What the evaluations of a recipe's variants share, per eval batch: the zero- and mean-ablated CE sums and the
    base model's own forward (its logits and the target MLPs' inputs / outputs).

    The ablated forwards replace the target MLPs by constants, and the base forward replaces nothing, so they depend
    on the base model, the eval sequences, the layer indices and the mean outputs, not on the sparse layers: the
    variants of a recipe (one stream, hence one training mean) compute them once instead of once each (three of the
    four forwards of every eval batch). The base forwards are kept while they fit in BASE_MEMO_BYTES (a large
    vocabulary's logits may not: those batches are recomputed). A different key (another base, sequences, layers or
    means) starts over, so a stale value is never used. The values are the exact tensors and floats the evaluation
    would compute again, used in the same order: results are bit-identical.
    """

    def __init__(self, share_base: bool = True) -> None:
        self._key: tuple | None = None
        self._sums: dict[tuple, object] = {}
        self._bytes = 0
        self.share_base = share_base
        """Whether to keep the base forwards (False for one evaluation: nobody would read them again)."""

    def value(self, key: tuple, item: tuple, compute, nbytes=None):
        """The memoized `compute()` of `item`; `nbytes(value)`: its size, kept only while the memo stays under
        BASE_MEMO_BYTES (None: always kept)."""
        if key != self._key:
            self._key, self._sums, self._bytes = key, {}, 0
        if item in self._sums:
            return self._sums[item]
        value = compute()
        size = 0 if nbytes is None else nbytes(value)
        if self._bytes + size <= BASE_MEMO_BYTES:
            self._sums[item] = value
            self._bytes += size
        return value


def memo_key(model: nn.Module, eval_sequences: torch.Tensor, indices: list[int], means, batch_sequences: int) -> tuple:
    def digest(t: torch.Tensor) -> str:
        return hashlib.sha1(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()

    mean_digests = None if means is None else tuple(digest(means[i].float()) for i in indices)
    return (id(model), digest(eval_sequences), tuple(indices), mean_digests, batch_sequences)


def base_pass(model: nn.Module, input_ids: torch.Tensor, indices: list[int], runner=None) -> tuple:
    """One base forward: ({layer: (x, y)} the target MLPs' inputs / outputs, each (B*L, d); the logits (B, L, V);
    with a `SuffixRunner`, the PrefixBatch of its block recorded by the same forward, else None)."""
    capture = MlpCapture(model, indices, stop_early=False)
    if runner is None:
        return capture(input_ids), capture.last_logits, None
    with runner.recording() as prefix:
        captured = capture(input_ids)
    return captured, capture.last_logits, prefix(input_ids)


def base_pass_bytes(value: tuple) -> int:
    captured, logits, prefix = value
    recorded = 0 if prefix is None else prefix.hidden.nbytes  # the block calls' tensors are small beside it
    return logits.nbytes + recorded + sum(x.nbytes + y.nbytes for x, y in captured.values())


class Replay:
    """The evaluation's spliced and ablated forwards from the residual stream entering the first sparse layer's block,
    recorded by the base forward of the same batch: nothing below that block changes, so only blocks L…end and the
    head run again (specialization/suffix.py, exact for every family). A layer at depth L of N saves ~L/N of those
    forwards' blocks — the dominant cost of evaluating a deep layer of a real model. The replay is checked against
    the base forward bit for bit on the first batch; where it differs, every forward is a full one (`runner` None)."""

    def __init__(self, model: nn.Module, indices: list[int], spliced_model: nn.Module | None) -> None:
        from ..specialization.suffix import SuffixRunner  # the replay `expertize specialize` introduced

        # a healed model (spliced_model) differs from the base below its sparse layers too: full forwards only
        self.runner = None if spliced_model is not None else SuffixRunner(model, min(indices))
        self.prefix = None
        self.checked = False

    def at(self, passed: tuple) -> Replay:
        """This batch's prefix (the base pass's third item); the first batch checks the replay."""
        _, base_logits, self.prefix = passed
        if self.runner is not None and not self.checked:
            from ..specialization.errors import SpecializationError  # beside SuffixRunner's lazy import

            self.checked = True
            try:
                if self.prefix is None:  # the memo's base pass was recorded without a replay: nothing to replay from
                    self.runner = None
                else:
                    self.runner.check(self.prefix, base_logits)
            except SpecializationError:  # not bit for bit this model's forward: full forwards, as before the replay
                self.runner = None
        return self
