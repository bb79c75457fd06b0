"""What the transcoder kinds share: a dictionary of L latents, each read from the MLP input by an encoder row and
written into its output by a decoder row, with an optional dense skip path (transcoder.py: TopK; jumprelu_
transcoders.py: JumpReLU and the cross-layer transcoder). The kind files may not import each other; both import this
block, as SAELens's transcoders share one base class.

    pre = W_enc x + b_enc                  (T, L)
    a   = act(pre)                         the kind's activation: TopK(ReLU(·)), JumpReLU_θ(·)
    y   = W_decᵀ a + b_dec  (+ W_skip x)

Shapes: W_enc (L, I); b_enc (L,); W_dec (L, O), row l = latent l's decoder direction; b_dec (O,); W_skip (O, I).
Names follow EleutherAI sparsify (`num_latents`, `k`, `W_dec`, `b_dec`, `W_skip`).

Part of the Hub bundle: imports only torch, the standard library and sibling files.
"""

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from .sparse_base import Coder, SparseLayer, linear_bound, uniform_
from .sparse_kernels import decode_rows
from .sparse_spec import SparseSpec, _require_int


@dataclasses.dataclass
class LatentCoderSpec(SparseSpec):
    """The fields and counts of a transcoder over `num_latents` latents; a kind restates `k`'s meaning."""

    unit_name: ClassVar[str] = "latent"
    units_field: ClassVar[str] = "num_latents"
    extra_per_latent: ClassVar[int] = 0
    """Parameters per latent besides its encoder row, encoder bias and decoder row (JumpReLU's threshold: 1)."""
    k_bound: ClassVar[str] = "k cannot exceed the latents that exist"
    """Why k may not exceed num_latents, in the kind's words (its error message)."""

    num_latents: int
    """L: dictionary size."""
    k: int = 32
    """Active latents per token."""

    skip_connection = False  # a class constant here; a kind with an optional skip path makes it a field

    def validate(self) -> None:
        super().validate()
        _require_int(self, "num_latents")
        _require_int(self, "k")
        if self.k > self.num_latents:
            raise ValueError(f"{self.kind}.k={self.k} exceeds {self.kind}.num_latents={self.num_latents}: "
                             f"{self.k_bound}; lower k or raise num_latents")

    @classmethod
    def matched_size(cls, fields: dict, num_latents: int, convention: str) -> int:
        """Matched to a TopK transcoder of `num_latents` latents: exactly that many (a per-latent threshold is the
        only addition; a skip path comes on top, as in Paulo et al.'s comparisons)."""
        return num_latents

    def _skip_parameters(self) -> int:
        return self.d_in * self.d_out if self.skip_connection else 0

    def num_parameters(self) -> int:
        I, O, L = self.d_in, self.d_out, self.num_latents
        return L * (I + 1 + self.extra_per_latent) + L * O + O + self._skip_parameters()

    def active_parameters(self) -> int:
        I, O, L = self.d_in, self.d_out, self.num_latents
        return L * (I + 1 + self.extra_per_latent) + self.k * O + O + self._skip_parameters()

    def flops_per_token(self) -> int:
        I, O, L = self.d_in, self.d_out, self.num_latents
        return 2 * (I * L + self.k * O + (I * O if self.skip_connection else 0)) + O


class LatentCoderLayer(SparseLayer):
    """The parameters, initialization, decoder, export view and resampling of a transcoder; the kind writes `encode`
    (its activation) and, where it has them, per-latent parameters (`_add_per_latent_parameters`)."""

    spec: LatentCoderSpec
    supports_resampling = True

    def __init__(self, spec: LatentCoderSpec) -> None:
        super().__init__(spec)
        I, O, L = spec.d_in, spec.d_out, spec.num_latents
        # registration order is the state dict's and the optimizer's order: encoder, per-latent, decoder, skip
        self.W_enc = nn.Parameter(torch.empty(L, I))
        self.b_enc = nn.Parameter(torch.empty(L))
        self._add_per_latent_parameters(L)
        self.W_dec = nn.Parameter(torch.empty(L, O))
        self.b_dec = nn.Parameter(torch.empty(O))
        self.W_skip = nn.Parameter(torch.empty(O, I)) if spec.skip_connection else None
        self._init_selection_bias(L)  # b_select only where the spec has `selection_bias` (TopK)
        self.reset_parameters()

    def _add_per_latent_parameters(self, num_latents: int) -> None:
        """A kind's parameters of shape (L,) besides b_enc (JumpReLU: its threshold); none by default."""

    def _reset_per_latent_parameters(self) -> None:
        """Their starting values (`reset_parameters`)."""

    def _resample_per_latent_parameters(self, units: torch.Tensor, live: torch.Tensor) -> dict[str, torch.Tensor]:
        """Their values for resampled `units` (`resample_units`): {name: rows}."""
        return {}

    def _coder_threshold(self) -> torch.Tensor | None:
        """The `Coder`'s thresholds (L,) where the activation has them."""
        return None

    @property
    def num_units(self) -> int:
        return self.spec.num_latents

    @property
    def output_bias(self) -> nn.Parameter:
        return self.b_dec  # added to every token's output

    def output_directions(self) -> torch.Tensor:
        return self.W_dec.detach()  # latent l adds W_dec[l] per unit of its value: (L, O)

    def sparse_coder(self) -> Coder:
        """Exactly the shape the sparse-coder tools hold (sparsify's transcoders, circuit-tracer's, SAELens's)."""
        skip = None if self.W_skip is None else self.W_skip.detach()
        select = None if self.b_select is None else self.b_select.detach()
        threshold = self._coder_threshold()
        return Coder(self.W_enc.detach(), self.b_enc.detach(), self.W_dec.detach(), self.b_dec.detach(), skip,
                     self.spec.coder_activation, int(self.spec.k), select,
                     None if threshold is None else threshold.detach())

    def reset_parameters(self) -> None:
        """nn.Linear defaults for the encoder and decoder (the MxD paper's baselines); b_enc = b_dec = 0. With a skip
        path W_dec and W_skip start at 0 (Paulo et al.; the MxD reference code)."""
        I, L = self.spec.d_in, self.spec.num_latents
        uniform_(self.W_enc, linear_bound(I))
        nn.init.zeros_(self.b_enc)
        self._reset_per_latent_parameters()
        if self.W_skip is not None:
            nn.init.zeros_(self.W_dec)
            nn.init.zeros_(self.W_skip)
        else:
            uniform_(self.W_dec, linear_bound(L))
        nn.init.zeros_(self.b_dec)
        if self.b_select is not None:
            nn.init.zeros_(self.b_select)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return decode_rows(self.encode(hidden_states), self.W_dec, self.b_dec, hidden_states, self.W_skip)

    @torch.no_grad()
    def resample_units(self, units: torch.Tensor, x: torch.Tensor, error: torch.Tensor) -> dict[str, torch.Tensor]:
        """Dead latents' encoder rows point at their inputs x (scaled to the live rows' mean norm, b_enc 0), their
        per-latent parameters start where the kind says; their decoder rows start at 0, so the output is unchanged
        until the decoder gradient (nonzero once the latent fires) moves them."""
        live = torch.ones(self.spec.num_latents, dtype=torch.bool, device=units.device)
        live[units] = False
        self._point_rows(self.W_enc, units, x, live)
        self.b_enc[units] = 0
        moved = self._resample_per_latent_parameters(units, live)
        self.W_dec[units] = 0
        return {"W_enc": units, "b_enc": units, **moved, "W_dec": units}
