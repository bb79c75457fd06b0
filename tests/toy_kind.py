"""A toy sparse layer kind that exists only in tests: what a new kind is, one file plus the registry row.

    s = W_enc x + b_enc                    router / encoder scores over L latents
    z = TopK(ReLU(s))                      the sparse code: K (latent, value) pairs per token
    y = W_decᵀ z + b_out                   row l of W_dec (L, O) is latent l's output direction

It declares what generic code asks of a kind (modeling/sparse_base.py's contract) and nothing else, and names its
parameters its own way (`b_out`, not the real kinds' `b_dec`: generic code reaches it as `output_bias`): an activation
meaning and a code-unit name of its own (so a test can tell that inspection read them from the kind, not from a
table), a router (`router_distribution = "scores"`: the layer records s as `router_logits`, so routing statistics
exist for it), a fixed output direction per latent (`output_directions`, so vocabulary effects exist for it) and
the top-K flag. It imports only torch and the bundle's shared files (sparse_base, sparse_spec, sparse_code,
sparse_kernels), as a kind file of the bundle does.

    with toy_kind_registered() as kind:      # LAYER_KINDS[kind] = (ToySpec, ToyLayer) for the block
        layer = build_sparse_layer({"kind": kind, "d_in": 32, "d_out": 32, **TOY_TINY_FIELDS[kind]})

The registration is removed on exit (also on error), so no other test sees the toy kind.
"""

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from expertize.modeling.sparse_base import SparseLayer, linear_bound, uniform_
from expertize.modeling.sparse_code import SparseCode
from expertize.modeling.sparse_kernels import relu_topk, sparse_rows_sum
from expertize.modeling.sparse_spec import SparseSpec, _require_int
from expertize.modeling.sparse_layers import LAYER_KINDS

__all__ = ["TOY_KIND", "TOY_TINY_FIELDS", "ToyLayer", "ToySpec", "toy_kind", "toy_kind_registered"]

TOY_KIND = "toy_topk"
"""The toy kind's registry key (no real kind has it)."""

TOY_ACTIVATION_MEANING = "toy latent value ReLU(s_l), s = W_enc x + b_enc, among the top K (tests/toy_kind.py)"
TOY_CODE_UNIT = "toy latent"
TOY_CITATION = "@misc{toy2026kind,\n  title = {A toy sparse kind that only tests register}\n}"


@dataclasses.dataclass
class ToySpec(SparseSpec):
    kind = TOY_KIND
    title: ClassVar[str] = "toy ReLU-TopK (tests only)"
    unit_name: ClassVar[str] = "latent"
    units_field: ClassVar[str] = "num_latents"
    activation_meaning: ClassVar[str] = TOY_ACTIVATION_MEANING
    code_unit_name: ClassVar[str] = TOY_CODE_UNIT
    citation: ClassVar[str] = TOY_CITATION

    num_latents: int
    """L: latents (the units of the code)."""
    k: int = 2
    """Active latents per token."""

    def validate(self) -> None:
        super().validate()
        _require_int(self, "num_latents")
        _require_int(self, "k")
        if self.k > self.num_latents:
            raise ValueError(f"{self.kind}.k={self.k} exceeds {self.kind}.num_latents={self.num_latents}; lower k")

    def num_parameters(self) -> int:
        I, O, L = self.d_in, self.d_out, self.num_latents
        return L * (I + 1) + L * O + O

    def active_parameters(self) -> int:
        I, O, L = self.d_in, self.d_out, self.num_latents
        return L * (I + 1) + self.k * O + O

    def flops_per_token(self) -> int:
        I, O, L = self.d_in, self.d_out, self.num_latents
        return 2 * (I * L + self.k * O) + O


class ToyLayer(SparseLayer):
    """The toy kind's layer: ReLU-TopK latents with their own decoder, the encoder scores doubling as the router."""

    spec: ToySpec

    selects_top_k_units = True
    router_distribution = "scores"  # a token's routing: the softmax of s, recorded in `router_logits`

    def __init__(self, spec: ToySpec) -> None:
        super().__init__(spec)
        I, O, L = spec.d_in, spec.d_out, spec.num_latents
        self.W_enc = nn.Parameter(torch.empty(L, I))
        self.b_enc = nn.Parameter(torch.empty(L))
        self.W_dec = nn.Parameter(torch.empty(L, O))
        self.b_out = nn.Parameter(torch.empty(O))
        self._init_selection_bias(L)  # none: the spec has no selection_bias field
        self.reset_parameters()

    @property
    def num_units(self) -> int:
        return self.spec.num_latents

    @property
    def output_bias(self) -> nn.Parameter:
        return self.b_out  # added to every token's output

    def reset_parameters(self) -> None:
        uniform_(self.W_enc, linear_bound(self.spec.d_in))
        uniform_(self.W_dec, linear_bound(self.spec.num_latents))
        nn.init.zeros_(self.b_enc)
        nn.init.zeros_(self.b_out)

    def output_directions(self) -> torch.Tensor:
        return self.W_dec.detach()  # latent l adds W_dec[l] per unit of its value: (L, O)

    def encode(self, x: torch.Tensor) -> SparseCode:
        """z = TopK(ReLU(W_enc x + b_enc)) as (index, weight) pairs: (..., I) -> (..., K)."""
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # (T, I)
        scores = F.linear(x, self.W_enc, self.b_enc)  # (T, L)
        self._set_router_outputs(scores, None)
        values, index = relu_topk(scores, self.spec.k)  # (T, K) each
        return self._hook_code(index, values, lead)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        lead = hidden_states.shape[:-1]
        out = sparse_rows_sum(self.encode(hidden_states).flat(), self.W_dec) + self.b_out  # (T, O)
        return out.view(*lead, -1)


TOY_TINY_FIELDS: dict[str, dict[str, Any]] = {TOY_KIND: dict(num_latents=24, k=3)}
"""The toy kind's row in the shape of tests/kinds.py's TINY_FIELDS (kind -> spec fields beyond d_in / d_out)."""


@contextlib.contextmanager
def toy_kind_registered() -> Iterator[str]:
    """Register the toy kind in `LAYER_KINDS` (the registry every generic lookup reads) for the block; yields its
    name. Refuses to nest (a second registration would hide which block removes it)."""
    if TOY_KIND in LAYER_KINDS:
        raise RuntimeError(f"the toy kind {TOY_KIND!r} is already registered; do not nest toy_kind_registered()")
    LAYER_KINDS[TOY_KIND] = (ToySpec, ToyLayer)
    try:
        yield TOY_KIND
    finally:
        LAYER_KINDS.pop(TOY_KIND, None)


@pytest.fixture
def toy_kind() -> Iterator[str]:
    """pytest fixture form of `toy_kind_registered()` (import it into a test module to use it)."""
    with toy_kind_registered() as kind:
        yield kind
