"""Routed single-neuron experts with shared neurons ("Secret mixtures of experts inside your LLM", Boix-Adsera 2025,
arXiv 2512.18452; the reference code's `MLPPlusMoE` / `MoE_TopK_SingleNeuron`).

    s = W_gate (W_gate_proj x) + b_gate          low-rank router I -> r -> N (full rank: W_gate x + b_gate)
    idx, v = TopK(s); g = softmax(v)            over the K selected experts only
    h_k = φ(w_idx_k · x + b_idx_k)               each expert is one neuron: input row w_i, bias b_i, output row u_i
    y = Σ_k g_k h_k u_idx_k + W_shared_decᵀ φ(W_shared_enc x + b_shared_enc) + b_dec

Shapes (letters as in sparse_base, plus r router rank, S shared neurons): W_enc (N, I), b_enc (N,), W_dec (N, O)
(rows = neurons, stored like embedding tables); W_gate_proj (r, I); W_gate (N, r) or (N, I); b_gate (N,);
W_shared_enc (S, I), b_shared_enc (S,), W_shared_dec (S, O); b_dec (O,).

Only the K selected rows of W_enc / b_enc / W_dec are read per token: the input dots go through `GatheredDot`
(chunked gathers forward, `embedding_bag` backward) and the output sum through `embedding_bag`. The router is the one
dense (T, N) product. The sparse code is (top-k neuron ids, softmax gate weights); steering adds λ to a neuron's gate
weight (y += λ h_n u_n), ablation zeroes it without renormalizing the others.

Init: the reference code's for the neurons' inputs and the router; the output rows start at 0 by default
(`decoder_init`), so that distillation starts from b_dec, the mean MLP output.

# Diff with the reference code: the shared MLP's output bias is merged into b_dec (the trainer sets b_dec to the mean
# MLP output); zero output rows by default (`decoder_init='paper'` restores U(±1/√K)). Neither has an auxiliary loss.
"""

import dataclasses
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from .sparse_base import ACTIVATIONS, SparseLayer, canonical_activation, linear_bound, uniform_
from .sparse_code import CodeHook, SparseCode
from .sparse_kernels import GatheredDot, sparse_rows_sum
from .sparse_spec import SparseSpec, _require_bool, _require_choice, _require_int, arxiv_bibtex

@dataclasses.dataclass
class RoutedNeuronsSpec(SparseSpec):
    kind = "routed_neurons"
    activation_meaning: ClassVar[str] = (
        "the neuron's contribution |g_n·h_n| (router gate x its activation; read at `contribution_hook`); active "
        "where nonzero (selected, with h_n != 0)"
    )
    title: ClassVar[str] = "routed single-neuron experts (secret MoE)"
    not_sparse_coder: ClassVar[str] = (
        "a router chooses the neurons and weights them by a softmax gate, beside a dense shared MLP: the code is "
        "no TopK(ReLU(W_enc x + b_enc)) of one linear encoder"
    )
    citation: ClassVar[str] = arxiv_bibtex(
        "boixadsera2025secret",
        title="Secret mixtures of experts inside your LLM",
        authors=["Boix-Adsera, Enric"],
        year=2025,
        arxiv_id="2512.18452",
    )
    num_experts: int
    """N (the paper's m): single-neuron routed experts (the paper uses 10k-100k)."""
    k: int = 32
    """K: routed neurons per token."""
    num_shared: int = 0
    """S: always-on shared neurons (a dense φ-MLP of width S). The paper uses S = K (Table 1: an even split of the
    active neurons between shared and routed is best)."""
    router_rank: int | None = 128
    """r: low-rank router d -> r -> N, which the paper finds better (128 for d = 512-640, 256 for d = 1024);
    0 or None gives the full-rank router d -> N."""
    activation: str = "gelu"
    """φ of the neurons: gelu (the paper's), gelu_new, silu, relu."""
    decoder_init: str = "zeros"
    """'zeros': output rows (routed and shared) start at 0, so the layer starts as b_dec, the trainer's mean MLP
    output (as mxd); 'paper': the reference code's U(±1/√K) routed and nn.Linear-default shared output rows."""
    selection_bias: bool = False
    """A per-neuron bias `b_select` (a buffer) added to the router scores only to choose the top K, never to weight
    (auxiliary-loss-free balancing, DeepSeek-V3; the trainer moves it, `train.balance`)."""

    def validate(self) -> None:
        super().validate()
        _require_int(self, "num_experts")
        _require_int(self, "k")
        if self.k > self.num_experts:
            raise ValueError(
                f"routed_neurons.k={self.k} exceeds routed_neurons.num_experts={self.num_experts}: TopK cannot select "
                "more experts than exist; lower k or raise num_experts"
            )
        _require_int(self, "num_shared", minimum=0)
        if self.router_rank is not None:
            _require_int(self, "router_rank", minimum=0)
        self.activation = canonical_activation(self.activation)
        _require_choice(self, "decoder_init", ("zeros", "paper"))
        _require_bool(self, "selection_bias")

    @property
    def low_rank_router(self) -> bool:
        return bool(self.router_rank)

    def _router_parameters(self) -> int:
        I, N = self.d_in, self.num_experts
        return (I * self.router_rank + self.router_rank * N if self.low_rank_router else I * N) + N

    def _router_macs(self) -> int:
        I, N = self.d_in, self.num_experts
        return I * self.router_rank + self.router_rank * N if self.low_rank_router else I * N

    def num_parameters(self) -> int:
        I, O, N, S = self.d_in, self.d_out, self.num_experts, self.num_shared
        return self._router_parameters() + N * (I + 1 + O) + S * (I + 1 + O) + O

    def active_parameters(self) -> int:
        """The whole router (it scores every expert) + the K selected neurons + the shared neurons + b_dec."""
        I, O, K, S = self.d_in, self.d_out, self.k, self.num_shared
        return self._router_parameters() + K * (I + 1 + O) + S * (I + 1 + O) + O

    def flops_per_token(self) -> int:
        """2 × multiply-accumulates (router, K + S neurons in and out) + the output bias."""
        I, O, K, S = self.d_in, self.d_out, self.k, self.num_shared
        return 2 * (self._router_macs() + (K + S) * (I + O)) + O


class RoutedNeuronsLayer(SparseLayer):
    """Top-K routed single-neuron experts plus shared neurons; see the module docstring for the equations."""

    spec: RoutedNeuronsSpec

    selects_top_k_units = True
    router_distribution = "scores"

    def output_directions(self) -> torch.Tensor:
        return self.W_dec.detach()  # neuron n's output row u_n: (N, O)
    supports_auxk = True
    """Dead routed neurons can model the residual error (`auxk_reconstruction`; conversion/training/auxk.py)."""

    def __init__(self, spec: RoutedNeuronsSpec) -> None:
        super().__init__(spec)
        I, O, N, S, r = spec.d_in, spec.d_out, spec.num_experts, spec.num_shared, spec.router_rank
        self.act = ACTIVATIONS[spec.activation]
        self.W_gate_proj = nn.Parameter(torch.empty(r, I)) if spec.low_rank_router else None
        self.W_gate = nn.Parameter(torch.empty(N, r if spec.low_rank_router else I))
        self.b_gate = nn.Parameter(torch.empty(N))
        self.W_enc = nn.Parameter(torch.empty(N, I))
        self.b_enc = nn.Parameter(torch.empty(N))
        self.W_dec = nn.Parameter(torch.empty(N, O))
        self.W_shared_enc = nn.Parameter(torch.empty(S, I)) if S else None
        self.b_shared_enc = nn.Parameter(torch.empty(S)) if S else None
        self.W_shared_dec = nn.Parameter(torch.empty(S, O)) if S else None
        self.b_dec = nn.Parameter(torch.empty(O))
        self._init_selection_bias(N)
        self.contribution_hook = CodeHook()
        """Read-only view of each selected neuron's contribution scale |g·h| at the code's shape (..., K): the
        activation a reader needs (a gate alone says "selected", not how much the neuron adds). Editing its output
        changes nothing; interventions edit `code_hook` (the gates)."""
        self.reset_parameters()

    @property
    def activation_hook(self) -> CodeHook:
        return self.contribution_hook

    @property
    def num_units(self) -> int:
        return self.spec.num_experts

    @property
    def output_bias(self) -> nn.Parameter:
        return self.b_dec  # added to every token's output

    def reset_parameters(self) -> None:
        """The reference code's init: neuron input rows and biases U(±1/√I); router and shared input layer as
        nn.Linear defaults; b_dec = 0. Output rows: zero (`decoder_init='zeros'`, the default) or the reference code's
        U(±1/√K) routed and nn.Linear-default shared rows (`'paper'`).
        # Diff with the reference code (default only): a random decoder adds an output of fixed scale (~0.1 per
        # coordinate) that distillation must first unlearn, which costs most on MLPs with small outputs."""
        I, K, S = self.spec.d_in, self.spec.k, self.spec.num_shared
        paper = self.spec.decoder_init == "paper"
        if self.W_gate_proj is not None:
            uniform_(self.W_gate_proj, linear_bound(I))
        uniform_(self.W_gate, linear_bound(self.W_gate.shape[1]))
        uniform_(self.b_gate, linear_bound(self.W_gate.shape[1]))
        uniform_(self.W_enc, linear_bound(I))
        uniform_(self.b_enc, linear_bound(I))
        if paper:
            uniform_(self.W_dec, linear_bound(K))
        else:
            nn.init.zeros_(self.W_dec)
        if self.W_shared_enc is not None:
            uniform_(self.W_shared_enc, linear_bound(I))
            uniform_(self.b_shared_enc, linear_bound(I))
            if paper:
                uniform_(self.W_shared_dec, linear_bound(S))
            else:
                nn.init.zeros_(self.W_shared_dec)
        nn.init.zeros_(self.b_dec)
        if self.b_select is not None:
            nn.init.zeros_(self.b_select)

    def router_logits_of(self, x: torch.Tensor) -> torch.Tensor:
        """Router scores s: (T, I) -> (T, N)."""
        if self.W_gate_proj is not None:
            x = F.linear(x, self.W_gate_proj)  # (T, r)
        return F.linear(x, self.W_gate, self.b_gate)  # (T, N)

    def encode(self, x: torch.Tensor) -> SparseCode:
        """(top-K neuron ids, softmax over their router scores): (..., I) -> (..., K)."""
        source, lead = x, x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # (T, I)
        logits = self.router_logits_of(x)  # (T, N)
        top_logits, index = self._select(logits, self.spec.k)  # (T, K) each (unbiased scores)
        self._set_router_outputs(logits if self.record_router_outputs else None, None)
        self._keep(source, logits=logits, live=top_logits)  # for AuxK, when it runs this step
        return self._hook_code(index, top_logits.softmax(dim=-1), lead)

    def neuron_activations(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """h = φ(w_idx · x + b_idx) of the selected neurons only: (T, I), (T, K) -> (T, K)."""
        # F.embedding, not b_enc[index]: indexing's backward accumulates in parallel in a run-dependent order on CPU,
        # so seeded runs would differ in the last bits; embedding's backward is deterministic.
        bias = F.embedding(index, self.b_enc.unsqueeze(-1)).squeeze(-1)  # (T, K)
        return self.act(GatheredDot.apply(x, self.W_enc, index) + bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        lead = hidden_states.shape[:-1]
        x = hidden_states.reshape(-1, hidden_states.shape[-1])  # (T, I)
        code = self.encode(hidden_states).flat()  # (T, K) (+ steered ids); the hook saw (..., K)
        h = self.neuron_activations(x, code.top_k_index)  # (T, K)
        gh = code.top_k_weights * h  # (T, K)
        self.contribution_hook(SparseCode(code.top_k_index.view(*lead, -1), gh.detach().abs().view(*lead, -1)))
        out = sparse_rows_sum(SparseCode(code.top_k_index, gh), self.W_dec)  # Σ_k g_k h_k u_k
        if self.W_shared_enc is not None:
            out = out + self.act(F.linear(x, self.W_shared_enc, self.b_shared_enc)) @ self.W_shared_dec  # (T, O)
        return (out + self.b_dec).view(*lead, -1)

    supports_resampling = True

    @torch.no_grad()
    def resample_units(self, units: torch.Tensor, x: torch.Tensor, error: torch.Tensor) -> dict[str, torch.Tensor]:
        """Dead neurons' router rows point at their (projected) inputs and their input rows at x, each scaled to the
        live rows' mean norm, biases 0; their output rows start at 0 (the output is unchanged)."""
        live = torch.ones(self.spec.num_experts, dtype=torch.bool, device=units.device)
        live[units] = False
        routed = F.linear(x.to(self.W_gate.dtype), self.W_gate_proj) if self.W_gate_proj is not None else x
        self._point_rows(self.W_gate, units, routed, live)
        self._point_rows(self.W_enc, units, x, live)
        self.b_gate[units] = 0
        self.b_enc[units] = 0
        self.W_dec[units] = 0
        return {"W_gate": units, "b_gate": units, "W_enc": units, "b_enc": units, "W_dec": units}

    def auxk_reconstruction(self, x: torch.Tensor, dead_mask: torch.Tensor, k_aux: int) -> torch.Tensor:
        """AuxK's ê for routed neurons: Σ_a g_a h_a u_a over the k_aux dead neurons with the highest router scores;
        no shared neurons, no b_dec. (..., I), (N,) bool -> (..., O).

        g_a is the gate the dead neuron would get if it joined the token's selection: a softmax over the K selected
        scores (detached) and the k_aux dead ones, keeping the dead entries. A router ranks by score, not by the
        size of an activation, so a dead neuron comes back only when its score beats the live ones; with the live
        scores in the denominator the auxiliary gradient raises a dead score in absolute terms wherever its neuron
        explains the residual (a softmax over the dead scores alone could only reorder them among themselves).
        Gradients reach only the selected dead neurons' rows of W_gate, b_gate, W_enc, b_enc and W_dec: the low-rank
        projection W_gate_proj is shared by every neuron, so its output is detached here."""
        kept, lead = self._take_kept(x), x.shape[:-1]  # the forward's router scores, when it kept them
        x = x.reshape(-1, x.shape[-1])  # (T, I)
        k_aux = min(int(k_aux), self.spec.num_experts)
        with torch.no_grad():
            routed_x = F.linear(x, self.W_gate_proj) if self.W_gate_proj is not None else x  # (T, r) or (T, I)
            logits, live = kept.get("logits"), kept.get("live")  # (T, N), (T, K): the forward's selection
            if logits is None:
                logits = F.linear(routed_x, self.W_gate, self.b_gate)
                live = self._select(logits, self.spec.k)[0]
            index = logits.masked_fill(~dead_mask, float("-inf")).topk(k_aux, dim=-1, sorted=False).indices
        # Scores of the selected dead neurons from their rows only (as `neuron_activations`): (T, k_aux)
        bias = F.embedding(index, self.b_gate.unsqueeze(-1)).squeeze(-1)
        dead = GatheredDot.apply(routed_x, self.W_gate, index) + bias
        dead = dead.masked_fill(~dead_mask[index], float("-inf"))  # live fillers (fewer than k_aux dead) get gate 0
        gates = torch.cat([live.to(dead.dtype), dead], dim=-1).softmax(dim=-1)[:, live.shape[1] :]  # (T, k_aux)
        h = self.neuron_activations(x, index)  # (T, k_aux)
        return sparse_rows_sum(SparseCode(index, gates * h), self.W_dec).view(*lead, -1)  # (..., O)
