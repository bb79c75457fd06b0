"""JumpReLU transcoders and cross-layer transcoders: the kinds whose latents fire above a learned threshold.

Part of the Hub bundle: imports only torch, the standard library and sibling files.

## JumpReLU transcoders (`jumprelu_transcoder`)

The transcoder form (Dunefsky et al. 2024) with the JumpReLU activation of Gemma Scope
(Rajamanoharan et al. 2024) and an optional linear skip path (Paulo et al. 2025):

    a = JumpReLU_θ(W_enc x + b_enc) = pre · 1[pre > θ]     over L latents, θ > 0 per latent
    y = W_decᵀ a + b_dec  (+ W_skip x)

Shapes as in latent_coder.py (the parameters, decoder, resampling and export view this kind shares with
transcoder.py): W_enc (L, I); b_enc (L,); threshold_exponent (L,); W_dec (L, O); b_dec (O,); W_skip (O, I).
θ = exp(THRESHOLD_RATE · threshold_exponent): Adam moves a parameter by about the learning rate per step whatever its
gradient's scale, so with θ = exp(p) the thresholds change by ~1 % per step while the encoder's rows move by several %:
the encoder pushed the pre-activations down under still thresholds and the L0 sank to under half its target
(stories260k, every layer, k = 16: L0 5-8 after 200 steps, whatever sparsity_coef). With the factor 10, log θ moves
~10x the learning rate and the L0 holds its target (16.2; FVU 0.259 against 0.262 at L0 6.8).

How many latents fire varies from token to token (no TopK caps it). The code of a call lists, for every token, as
many slots as the busiest token of the call needs, the largest values first; a token with fewer firing latents fills
its remaining slots with weight 0, which no reader counts (`active_entries`: nonzero). So the code's width varies
between calls; its active entries are exactly the firing latents. Under torch.compile / torch.export (no
data-dependent shapes) the code has a slot per latent instead: the same firing entries, the same output.

Sparsity: `k` is the target L0. While training, the layer's `aux_loss` is sparsity_coef · (L0 / k − 1)², with L0 the
mean count of firing latents per token, differentiated for θ by the straight-through estimator (sparse_kernels.py
`JumpStep`); a fixed-coefficient λ·L0 (Gemma Scope) leaves the L0 where the coefficient lands it, the target puts it
where a TopK transcoder of the same k sits, so the two compare at equal L0. The estimator's window ε is relative to
the threshold (ε_l = bandwidth · θ_l): the inputs here are the model's own MLP inputs, not normalized to one scale as
Gemma Scope's were, so an absolute ε would mean something different at every layer.

## Cross-layer transcoders (`clt`)

CLT (Ameisen et al. 2025, "Circuit Tracing", the transcoders circuit-tracer loads): every
converted layer s has an encoder reading its own MLP input, and its latents write into the MLP output of every
converted layer m ≥ s:

    a_s = JumpReLU_θs(W_enc,s x_s + b_enc,s)                     over L latents per layer (as above)
    y_m = b_dec,m + Σ_{s ∈ sources(m)} W_dec,s→mᵀ a_s           sources(m) = the CLT's layers ≤ m, m itself last

One `CltLayer` replaces each MLP: it holds its own encoder, its bias and the decoders *into* it from each source
(W_dec (S, L, O), S = len(sources), row order of `spec.sources`). Shapes: W_enc (L, I), b_enc (L,),
threshold_exponent (L,), W_dec (S, L, O), b_dec (O,).

The layers of one CLT share a code bus (`link_cross_layer`, run by the model when it builds its sparse layers and by
whatever builds a CLT's layers outside a model): in a forward, each layer posts its code (after interventions and
`code_hook`: ablating a latent removes it from every later layer's output too, as in circuit-tracer) and reads its
sources' codes from the same pass. So a CLT's layers run in order, each once per pass, as a model's forward (with or
without a KV cache) and distillation's stack run them; the first layer opens a pass, the last closes it, and a layer
whose sources have not run in the current pass refuses to guess (`CrossLayerError`).
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from .latent_coder import LatentCoderLayer, LatentCoderSpec
from .sparse_base import SparseLayer, linear_bound, uniform_
from .sparse_code import SparseCode
from .sparse_kernels import JumpReLU, JumpStep, sparse_rows_sum
from .sparse_spec import _require_bool, _require_positive, arxiv_bibtex

JUMPRELU_CITATION = arxiv_bibtex(
    "rajamanoharan2024jumprelu",
    title="Jumping Ahead: Improving Reconstruction Fidelity with JumpReLU Sparse Autoencoders",
    authors=["Rajamanoharan, Senthooran", "Lieberum, Tom", "Sonnerat, Nicolas", "Conmy, Arthur",
             "Varma, Vikrant", "Kram{\\'a}r, J{\\'a}nos", "Nanda, Neel"],
    year=2024,
    arxiv_id="2407.14435",
)

THRESHOLD_RATE = 10.0
"""θ = exp(THRESHOLD_RATE · threshold_exponent) (see the module's docstring for why)."""


@dataclasses.dataclass
class JumpReluTranscoderSpec(LatentCoderSpec):
    kind = "jumprelu_transcoder"
    title: ClassVar[str] = "JumpReLU transcoder"
    activation_meaning: ClassVar[str] = "latent value JumpReLU(W_enc x + b_enc) = pre · 1[pre > threshold]"
    coder_activation: ClassVar[str | None] = "jumprelu"
    citation: ClassVar[str] = JUMPRELU_CITATION
    extra_per_latent: ClassVar[int] = 1  # the threshold
    k_bound: ClassVar[str] = "the target L0 cannot exceed the latents that exist"
    k: int = 32
    """The target L0: the mean number of firing latents per token the sparsity loss steers to."""
    skip_connection: bool = False
    """A dense linear skip path W_skip x beside the latents (a skip transcoder, Paulo et al. 2025)."""
    sparsity_coef: float = 10.0
    """Weight of the sparsity loss sparsity_coef · (L0 / k − 1)² beside the distillation loss."""
    bandwidth: float = 4.0
    """The straight-through window around each threshold, as a fraction of the threshold (docs/results/
    circuit_tracing.md: a wide window left fewer latents dead and a lower KL on two models)."""

    def validate(self) -> None:
        super().validate()
        _require_bool(self, "skip_connection")
        _require_positive(self, "sparsity_coef")
        _require_positive(self, "bandwidth")


class JumpReluTranscoderLayer(LatentCoderLayer):
    """JumpReLU transcoder; `W_skip` when `spec.skip_connection`."""

    spec: JumpReluTranscoderSpec
    l0_is_trained_target = True  # spec.k: the sparsity loss steers the mean L0 there
    supports_preact_loss = True  # dead latents sit below θ, where neither loss reaches them (dead_preact_gap)

    def _add_per_latent_parameters(self, num_latents: int) -> None:
        self.threshold_exponent = nn.Parameter(torch.empty(num_latents))

    def _reset_per_latent_parameters(self) -> None:
        """θ = 1e-3 (Gemma Scope's start) until the first training batch sets it (`init_from_inputs`)."""
        nn.init.constant_(self.threshold_exponent, math.log(1e-3) / THRESHOLD_RATE)

    def _resample_per_latent_parameters(self, units: torch.Tensor, live: torch.Tensor) -> dict[str, torch.Tensor]:
        """Resampled latents' thresholds drop to the live latents' median, so they fire where they now point."""
        if live.any():
            self.threshold_exponent[units] = self.threshold_exponent[live].median()
        return {"threshold_exponent": units}

    def threshold_parameters(self) -> list[nn.Parameter]:
        return [self.threshold_exponent]

    @property
    def threshold(self) -> torch.Tensor:
        """θ (L,) > 0: a latent fires where its pre-activation exceeds it."""
        return (THRESHOLD_RATE * self.threshold_exponent).exp()

    def _coder_threshold(self) -> torch.Tensor:
        return self.threshold

    @torch.no_grad()
    def init_from_inputs(self, x: torch.Tensor) -> list[nn.Parameter]:
        """θ_l = the (1 − k/L) quantile of latent l's pre-activations over the first training batch, so that every
        latent fires on about k/L of the tokens and the L0 starts at the target instead of at ~L/2 (θ = 1e-3) from
        where the straight-through window, which only sees pre-activations near θ, needs many steps to bring it.
        A latent with too few positive pre-activations gets a small positive θ. x (T, I)."""
        pre = F.linear(x.reshape(-1, x.shape[-1]).to(self.W_enc.dtype), self.W_enc, self.b_enc)  # (T, L)
        T, L = pre.shape
        rank = min(T, max(1, math.ceil(T * (1 - self.spec.k / L))))
        quantile = pre.float().kthvalue(rank, dim=0).values  # (L,)
        floor = 1e-3 * pre.float().abs().mean().clamp_min(1e-12)
        exponent = quantile.clamp_min(floor).log() / THRESHOLD_RATE
        self.threshold_exponent.copy_(exponent.to(self.threshold_exponent.dtype))
        return [self.threshold_exponent]

    def encode(self, x: torch.Tensor) -> SparseCode:
        """a = JumpReLU(W_enc x + b_enc) as the code: (..., I) -> (..., W), W = the most latents firing on one token
        of this call (at least 1)."""
        lead = x.shape[:-1]
        pre = F.linear(x.reshape(-1, x.shape[-1]), self.W_enc, self.b_enc)  # (T, L)
        threshold = self.threshold.to(pre.dtype)
        window = self.spec.bandwidth * threshold  # (L,): the straight-through window's width per latent
        acts = JumpReLU.apply(pre, threshold, window)  # (T, L)
        fired = acts != 0  # (T, L); θ > 0, so a firing value is > θ > 0
        if self.wants_router_outputs:  # training (or asked by the model): the sparsity loss of this forward
            l0 = JumpStep.apply(pre, threshold, window).sum(-1).mean()
            self.aux_loss = self.spec.sparsity_coef * (l0 / self.spec.k - 1).square()
        if self.training and self.dead_for_preact is not None and pre.shape[0]:
            self.preact_loss = dead_preact_gap(pre, threshold, self.dead_for_preact, self.spec.k)
        if torch.compiler.is_compiling() or not pre.shape[0]:
            width = acts.shape[-1]  # a traced graph has no data-dependent shape: a slot per latent (the idle at 0)
        else:
            width = max(1, int(fired.sum(-1).max()))
        values, index = acts.topk(width, dim=-1)  # (T, W) each, largest first
        return self._hook_code(index, values, lead)


def dead_preact_gap(pre: torch.Tensor, threshold: torch.Tensor, dead: torch.Tensor, k: int) -> torch.Tensor:
    """The pre-activation loss on dead latents (after Anthropic's, "Circuits Updates", Jan 2025, which SAELens
    restricts to dead latents as here): how far below its threshold each dead latent's pre-activations sit on the n
    tokens where they are highest, n = ⌈T·k/L⌉ (a latent's fair share of the batch), in units of the batch's
    pre-activation scale, summed over the dead latents, over the latent count L:

        loss = (1/L) Σ_{l dead} mean_{t ∈ top_n(pre_:,l)} ReLU(θ_l − pre_tl) / rms(pre)      pre (T, L), θ (L,)

    Why: a latent whose pre-activations all sit below θ − window/2 gets no gradient from the distillation loss nor
    from the L0 loss (both reach θ only through the straight-through window), so it stays dead. This gradient lowers
    its θ and raises its pre-activations on the tokens it is nearest to firing on (its encoder row moves toward
    those tokens' inputs) until it fires there — on its fair share, not on every token, which would make every
    revived latent a generalist with an untrained decoder. It reaches only the dead latents' own parameters.
    rms(pre) (no gradient) keeps the term's size, and so its share of the clipped gradient norm, the same at every
    activation scale: dividing by each latent's own θ instead let a near-zero θ swamp the clipping and starve the
    distillation (FVU 0.12 -> 0.8-13.5 on the quickstart). Exactly 0 with no dead latent, without a host sync."""
    T, L = pre.shape
    n = min(T, max(1, math.ceil(T * k / L)))
    nearest = pre.topk(n, dim=0).values  # (n, L): each latent's n highest pre-activations of the batch
    scale = pre.detach().float().square().mean().sqrt().clamp_min(1e-12).to(pre.dtype)
    gap = (threshold - nearest).relu().mean(0) / scale  # (L,)
    return (gap * dead.to(gap.dtype)).sum() / L


class CrossLayerError(RuntimeError):
    """A CLT layer run out of order, without its sources, or linked to layers that are not its CLT's."""


@dataclasses.dataclass
class CltSpec(JumpReluTranscoderSpec):
    kind = "clt"
    title: ClassVar[str] = "cross-layer transcoder"
    citation: ClassVar[str] = (
        "@article{ameisen2025circuit,\n"
        "  title         = {Circuit Tracing: Revealing Computational Graphs in Language Models},\n"
        "  author        = {Ameisen, Emmanuel and Lindsey, Jack and Pearce, Adam and Gurnee, Wes and Turner, Nicholas L."
        " and Chen, Brian and Citro, Craig and Abrahams, David and Carter, Shan and Hosmer, Basil and Marcus, Jonathan"
        " and Sklar, Michael and Templeton, Adly and Bricken, Trenton and McDougall, Callum and Cunningham, Hoagy and"
        " Henighan, Thomas and Jermyn, Adam and Jones, Andy and Persic, Andrew and Qi, Zhenyi and Thompson, T. Ben and"
        " Zimmerman, Sam and Rivoire, Kelley and Conerly, Thomas and Olah, Chris and Batson, Joshua},\n"
        "  journal       = {Transformer Circuits Thread},\n"
        "  year          = {2025},\n"
        "  url           = {https://transformer-circuits.pub/2025/attribution-graphs/methods.html}\n"
        "}\n" + JUMPRELU_CITATION
    )
    coder_activation: ClassVar[str | None] = None  # no layer of a CLT is a coder alone
    cross_layer: ClassVar[bool] = True
    not_sparse_coder: ClassVar[str] = (
        "a cross-layer transcoder's output at a layer sums the latents of every earlier layer, so no layer is a coder "
        "on its own (circuit-tracer reads the whole CLT: its export writes that layout)"
    )

    sources: list[int] | None = None
    """The model layers whose latents write into this layer, ascending, this layer last; set per layer by
    `at_layer` when a recipe converts its layers. None: a lone layer that reads only its own latents (a JumpReLU
    transcoder in a CLT's layout)."""

    def validate(self) -> None:
        super().validate()
        if self.skip_connection:
            raise ValueError(f"{self.kind}.skip_connection must be false: a CLT here has no skip path")
        if self.sources is not None:
            ok = (isinstance(self.sources, list) and self.sources
                  and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in self.sources)
                  and self.sources == sorted(set(self.sources)))
            if not ok:
                raise ValueError(f"{self.kind}.sources must be a non-empty ascending list of distinct layer indices, "
                                 f"got {self.sources!r}")

    def at_layer(self, index: int, layer_ids: list[int]) -> "CltSpec":
        """The spec of the CLT's layer `index` among the converted `layer_ids`: its sources are those ≤ index."""
        return dataclasses.replace(self, sources=[i for i in sorted(layer_ids) if i <= index])

    @property
    def num_sources(self) -> int:
        return 1 if self.sources is None else len(self.sources)

    @property
    def placed(self) -> bool:
        """Whether the spec names its model layer (`sources` set)."""
        return self.sources is not None

    def num_parameters(self) -> int:
        I, O, L = self.d_in, self.d_out, self.num_latents
        return L * (I + 2) + self.num_sources * L * O + O

    def active_parameters(self) -> int:
        I, O, L = self.d_in, self.d_out, self.num_latents
        return L * (I + 2) + self.num_sources * self.k * O + O

    def flops_per_token(self) -> int:
        I, O, L = self.d_in, self.d_out, self.num_latents
        return 2 * (I * L + self.num_sources * self.k * O) + O


class _CodeBus:
    """The codes of one CLT's layers in the current pass: layer index -> its code flattened to (T, W)."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.codes: dict[int, SparseCode] = {}


def link_cross_layer(layers: Mapping[int, SparseLayer]) -> None:
    """Give the CLT layers among `layers` (model layer index -> sparse layer) one shared code bus, checking that every
    layer's sources are CLT layers of the same width here. Other kinds are left alone; idempotent."""
    clt = {int(i): layer for i, layer in layers.items() if isinstance(layer, CltLayer) and layer.spec.placed}
    if not clt:
        return
    for index, layer in clt.items():
        sources = layer.spec.sources
        if sources[-1] != index:
            raise CrossLayerError(f"the CLT layer at model layer {index} names its sources {sources}: the last must "
                                  f"be the layer itself ({index})")
        missing = [s for s in sources if s not in clt]
        if missing:
            raise CrossLayerError(f"the CLT layer at model layer {index} reads layer(s) {missing}, which are not CLT "
                                  "layers of this model; a CLT converts all of its layers together")
        widths = {clt[s].spec.num_latents for s in sources}
        if len(widths) > 1:
            raise CrossLayerError(f"the CLT layer at model layer {index} reads layers of widths {sorted(widths)}; a "
                                  "CLT has one width")
    bus = _CodeBus(min(clt), max(clt))
    for layer in clt.values():
        layer._bus = bus


class CltLayer(JumpReluTranscoderLayer):
    """One model layer of a cross-layer transcoder: its encoder, and the decoders into it from its sources."""

    spec: CltSpec
    supports_resampling = False  # a latent's decoders live in every later layer: resampling one layer is partial
    resample_units = SparseLayer.resample_units

    def __init__(self, spec: CltSpec) -> None:
        super().__init__(spec)
        S, L, O = spec.num_sources, spec.num_latents, spec.d_out
        self.W_dec = nn.Parameter(torch.empty(S, L, O))
        self._bus: _CodeBus | None = None
        uniform_(self.W_dec, linear_bound(L) / math.sqrt(S))

    @property
    def index(self) -> int | None:
        """The model layer this CLT layer replaces the MLP of (None for a lone layer)."""
        return None if self.spec.sources is None else self.spec.sources[-1]

    def output_directions(self) -> torch.Tensor:
        return self.W_dec[-1].detach()  # (L, O): what each of this layer's latents writes into this layer

    sparse_coder = SparseLayer.sparse_coder  # None: no layer of a CLT is a coder alone (the spec says why)

    def decoder_from(self, source: int) -> torch.Tensor:
        """(L, O), detached: what the latents of model layer `source` (one of `spec.sources`) write into this layer's
        output, per unit of their value. The view the exporters read (circuit-tracer's W_dec_i, SAELens's per-layer
        W_dec and cross_layer_decoders), so that no caller indexes W_dec's source order itself."""
        sources = self.spec.sources if self.spec.sources is not None else [source]
        if source not in sources:
            raise ValueError(f"layer {self.index} of this CLT reads sources {sources}, not layer {source}")
        return self.W_dec[sources.index(source)].detach()

    def reset_parameters(self) -> None:
        """The encoder as the JumpReLU transcoder's; the decoders into this layer U(±1/√(L·S)) from each of its S
        sources, so that their sum starts at a transcoder's scale. Only `nn.init` calls, which transformers keeps
        off loaded tensors."""
        super().reset_parameters()
        if self.W_dec.dim() == 3:  # not while the JumpReLU transcoder's __init__ holds its (L, O) decoder
            uniform_(self.W_dec, linear_bound(self.spec.num_latents) / math.sqrt(self.spec.num_sources))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        lead = hidden_states.shape[:-1]
        code = self.encode(hidden_states).flat()  # (T, W): this layer's latents, hooked
        bus = self._bus
        if bus is None:
            if self.spec.num_sources > 1:
                raise CrossLayerError(
                    f"the CLT layer at model layer {self.index} is not linked to its sources {self.spec.sources[:-1]}: "
                    "build its layers inside a model, or call link_cross_layer on them")
            codes = {self.index: code}
        else:
            if self.index == bus.first:
                bus.codes.clear()  # a new pass
            bus.codes[self.index] = code
            codes = bus.codes
        sources = self.spec.sources or [self.index]  # a lone layer reads its own latents (index None)
        missing = [s for s in sources if s not in codes]
        if missing:
            raise CrossLayerError(
                f"the CLT layer at model layer {self.index} reads the codes of layer(s) {missing} from the same pass, "
                "and they have not run in it: run the CLT's layers in order, each once per pass (a model forward "
                "does; a layer alone, or recomputed by gradient checkpointing, cannot be)")
        out = self.b_dec.expand(code.top_k_index.shape[0], -1)  # (T, O)
        for position, source in enumerate(sources):
            source_code = codes[source]
            if source_code.top_k_index.shape[0] != code.top_k_index.shape[0]:
                raise CrossLayerError(
                    f"the CLT layer at model layer {self.index} got {code.top_k_index.shape[0]} tokens, but layer "
                    f"{source} posted {source_code.top_k_index.shape[0]} in this pass: run every layer on the same "
                    "tokens")
            out = out + sparse_rows_sum(source_code, self.W_dec[position])  # (T, O)
        if bus is not None and self.index == bus.last:
            bus.codes.clear()  # the pass is over: nothing stale remains for a layer run alone
        return out.view(*lead, -1)

    def average_code_output(self, x: torch.Tensor, mean_weights: torch.Tensor) -> torch.Tensor:
        if not self.reads_other_layers:  # the CLT's first layer reads only its own latents
            return super().average_code_output(x, mean_weights)
        raise CrossLayerError("a CLT layer's output depends on the codes of its earlier layers; its code share is 1 "
                              "by construction (no dense path), not measured alone")

    @property
    def reads_other_layers(self) -> bool:
        return self.spec.num_sources > 1
