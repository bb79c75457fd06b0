"""MoE-X (Yang et al. 2025, "Mixture of Experts Made Intrinsically Interpretable", arXiv 2503.07639).

    zʲ = φ(W_encʲ x + b_encʲ)                [* (W_upʲ x + b_upʲ) with expert_glu]     expert j's hidden code, (D,)
    s  = router scores over the M experts     sparsity-aware (parameter-free, Eq. 7) or switch (W_router x, Eq. 1)
    ω  = Softmax(TopK_K(s))                   K of M non-zero, softmax over the K selected scores only
    y  = Σ_{j ∈ TopK} W_decʲ (ω_j zʲ) + b_dec = W_dec_mega · concat_j(ω_j zʲ) + b_dec                        (§4.2)

The sparse code (`encode`, `code_hook`) is the paper's "scaled hidden code" concat_j(ω_j zʲ) over M·D hidden units:
unit j·D + h is hidden unit h of expert j. Per token it lists the K·D units of the selected experts, zeros included
where φ is off, so its shape is fixed, (T, K·D).

Sparsity-aware router (Eq. 7). For expert j, with the statistics of W_encʲ's columns over its D rows:
    μʲ = mean_m W_encʲ[m, :],  (σʲ)² = var_m W_encʲ[m, :]        (I,) each; NOT detached ("we do not detach")
    μ_h = μʲᵀ x,  σ_h² = (σʲ)²ᵀ x²                                a hidden unit's pre-activation ~ N(μ_h, σ_h²)
    s_j = −erf(μ_h / (√2 σ_h)) = 1 − 2 P(h > 0)                   high score = few expected active units
# Diff with the paper (AMBIGUOUS, digest note B): its σ_h is (σʲ)²ᵀx², a variance, yet Eq. 5-7 divide by it as a
# standard deviation. `sigma_mode="std"` (default) uses σ_h = sqrt((σʲ)²ᵀx²); "var_literal" divides by the variance.
# The score is one number per expert, not a sum over its D units: under the i.i.d. assumption every unit of expert j
# has the same P(h > 0), and D·P(h > 0) (the estimated ℓ0, Eq. 6) ranks experts like P since all share D.
# `bias_aware_router` (ours; the paper's experts have no bias): μ_h += mean(b_encʲ), σ_h² += var(b_encʲ), i.e. the
# biases are treated as one more i.i.d. Gaussian term. With `expert_glu` the statistics come from W_enc, the branch
# under φ, which decides where zʲ vanishes (ours: the paper has no GLU experts).

Switch router: logits W_router x, then the same Softmax(TopK(·)) (the paper's Eq. 1; equal to Mixtral's softmax over
all M, top-k, renormalize). Scores of both routers are computed in float32 (at least).

Load balance (App. F, Fedus et al.): aux = coef · M · Σ_i f_i P_i with P_i = mean over tokens of softmax(s)_i over
all M scores (AMBIGUOUS: the paper never defines p(x) for its parameter-free router; this is the digest's choice and
what transformers' `load_balancing_loss_func` computes from `router_logits`). f_i counts the top-1 expert ("top1",
the paper's Eq. 20) or every top-K assignment divided by T·K ("topk"; so both are 1 at perfect balance, whereas
transformers divides by T only, i.e. its value is K times ours).

`gate_scaling` (ours, for upcycling): "softmax" (the paper), "none" (ω_j = 1: split experts sum to the dense MLP
exactly at K = M; the router then gets no task gradient) or "k_softmax" (K · softmax: gates sum to K, so split
experts keep their scale at uniform routing while the router still learns).

Shapes (letters as in sparse_base, plus M experts, D d_expert): W_enc, W_up (M, D, I); b_enc, b_up (M, D);
W_dec (M, O, D); b_dec (O,); W_router (M, I) for the switch router only. Expert weights are (experts, out, in), the
layout of transformers' MoE experts (`down_proj (E, H, I)`) and peft's default for 3-D `target_parameters`.
Dispatch is dropless: assignments are sorted by expert and each expert runs one matmul over its tokens. The output
is decoded from those expert-grouped codes while interventions and the code hook leave the code untouched; edited
values (ablation, a hook, in place or not) are regrouped by expert first; changed units (steering, a hook) fall back
to gathering the listed units' decoder columns (`decoder_rows`, a copy of W_dec), as do inference-mode forwards
(their tensors carry no version counter, so in-place edits cannot be seen). The grouped dispatch needs the expert
counts on the host; under torch.compile / torch.export every expert runs on every token instead (`_dense_code`: no
data-dependent shapes, M/K times the expert FLOPs), so compiled graphs have no break.
"""

import dataclasses
import math
from collections.abc import Iterable
from typing import ClassVar, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from .sparse_base import ACTIVATIONS, SparseLayer, canonical_activation, linear_bound, uniform_
from .sparse_code import SparseCode
from .sparse_kernels import sparse_rows_sum
from .sparse_spec import SparseSpec, _require_bool, _require_choice, _require_int, arxiv_bibtex

ROUTER_EPS = 1e-6
"""Added to σ_h² (std) or σ_h (var_literal): a zero input (padding) would otherwise give 0/0."""


@dataclasses.dataclass
class MoeXSpec(SparseSpec):
    kind = "moe_x"
    activation_meaning: ClassVar[str] = (
        "scaled hidden unit ω_j z^j_h of a selected expert (unit j·D + h); active where nonzero (with GELU / SiLU "
        "experts the negative values count: the output depends on them)"
    )
    code_unit_name: ClassVar[str] = "hidden unit"
    auto_lr_factor: ClassVar[float] = 0.3
    """MoE-X's best rate was 3e-3 where the other kinds' was 1e-2, on tiny-gpt2-shakespeare (docs/results/all_kinds.md)
    and SmolLM2-135M layer 15 (benchmarks/smollm2_lr_sweep.yaml)."""
    title: ClassVar[str] = "MoE-X"
    not_sparse_coder: ClassVar[str] = (
        "a router picks the experts and weights them by a softmax over their scores, so the code is no "
        "TopK(ReLU(W_enc x + b_enc)) of one linear encoder"
    )
    init_modes: ClassVar[tuple[str, ...]] = ("default", "split", "copy")
    citation: ClassVar[str] = arxiv_bibtex(
        "yang2025moex",
        title="Mixture of Experts Made Intrinsically Interpretable",
        authors=["Yang, Xingyi", "Venhoff, Constantin", "Khakzar, Ashkan", "de Witt, Christian Schroeder",
                 "Dokania, Puneet K.", "Bibi, Adel", "Torr, Philip"],
        year=2025,
        arxiv_id="2503.07639",
    )
    d_expert: int
    """D: hidden width of each expert (the base MLP's width for copy-upcycling, width / M for split-upcycling)."""
    num_experts: int = 8
    """M: number of experts (8 in every experiment of the paper)."""
    k: int = 2
    """K: experts per token (2 in the paper's main experiments)."""
    activation: str = "relu"
    """φ inside every expert: relu (MoE-X), or gelu / gelu_new / silu (the "Switch (GELU)" baseline, or an exact
    upcycle of a GELU / SiLU MLP)."""
    expert_bias: bool = False
    """Encoder biases b_enc (and b_up) per expert (GPT-2 / Pythia MLPs have them; the paper's experts do not)."""
    expert_glu: bool = False
    """GLU experts W_decʲ (φ(W_encʲ x) * W_upʲ x), for exact upcycling of Llama-style gated MLPs."""
    router: str = "sparsity"
    """"sparsity" (MoE-X's parameter-free router) or "switch" (linear top-k router W_router x, the baseline)."""
    sigma_mode: str = "std"
    """Sparsity router: "std" divides μ_h by sqrt(σ²ᵀx²) (consistent); "var_literal" by σ²ᵀx² (the paper's text)."""
    bias_aware_router: bool = False
    """Sparsity router extension (ours): include b_enc's mean and variance in μ_h and σ_h². Needs expert_bias."""
    gate_scaling: str = "softmax"
    """"softmax" over the K selected scores (paper); "none" (ω = 1); "k_softmax" (K · softmax)."""
    load_balance_coef: float = 1e-3
    """λ of the load-balance loss (0.001 in the paper); the layer reports λ · loss as `aux_loss`."""
    load_balance_counting: str = "top1"
    """f_i of the balance loss counts the top-1 expert ("top1", paper) or all top-K assignments ("topk")."""
    decoder_init: str = "zeros"
    """'zeros': W_dec starts at 0, so the layer starts as b_dec (the trainer's mean MLP output, as mxd) and
    distillation starts from FVU 1; 'paper': nn.Linear's default (training from scratch). Upcycling overwrites both."""
    selection_bias: bool = False
    """A per-expert bias `b_select` (a buffer) added to the router scores only to choose the top K, never to weight
    (auxiliary-loss-free balancing, DeepSeek-V3; the trainer moves it, `train.balance`)."""

    @classmethod
    def mlp_defaults(cls, shape, *, init: str = "default", num_units: int | None = None) -> dict:
        """Experts mirror the dense MLP's form (GLU experts for gated MLPs, encoder biases where the MLP has them) and
        its width: d_expert = ceil(H / M) (the dense width split over the experts; M is `num_units`, or the default 8
        when parameter matching chooses M), or H for init "copy". The activation is the MLP's when the weights come
        from it (an exact split / copy) and MoE-X's ReLU otherwise; the GELU/SiLU -> ReLU switch of an upcycled layer
        is explicit (activation: relu)."""
        num_experts = num_units if num_units is not None else cls.__dataclass_fields__["num_experts"].default
        return {
            "d_expert": shape.d_hidden if init == "copy" else math.ceil(shape.d_hidden / num_experts),
            "expert_glu": shape.glu,
            "expert_bias": not shape.glu,  # GPT-2 / Pythia MLPs have biases, Llama-like gated ones do not
            # split with k < M: K · softmax keeps the experts' scale while the router still gets a gradient. Not
            # the MLP even at k = M (the gates follow the scores): exactly the MLP takes k = M and gate_scaling
            # "none" (dense_init_fields; a recipe's layer.options, docs/upcycle.md).
            "gate_scaling": "k_softmax" if init == "split" else "softmax",
            "activation": "relu" if init == "default" else shape.activation,
        }

    @classmethod
    def dense_init_fields(cls, method: str, dense, *, num_units: int | None = None, k: int | None = None) -> dict:
        """The exact upcycle of `dense` (conversion/surgery/dense_init.py): split: d_expert = ceil(H / M), k = M and
        gate_scaling "none" (with all experts on the layer equals the MLP; lower k for a sparse layer); copy:
        d_expert = H, k = 2 (the paper) and softmax gates (they sum to 1). The activation, GLU form and expert
        biases are the MLP's; M is `num_units` (default 8)."""
        num_experts = num_units if num_units is not None else cls.__dataclass_fields__["num_experts"].default
        split = method == "split"
        return dict(
            d_in=dense.d_in,
            d_out=dense.d_out,
            d_expert=math.ceil(dense.d_hidden / num_experts) if split else dense.d_hidden,
            num_experts=num_experts,
            k=(num_experts if split else 2) if k is None else k,
            activation=dense.activation,
            expert_bias=dense.bias,
            expert_glu=dense.glu,
            gate_scaling="none" if split else "softmax",
        )

    def validate(self) -> None:
        super().validate()
        for name in ("d_expert", "num_experts", "k"):
            _require_int(self, name)
        if self.k > self.num_experts:
            raise ValueError(
                f"moe_x.k={self.k} exceeds moe_x.num_experts={self.num_experts}: TopK cannot select more experts "
                "than exist; lower k or raise num_experts"
            )
        self.activation = canonical_activation(self.activation)
        for name in ("expert_bias", "expert_glu", "bias_aware_router"):
            _require_bool(self, name)
        _require_choice(self, "router", ("sparsity", "switch"))
        _require_choice(self, "sigma_mode", ("std", "var_literal"))
        _require_choice(self, "gate_scaling", ("softmax", "none", "k_softmax"))
        _require_choice(self, "load_balance_counting", ("top1", "topk"))
        _require_choice(self, "decoder_init", ("zeros", "paper"))
        _require_bool(self, "selection_bias")
        coef = self.load_balance_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef) or coef < 0:
            raise ValueError(f"moe_x.load_balance_coef must be a finite number >= 0, got {coef!r}")
        self.load_balance_coef = float(coef)
        if self.router == "switch" and (self.bias_aware_router or self.sigma_mode != "std"):
            raise ValueError(
                "moe_x.bias_aware_router and moe_x.sigma_mode only apply to router='sparsity', got router='switch' "
                f"with bias_aware_router={self.bias_aware_router}, sigma_mode={self.sigma_mode!r}; drop them or use "
                "router='sparsity'"
            )
        if self.bias_aware_router and not self.expert_bias:
            raise ValueError(
                "moe_x.bias_aware_router=true needs expert_bias=true (there is no b_enc to include in the router "
                "statistics); enable expert_bias or disable bias_aware_router"
            )

    def _expert_parameters(self) -> int:
        I, O, D = self.d_in, self.d_out, self.d_expert
        n_enc = 2 if self.expert_glu else 1
        return n_enc * D * (I + int(self.expert_bias)) + O * D

    def _router_parameters(self) -> int:
        return self.num_experts * self.d_in if self.router == "switch" else 0

    def num_parameters(self) -> int:
        return self.num_experts * self._expert_parameters() + self.d_out + self._router_parameters()

    def active_parameters(self) -> int:
        # K experts, b_dec and the switch router. The sparsity router's column statistics read every encoder once per
        # forward (not per token); like the paper's "active parameters", they are not counted.
        return self.k * self._expert_parameters() + self.d_out + self._router_parameters()

    def flops_per_token(self) -> int:
        I, O, D, M, K = self.d_in, self.d_out, self.d_expert, self.num_experts, self.k
        n_enc = 2 if self.expert_glu else 1
        router = 2 * I * M if self.router == "switch" else 2 * 2 * I * M  # sparsity: μᵀx and (σ²)ᵀx²
        # Excludes the per-forward column statistics (≈ 3·M·D·I per forward, amortized over the tokens).
        return 2 * K * (n_enc * I * D + D * O) + router + O


class MoeXRouting(NamedTuple):
    """The router's decision for each token."""

    router_logits: torch.Tensor
    """(T, M) scores TopK ranks (float32, or float64 for float64 inputs): sparsity scores s ∈ (−1, 1) or switch
    logits."""
    top_k_index: torch.Tensor
    """(T, K) selected experts, best first (slot 0 is the argmax: the "top1" balance count)."""
    top_k_weights: torch.Tensor
    """(T, K) gate weights ω, in the input's dtype."""


class _Dispatch(NamedTuple):
    order: torch.Tensor  # (T·K,) assignment ids (t·K + slot) grouped by expert
    inverse: torch.Tensor  # (T·K,) position of each assignment in `order`
    counts: list[int]  # (M,) assignments per expert


class _PermuteRows(torch.autograd.Function):
    """rows[perm] for a permutation `perm` with inverse `inv`: the backward is the gather grad[inv], not the
    zero-fill + scatter-add that advanced indexing's backward does (it cannot know the index is a permutation)."""

    @staticmethod
    def forward(ctx, rows, perm, inv):  # rows (N, F); perm, inv (N,)
        ctx.save_for_backward(inv)
        return rows.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inv,) = ctx.saved_tensors
        return grad.index_select(0, inv), None, None


class _ColumnStats(torch.autograd.Function):
    """Column means and population variances over dim 1 in `dtype`: W (M, D, I) -> μ, σ² (M, I) each.

    Same values and gradients as `W.mean(1)` and `W.var(1, unbiased=False)`, but the backward is one pass writing one
    (M, D, I) tensor instead of autograd's several full-size temporaries: the statistics touch every encoder weight
    on every step, so this is the router's main cost.
    """

    @staticmethod
    def forward(ctx, W, dtype):
        W_ = W.to(dtype)
        mu = W_.mean(dim=1)  # (M, I)
        var = (W_ - mu.unsqueeze(1)).square_().mean(dim=1)  # two passes; ~2x faster than var_mean on CPU
        ctx.save_for_backward(W, mu)
        return mu, var

    @staticmethod
    def backward(ctx, grad_mu, grad_var):
        W, mu = ctx.saved_tensors
        D = W.shape[1]
        # g_μ/D + (2/D) g_σ² (W − μ) = a W + b, a single pass over W: a = (2/D) g_σ², b = g_μ/D − a μ, (M, 1, I) each.
        a = (2.0 / D) * grad_var.unsqueeze(1)
        b = grad_mu.unsqueeze(1) / D - a * mu.unsqueeze(1)
        return torch.addcmul(b, W.to(mu.dtype), a).to(W.dtype), None


class MoeXLayer(SparseLayer):
    """MoE-X as a drop-in MLP replacement; see the module docstring for the equations and the ambiguity flags."""

    spec: MoeXSpec
    is_transposed = False  # peft ParamWrapper: the 3-D expert weights are (experts, out, in)

    supports_auxk = False
    """No AuxK (conversion/training/auxk.py): the code's units are the experts' hidden units, and a selected expert
    computes all of them, so a unit that never fires is off by its own ReLU, not beaten in a top-k; AuxK's remedy
    (let the best-ranked losers model the residual) has no losers to rank. The routed choice is over M (8 in the
    paper) experts, which the spec's load-balance loss already keeps in use."""

    def __init__(self, spec: MoeXSpec) -> None:
        super().__init__(spec)
        I, O, M, D = spec.d_in, spec.d_out, spec.num_experts, spec.d_expert
        self.act = ACTIVATIONS[spec.activation]
        self.W_enc = nn.Parameter(torch.empty(M, D, I))
        self.b_enc = nn.Parameter(torch.empty(M, D)) if spec.expert_bias else None
        self.W_up = nn.Parameter(torch.empty(M, D, I)) if spec.expert_glu else None
        self.b_up = nn.Parameter(torch.empty(M, D)) if spec.expert_glu and spec.expert_bias else None
        self.W_dec = nn.Parameter(torch.empty(M, O, D))
        self.b_dec = nn.Parameter(torch.empty(O))
        self.W_router = nn.Parameter(torch.empty(M, I)) if spec.router == "switch" else None
        self._init_selection_bias(M)
        self.reset_parameters()

    @property
    def num_units(self) -> int:
        return self.spec.num_experts * self.spec.d_expert

    @property
    def output_bias(self) -> nn.Parameter:
        return self.b_dec  # added to every token's output

    def reset_parameters(self) -> None:
        """nn.Linear's default init for every expert's encoder and the switch router, W_dec per `decoder_init`;
        zero biases (the trainer sets b_dec to the mean MLP output). Upcycling overwrites these
        (`init_from_dense`)."""
        I, D = self.spec.d_in, self.spec.d_expert
        for w in (self.W_enc, self.W_up, self.W_router):
            if w is not None:
                uniform_(w, linear_bound(I))
        if self.spec.decoder_init == "zeros":
            nn.init.zeros_(self.W_dec)
        else:
            uniform_(self.W_dec, linear_bound(D))
        for b in (self.b_enc, self.b_up, self.b_dec, self.b_select):
            if b is not None:
                nn.init.zeros_(b)

    router_distribution = "scores"

    @property
    def num_routed_experts(self) -> int:
        return self.spec.num_experts

    def routed_experts(self, top_k_index: torch.Tensor) -> torch.Tensor:
        """Code units j·D + h -> the K selected experts j (each once): (..., K·D) -> (..., K)."""
        D = self.spec.d_expert
        return top_k_index[..., ::D] // D

    def selection_load(self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Tokens routed to each expert (the selection is over experts, whose hidden units the code lists D at a
        time, `b_select` (M,)): (M,) float32."""
        experts = self.routed_experts(top_k_index).reshape(-1)  # each selected expert once per token
        ones = torch.ones(experts.numel(), device=experts.device)
        return torch.zeros(self.spec.num_experts, device=experts.device).index_add_(0, experts, ones)

    def output_directions(self) -> torch.Tensor:
        return self.decoder_rows().detach()  # unit j·D + h: column h of expert j's decoder: (M·D, O)

    # -- starting from a dense MLP (conversion/surgery/dense_init.py) ----------------------------------------------

    @property
    def dense_init_groups(self) -> int:
        return self.spec.num_experts  # expert j holds neuron group j

    def dense_fit_problems(self, dense, method: str) -> list[str]:
        spec, M = self.spec, self.spec.num_experts
        want_d_expert = math.ceil(dense.d_hidden / M) if method == "split" else dense.d_hidden
        problems = []
        if (spec.d_in, spec.d_out) != (dense.d_in, dense.d_out):
            problems.append(f"d_in, d_out = {spec.d_in}, {spec.d_out} but the MLP maps {dense.d_in} -> {dense.d_out}")
        if spec.d_expert != want_d_expert:
            problems.append(f"d_expert={spec.d_expert} but {method} of a {dense.d_hidden}-wide MLP into {M} experts "
                            f"needs d_expert={want_d_expert}")
        if spec.expert_glu != dense.glu:
            form = "gated (GLU)" if dense.glu else "not gated"
            problems.append(f"expert_glu={spec.expert_glu} but the MLP is {form}")
        if (dense.b_in is not None or dense.b_up is not None) and not spec.expert_bias:
            problems.append("the MLP has encoder biases but expert_bias=false")
        if method == "copy" and spec.gate_scaling != "softmax":
            problems.append(f"copy-upcycling needs gates that sum to 1 (gate_scaling='softmax'), got "
                            f"{spec.gate_scaling!r}, which would multiply the MLP's output; "
                            "use gate_scaling='softmax'")
        if method == "split" and spec.gate_scaling == "softmax":
            problems.append("split-upcycling with gate_scaling='softmax' scales every expert's share of the dense sum "
                            "by its gate (≈ 1/k): use gate_scaling='none' (exact at k = num_experts) or 'k_softmax'")
        return problems

    @torch.no_grad()
    def init_from_dense(self, dense, groups: list[torch.Tensor], *, noise_std: float = 0.0, seed: int = 0) -> None:
        """Expert j takes neurons groups[j] into its first len(groups[j]) slots: their encoder rows, biases and
        decoder columns; spare slots are zero (they add nothing). The switch router keeps its random initialization
        (Komatsuzaki et al.). Noise goes to the encoders only (the sparsity router reads W_enc: identical experts
        would tie)."""

        def fill(param: nn.Parameter | None, source: torch.Tensor | None, dim: int) -> None:
            # param (M, ..., D, ...) with the hidden dim at `dim` (1 for W_enc/W_up/b_enc/b_up, 2 for W_dec): expert
            # j takes `source`'s hidden entries groups[j] (dim 0 of source, -1 for W_out) into its first len(group)
            # slots.
            if param is None:
                return
            if source is None:  # the MLP has no such bias: zeros keep the function
                nn.init.zeros_(param)
                return
            value = torch.zeros(param.shape, dtype=source.dtype, device=source.device)
            for j, group in enumerate(groups):
                part = source.index_select(0 if dim == 1 else source.dim() - 1, group.to(source.device))
                value[j].narrow(dim - 1, 0, len(group)).copy_(part)
            param.copy_(value)

        fill(self.W_enc, dense.w_in, 1)  # (M, D, I) <- rows of W_in
        fill(self.b_enc, dense.b_in, 1)  # (M, D)
        fill(self.W_up, dense.w_up, 1)
        fill(self.b_up, dense.b_up, 1)
        fill(self.W_dec, dense.w_out, 2)  # (M, O, D) <- columns of W_out
        if dense.b_out is None:
            nn.init.zeros_(self.b_dec)
        else:
            self.b_dec.copy_(dense.b_out)
        if noise_std > 0:
            gen = torch.Generator().manual_seed(seed)
            scale = noise_std * dense.w_in.double().std().item()
            for j, group in enumerate(groups):  # one expert at a time: no second (M, D, I) tensor
                noise = torch.randn((len(group), self.W_enc.shape[2]), generator=gen, dtype=torch.float64)
                self.W_enc[j, : len(group)].add_((scale * noise).to(self.W_enc))  # padding slots stay zero

    def unit_index(self, expert: int, hidden: int) -> int:
        """Code unit id of hidden unit `hidden` of expert `expert` (j·D + h)."""
        return expert * self.spec.d_expert + hidden

    def decoder_rows(self) -> torch.Tensor:
        """The mega-decoder as rows: (M·D, O), row j·D + h = W_decʲ[:, h]. A copy (W_dec is stored (M, O, D))."""
        return self.W_dec.transpose(1, 2).reshape(self.num_units, self.spec.d_out)

    # -- router ---------------------------------------------------------------------------------------------------

    def router_scores(self, x: torch.Tensor) -> torch.Tensor:
        """(T, I) -> (T, M) scores, float32 (float64 for float64 x): sparsity-aware s (Eq. 7) or switch logits."""
        dtype = torch.promote_types(x.dtype, torch.float32)  # bf16 / fp16 statistics would misrank experts
        xf = x.to(dtype)
        if self.W_router is not None:
            return F.linear(xf, self.W_router.to(dtype))
        # (M, I) column means μʲ and variances (σʲ)² (the paper's 1/D) of W_enc (M, D, I); with gradient: the router
        # regularizes W_enc toward sparsity (§4.3.2)
        mu, var = _ColumnStats.apply(self.W_enc, dtype)
        mu_h = xf @ mu.T  # (T, M)
        var_h = xf.square() @ var.T  # (T, M)
        if self.spec.bias_aware_router:
            b = self.b_enc.to(dtype)  # (M, D)
            mu_h = mu_h + b.mean(dim=1)
            var_h = var_h + b.var(dim=1, unbiased=False)
        sigma_h = (var_h + ROUTER_EPS).sqrt() if self.spec.sigma_mode == "std" else var_h + ROUTER_EPS
        return -torch.erf(mu_h / (math.sqrt(2.0) * sigma_h))

    def route(self, x: torch.Tensor) -> MoeXRouting:
        """(T, I) -> scores (T, M), TopK experts and gate weights (T, K)."""
        scores = self.router_scores(x)  # (T, M)
        # (T, K), sorted: slot 0 is the argmax (of the biased scores, with a selection bias)
        top_scores, top_k_index = self._select(scores, self.spec.k, sorted=True)
        if self.spec.gate_scaling == "none":
            weights = torch.ones_like(top_scores)
        else:
            weights = top_scores.softmax(dim=-1)  # softmax over the K selected scores only (Eq. 1, Eq. 7)
            if self.spec.gate_scaling == "k_softmax":
                weights = weights * self.spec.k
        return MoeXRouting(scores, top_k_index, weights.to(x.dtype))

    def load_balance_loss(self, router_logits: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
        """Unweighted M · Σ_i f_i P_i (App. F): router_logits (T, M), top_k_index (T, K) -> scalar."""
        M = self.spec.num_experts
        P = router_logits.softmax(dim=-1).mean(dim=0)  # (M,) mean router probability, differentiable
        if self.spec.load_balance_counting == "top1":
            counted = top_k_index[:, 0]  # (T,) the argmax expert (Eq. 20)
        else:
            counted = top_k_index.reshape(-1)  # (T·K,) every assignment
        # (M,) fraction routed; a scatter, not bincount, so that the shape never depends on the data (torch.compile)
        f = P.new_zeros(M).index_add_(0, counted, P.new_ones(counted.shape)) / max(counted.numel(), 1)
        return M * (f * P).sum()

    # -- experts --------------------------------------------------------------------------------------------------

    def _dispatch(self, top_k_index: torch.Tensor) -> _Dispatch:
        flat = top_k_index.reshape(-1)  # (T·K,) expert of assignment t·K + slot
        order = flat.argsort(stable=True)  # (T·K,)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()  # one host sync per forward
        return _Dispatch(order, inverse, counts)

    def _expert_hidden(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Unscaled expert codes zʲ: x_sorted (T·K, I) grouped by expert -> (T·K, D)."""
        # unbind, not W[j]: the backward of M selects would build M zero-filled (M, D, I) gradients; unbind's is one
        # stack. Each weight is read once per forward (peft's parametrizations apply on read).
        W_enc = self.W_enc.unbind(0)
        b_enc = (None,) * len(counts) if self.b_enc is None else self.b_enc.unbind(0)
        W_up = None if self.W_up is None else self.W_up.unbind(0)
        b_up = (None,) * len(counts) if self.b_up is None else self.b_up.unbind(0)
        out = []
        for j, x_j in enumerate(x_sorted.split(counts)):  # a loop over experts, never over tokens
            if x_j.shape[0] == 0:
                continue
            z = self.act(F.linear(x_j, W_enc[j], b_enc[j]))  # (n_j, D)
            if W_up is not None:
                z = z * F.linear(x_j, W_up[j], b_up[j])
            out.append(z)
        return torch.cat(out) if out else x_sorted.new_zeros(0, self.spec.d_expert)

    def _decode_sorted(self, w_sorted: torch.Tensor, dispatch: _Dispatch) -> torch.Tensor:
        """Σ_j W_decʲ (ω_j zʲ) from the scaled codes grouped by expert: w_sorted (T·K, D) -> (T, O)."""
        W_dec = self.W_dec.unbind(0)  # (O, D) each
        out = [F.linear(w_j, W_dec[j]) for j, w_j in enumerate(w_sorted.split(dispatch.counts)) if w_j.shape[0]]
        y_sorted = torch.cat(out) if out else w_sorted.new_zeros(0, self.spec.d_out)  # (T·K, O)
        # Back to (token, slot) order, then sum the K slots (deterministic, unlike index_add_ on GPUs).
        y = _PermuteRows.apply(y_sorted, dispatch.inverse, dispatch.order)  # (T·K, O)
        return y.view(-1, self.spec.k, self.spec.d_out).sum(dim=1)  # (T, O)

    def _grouped_code(self, x: torch.Tensor, routing: MoeXRouting, dispatch: _Dispatch):
        """Run the selected experts, one matmul per expert over its tokens. x (T, I) -> the code's unit ids and
        values (T, K·D) each, and the same values grouped by expert (T·K, D), which `_decode_sorted` reads."""
        T, K, D = x.shape[0], self.spec.k, self.spec.d_expert
        # (T, I) -> (T·K, I) one row per assignment -> grouped by expert; repeat's backward is a sum over K.
        x_sorted = _PermuteRows.apply(x.repeat_interleave(K, dim=0), dispatch.order, dispatch.inverse)
        gates_sorted = routing.top_k_weights.reshape(-1)[dispatch.order]  # (T·K,)
        scaled_sorted = self._expert_hidden(x_sorted, dispatch.counts) * gates_sorted.unsqueeze(-1)  # ω_j zʲ
        weights = _PermuteRows.apply(scaled_sorted, dispatch.inverse, dispatch.order).view(T, K * D)  # per token
        return self._unit_ids(routing), weights, scaled_sorted

    def _dense_code(self, x: torch.Tensor, routing: MoeXRouting) -> tuple[torch.Tensor, torch.Tensor]:
        """The same code with no data-dependent shapes (for torch.compile / torch.export): every expert runs on every
        token and the selected experts' units are gathered. x (T, I) -> unit ids and values (T, K·D) each.
        M/K times the expert FLOPs of `_grouped_code`, and no host synchronization."""
        T, K, D = x.shape[0], self.spec.k, self.spec.d_expert
        W_enc = self.W_enc.unbind(0)
        b_enc = (None,) * self.spec.num_experts if self.b_enc is None else self.b_enc.unbind(0)
        W_up = None if self.W_up is None else self.W_up.unbind(0)
        b_up = (None,) * self.spec.num_experts if self.b_up is None else self.b_up.unbind(0)
        hidden = []
        for j in range(self.spec.num_experts):
            z = self.act(F.linear(x, W_enc[j], b_enc[j]))  # (T, D)
            if W_up is not None:
                z = z * F.linear(x, W_up[j], b_up[j])
            hidden.append(z)
        z = torch.stack(hidden, dim=1).gather(1, routing.top_k_index.unsqueeze(-1).expand(-1, -1, D))  # (T, K, D)
        weights = (z * routing.top_k_weights.unsqueeze(-1)).reshape(T, K * D)
        return self._unit_ids(routing), weights

    def _unit_ids(self, routing: MoeXRouting) -> torch.Tensor:
        """Unit ids j·D + h of the selected experts' hidden units: (T, K·D)."""
        D = self.spec.d_expert
        offsets = torch.arange(D, device=routing.top_k_index.device)
        return (routing.top_k_index.unsqueeze(-1) * D + offsets).flatten(1)

    # -- public API -----------------------------------------------------------------------------------------------

    def encode(self, x: torch.Tensor) -> SparseCode:
        """The scaled hidden code concat_j(ω_j zʲ) as (unit id, value) pairs: (..., I) -> (..., K·D)."""
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # (T, I)
        routing = self.route(x)
        if torch.compiler.is_compiling():
            index, weights = self._dense_code(x, routing)
        else:
            index, weights, _ = self._grouped_code(x, routing, self._dispatch(routing.top_k_index))
        return self._hook_code(index, weights, lead)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        lead = hidden_states.shape[:-1]
        x = hidden_states.reshape(-1, hidden_states.shape[-1])  # (T, I)
        routing = self.route(x)
        if self.wants_router_outputs:
            aux = self.spec.load_balance_coef * self.load_balance_loss(routing.router_logits, routing.top_k_index)
            self._set_router_outputs(routing.router_logits, aux)
        if torch.compiler.is_compiling():
            index, weights = self._dense_code(x, routing)
            code, _, _ = self._hook_code_tracked(index, weights, lead)
            out = sparse_rows_sum(code, self.decoder_rows())
            return (out + self.b_dec).view(*lead, -1)
        dispatch = self._dispatch(routing.top_k_index)
        index, weights, scaled_sorted = self._grouped_code(x, routing, dispatch)
        code, same_units, same_values = self._hook_code_tracked(index, weights, lead)  # code: (T, K·D)
        if same_units and same_values:
            # The code is untouched: decode the expert-grouped codes directly (the per-token copy is left unused).
            out = self._decode_sorted(scaled_sorted, dispatch)
        elif same_units:
            # Same units, edited values (ablation, a hook): regroup the edited values by expert.
            edited = code.top_k_weights.reshape(-1, self.spec.d_expert)  # (T·K, D)
            w_sorted = _PermuteRows.apply(edited, dispatch.order, dispatch.inverse)
            out = self._decode_sorted(w_sorted, dispatch)
        else:
            # Steering or a hook changed which units are listed, or edits cannot be seen (inference-mode tensors):
            # gather each listed unit's decoder column.
            out = sparse_rows_sum(code, self.decoder_rows())
        return (out + self.b_dec).view(*lead, -1)

    def ablate_experts(self, experts: Iterable[int]) -> None:
        """Zero every hidden unit of `experts` after routing. The gate weights of the other selected experts are not
        renormalized (as `ablate`); clear with `clear_interventions()`."""
        experts = [int(j) for j in experts]
        bad = [j for j in experts if not 0 <= j < self.spec.num_experts]
        if bad:
            raise ValueError(
                f"expert id(s) {bad} out of range: this layer has {self.spec.num_experts} experts "
                f"(0..{self.spec.num_experts - 1})"
            )
        D = self.spec.d_expert
        self.ablate([u for j in experts for u in range(j * D, (j + 1) * D)])
