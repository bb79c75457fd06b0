"""The sparse code of a layer, its hook point and the interventions on it (steering and ablation after TopK).

Part of the Hub bundle: imports only torch and the standard library. Shape letters as in sparse_base.py.
"""

import contextlib
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch
from torch import nn


class SparseCode(NamedTuple):
    """The sparse part of a layer's computation for each token."""

    top_k_index: torch.Tensor
    """(..., K) int64 ids of the selected experts / latents. Selected is not fired: a slot of weight 0 adds nothing
    (a TopK code lists K units on every token, also where fewer than K pre-activations are positive and the ReLU
    zeroed the rest; a JumpReLU code pads tokens with fewer firing latents than the call's busiest). Count firings
    with `fired()`, never from the ids alone."""
    top_k_weights: torch.Tensor
    """(..., K) their coefficients (post-activation, post-TopK); 0 in a slot that did not fire."""

    def fired(self) -> torch.Tensor:
        """(..., K) bool: the slots whose unit fired, weight != 0 (`SparseLayer.active_entries`, the rule every
        statistic of this project counts with: a unit of nonzero weight adds weight x its direction to the output,
        whatever the sign)."""
        return self.top_k_weights != 0

    def flat(self) -> "SparseCode":
        """The same code with the leading dims flattened: (..., K) -> (T, K)."""
        return SparseCode(
            self.top_k_index.reshape(-1, self.top_k_index.shape[-1]),
            self.top_k_weights.reshape(-1, self.top_k_weights.shape[-1]),
        )


class CodeHook(nn.Module):
    """Identity on the `SparseCode`.

    A stable module path (`...mlp.code_hook`) whose forward output hooks, nnsight and SAE tooling can read and replace.
    The code it sees has the layer input's leading shape, e.g. (batch, seq, K) inside a model, like the module's own
    output (batch, seq, d_out).
    """

    def forward(self, code: SparseCode) -> SparseCode:
        return code


class CodeInterventions:
    """Steering and ablation of a layer's code after TopK, and the code's pass through `code_hook`: the part of
    `SparseLayer` (sparse_base.py) that edits the code. The layer sets `code_hook` and `num_units`, and calls
    `clear_interventions()` in its `__init__`."""

    def _check_units(self, units: Iterable[int]) -> list[int]:
        units = [int(u) for u in units]
        bad = [u for u in units if not 0 <= u < self.num_units]
        if bad:
            raise ValueError(f"unit id(s) {bad} out of range: this layer has {self.num_units} units (0..{self.num_units - 1})")
        return units

    @staticmethod
    def _check_positions(positions: Iterable[int] | None) -> tuple[int, ...] | None:
        if positions is None:
            return None
        if isinstance(positions, int):
            positions = [positions]
        checked = tuple(sorted({int(p) for p in positions}))
        if not checked:
            raise ValueError("positions is empty; give token positions (e.g. [0, -1]) or None for every position")
        return checked

    def steer(self, unit: int, value: float, positions: Iterable[int] | None = None) -> None:
        """Add `value` to unit `unit`'s coefficient after TopK (the MxD paper's `a_n += λ`) at every position, or at
        `positions`: indices along the sequence of each forward call (negative ones count from its end; one that a
        call does not have is skipped). With `generate` and a KV cache the prompt is the first call and every new
        token a call of its own, so `positions=[-1]` steers the prompt's last token and every generated one."""
        (unit,) = self._check_units([unit])
        where = self._check_positions(positions)
        if where is None:
            self._steering[unit] = self._steering.get(unit, 0.0) + float(value)
        else:
            self._steering_at[unit, where] = self._steering_at.get((unit, where), 0.0) + float(value)

    def ablate(self, units: Iterable[int], positions: Iterable[int] | None = None) -> None:
        """Zero the coefficients of `units` after TopK (the other selected units keep theirs), at every position or
        at `positions` (as `steer`'s)."""
        units = frozenset(self._check_units(units))
        where = self._check_positions(positions)
        if where is None:
            self._ablated = self._ablated | units
        else:
            self._ablated_at[where] = self._ablated_at.get(where, frozenset()) | units

    def clear_interventions(self) -> None:
        # Interventions are run-time state, never saved: plain attributes, not buffers.
        self._steering: dict[int, float] = {}
        self._ablated: frozenset[int] = frozenset()
        # The same at chosen positions only: {(unit, positions): value} and {positions: units}.
        self._steering_at: dict[tuple[int, tuple[int, ...]], float] = {}
        self._ablated_at: dict[tuple[int, ...], frozenset[int]] = {}

    @contextlib.contextmanager
    def intervene(
        self, steer: dict[int, float] | None = None, ablate: Iterable[int] = (),
        positions: Iterable[int] | None = None,
    ) -> Iterator["CodeInterventions"]:
        """Context manager: `with layer.intervene(steer={5: 100.0}, ablate=[3]): model.generate(...)`; with
        `positions` (e.g. [-1]) only there (see `steer`)."""
        saved = (dict(self._steering), self._ablated, dict(self._steering_at), dict(self._ablated_at))
        try:
            for unit, value in (steer or {}).items():
                self.steer(unit, value, positions)
            ablate = list(ablate)
            if ablate:
                self.ablate(ablate, positions)
            yield self
        finally:
            self._steering, self._ablated, self._steering_at, self._ablated_at = saved

    def _hook_code(self, index: torch.Tensor, weights: torch.Tensor, lead: tuple[int, ...]) -> SparseCode:
        """Interventions, then `code_hook` at the input's leading shape: (T, K) each -> the code (*lead, K')."""
        code = self._intervene_on_code(index, weights, lead)
        return self.code_hook(SparseCode(code.top_k_index.reshape(*lead, -1), code.top_k_weights.reshape(*lead, -1)))

    def _hook_code_tracked(
        self, index: torch.Tensor, weights: torch.Tensor, lead: tuple[int, ...]
    ) -> tuple[SparseCode, bool, bool]:
        """`_hook_code` for layers that decode faster from their own internal form while the code is untouched.

        Returns (the code flattened to (T, K'), same_units, same_values): whether the code's units / values are still
        `index` / `weights` — no intervention and no hook replaced or edited them (in place too: nnsight's setitem
        bumps the version counter). Where edits cannot be seen — under torch.compile / torch.export, or for
        inference-mode tensors, which carry no version counter — both are False, so the caller decodes whatever the
        code holds (its general path, which is also free of host synchronizations).
        """
        code = self._intervene_on_code(index, weights, lead)
        shown = SparseCode(code.top_k_index.reshape(*lead, -1), code.top_k_weights.reshape(*lead, -1))
        trackable = not (
            torch.compiler.is_compiling() or shown.top_k_index.is_inference() or shown.top_k_weights.is_inference()
        )
        stamp = (shown.top_k_index._version, shown.top_k_weights._version) if trackable else None
        out = self.code_hook(shown)
        if not trackable:
            return out.flat(), False, False
        same_units = (
            code.top_k_index is index and out.top_k_index is shown.top_k_index and out.top_k_index._version == stamp[0]
        )
        same_values = (
            code.top_k_weights is weights
            and out.top_k_weights is shown.top_k_weights
            and out.top_k_weights._version == stamp[1]
        )
        return out.flat(), same_units, same_values

    def _intervene_on_code(
        self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, lead: tuple[int, ...] = ()
    ) -> SparseCode:
        # top_k_index, top_k_weights: (T, K), T = prod(lead) tokens; the last of `lead` is the sequence
        if self._ablated:
            ablated = torch.tensor(sorted(self._ablated), device=top_k_index.device)
            top_k_weights = top_k_weights.masked_fill(torch.isin(top_k_index, ablated), 0.0)
        for where, units in self._ablated_at.items():
            at = self._at_positions(where, top_k_index, lead)  # (T, 1)
            hit = torch.isin(top_k_index, torch.tensor(sorted(units), device=top_k_index.device)) & at  # (T, K)
            top_k_weights = top_k_weights.masked_fill(hit, 0.0)
        if self._steering or self._steering_at:
            # Steered units ride along as extra (index, value) pairs: the sum over the code then adds λ·row_n exactly,
            # also when n is already among the top K (embedding_bag sums duplicate ids). At chosen positions the
            # pair is there at every position with the value 0 elsewhere (adds nothing, and fires nowhere else).
            n_tokens = top_k_index.shape[0]
            units = list(self._steering) + [unit for unit, _ in self._steering_at]
            values = torch.tensor(
                list(self._steering.values()) + list(self._steering_at.values()),
                device=top_k_weights.device, dtype=top_k_weights.dtype,
            ).expand(n_tokens, len(units))  # (T, S)
            if self._steering_at:
                at = torch.cat([self._at_positions(where, top_k_index, lead) for _, where in self._steering_at], -1)
                values = torch.cat([values[:, : len(self._steering)], values[:, len(self._steering):] * at], -1)
            extra_index = torch.tensor(units, device=top_k_index.device).expand(n_tokens, len(units))  # (T, S)
            top_k_index = torch.cat([top_k_index, extra_index], dim=-1)  # (T, K + S)
            top_k_weights = torch.cat([top_k_weights, values], dim=-1)  # (T, K + S)
        return SparseCode(top_k_index, top_k_weights)

    @staticmethod
    def _at_positions(positions: tuple[int, ...], top_k_index: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
        """(T, 1) bool: whether each of the T = prod(lead) tokens stands at one of `positions` of its sequence (the
        last dim of `lead`; negative positions from its end)."""
        length = lead[-1] if lead else 1
        wanted = sorted({p + length if p < 0 else p for p in positions if -length <= p < length})
        position = torch.arange(top_k_index.shape[0], device=top_k_index.device) % max(length, 1)  # (T,)
        return torch.isin(position, torch.tensor(wanted, dtype=torch.long, device=position.device))[:, None]
