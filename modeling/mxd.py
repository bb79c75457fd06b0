"""Mixture of Decoders (MxD; Oldfield et al. 2025, arXiv 2505.21364).

    z = φ(E x + b_E)                       (MLP encoder)      or   z = φ(E x + b_E) * (E_glu x + b_glu)   (GLU)
    a = TopK(ReLU(G x + b_G))              sparse expert coefficients over N experts
    y = (Cᵀ a) * (Dᵀ z) + b                Lemma 2: equals Σ_n a_n W_nᵀ z with full-rank experts W_n = D diag(c_n)

Shapes (letters as in sparse_base): W_enc, W_glu (H, I); W_gate (N, I); W_experts = C (N, O), row n = c_n;
W_dec = D (H, O); b_dec (O,).

`Cᵀa` is a weighted sum of the K selected rows of C (`embedding_bag`): the N-wide coefficient vector is never
densified and the N×H×O expert tensor is never materialized.

# Diff with the reference code (james-oldfield/MxD): it scatters `a` into a dense N-vector and computes `a @ C`
# over all N experts. Its GLU puts the activation on `W_enc`, as here (the paper's text names them the other way).
"""

import dataclasses
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from .sparse_base import (
    ACTIVATIONS,
    SparseCode,
    SparseLayer,
    SparseSpec,
    _LinearReluTopK,
    _require_bool,
    _require_choice,
    _require_int,
    arxiv_bibtex,
    canonical_activation,
    linear_bound,
    sparse_rows_sum,
    uniform_,
)
from .transcoder import dead_relu_topk


@dataclasses.dataclass
class MxdSpec(SparseSpec):
    kind = "mxd"
    title: ClassVar[str] = "Mixture of Decoders (MxD)"
    match_conventions: ClassVar[tuple[str, ...]] = ("exact", "paper")
    citation: ClassVar[str] = arxiv_bibtex(
        "oldfield2025mxd",
        title="Towards Interpretability Without Sacrifice: "
        "Faithful Dense Layer Decomposition with Mixture of Decoders",
        authors=["Oldfield, James", "Im, Shawn", "Li, Yixuan", "Nicolaou, Mihalis A.", "Patras, Ioannis",
                 "Chrysos, Grigorios G."],
        year=2025,
        arxiv_id="2505.21364",
    )
    d_hidden: int
    """H: width of the dense hidden code z (the base MLP's width, by default)."""
    num_experts: int
    """N: number of experts (rows of C)."""
    k: int = 32
    """K: active experts per token."""
    encoder: str = "mlp"
    """'mlp' (z = φ(Ex)) or 'glu' (z = φ(Ex) * E_glu x), matching the base model's MLP."""
    activation: str = "gelu"
    """φ: gelu (exact), gelu_new (tanh approximation, GPT-2), silu (Llama), relu."""
    encoder_bias: bool = True
    """Biases on the encoder projections (b_E and, for GLU, b_glu)."""
    random_k: bool = False
    """Training only: draw K̂ ~ U{K - K//2, ..., K + K//2} per forward (MxD paper App. C.2); eval uses K."""
    unit_norm_experts: bool = False
    """Keep every expert row c_n at unit L2 norm (the reference code's `norm_dec`); the trainer calls
    `renormalize_experts_()` after each step and `project_expert_grads_()` before it."""

    def validate(self) -> None:
        super().validate()
        _require_int(self, "d_hidden")
        _require_int(self, "num_experts")
        _require_int(self, "k")
        if self.k > self.num_experts:
            raise ValueError(
                f"mxd.k={self.k} exceeds mxd.num_experts={self.num_experts}: TopK cannot select more experts than "
                "exist; lower k or raise num_experts"
            )
        _require_choice(self, "encoder", ("mlp", "glu"))
        self.activation = canonical_activation(self.activation)
        for name in ("encoder_bias", "random_k", "unit_norm_experts"):
            _require_bool(self, name)

    @property
    def glu(self) -> bool:
        return self.encoder == "glu"

    @classmethod
    def matched_size(cls, fields: dict, num_latents: int, convention: str) -> int | None:
        """"paper": N of the MxD paper's Table 2 (N = 21,490 for GPT-2). For MLP encoders its reference code leaves
        the encoder biases out on both sides and rounds, N = round((L - H)(I + O) / (I + O + 1)); for GLU encoders
        it counts every bias and floors, which is the exact search (None)."""
        if convention != "paper" or fields.get("encoder", "mlp") != "mlp":
            return None
        I, O, H = fields["d_in"], fields["d_out"], fields["d_hidden"]
        return round((num_latents - H) * (I + O) / (I + O + 1))

    def num_parameters(self) -> int:
        I, O, H, N = self.d_in, self.d_out, self.d_hidden, self.num_experts
        n_enc = 2 if self.glu else 1
        return n_enc * H * (I + int(self.encoder_bias)) + H * O + N * (I + O + 1) + O

    def active_parameters(self) -> int:
        I, O, H, N = self.d_in, self.d_out, self.d_hidden, self.num_experts
        n_enc = 2 if self.glu else 1
        # The whole gate is read to rank the experts; only K rows of C are touched.
        return n_enc * H * (I + int(self.encoder_bias)) + H * O + N * (I + 1) + self.k * O + O

    def flops_per_token(self) -> int:
        I, O, H, N, K = self.d_in, self.d_out, self.d_hidden, self.num_experts, self.k
        n_enc = 2 if self.glu else 1
        return 2 * (n_enc * I * H + H * O + I * N + K * O) + O


class MxdLayer(SparseLayer):
    """MxD as a drop-in MLP replacement; see the module docstring for the equations."""

    spec: MxdSpec

    supports_auxk = True
    """Dead experts (gate units) can model the residual error (`auxk_reconstruction`; conversion/training/auxk.py)."""

    def __init__(self, spec: MxdSpec) -> None:
        super().__init__(spec)
        I, O, H, N = spec.d_in, spec.d_out, spec.d_hidden, spec.num_experts
        self.act = ACTIVATIONS[spec.activation]
        self.W_enc = nn.Parameter(torch.empty(H, I))
        self.b_enc = nn.Parameter(torch.empty(H)) if spec.encoder_bias else None
        self.W_glu = nn.Parameter(torch.empty(H, I)) if spec.glu else None
        self.b_glu = nn.Parameter(torch.empty(H)) if spec.glu and spec.encoder_bias else None
        self.W_gate = nn.Parameter(torch.empty(N, I))
        self.b_gate = nn.Parameter(torch.empty(N))
        self.W_experts = nn.Parameter(torch.empty(N, O))  # C
        self.W_dec = nn.Parameter(torch.empty(H, O))  # D
        self.b_dec = nn.Parameter(torch.empty(O))
        self.reset_parameters()

    @property
    def num_units(self) -> int:
        return self.spec.num_experts

    def reset_parameters(self) -> None:
        """The paper's init (§B.4.1, reference code): nn.Linear defaults for E, E_glu, G and C; b_E = b_G = 0;
        D = 0 (so the layer starts as the constant b_dec, which the trainer sets to the mean MLP output)."""
        I, N = self.spec.d_in, self.spec.num_experts
        uniform_(self.W_enc, linear_bound(I))
        if self.b_enc is not None:
            nn.init.zeros_(self.b_enc)
        if self.W_glu is not None:
            uniform_(self.W_glu, linear_bound(I))
        if self.b_glu is not None:
            uniform_(self.b_glu, linear_bound(I))
        uniform_(self.W_gate, linear_bound(I))
        nn.init.zeros_(self.b_gate)
        if self.spec.unit_norm_experts:
            uniform_(self.W_experts, 1.0)
            if not getattr(self.W_experts, "_is_hf_initialized", False):  # never rescale loaded weights
                self.renormalize_experts_()
        else:
            uniform_(self.W_experts, linear_bound(N))
        nn.init.zeros_(self.W_dec)
        nn.init.zeros_(self.b_dec)

    # -- forward ------------------------------------------------------------------------------------------------

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Dense hidden code z: (T, I) -> (T, H)."""
        z = self.act(F.linear(x, self.W_enc, self.b_enc))
        if self.W_glu is not None:
            z = z * F.linear(x, self.W_glu, self.b_glu)
        return z

    def gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-activation expert scores G x + b_G: (T, I) -> (T, N)."""
        return F.linear(x, self.W_gate, self.b_gate)

    def encode(self, x: torch.Tensor) -> SparseCode:
        """Sparse expert coefficients a = TopK(ReLU(Gx + b_G)) as (index, weight) pairs: (..., I) -> (..., K)."""
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # (T, I)
        # = relu_topk(self.gate_logits(x), k), with a backward over the K selected gate rows only (no dense (T, N) grad)
        values, index = _LinearReluTopK.apply(x, self.W_gate, self.b_gate, self._sample_k(self.spec.k))  # (T, K) each
        return self._hook_code(index, values, lead)

    def _sample_k(self, k: int) -> int:
        if not (self.training and self.spec.random_k):
            return k
        # One K̂ per forward, from torch's global RNG so that seeded / resumed runs reproduce it.
        lo, hi = max(1, k - k // 2), min(self.spec.num_experts, k + k // 2)
        return int(torch.randint(lo, hi + 1, ()).item())

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        lead = hidden_states.shape[:-1]
        x = hidden_states.reshape(-1, hidden_states.shape[-1])  # (T, I)
        code = self.encode(hidden_states).flat()  # (T, K); the hook saw (..., K)
        mix = sparse_rows_sum(code, self.W_experts)  # Cᵀa: (T, O)
        out = mix * (self.hidden(x) @ self.W_dec) + self.b_dec  # (T, O)
        return out.view(*lead, -1)

    def auxk_reconstruction(self, x: torch.Tensor, dead_mask: torch.Tensor, k_aux: int) -> torch.Tensor:
        """AuxK's ê for MxD: (Cᵀa_aux) * (Dᵀz) with a_aux = TopK_aux(ReLU(Gx + b_G)) over the dead experts, i.e. the
        dead experts' rows of C under the same dense modulation; no b_dec. (..., I), (N,) bool -> (..., O).
        Gradients reach only the selected dead experts' rows of W_gate, b_gate and W_experts: Dᵀz is detached, so
        the shared dense path (W_enc, W_glu, W_dec) is trained by the main loss alone (as an SAE's AuxK touches only
        dead latents' parameters). Random K̂ and interventions do not apply here."""
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # (T, I)
        values, index = dead_relu_topk(x, self.W_gate, self.b_gate, dead_mask, k_aux)  # (T, k_aux) each
        mix = sparse_rows_sum(SparseCode(index, values), self.W_experts)  # Cᵀa_aux: (T, O)
        with torch.no_grad():
            modulation = self.hidden(x) @ self.W_dec  # Dᵀz: (T, O)
        return (mix * modulation).view(*lead, -1)

    # -- unit-norm experts (reference code's `norm_dec`) ----------------------------------------------------------

    def before_optimizer_step(self) -> None:
        if self.spec.unit_norm_experts:
            self.project_expert_grads_()

    def after_optimizer_step(self) -> None:
        if self.spec.unit_norm_experts:
            self.renormalize_experts_()

    @torch.no_grad()
    def renormalize_experts_(self) -> None:
        self.W_experts.div_(self.W_experts.norm(dim=-1, keepdim=True).clamp_min(1e-12))

    @torch.no_grad()
    def project_expert_grads_(self) -> None:
        """Remove the gradient component parallel to each c_n (keeps the step on the unit sphere to first order)."""
        grad = self.W_experts.grad
        if grad is None:
            return
        rows = self.W_experts / self.W_experts.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # (N, O)
        grad.sub_((grad * rows).sum(-1, keepdim=True) * rows)

    # -- inspection ---------------------------------------------------------------------------------------------

    def expert_weight(self, n: int) -> torch.Tensor:
        """Materialize expert n's full-rank matrix W_n = D diag(c_n): (H, O). For inspection only."""
        return self.W_dec * self.W_experts[n]
