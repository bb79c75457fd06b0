"""TopK transcoders (Dunefsky et al. 2024) and skip transcoders (Paulo et al. 2025): the MxD paper's baselines.

    z = TopK(ReLU(W_enc x + b_enc))        over L latents
    y = W_decᵀ z + b_dec  (+ W_skip x)     skip transcoder adds a dense linear skip path

Shapes: W_enc (L, I); b_enc (L,); W_dec (L, O), row l = latent l's decoder direction; b_dec (O,); W_skip (O, I).
Names follow EleutherAI sparsify (`num_latents`, `k`, `W_dec`, `b_dec`, `W_skip`). The decoder sum touches only the K
selected rows of W_dec (`embedding_bag`).
"""

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from .sparse_base import Coder, SparseLayer, linear_bound, uniform_
from .sparse_code import SparseCode
from .sparse_kernels import LinearReluTopK, dead_relu_topk, decode_rows, sparse_rows_sum
from .sparse_spec import SparseSpec, _require_bool, _require_int, arxiv_bibtex


@dataclasses.dataclass
class TranscoderSpec(SparseSpec):
    kind = "transcoder"
    activation_meaning: ClassVar[str] = "latent value TopK(ReLU(W_enc x + b_enc))"
    title: ClassVar[str] = "TopK transcoder"
    unit_name: ClassVar[str] = "latent"
    units_field: ClassVar[str] = "num_latents"
    citation: ClassVar[str] = arxiv_bibtex(
        "dunefsky2024transcoders",
        title="Transcoders Find Interpretable LLM Feature Circuits",
        authors=["Dunefsky, Jacob", "Chlenski, Philippe", "Nanda, Neel"],
        year=2024,
        arxiv_id="2406.11944",
    )
    num_latents: int
    """L: dictionary size (the MxD paper uses 32 × d_in)."""
    k: int = 32
    """Active latents per token."""
    selection_bias: bool = False
    """A per-latent bias `b_select` (a buffer) added to the encoder pre-activations only to choose the top K among
    the positive ones, never to weight (auxiliary-loss-free balancing; the trainer moves it, `train.balance`)."""

    skip_connection = False  # class constant; the skip transcoder sets it
    coder_activation: ClassVar[str | None] = "topk"

    def validate(self) -> None:
        super().validate()
        _require_int(self, "num_latents")
        _require_int(self, "k")
        _require_bool(self, "selection_bias")
        if self.k > self.num_latents:
            raise ValueError(
                f"{self.kind}.k={self.k} exceeds {self.kind}.num_latents={self.num_latents}: TopK cannot select more "
                "latents than exist; lower k or raise num_latents"
            )

    @classmethod
    def matched_size(cls, fields: dict, num_latents: int, convention: str) -> int:
        """A transcoder matched to a transcoder of `num_latents` latents has exactly that many (a skip transcoder
        too: its skip path comes on top, as in Paulo et al.'s comparisons)."""
        return num_latents

    def num_parameters(self) -> int:
        I, O, L = self.d_in, self.d_out, self.num_latents
        return L * (I + 1) + L * O + O + (I * O if self.skip_connection else 0)

    def active_parameters(self) -> int:
        I, O, L = self.d_in, self.d_out, self.num_latents
        return L * (I + 1) + self.k * O + O + (I * O if self.skip_connection else 0)

    def flops_per_token(self) -> int:
        I, O, L = self.d_in, self.d_out, self.num_latents
        return 2 * (I * L + self.k * O + (I * O if self.skip_connection else 0)) + O


@dataclasses.dataclass
class SkipTranscoderSpec(TranscoderSpec):
    kind = "skip_transcoder"
    title: ClassVar[str] = "skip transcoder"
    citation: ClassVar[str] = arxiv_bibtex(
        "paulo2025transcoders",
        title="Transcoders Beat Sparse Autoencoders for Interpretability",
        authors=["Paulo, Gon{\\c{c}}alo", "Shabalin, Stepan", "Belrose, Nora"],
        year=2025,
        arxiv_id="2501.18823",
    )
    skip_connection = True


class TranscoderLayer(SparseLayer):
    """TopK transcoder, with the zero-initialized skip path `W_skip` when `spec.skip_connection`."""

    spec: TranscoderSpec

    selects_top_k_units = True

    def output_directions(self) -> torch.Tensor:
        return self.W_dec.detach()  # latent l adds W_dec[l] per unit of its value: (L, O)

    def sparse_coder(self) -> Coder:
        """Exactly the shape the sparse-coder tools hold (sparsify's transcoders, circuit-tracer's)."""
        skip = None if self.W_skip is None else self.W_skip.detach()
        select = None if self.b_select is None else self.b_select.detach()
        return Coder(self.W_enc.detach(), self.b_enc.detach(), self.W_dec.detach(), self.b_dec.detach(), skip,
                     "topk", int(self.spec.k), select)
    supports_auxk = True
    """Dead latents can model the residual error (`auxk_reconstruction`; conversion/training/auxk.py)."""

    def __init__(self, spec: TranscoderSpec) -> None:
        super().__init__(spec)
        I, O, L = spec.d_in, spec.d_out, spec.num_latents
        self.W_enc = nn.Parameter(torch.empty(L, I))
        self.b_enc = nn.Parameter(torch.empty(L))
        self.W_dec = nn.Parameter(torch.empty(L, O))
        self.b_dec = nn.Parameter(torch.empty(O))
        self.W_skip = nn.Parameter(torch.empty(O, I)) if spec.skip_connection else None
        self._init_selection_bias(L)
        self.reset_parameters()

    @property
    def num_units(self) -> int:
        return self.spec.num_latents

    @property
    def output_bias(self) -> nn.Parameter:
        return self.b_dec  # added to every token's output

    def reset_parameters(self) -> None:
        """nn.Linear defaults for the encoder and decoder (MxD paper's baselines); b_enc = b_dec = 0.
        Skip transcoders start with W_dec = W_skip = 0 (Paulo et al.; the MxD reference code)."""
        I, L = self.spec.d_in, self.spec.num_latents
        uniform_(self.W_enc, linear_bound(I))
        nn.init.zeros_(self.b_enc)
        if self.W_skip is not None:
            nn.init.zeros_(self.W_dec)
            nn.init.zeros_(self.W_skip)
        else:
            uniform_(self.W_dec, linear_bound(L))
        nn.init.zeros_(self.b_dec)
        if self.b_select is not None:
            nn.init.zeros_(self.b_select)

    def encode(self, x: torch.Tensor) -> SparseCode:
        """z = TopK(ReLU(W_enc x + b_enc)) as (index, weight) pairs: (..., I) -> (..., K).

        The backward touches only the K selected encoder rows (`LinearReluTopK`: no dense (T, L) gradient, no two
        T×L×I products); the pre-activations are kept for AuxK when it runs this step."""
        source, lead = x, x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # (T, I)
        values, index, pre = LinearReluTopK.apply(
            x, self.W_enc, self.b_enc, self.spec.k, self.b_select, self._wants_pre()
        )  # (T, K) each
        self._note_selection_scale(values)
        self._keep(source, pre=pre)
        return self._hook_code(index, values, lead)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return decode_rows(self.encode(hidden_states), self.W_dec, self.b_dec, hidden_states, self.W_skip)

    supports_resampling = True

    @torch.no_grad()
    def resample_units(self, units: torch.Tensor, x: torch.Tensor, error: torch.Tensor) -> dict[str, torch.Tensor]:
        """Dead latents' encoder rows point at their inputs x (scaled to the live rows' mean norm, b_enc 0); their
        decoder rows start at 0, so the output is unchanged until the decoder gradient (nonzero once the latent
        fires) moves them."""
        live = torch.ones(self.spec.num_latents, dtype=torch.bool, device=units.device)
        live[units] = False
        self._point_rows(self.W_enc, units, x, live)
        self.b_enc[units] = 0
        self.W_dec[units] = 0
        return {"W_enc": units, "b_enc": units, "W_dec": units}

    def auxk_reconstruction(self, x: torch.Tensor, dead_mask: torch.Tensor, k_aux: int) -> torch.Tensor:
        """AuxK's ê: W_decᵀ z_aux with z_aux = TopK_aux(ReLU(W_enc x + b_enc)) over the dead latents; no b_dec and
        no skip path (the dead latents' contribution only). (..., I), (L,) bool -> (..., O).
        Gradients reach only the selected dead latents' rows of W_enc, b_enc and W_dec. The ranking reuses the
        training forward's pre-activations when it kept them (`keep_for_auxk`)."""
        kept, lead = self._take_kept(x), x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # (T, I)
        values, index = dead_relu_topk(x, self.W_enc, self.b_enc, dead_mask, k_aux, pre=kept.get("pre"))
        return sparse_rows_sum(SparseCode(index, values), self.W_dec).view(*lead, -1)  # (..., O)
