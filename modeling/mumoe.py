"""Multilinear Mixture of Experts (μMoE; Oldfield et al., NeurIPS 2024, arXiv 2402.12550) as an MLP replacement.

A μMoE map (Eq. 1) mixes N linear experts W_n (P×Q, plus a per-expert bias β_n) with dense gate coefficients a:

    y = Σ_n a_n (W_nᵀ z + β_n),    a = entmax15(LN(G x))         G (N, I), no bias, zero init; LN without affine

and never forms the N×P×Q expert tensor: the experts are a factorized tensor that is contracted in rank space.

    CP (Eq. 2), rank R:          y = U_outᵀ [ (U_expertsᵀ a) ⊙ (U_in z + b_in) ]
                                 W_n = U_inᵀ diag(U_experts[n]) U_out,  β_n = U_outᵀ (U_experts[n] ⊙ b_in)
    tensor ring (Eq. 3), R1 R2 R3:
                                 F1 = U_experts ×_1 a (R1×R2),  F2 = U_in ×_3 z + b_in (R2×R3),  y = ⟨F1 F2, U_out⟩
                                 W_n[p, q] = tr(U_experts[n] · U_in[:, :, p] · U_out[:, :, q]ᵀ)

The per-expert bias is the paper's "append 1 to z" (input mode P+1), stored as its own tensor `b_in`.

As a drop-in MLP (`form`):

- "encoder" (default): z = φ(E x + b_E) (or the GLU φ(E x) * (E_glu x)), y = μMoE(z; a) + b_dec. The dense first
  layer keeps the base MLP's hidden code and its shape (plain or gated, so Llama works unchanged), and only the
  decoder becomes a mixture of experts, like MxD's: MxD's y = (Cᵀa) * (Dᵀz) is a CP μMoE with R = O, U_out = I_O,
  so with this form the two kinds differ only in the gate and the low-rank output factor, which makes them directly
  comparable on the same budget. It also spends the whole rank budget on one map instead of two.
- "block": the paper's GPT-2 block, y = μMoE_out(φ(μMoE_in(x; a)); a) + b_dec, with one `a` shared by both maps (a
  third map μMoE_glu for gated base MLPs: z = φ(μMoE_in(x; a)) * μMoE_glu(x; a)).
  # Diff with the reference code (james-oldfield/muMoE, nanoGPT): no affine LayerNorm on the data branch, because
  # the MLP input of a pre-LN transformer is already normalized; the gate reads the same input.

Init (App. F.2): gate G = 0 (a starts uniform), input factors U(±1/√P), experts N(1, σ) (TR: diagonal slices), and
the output map's U_out = 0 by default (`decoder_init`) so that distillation starts from b_dec, the mean MLP output.

The gate is always computed in at least float32 (entmax's support is decided by comparisons of sorted logits).
LayerNorm is used instead of the paper's vision BatchNorm: BatchNorm depends on the batch and breaks KV-cached
generation. There is no load-balancing loss (as in the paper). Hierarchical μMoEs (App. E) are not implemented.

Sparse code: entmax gives exact zeros, but its support varies per token, so `encode` returns all N experts as
(index, weight) pairs: `top_k_index` is arange(N) broadcast to (..., N) (a view, not a copy) and `top_k_weights` is
`a`. The forward always computes `U_expertsᵀ a` over all N anyway, so this costs nothing extra; L0 counts the
weights > 0. Steering and ablation act on `a` after the gate and are not renormalized, so ablating expert n is
exactly the paper's counterfactual W_n := 0 (with β_n; §4.2).

Shapes (letters as in sparse_base, plus): R CP rank; R1, R2, R3 tensor-ring ranks; P, Q the input and output width
of one μMoE map (I→H or H→O). Stored factors: CP U_experts (N, R), U_in (R, P), b_in (R,), U_out (R, Q);
TR U_experts (N, R1, R2), U_in (R2, R3, P), b_in (R2, R3), U_out (R1, R3, Q). The paper's cores are permutations
of these: U¹[a, n, b] = U_experts[n, a, b], U²[b, p, c] = U_in[b, c, p], U³[c, q, a] = U_out[a, c, q].
"""

import dataclasses
import math
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from .sparse_base import ACTIVATIONS, SparseLayer, canonical_activation, linear_bound, uniform_
from .sparse_code import SparseCode
from .sparse_spec import SparseSpec, _require_bool, _require_choice, _require_int, arxiv_bibtex

GATE_NORM_EPS = 1e-5
"""eps of the parameter-free LayerNorm on the gate logits (torch's default, as in the reference code)."""


# -- entmax15 ----------------------------------------------------------------------------------------------------


class _Entmax15(torch.autograd.Function):
    """1.5-entmax along the last dim (Peters et al. 2019): p_i = [z_i/2 - τ]₊² with τ such that Σ p = 1.

    Forward: exact threshold from the sorted inputs. For the top-ρ sorted values s_1 ≥ ... ≥ s_ρ of z/2, Σ_{i≤ρ}
    (s_i - τ)² = 1 gives τ(ρ) = mean_ρ - sqrt((1 - ρ·var_ρ)/ρ); the support size is the largest ρ with τ(ρ) < s_ρ
    (strict, so that a value tied exactly at the threshold gets an exact 0 rather than a rounding residue). The test
    holds exactly for ρ = 1..ρ* and fails beyond (Σ_{i<ρ}(s_i - s_ρ)² ≥ 1 there), so counting the passes finds ρ*.
    Backward: with g = sqrt(p) (zero off the support), J = diag(g) - g gᵀ / Σg, so dx = g ⊙ dy - g (gᵀdy / Σg).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:  # logits (T, N)
        x = (logits - logits.amax(dim=-1, keepdim=True)) / 2  # shift for stability: entmax is shift invariant
        s = x.sort(dim=-1, descending=True).values  # (T, N)
        rho = torch.arange(1, x.shape[-1] + 1, device=x.device, dtype=x.dtype)  # (N,)
        mean = s.cumsum(-1) / rho  # (T, N)
        mean_sq = (s * s).cumsum(-1) / rho  # (T, N)
        delta = (1 - rho * (mean_sq - mean * mean)) / rho
        # delta < 0 only where the top-ρ values are not all equal, so there mean_ρ > s_ρ and τ = mean_ρ fails the test
        tau = mean - delta.clamp_min(0).sqrt()  # (T, N)
        support = (tau < s).sum(dim=-1, keepdim=True)  # (T, 1), >= 1 since τ(1) = s_1 - 1
        tau_star = tau.gather(-1, support - 1)  # (T, 1)
        p = (x - tau_star).clamp_min(0) ** 2  # (T, N), exact zeros off the support
        ctx.save_for_backward(p)
        return p

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (p,) = ctx.saved_tensors
        g = p.sqrt()  # (T, N)
        grad_in = grad * g
        return grad_in - g * (grad_in.sum(-1, keepdim=True) / g.sum(-1, keepdim=True))


def entmax15(logits: torch.Tensor) -> torch.Tensor:
    """1.5-entmax over the last dim: a sparse softmax (exact zeros), differentiable, sums to one."""
    return _Entmax15.apply(logits)


# -- spec ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class MuMoESpec(SparseSpec):
    """Fields shared by `mumoe_cp` and `mumoe_tr` (this base class is not a registered kind)."""

    activation_meaning: ClassVar[str] = "soft gate coefficient a_n (entmax15: fires where a_n > 0)"
    not_sparse_coder: ClassVar[str] = (
        "expert n adds W_nᵀz + β_n, which depends on the token through the hidden code z, under a dense entmax "
        "gate: no fixed decoder row per expert and no TopK code"
    )

    citation: ClassVar[str] = arxiv_bibtex(
        "oldfield2024mumoe",
        title="Multilinear Mixture of Experts: Scalable Expert Specialization through Factorization",
        authors=["Oldfield, James", "Georgopoulos, Markos", "Chrysos, Grigorios G.", "Tzelepis, Christos",
                 "Panagakis, Yannis", "Nicolaou, Mihalis A.", "Deng, Jiankang", "Patras, Ioannis"],
        year=2024,
        arxiv_id="2402.12550",
    )

    match_field: ClassVar[str] = "rank"
    """Parameter matching (recipe `layer.match_transcoder`) picks the largest rank within the budget."""

    d_hidden: int
    """H: width of the hidden code z (the base MLP's width, by default)."""
    num_experts: int
    """N: number of experts (columns of the gate)."""
    rank: int
    """CP: R. Tensor ring: R3 (the paper tunes R3 to a parameter budget and keeps R1 = R2 = 4)."""
    form: str = "encoder"
    """'encoder' (dense encoder, μMoE decoder) or 'block' (the paper's μMoE → φ → μMoE); see the module docstring."""
    encoder: str = "mlp"
    """'mlp' (z = φ(·)) or 'glu' (z = φ(·) * (·)), matching the base model's MLP."""
    activation: str = "gelu"
    """φ: gelu (exact), gelu_new (tanh approximation, GPT-2), silu (Llama), relu."""
    encoder_bias: bool = True
    """Biases of whatever produces z: b_E (and b_glu) for form='encoder'; the first maps' per-expert biases for
    form='block'."""
    expert_bias: bool = True
    """Per-expert biases β_n of the output map (the paper's appended 1 on the input mode)."""
    gate_norm: str = "layernorm"
    """'layernorm' (parameter-free, over the N logits; the paper's choice for language) or 'none'."""
    gate_activation: str = "entmax15"
    """'entmax15' (the paper's; sparse) or 'softmax' (the paper's ablation; dense)."""
    expert_init_std: float = 1.0
    """σ of the expert factor's init: CP entries ~ N(1, σ); tensor ring slices diag(N(1, σ)) (paper App. F.2)."""
    decoder_init: str = "zeros"
    """'zeros': the output map's U_out starts at 0, so the layer starts as b_dec, the trainer's mean MLP output (as
    mxd); 'paper': U_out ~ U(±1/√R) (CP) or U(±1/√(R3·R1)) (TR), the paper's from-scratch init."""

    def validate(self) -> None:
        super().validate()
        for name in ("d_hidden", "num_experts", "rank"):
            _require_int(self, name)
        _require_choice(self, "form", ("encoder", "block"))
        _require_choice(self, "encoder", ("mlp", "glu"))
        self.activation = canonical_activation(self.activation)
        _require_bool(self, "encoder_bias")
        _require_bool(self, "expert_bias")
        if self.gate_norm == "batchnorm":
            raise ValueError(
                f"{self.kind}.gate_norm='batchnorm' is not supported: BatchNorm makes the gate depend on the batch, "
                "which breaks KV-cached generation (the paper uses LayerNorm for language models); use 'layernorm'"
            )
        _require_choice(self, "gate_norm", ("layernorm", "none"))
        _require_choice(self, "gate_activation", ("entmax15", "softmax"))
        _require_choice(self, "decoder_init", ("zeros", "paper"))
        std = self.expert_init_std
        if isinstance(std, bool) or not isinstance(std, (int, float)) or not (math.isfinite(std) and std >= 0):
            raise ValueError(f"{self.kind}.expert_init_std must be a finite number >= 0, got {std!r}")

    @property
    def glu(self) -> bool:
        return self.encoder == "glu"

    # One μMoE map P -> Q (its factors; the gate is counted once per layer). Kinds implement these two.
    def map_parameters(self, d_in: int, d_out: int, bias: bool) -> int:
        raise NotImplementedError

    def map_macs(self, d_in: int, d_out: int) -> int:
        """Multiply-accumulates of one map per token, the paper's Table 5 FLOP count."""
        raise NotImplementedError

    def num_parameters(self) -> int:
        I, O, H, N = self.d_in, self.d_out, self.d_hidden, self.num_experts
        n_enc = 2 if self.glu else 1
        if self.form == "block":
            first = n_enc * self.map_parameters(I, H, self.encoder_bias)
        else:
            first = n_enc * H * (I + int(self.encoder_bias))
        return first + N * I + self.map_parameters(H, O, self.expert_bias) + O

    def active_parameters(self) -> int:
        """Every parameter: μMoE is dense compute (entmax zeros skip no work; they only stop those experts' grads)."""
        return self.num_parameters()

    def flops_per_token(self) -> int:
        """2 × multiply-accumulates of the products (gate, encoder, μMoE maps) + the output bias; normalization,
        entmax's sort and elementwise products are not counted (as for mxd)."""
        I, O, H, N = self.d_in, self.d_out, self.d_hidden, self.num_experts
        n_enc = 2 if self.glu else 1
        first = n_enc * (self.map_macs(I, H) if self.form == "block" else I * H)
        return 2 * (I * N + first + self.map_macs(H, O)) + O


@dataclasses.dataclass
class MuMoECPSpec(MuMoESpec):
    kind = "mumoe_cp"
    title: ClassVar[str] = "CP multilinear mixture of experts (CPμMoE)"

    def map_parameters(self, d_in: int, d_out: int, bias: bool) -> int:
        R = self.rank
        return R * (self.num_experts + d_in + d_out) + R * int(bias)

    def map_macs(self, d_in: int, d_out: int) -> int:
        return self.rank * (self.num_experts + d_in + d_out)


@dataclasses.dataclass
class MuMoETRSpec(MuMoESpec):
    kind = "mumoe_tr"
    title: ClassVar[str] = "tensor-ring multilinear mixture of experts (TRμMoE)"
    rank_1: int = 4
    """R1: ring rank between the output and expert cores (R1 = 1 gives a tensor train)."""
    rank_2: int = 4
    """R2: ring rank between the expert and input cores. Expert rank ≤ min(R3·min(R1, R2), P, Q)."""

    def validate(self) -> None:
        super().validate()
        _require_int(self, "rank_1")
        _require_int(self, "rank_2")

    def map_parameters(self, d_in: int, d_out: int, bias: bool) -> int:
        R1, R2, R3 = self.rank_1, self.rank_2, self.rank
        return R1 * self.num_experts * R2 + R2 * d_in * R3 + R3 * d_out * R1 + R2 * R3 * int(bias)

    def map_macs(self, d_in: int, d_out: int) -> int:
        R1, R2, R3 = self.rank_1, self.rank_2, self.rank
        return R1 * self.num_experts * R2 + R2 * d_in * R3 + R1 * R2 * R3 + R1 * d_out * R3


# -- one factorized μMoE map --------------------------------------------------------------------------------------


class MuMoECPMap(nn.Module):
    """y = U_outᵀ[(U_expertsᵀ a) ⊙ (U_in z + b_in)] (Eq. 2): (T, N), (T, P) -> (T, Q)."""

    def __init__(self, num_experts: int, d_in: int, d_out: int, rank: int, bias: bool, expert_init_std: float):
        super().__init__()
        self.expert_init_std = expert_init_std
        self.U_experts = nn.Parameter(torch.empty(num_experts, rank))
        self.U_in = nn.Parameter(torch.empty(rank, d_in))
        self.b_in = nn.Parameter(torch.empty(rank)) if bias else None
        self.U_out = nn.Parameter(torch.empty(rank, d_out))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Paper App. F.2 / reference code: input factor U(±1/√P) (its bias row too), output factor U(±1/√R),
        expert factor N(1, σ) so that every expert starts near one shared low-rank map."""
        uniform_(self.U_in, linear_bound(self.U_in.shape[1]))
        if self.b_in is not None:
            uniform_(self.b_in, linear_bound(self.U_in.shape[1]))
        uniform_(self.U_out, linear_bound(self.U_out.shape[0]))
        nn.init.normal_(self.U_experts, mean=1.0, std=self.expert_init_std)

    def forward(self, a: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        mix = a @ self.U_experts  # U_expertsᵀ a: (T, R)
        return (mix * F.linear(z, self.U_in, self.b_in)) @ self.U_out  # (T, R) -> (T, Q)

    def expert_weight(self, n: int) -> torch.Tensor:
        """W_n = U_inᵀ diag(U_experts[n]) U_out: (P, Q). For inspection only."""
        return (self.U_in.T * self.U_experts[n]) @ self.U_out

    def expert_bias(self, n: int) -> torch.Tensor:
        """β_n: (Q,); zero without a bias."""
        if self.b_in is None:
            return self.U_out.new_zeros(self.U_out.shape[1])
        return (self.U_experts[n] * self.b_in) @ self.U_out


class MuMoETRMap(nn.Module):
    """Tensor-ring μMoE map (Eq. 3): (T, N), (T, P) -> (T, Q) through per-token R1×R2 and R2×R3 matrices."""

    def __init__(
        self, num_experts: int, d_in: int, d_out: int, ranks: tuple[int, int, int], bias: bool, expert_init_std: float
    ):
        super().__init__()
        R1, R2, R3 = ranks
        self.expert_init_std = expert_init_std
        self.U_experts = nn.Parameter(torch.empty(num_experts, R1, R2))
        self.U_in = nn.Parameter(torch.empty(R2, R3, d_in))
        self.b_in = nn.Parameter(torch.empty(R2, R3)) if bias else None
        self.U_out = nn.Parameter(torch.empty(R1, R3, d_out))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Paper App. F.2 / reference code: input core U(±1/√P) (its bias slice too), output core U(±1/√(R3·R1)),
        every expert slice U_experts[n] = diag(N(1, σ)) (rectangular identity plus noise on the diagonal)."""
        R1, R3, P = self.U_out.shape[0], self.U_in.shape[1], self.U_in.shape[2]
        uniform_(self.U_in, linear_bound(P))
        if self.b_in is not None:
            uniform_(self.b_in, linear_bound(P))
        uniform_(self.U_out, linear_bound(R3 * R1))
        nn.init.zeros_(self.U_experts)
        # nn.init has no batched `eye_`; write the diagonals directly, but (like nn.init under transformers) never
        # over loaded weights, which carry `_is_hf_initialized`.
        if not getattr(self.U_experts, "_is_hf_initialized", False):
            with torch.no_grad():
                self.U_experts.diagonal(dim1=1, dim2=2).normal_(1.0, self.expert_init_std)

    def forward(self, a: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        N, R1, R2 = self.U_experts.shape
        _, R3, P = self.U_in.shape
        T = a.shape[0]
        f1 = (a @ self.U_experts.view(N, R1 * R2)).view(T, R1, R2)  # U¹ ×₂ a
        bias = self.b_in.view(R2 * R3) if self.b_in is not None else None
        f2 = F.linear(z, self.U_in.view(R2 * R3, P), bias).view(T, R2, R3)  # U² ×₂ [z; 1]
        f = torch.bmm(f1, f2)  # (T, R1, R3)
        return f.view(T, R1 * R3) @ self.U_out.view(R1 * R3, -1)  # Σ_{r1, r3} f · U³: (T, Q)

    def expert_weight(self, n: int) -> torch.Tensor:
        """W_n[p, q] = Σ U_experts[n, a, b] U_in[b, c, p] U_out[a, c, q] (Eq. 8): (P, Q). For inspection only."""
        return torch.einsum("ab,bcp,acq->pq", self.U_experts[n], self.U_in, self.U_out)

    def expert_bias(self, n: int) -> torch.Tensor:
        """β_n: (Q,); zero without a bias."""
        if self.b_in is None:
            return self.U_out.new_zeros(self.U_out.shape[2])
        return torch.einsum("ab,bc,acq->q", self.U_experts[n], self.b_in, self.U_out)


# -- the layer ----------------------------------------------------------------------------------------------------


class MuMoELayer(SparseLayer):
    """μMoE (CP or tensor ring) as a drop-in MLP replacement; see the module docstring for the equations."""

    spec: MuMoESpec

    router_distribution = "gates"  # a token's routing: its entmax gate a itself
    token_directions = True  # expert n's output W_nᵀ z + β_n depends on the token's hidden code z

    def direction_terms(self, z: torch.Tensor) -> torch.Tensor:
        return z  # (T, H)

    def directions_from_means(self, means: torch.Tensor) -> torch.Tensor:
        one_hot = torch.eye(self.num_units, device=means.device, dtype=self.b_dec.dtype)
        return self.mumoe_out(one_hot, means.to(self.b_dec.dtype))  # W_nᵀ mean z + β_n: (N, O)

    def __init__(self, spec: MuMoESpec) -> None:
        super().__init__(spec)
        I, O, H, N = spec.d_in, spec.d_out, spec.d_hidden, spec.num_experts
        self.act = ACTIVATIONS[spec.activation]
        self.W_gate = nn.Parameter(torch.empty(N, I))
        block = spec.form == "block"
        self.W_enc = nn.Parameter(torch.empty(H, I)) if not block else None
        self.b_enc = nn.Parameter(torch.empty(H)) if not block and spec.encoder_bias else None
        self.W_glu = nn.Parameter(torch.empty(H, I)) if not block and spec.glu else None
        self.b_glu = nn.Parameter(torch.empty(H)) if not block and spec.glu and spec.encoder_bias else None
        self.mumoe_in = self._make_map(I, H, spec.encoder_bias) if block else None
        self.mumoe_glu = self._make_map(I, H, spec.encoder_bias) if block and spec.glu else None
        self.mumoe_out = self._make_map(H, O, spec.expert_bias)
        self.b_dec = nn.Parameter(torch.empty(O))
        self.reset_parameters()

    def _make_map(self, d_in: int, d_out: int, bias: bool) -> nn.Module:
        spec = self.spec
        if isinstance(spec, MuMoETRSpec):
            ranks = (spec.rank_1, spec.rank_2, spec.rank)
            return MuMoETRMap(spec.num_experts, d_in, d_out, ranks, bias, spec.expert_init_std)
        return MuMoECPMap(spec.num_experts, d_in, d_out, spec.rank, bias, spec.expert_init_std)

    @property
    def num_units(self) -> int:
        return self.spec.num_experts

    @property
    def output_bias(self) -> nn.Parameter:
        return self.b_dec  # added to every token's output

    def reset_parameters(self) -> None:
        """Gate G = 0 (reference code: the normalized logits start at 0, so a starts uniform at 1/N); the dense
        encoder as MxD's (nn.Linear default E and E_glu, b_E = 0); the maps' paper init, except that by default
        (`decoder_init='zeros'`) the output map's U_out starts at 0, so that the layer starts as b_dec (the trainer's
        mean MLP output), like MxD's D = 0.
        # Diff with the paper (default only), which trains from scratch: a random decoder adds an output of fixed
        # scale that distillation must first unlearn, which costs most on MLPs with small outputs."""
        nn.init.zeros_(self.W_gate)
        if self.W_enc is not None:
            uniform_(self.W_enc, linear_bound(self.spec.d_in))
        if self.b_enc is not None:
            nn.init.zeros_(self.b_enc)
        if self.W_glu is not None:
            uniform_(self.W_glu, linear_bound(self.spec.d_in))
        if self.b_glu is not None:
            uniform_(self.b_glu, linear_bound(self.spec.d_in))
        for mumoe in (self.mumoe_in, self.mumoe_glu, self.mumoe_out):
            if mumoe is not None:
                mumoe.reset_parameters()
        if self.spec.decoder_init == "zeros":
            # Only the last map: a zero first map would give z = φ(0), and a dead start for φ = relu.
            nn.init.zeros_(self.mumoe_out.U_out)
        nn.init.zeros_(self.b_dec)

    # -- gate ---------------------------------------------------------------------------------------------------

    def gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Normalized gate logits LN(G x) in at least float32: (T, I) -> (T, N)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.to(dtype), self.W_gate.to(dtype))  # (T, N)
            if self.spec.gate_norm == "layernorm":
                logits = F.layer_norm(logits, logits.shape[-1:], eps=GATE_NORM_EPS)
        return logits

    def encode(self, x: torch.Tensor) -> SparseCode:
        """Expert coefficients a = entmax15(LN(G x)) as (index, weight) pairs over all N experts: (..., I) -> (..., N).

        The weights are float32 (or float64) whatever the input dtype; `top_k_index` is a broadcast view.
        """
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # (T, I)
        logits = self.gate_logits(x)  # (T, N)
        a = entmax15(logits) if self.spec.gate_activation == "entmax15" else logits.softmax(dim=-1)  # (T, N)
        self._set_router_outputs(logits if self.record_router_outputs else None, None)
        index = torch.arange(a.shape[-1], device=a.device).expand_as(a)  # (T, N)
        return self._hook_code(index, a, lead)

    def coefficients(self, code: SparseCode) -> torch.Tensor:
        """Dense coefficients a from (index, weight) pairs, summing repeated ids (steering): (T, K) -> (T, N)."""
        weights = code.top_k_weights
        a = weights.new_zeros(weights.shape[0], self.num_units)
        return a.scatter_add(-1, code.top_k_index, weights)

    # -- forward ------------------------------------------------------------------------------------------------

    def hidden(self, x: torch.Tensor, a: torch.Tensor | None) -> torch.Tensor:
        """Hidden code z: (T, I), (T, N) -> (T, H). `a` is used only by form='block'."""
        if self.mumoe_in is not None:
            z = self.act(self.mumoe_in(a, x))
            if self.mumoe_glu is not None:
                z = z * self.mumoe_glu(a, x)
            return z
        z = self.act(F.linear(x, self.W_enc, self.b_enc))
        if self.W_glu is not None:
            z = z * F.linear(x, self.W_glu, self.b_glu)
        return z

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        lead = hidden_states.shape[:-1]
        x = hidden_states.reshape(-1, hidden_states.shape[-1])  # (T, I)
        code = self.encode(hidden_states).flat()  # (T, N) (+ steered ids); the hook saw (..., N)
        a = self.coefficients(code).to(x.dtype)  # (T, N)
        out = self.mumoe_out(a, self.hidden(x, a)) + self.b_dec  # (T, O)
        return out.view(*lead, -1)

    # -- inspection ---------------------------------------------------------------------------------------------

    def expert_weight(self, n: int) -> torch.Tensor:
        """Expert n of the output map, materialized: W_n (H, O). For inspection only."""
        return self.mumoe_out.expert_weight(n)
