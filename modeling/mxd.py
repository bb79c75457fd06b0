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

from .sparse_base import ACTIVATIONS, SparseLayer, canonical_activation, linear_bound, uniform_
from .sparse_code import SparseCode
from .sparse_kernels import LinearReluTopK, dead_relu_topk, sparse_rows_sum
from .sparse_spec import SparseSpec, _require_bool, _require_choice, _require_int, arxiv_bibtex


@dataclasses.dataclass
class MxdSpec(SparseSpec):
    kind = "mxd"
    activation_meaning: ClassVar[str] = "expert coefficient a_n = TopK(ReLU(G x + b_G))"
    title: ClassVar[str] = "Mixture of Decoders (MxD)"
    not_sparse_coder: ClassVar[str] = (
        "expert n adds c_n ⊙ (Dᵀz), which depends on the token through the hidden code z: no fixed decoder row "
        "per expert"
    )
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
    """H: width of the dense hidden code z (by default half the base MLP's width; the paper's is the full width)."""
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
    selection_bias: bool = False
    """A per-expert bias `b_select` (a buffer) added to the gate scores only to choose the top K among the positive
    ones, never to weight (auxiliary-loss-free balancing; the trainer moves it, `train.balance`)."""

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
        for name in ("encoder_bias", "random_k", "unit_norm_experts", "selection_bias"):
            _require_bool(self, name)

    @property
    def glu(self) -> bool:
        return self.encoder == "glu"

    @classmethod
    def mlp_defaults(cls, shape, *, init: str = "default", num_units: int | None = None) -> dict:
        """H = half the MLP's width, not the paper's full width. With H = W the dense path contains the MLP itself
        (Cᵀa a constant vector), and the longer it trains the less its experts carry: on the two tiny benchmark
        models the code's share at K = 32 fell to 0.44-0.51 at the largest budget. H = W/2 was the setting whose code
        carried at least half of the layer on every model and budget measured at K = 32 (0.65-1.00), with the lowest
        KL among those (docs/results/code_share.md). The paper's recipes (recipes/paper/) set H = W explicitly."""
        fields = super().mlp_defaults(shape, init=init, num_units=num_units)
        fields["d_hidden"] = max(1, shape.d_hidden // 2)
        return fields

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

    selects_top_k_units = True
    token_directions = True  # expert n's output is c_n ⊙ (Dᵀz): its direction depends on the token's hidden code

    def direction_terms(self, z: torch.Tensor) -> torch.Tensor:
        return z @ self.W_dec.to(z.dtype)  # Dᵀz: (T, O)

    def directions_from_means(self, means: torch.Tensor) -> torch.Tensor:
        return self.W_experts.detach().to(means.dtype) * means  # c_n ⊙ mean Dᵀz: (N, O)
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
        self._init_selection_bias(N)
        self.reset_parameters()

    @property
    def num_units(self) -> int:
        return self.spec.num_experts

    @property
    def output_bias(self) -> nn.Parameter:
        return self.b_dec  # added to every token's output

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
        if self.b_select is not None:
            nn.init.zeros_(self.b_select)

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
        source, lead = x, x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # (T, I)
        # = relu_topk(self.gate_logits(x), k, b_select), with a backward over the K selected gate rows only (no dense
        # (T, N) grad); pre (T, N) is kept for AuxK when it runs this step
        values, index, pre = LinearReluTopK.apply(
            x, self.W_gate, self.b_gate, self._sample_k(self.spec.k), self.b_select, self._wants_pre()
        )  # (T, K) each
        self._note_selection_scale(values)
        self._keep(source, pre=pre)
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
        modulation = self.hidden(x) @ self.W_dec  # Dᵀz: (T, O)
        self._keep(hidden_states, modulation=modulation)
        out = mix * modulation + self.b_dec  # (T, O)
        return out.view(*lead, -1)

    def average_code_output(self, x: torch.Tensor, mean_weights: torch.Tensor) -> torch.Tensor:
        """(Cᵀā) ⊙ (Dᵀz) + b with ā = `mean_weights` (N,): the output is linear in the code, so the average code is
        one (O,) mix instead of an N-wide code per token. (..., I) -> (..., O)."""
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # (T, I)
        mix = mean_weights.to(self.W_experts.dtype) @ self.W_experts  # Cᵀā: (O,)
        return (mix * (self.hidden(x) @ self.W_dec) + self.b_dec).view(*lead, -1)

    def auxk_reconstruction(self, x: torch.Tensor, dead_mask: torch.Tensor, k_aux: int) -> torch.Tensor:
        """AuxK's ê for MxD: (Cᵀa_aux) * (Dᵀz) with a_aux = TopK_aux(ReLU(Gx + b_G)) over the dead experts, i.e. the
        dead experts' rows of C under the same dense modulation; no b_dec. (..., I), (N,) bool -> (..., O).
        Gradients reach only the selected dead experts' rows of W_gate, b_gate and W_experts: Dᵀz is detached, so
        the shared dense path (W_enc, W_glu, W_dec) is trained by the main loss alone (as an SAE's AuxK touches only
        dead latents' parameters). Random K̂ and interventions do not apply here. The dense products (the gate
        pre-activations and Dᵀz) are the training forward's when it kept them (`keep_for_auxk`), else recomputed."""
        kept, lead = self._take_kept(x), x.shape[:-1]  # the forward's pre-activations and Dᵀz, when it kept them
        x = x.reshape(-1, x.shape[-1])  # (T, I)
        values, index = dead_relu_topk(x, self.W_gate, self.b_gate, dead_mask, k_aux, pre=kept.get("pre"))
        mix = sparse_rows_sum(SparseCode(index, values), self.W_experts)  # Cᵀa_aux: (T, O)
        modulation = kept.get("modulation")
        if modulation is None:
            with torch.no_grad():
                modulation = self.hidden(x) @ self.W_dec  # Dᵀz: (T, O)
        return (mix * modulation).view(*lead, -1)

    supports_resampling = True

    @torch.no_grad()
    def resample_units(self, units: torch.Tensor, x: torch.Tensor, error: torch.Tensor) -> dict[str, torch.Tensor]:
        """Dead experts' gate rows point at their inputs x (scaled to the live rows' mean norm, b_gate 0), so they
        win the top K on similar tokens; their rows of C start at 0 (the output is unchanged; C's gradient is
        nonzero as soon as the expert is selected, and then the gate's)."""
        live = torch.ones(self.spec.num_experts, dtype=torch.bool, device=units.device)
        live[units] = False
        self._point_rows(self.W_gate, units, x, live)
        self.b_gate[units] = 0
        self.W_experts[units] = 0
        if self.spec.unit_norm_experts:  # a unit row that the gradient can rotate (zero cannot be normalized)
            self.W_experts[units] = error[:, : self.spec.d_out].to(self.W_experts.dtype)
            self.renormalize_experts_()
        return {"W_gate": units, "b_gate": units, "W_experts": units}

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
