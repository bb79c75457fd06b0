"""Monet: Mixture of Monosemantic Experts (Park, Ahn, Kim & Kang, ICLR 2025, arXiv 2412.04139), as a drop-in MLP.

N = S² product experts, expert id e = i·S + j (i: a sub-expert of router 1, j: of router 2), composed from 2·S
sub-experts, so parameters grow with √N:

    monet_hd (Eq. 6):   E_ij(x) = V_j σ(U_i x + b¹_i) + b²_j
    monet_vd (Eq. 13):  E_ij(x) = [[V¹¹_i, V¹²_i], [V²¹_j, V²²_j]] σ([U¹_i; U²_j] x + [b¹¹_i; b²¹_j]) + [b¹²_i; b²²_j]
    y = Σ_r Σ_i Σ_j ĝ¹_ri ĝ²_rj E_ij(x) + b_dec = Σ_ij G_ij E_ij(x) + b_dec,     G_ij = Σ_r ĝ¹_ri ĝ²_rj   (Eqs. 7, 14)

Heads are summed, as in the paper (so Σ_ij G_ij = R). Each head's two sub-routers read the full x (the released code;
the paper's text splits x in halves). ĝ is a softmax of the *raw* logits over the selected sub-experts, 0 elsewhere.
Selection per head and side (`routing`):
    "quantile"  the paper's sort-free routing (released `MonetRouter`): BatchNorm the logits per head (no affine;
                statistics pooled over tokens and sub-experts), keep ẑ_ri >= min(max_i ẑ_ri, Φ⁻¹(1 - k/S)): about k
                under Gaussian statistics, always at least one. Training mode normalizes with the batch's statistics
                and updates the running ones (momentum `bn_momentum`, as torch BatchNorm1d); eval mode uses the running
                statistics, so a token's routing does not depend on the rest of its batch. So: call `.eval()` for
                inference and interventions; a spliced model trained end to end in train mode also counts its padding
                tokens in the batch statistics; under DDP each process normalizes with its own batch and DDP
                broadcasts rank 0's running statistics. The running statistics are persistent buffers (saved, loaded;
                `reset_parameters` sets them to mean 0, variance 1 through torch.nn.init, which transformers skips
                for loaded tensors). Φ⁻¹(1 - k/S) is a Python float derived from the spec, never a buffer.
    "topk"      exactly the k largest logits per head (no statistics).

Fast path: the factorized sums of Eq. 12 / App. A.1 (Algorithms 1-2). Every sub-expert's hidden units are computed
(S·M = d_hidden, like the dense MLP) and mixed through the two gate factors; neither the N experts nor the (T, N)
gate G is materialized.

Sparse code (`encode`, `code_hook`): the active product experts of each token merged over heads, ids i·S + j with
weights G_ij > 0, sorted by weight and padded with zero weights to the widest token of the batch. Interventions act
on it: when the code reaching the layer differs from the routed one (`ablate`, `steer`, or a code-hook edit), the
output is computed from the code itself, y = Σ_p w_p E_{e_p}(x) + b_dec, gathering sub-expert hiddens for the listed
experts only. So `ablate([i·S + j])` removes exactly expert (i, j), from every head, and leaves every other expert's
gate as it was (the paper's masking; no renormalization); sub-experts i and j keep serving their other pairs.
The code is built on every forward (the trainer reads L0 and dead experts from it): a sort over the R·K1·K2
candidate pairs of each token and, for quantile routing, host syncs for the data-dependent widths.

Auxiliary losses (Eqs. 16-17), over the tokens of one forward, weighted by the spec and reported as `aux_loss`:
    uniformity = -1/(2RS) Σ_r Σ_s [log(p̄¹_rs + ε) + log(p̄²_rs + ε)],   p̄ = batch mean of ĝ
                 (a KL to the uniform distribution up to the constant log S: its minimum ≈ log S, when uniform)
    ambiguity  = 1/(2R) Σ_r [(1 - max_s ĝ¹_rs) + (1 - max_s ĝ²_rs)], averaged over tokens

Letters: T tokens, I d_in, O d_out, R routing heads, S = √N sub-experts per side, M = expert_dim (hidden units of one
sub-expert), H = d_hidden = S·M, N = S² product experts, P entries of the code per token.

# Diff with dmis-lab/Monet: one router per layer (no routing groups shared across 4 layers: each replaced MLP stands
# alone); the router trains (the released module freezes it); the straightflow terms and expert biases use the true
# sums Σ_j ĝ²_rj instead of assuming 1, so the fast path stays exact for gates that do not sum to 1 per head; the
# down projections start at zero (the layer starts as b_dec, as MxD's D = 0), since we distil instead of pretraining.
"""

import dataclasses
import math
from statistics import NormalDist
from typing import ClassVar, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from .sparse_base import ACTIVATIONS, SparseLayer, canonical_activation, linear_bound, uniform_
from .sparse_code import SparseCode
from .sparse_spec import SparseSpec, _require_choice, _require_int, arxiv_bibtex

UNIFORMITY_EPS = 1e-6
"""ε inside the uniformity loss's log: a sub-expert no token selected has batch-mean gate 0."""


@dataclasses.dataclass
class MonetSpec(SparseSpec):
    """Fields shared by `monet_hd` and `monet_vd` (see the module docstring)."""

    activation_meaning: ClassVar[str] = "head-summed product-expert gate G_ij (unit i·S + j)"
    not_sparse_coder: ClassVar[str] = (
        "each product expert adds a small non-linear MLP of the token, V σ(U x + b¹) + b², under a routed gate: no "
        "fixed decoder row per expert"
    )

    citation: ClassVar[str] = arxiv_bibtex(
        "park2025monet",
        title="Monet: Mixture of Monosemantic Experts for Transformers",
        authors=["Park, Jungwoo", "Ahn, Young Jin", "Kim, Kee-Eung", "Kang, Jaewoo"],
        year=2025,
        arxiv_id="2412.04139",
    )

    match_field: ClassVar[str] = "d_hidden"
    """Parameter matching varies the hidden width: num_parameters() is linear in it, while num_experts only moves
    the router and expert biases (and must stay a perfect square)."""

    d_hidden: int
    """H = S·M: hidden units of the S sub-experts of one side together (the paper keeps S·M = 4·d_model, the dense
    MLP's width; recipes default to the base MLP's width). A multiple of S (monet_vd: of 2·S)."""
    num_experts: int
    """N = S²: product experts, the units of the code and of `ablate` / `steer` (id i·S + j). A perfect square."""
    k: int = 8
    """Sub-experts each head selects per side (the paper's moe_topk): about k² product experts per head. Exact
    for routing "topk", the expected count for "quantile"."""
    num_heads: int = 8
    """R: routing heads (the paper's moe_heads); their outputs are summed."""
    routing: str = "quantile"
    """"quantile" (BatchNorm + Φ⁻¹(1 - k/S) threshold, the paper's) or "topk" (exactly k per head and side)."""
    activation: str = "relu2"
    """σ: relu2 (squared ReLU, the paper's), gelu, gelu_new, silu, relu."""
    uniformity_coef: float = 1e-3
    """λ on the uniformity loss (paper: 1e-3)."""
    ambiguity_coef: float = 1e-3
    """λ on the ambiguity loss (paper: 1e-3)."""
    bn_momentum: float = 0.1
    """Running-statistics momentum of the quantile router's BatchNorm (torch's default; the paper does not say)."""
    bn_eps: float = 1e-5
    """BatchNorm ε of the quantile router."""

    def validate(self) -> None:
        super().validate()
        _require_int(self, "d_hidden")
        _require_int(self, "num_experts", minimum=4)
        _require_int(self, "k")
        _require_int(self, "num_heads")
        N, S = self.num_experts, math.isqrt(self.num_experts)
        if S * S != N:
            raise ValueError(
                f"{self.kind}.num_experts must be a perfect square S·S (product experts i·S + j over S sub-experts "
                f"per side), got {N}; the nearest are {S * S} and {(S + 1) ** 2}"
            )
        if self.k > S:
            raise ValueError(
                f"{self.kind}.k={self.k} exceeds √num_experts={S}: each head selects k of the {S} sub-experts on each "
                "side; lower k or raise num_experts"
            )
        step = self.hidden_step
        if self.d_hidden % step:
            below, above = self.d_hidden // step * step, (self.d_hidden // step + 1) * step
            raise ValueError(
                f"{self.kind}.d_hidden={self.d_hidden} must be a multiple of {step}: the hidden units are split "
                f"evenly over the {S} sub-experts of a side{' and then in halves' if step != S else ''}; use "
                f"{' or '.join(str(v) for v in (below, above) if v > 0)}"
            )
        _require_choice(self, "routing", ("quantile", "topk"))
        self.activation = canonical_activation(self.activation)
        for name in ("uniformity_coef", "ambiguity_coef", "bn_momentum", "bn_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{self.kind}.{name} must be a finite number, got {value!r}")
            setattr(self, name, float(value))
        for name in ("uniformity_coef", "ambiguity_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{self.kind}.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.bn_momentum <= 1:
            raise ValueError(f"{self.kind}.bn_momentum must lie in (0, 1], got {self.bn_momentum}")
        if not self.bn_eps > 0:
            raise ValueError(f"{self.kind}.bn_eps must be > 0, got {self.bn_eps}")

    @property
    def hidden_step(self) -> int:
        """d_hidden must be a multiple of this: S (monet_vd: 2·S, each sub-expert's units split in halves)."""
        return self.num_sub_experts

    @property
    def num_sub_experts(self) -> int:
        """S = √N sub-experts per side."""
        return math.isqrt(self.num_experts)

    @property
    def expert_dim(self) -> int:
        """M: hidden units of one sub-expert (monet_vd: M/2 from each side of a product expert)."""
        return self.d_hidden // self.num_sub_experts

    # The counts read only raw fields (math.isqrt, no derived state): the parameter matcher evaluates them on
    # unvalidated specs. Both decompositions have the same counts (paper App. A.2).

    def num_parameters(self) -> int:
        I, O, H, R, S = self.d_in, self.d_out, self.d_hidden, self.num_heads, math.isqrt(self.num_experts)
        # routers + up projections and their biases + down projections + per-sub-expert output biases + b_dec
        return 2 * R * S * I + H * (I + 1) + H * O + S * O + O

    def active_parameters(self) -> int:
        """Routers, plus the sub-experts the heads can select: at most min(S, R·k) per side (k is the expected count
        under quantile routing). The fast path reads all of them; this counts what influences the output."""
        I, O, H, R, S = self.d_in, self.d_out, self.d_hidden, self.num_heads, math.isqrt(self.num_experts)
        used = min(S, R * self.k)
        return 2 * R * S * I + used * H // S * (I + 1) + used * H // S * O + used * O + O

    def flops_per_token(self) -> int:
        """The fast path as implemented (dense over the S sub-experts, like the paper's Algorithms 1-2): routers,
        up projection, the two gate contractions (2·R·H each side in total), down projection, expert biases."""
        I, O, H, R, S = self.d_in, self.d_out, self.d_hidden, self.num_heads, math.isqrt(self.num_experts)
        return 2 * (2 * R * S * I + H * I + 2 * R * H + H * O + S * O) + H + O


@dataclasses.dataclass
class MonetHDSpec(MonetSpec):
    kind = "monet_hd"
    title: ClassVar[str] = "Monet with horizontal expert decomposition (Monet-HD)"


@dataclasses.dataclass
class MonetVDSpec(MonetSpec):
    kind = "monet_vd"
    title: ClassVar[str] = "Monet with vertical expert decomposition (Monet-VD)"

    @property
    def hidden_step(self) -> int:
        return 2 * self.num_sub_experts

    def validate(self) -> None:
        super().validate()
        if self.d_out % 2:
            raise ValueError(
                f"monet_vd.d_out must be even: the vertical decomposition splits the output in halves (top from "
                f"sub-expert i, bottom from j), got {self.d_out}; use monet_hd"
            )


class MonetRouting(NamedTuple):
    """One forward's routing, per token, head and side."""

    logits1: torch.Tensor
    """(T, R, S) raw router-1 logits (at least float32)."""
    logits2: torch.Tensor
    """(T, R, S) raw router-2 logits."""
    gates1: torch.Tensor
    """(T, R, S) ĝ¹: softmax of the raw logits over the selected sub-experts, 0 elsewhere."""
    gates2: torch.Tensor
    """(T, R, S) ĝ²."""


class MonetLayer(SparseLayer):
    """Router, sparse code and forward shared by both decompositions; subclasses hold the sub-experts."""

    spec: MonetSpec

    supports_auxk = False
    """No AuxK (conversion/training/auxk.py): a product expert (i, j) owns no parameters of its own (it is built from
    sub-experts i and j, which serve every other pair too), so there are no dead units' rows for an auxiliary loss
    to train without moving live experts; the sub-experts are kept in use by the uniformity loss (Eq. 16)."""

    router_distribution = "gates"  # a token's routing: its head-summed gates G_ij, normalized

    def __init__(self, spec: MonetSpec) -> None:
        super().__init__(spec)
        I, O, R, S = spec.d_in, spec.d_out, spec.num_heads, spec.num_sub_experts
        self.act = ACTIVATIONS[spec.activation]
        self.W_router1 = nn.Parameter(torch.empty(R * S, I))  # rows r·S + i: head r's key of sub-expert i
        self.W_router2 = nn.Parameter(torch.empty(R * S, I))
        if spec.routing == "quantile":
            # Persistent: the eval-time routing is defined by these, so they travel with the checkpoint.
            for name in ("running_mean1", "running_var1", "running_mean2", "running_var2"):
                self.register_buffer(name, torch.empty(R))
        k = spec.k
        self.quantile_threshold = NormalDist().inv_cdf(1 - k / S) if k < S else -math.inf
        """Φ⁻¹(1 - k/S) on the normalized logits (-inf when k = S: every sub-expert)."""
        self._build_experts()
        self.b_dec = nn.Parameter(torch.empty(O))
        self.reset_parameters()

    @property
    def num_units(self) -> int:
        return self.spec.num_experts

    @property
    def output_bias(self) -> nn.Parameter:
        return self.b_dec  # added to every token's output

    def split_expert_id(self, expert: int) -> tuple[int, int]:
        """(i, j): the router-1 and router-2 sub-experts of product expert `expert` = i·S + j."""
        (expert,) = self._check_units([expert])
        return divmod(expert, self.spec.num_sub_experts)

    def reset_parameters(self) -> None:
        """nn.Linear's default for routers and up projections; zero down projections, so that the layer starts as
        the constant b_dec, which the trainer sets to the mean MLP output (as MxD's D = 0; the paper, trained from
        scratch, does not give its init); zero biases as in the released code; BatchNorm statistics N(0, 1)."""
        bound = linear_bound(self.spec.d_in)
        uniform_(self.W_router1, bound)
        uniform_(self.W_router2, bound)
        if self.spec.routing == "quantile":
            for side in (1, 2):
                nn.init.zeros_(getattr(self, f"running_mean{side}"))
                nn.init.ones_(getattr(self, f"running_var{side}"))
        self._reset_experts()
        nn.init.zeros_(self.b_dec)

    # -- routing ------------------------------------------------------------------------------------------------

    def route(self, x: torch.Tensor) -> MonetRouting:
        """Logits and gates of tokens x (T, I). In training mode with quantile routing this updates the BatchNorm
        running statistics, like any forward."""
        T, R, S = x.shape[0], self.spec.num_heads, self.spec.num_sub_experts
        dtype = torch.promote_types(x.dtype, torch.float32)  # route in at least float32 (as the released code)
        z1 = F.linear(x, self.W_router1).view(T, R, S).to(dtype)
        z2 = F.linear(x, self.W_router2).view(T, R, S).to(dtype)
        g1 = torch.softmax(z1.masked_fill(~self._select(z1, 1), -math.inf), dim=-1)  # (T, R, S)
        g2 = torch.softmax(z2.masked_fill(~self._select(z2, 2), -math.inf), dim=-1)
        return MonetRouting(z1, z2, g1, g2)

    @torch.no_grad()
    def _select(self, z: torch.Tensor, side: int) -> torch.Tensor:
        """Selected sub-experts, (T, R, S) bool, at least one per token and head."""
        if self.spec.routing == "topk":
            return torch.zeros_like(z, dtype=torch.bool).scatter_(-1, z.topk(self.spec.k, dim=-1).indices, True)
        running_mean, running_var = getattr(self, f"running_mean{side}"), getattr(self, f"running_var{side}")
        if self.training and z.shape[0] > 0:
            mean, var = z.mean(dim=(0, 2)), z.var(dim=(0, 2), unbiased=False)  # (R,) pooled over tokens, sub-experts
            count = z.shape[0] * z.shape[2]  # >= 2 since S >= 2
            # torch BatchNorm's update: biased variance normalizes, the unbiased one is tracked.
            running_mean.lerp_(mean.to(running_mean.dtype), self.spec.bn_momentum)
            running_var.lerp_((var * count / (count - 1)).to(running_var.dtype), self.spec.bn_momentum)
        else:
            mean, var = running_mean.to(z.dtype), running_var.to(z.dtype)
        normalized = (z - mean[:, None]) * torch.rsqrt(var[:, None] + self.spec.bn_eps)  # (T, R, S)
        # min(row max, Φ⁻¹(1 - k/S)): the row max keeps at least one sub-expert when none clears the quantile.
        threshold = normalized.amax(dim=-1, keepdim=True).clamp_max(self.quantile_threshold)  # (T, R, 1)
        return normalized >= threshold

    def router_losses(self, routing: MonetRouting) -> tuple[torch.Tensor, torch.Tensor]:
        """Unweighted (uniformity, ambiguity) of Eqs. 16-17 over the tokens of `routing`."""
        g1, g2 = routing.gates1, routing.gates2
        log_mean1, log_mean2 = torch.log(g1.mean(0) + UNIFORMITY_EPS), torch.log(g2.mean(0) + UNIFORMITY_EPS)  # (R, S)
        uniformity = -(log_mean1.mean() + log_mean2.mean()) / 2
        ambiguity = ((1 - g1.amax(-1)).mean() + (1 - g2.amax(-1)).mean()) / 2
        return uniformity, ambiguity

    def _product_code(self, routing: MonetRouting) -> tuple[torch.Tensor, torch.Tensor]:
        """Active product experts merged over heads: ids i·S + j and weights G_ij, (T, P) each, by weight."""
        g1, g2 = routing.gates1, routing.gates2
        T, _, S = g1.shape
        w1, i = g1.topk(self._code_width(g1), dim=-1)  # (T, R, K1): the selected sub-experts (+ zero-weight padding)
        w2, j = g2.topk(self._code_width(g2), dim=-1)  # (T, R, K2)
        ids = (i[..., :, None] * S + j[..., None, :]).reshape(T, -1)  # (T, R·K1·K2)
        w = (w1[..., :, None] * w2[..., None, :]).reshape(T, -1)  # ĝ¹_ri ĝ²_rj: (T, R·K1·K2)
        # Merge heads that picked the same expert (G_ij sums them): sort by id, then sum each run of equal ids.
        ids, order = ids.sort(dim=-1)
        w = w.gather(-1, order)
        first = torch.ones_like(ids, dtype=torch.bool)
        first[:, 1:] = ids[:, 1:] != ids[:, :-1]
        run = first.cumsum(dim=-1) - 1  # (T, R·K1·K2) index of each entry's run
        merged_w = torch.zeros_like(w).scatter_add(-1, run, w)
        merged_ids = torch.zeros_like(ids).scatter(-1, run, ids)  # every member of a run writes the same id
        merged_w, order = merged_w.sort(dim=-1, descending=True)
        merged_ids = merged_ids.gather(-1, order)
        if torch.compiler.is_compiling():
            return merged_ids, merged_w  # static width R·K1·K2 (zero-weight padding included): no host sync
        width = max(1, int((merged_w > 0).sum(-1).max())) if T else 1
        return merged_ids[:, :width], merged_w[:, :width]  # (T, P)

    def _code_width(self, gates: torch.Tensor) -> int:
        """Sub-experts per head to read off the gates: k for top-k routing; for quantile routing the most any token
        selected (a host sync), or all S under torch.compile / torch.export (zero-weight padding, static shapes)."""
        if self.spec.routing == "topk":
            return self.spec.k
        if torch.compiler.is_compiling():
            return self.spec.num_sub_experts
        return max(1, int((gates > 0).sum(-1).max())) if gates.shape[0] else 1  # data-dependent: a host sync

    # -- code, forward ------------------------------------------------------------------------------------------

    def encode(self, x: torch.Tensor) -> SparseCode:
        """Active product experts (ids i·S + j) and their head-summed gates G_ij: (..., I) -> (..., P)."""
        lead = x.shape[:-1]
        index, weights = self._product_code(self.route(x.reshape(-1, x.shape[-1])))
        return self._hook_code(index, weights, lead)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        lead = hidden_states.shape[:-1]
        x = hidden_states.reshape(-1, hidden_states.shape[-1])  # (T, I)
        routing = self.route(x)
        if self.wants_router_outputs:
            uniformity, ambiguity = self.router_losses(routing)
            aux = self.spec.uniformity_coef * uniformity + self.spec.ambiguity_coef * ambiguity
            logits = torch.cat([routing.logits1.flatten(1), routing.logits2.flatten(1)], dim=-1)  # (T, 2·R·S)
            self._set_router_outputs(logits, aux)
        index, weights = self._product_code(routing)  # (T, P)
        code, same_units, same_values = self._hook_code_tracked(index, weights, lead)  # code: (T, P')
        hidden = self._hidden(x)
        if not (same_units and same_values):  # an intervention or a hook edited the code (or edits cannot be seen)
            S = self.spec.num_sub_experts
            ids, w = code.top_k_index, code.top_k_weights.to(self.b_dec.dtype)
            mix = self._mix_code(hidden, ids // S, ids % S, w)
        else:
            mix = self._mix_gates(hidden, routing.gates1.to(self.b_dec.dtype), routing.gates2.to(self.b_dec.dtype))
        return (self._decode(mix) + self.b_dec).view(*lead, -1)

    # -- the sub-experts (per decomposition) ----------------------------------------------------------------------

    def _build_experts(self) -> None:
        raise NotImplementedError

    def _reset_experts(self) -> None:
        raise NotImplementedError

    def _hidden(self, x: torch.Tensor):
        """Every sub-expert's hidden units for x (T, I)."""
        raise NotImplementedError

    def _mix_gates(self, hidden, g1: torch.Tensor, g2: torch.Tensor):
        """Hidden units mixed by G = Σ_r ĝ¹_r ⊗ ĝ²_r without forming G (the factorized sums)."""
        raise NotImplementedError

    def _mix_code(self, hidden, i: torch.Tensor, j: torch.Tensor, w: torch.Tensor):
        """The same mix from a code: experts (i_p, j_p) with weights w_p, (T, P) each."""
        raise NotImplementedError

    def _decode(self, mix) -> torch.Tensor:
        """Down projections and expert biases: (T, O), without b_dec."""
        raise NotImplementedError


def _gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[b, index[b, p], :] for t (T, S, M) and index (T, P): (T, P, M)."""
    return t.gather(1, index[..., None].expand(-1, -1, t.shape[-1]))


def _scatter_add(like: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """out[b, index[b, p], :] += src[b, p, :] into zeros shaped like `like` (T, S, M)."""
    return torch.zeros_like(like).scatter_add(1, index[..., None].expand(-1, -1, like.shape[-1]), src)


class MonetHDLayer(MonetLayer):
    """Monet-HD: expert (i, j) = bottom layer U_i, b¹_i and top layer V_j, b²_j (Eq. 6; Algorithm 1).

    Shapes: W_up (H, I), rows i·M:(i+1)·M = U_i; b_up (H,) = [b¹_i]; W_down (H, O), rows j·M:(j+1)·M = V_jᵀ;
    b_experts (S, O), row j = b²_j; b_dec (O,).
    """

    def _build_experts(self) -> None:
        I, O, H, S = self.spec.d_in, self.spec.d_out, self.spec.d_hidden, self.spec.num_sub_experts
        self.W_up = nn.Parameter(torch.empty(H, I))
        self.b_up = nn.Parameter(torch.empty(H))
        self.W_down = nn.Parameter(torch.empty(H, O))
        self.b_experts = nn.Parameter(torch.empty(S, O))

    def _reset_experts(self) -> None:
        uniform_(self.W_up, linear_bound(self.spec.d_in))
        nn.init.zeros_(self.b_up)
        nn.init.zeros_(self.W_down)
        nn.init.zeros_(self.b_experts)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        S, M = self.spec.num_sub_experts, self.spec.expert_dim
        return self.act(F.linear(x, self.W_up, self.b_up)).view(-1, S, M)  # σ(U_i x + b¹_i): (T, S, M)

    def _mix_gates(self, h, g1, g2):
        y = torch.einsum("tri,tim->trm", g1, h)  # Σ_i ĝ¹_ri h_i: (T, R, M)
        z = torch.einsum("trj,trm->tjm", g2, y)  # Σ_r ĝ²_rj y_r = Σ_i G_ij h_i: (T, S, M)   (Eq. 12)
        col = torch.einsum("trj,tr->tj", g2, g1.sum(-1))  # Σ_i G_ij, the weight of b²_j: (T, S)
        return z, col

    def _mix_code(self, h, i, j, w):
        z = _scatter_add(h, j, _gather(h, i) * w[..., None])  # Σ_{p: j_p = j} w_p h_{i_p}: (T, S, M)
        col = w.new_zeros(h.shape[:2]).scatter_add(1, j, w)  # (T, S)
        return z, col

    def _decode(self, mix) -> torch.Tensor:
        z, col = mix
        return z.flatten(1) @ self.W_down + col @ self.b_experts  # Σ_j V_j z_j + Σ_j col_j b²_j: (T, O)


class MonetVDLayer(MonetLayer):
    """Monet-VD: expert (i, j) stacks half the hidden units of i over half of j, and the top output half from i's
    blocks over the bottom half from j's (Eq. 13; App. A.1; Algorithm 2).

    Shapes (H/2 = S·M/2 hidden units per side, O/2 outputs per half): W_up1, W_up2 (H/2, I), rows i·M/2:(i+1)·M/2 =
    U¹_i (resp. U²_j); b_up1, b_up2 (H/2,) = [b¹¹_i], [b²¹_j]; W_down11, W_down12 (H/2, O/2), i-blocks = V¹¹_iᵀ,
    V¹²_iᵀ; W_down21, W_down22 (H/2, O/2), j-blocks = V²¹_jᵀ, V²²_jᵀ; b_experts1 (S, O/2) = [b¹²_i];
    b_experts2 (S, O/2) = [b²²_j]; b_dec (O,).
    """

    def _build_experts(self) -> None:
        I, O, H, S = self.spec.d_in, self.spec.d_out, self.spec.d_hidden, self.spec.num_sub_experts
        for side in (1, 2):
            setattr(self, f"W_up{side}", nn.Parameter(torch.empty(H // 2, I)))
            setattr(self, f"b_up{side}", nn.Parameter(torch.empty(H // 2)))
        for block in ("11", "12", "21", "22"):
            setattr(self, f"W_down{block}", nn.Parameter(torch.empty(H // 2, O // 2)))
        self.b_experts1 = nn.Parameter(torch.empty(S, O // 2))
        self.b_experts2 = nn.Parameter(torch.empty(S, O // 2))

    def _reset_experts(self) -> None:
        for side in (1, 2):
            uniform_(getattr(self, f"W_up{side}"), linear_bound(self.spec.d_in))
            nn.init.zeros_(getattr(self, f"b_up{side}"))
        for block in ("11", "12", "21", "22"):
            nn.init.zeros_(getattr(self, f"W_down{block}"))
        nn.init.zeros_(self.b_experts1)
        nn.init.zeros_(self.b_experts2)

    def _hidden(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        S, M2 = self.spec.num_sub_experts, self.spec.expert_dim // 2
        a1 = self.act(F.linear(x, self.W_up1, self.b_up1)).view(-1, S, M2)  # σ(U¹_i x + b¹¹_i): (T, S, M/2)
        a2 = self.act(F.linear(x, self.W_up2, self.b_up2)).view(-1, S, M2)  # σ(U²_j x + b²¹_j): (T, S, M/2)
        return a1, a2

    def _mix_gates(self, hidden, g1, g2):
        a1, a2 = hidden
        rows = torch.einsum("tri,tr->ti", g1, g2.sum(-1))  # Σ_j G_ij: (T, S)
        cols = torch.einsum("trj,tr->tj", g2, g1.sum(-1))  # Σ_i G_ij: (T, S)
        y1 = torch.einsum("tri,tim->trm", g1, a1)  # Σ_i ĝ¹_ri a¹_i: (T, R, M/2)
        y2 = torch.einsum("trj,tjm->trm", g2, a2)  # Σ_j ĝ²_rj a²_j: (T, R, M/2)
        x11 = rows[..., None] * a1  # straightflow Σ_j G_ij a¹_i: (T, S, M/2)
        x12 = torch.einsum("tri,trm->tim", g1, y2)  # crossflow Σ_j G_ij a²_j, indexed by i: (T, S, M/2)
        x21 = torch.einsum("trj,trm->tjm", g2, y1)  # crossflow Σ_i G_ij a¹_i, indexed by j: (T, S, M/2)
        x22 = cols[..., None] * a2  # straightflow Σ_i G_ij a²_j: (T, S, M/2)
        return x11, x12, x21, x22, rows, cols

    def _mix_code(self, hidden, i, j, w):
        a1, a2 = hidden
        rows = w.new_zeros(a1.shape[:2]).scatter_add(1, i, w)  # (T, S)
        cols = w.new_zeros(a2.shape[:2]).scatter_add(1, j, w)  # (T, S)
        x12 = _scatter_add(a2, i, _gather(a2, j) * w[..., None])  # Σ_{p: i_p = i} w_p a²_{j_p}: (T, S, M/2)
        x21 = _scatter_add(a1, j, _gather(a1, i) * w[..., None])  # Σ_{p: j_p = j} w_p a¹_{i_p}: (T, S, M/2)
        return rows[..., None] * a1, x12, x21, cols[..., None] * a2, rows, cols

    def _decode(self, mix) -> torch.Tensor:
        x11, x12, x21, x22, rows, cols = mix
        top = x11.flatten(1) @ self.W_down11 + x12.flatten(1) @ self.W_down12 + rows @ self.b_experts1  # (T, O/2)
        bottom = x21.flatten(1) @ self.W_down21 + x22.flatten(1) @ self.W_down22 + cols @ self.b_experts2  # (T, O/2)
        return torch.cat([top, bottom], dim=-1)  # (T, O)
