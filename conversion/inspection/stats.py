"""The streaming statistics engine: one pass of an expertize model over named corpora, every sparse layer at once.

What a unit and its activation are comes from the layer's sparse code (`SparseCode`, read at `mlp.activation_hook`:
the code hook, or a kind's own view where its code weight is not the unit's contribution, e.g. routed neurons' |g·h|),
so every kind is covered the same way: per token the code lists (unit id, weight) pairs, and a unit **fires** on a
token when it is listed and active by the layer's rule (`SparseLayer.active_entries`: nonzero, the rule the
evaluation's L0 and dead units and the training logs count with); its **activation** there is that weight.

    mxd                          experts; a = TopK(ReLU(G x)) coefficient
    transcoder, skip_transcoder  latents; TopK(ReLU(W_enc x)) value
    moe_x                        hidden unit h of expert j (id j·D + h); the scaled code ω_j zʲ_h (GELU / SiLU
                                 experts: negative values fire too, the output depends on them)
    routed_neurons               neurons; the contribution |g·h| (router gate x the neuron's activation)
    monet_hd, monet_vd           product experts i·S + j; the head-summed gate G_ij
    mumoe_cp, mumoe_tr           experts; the soft gate coefficient a_n. With the default entmax15 gate a unit fires
                                 where a_n != 0 (entmax's exact zeros); with gate_activation=softmax every expert
                                 fires on every token (frequency 1), so rank such units by activation instead.

Per unit: firing frequency (overall and per corpus), mean activation over its firing tokens, max activation, the
top-N contexts (topk.py), its direct effect on the vocabulary (effects.py); router kinds add routing.py's numbers.
Memory is bounded by units × N × window per layer (plus (U, O) sums for mxd / mumoe effects).
"""

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from .effects import EffectAccumulator, vocab_effects
from .routing import RoutingAccumulator, has_router
from .topk import TopContexts

__all__ = ["InspectionSettings", "InspectionStats", "LayerStats", "collect_stats", "sparse_layers_of"]


@dataclasses.dataclass
class InspectionSettings:
    tokens: int = 100_000
    """Tokens read from each corpus (rounded up to whole sequences)."""
    context_length: int = 128
    batch_size: int = 8
    top_n: int = 10
    """Top activating contexts kept per unit."""
    left: int = 12
    """Tokens shown before each context's peak."""
    right: int = 4
    """Tokens shown after it."""
    vocab_top: int = 10
    """Promoted / suppressed tokens per unit."""
    layers: tuple[int, ...] | None = None
    """Sparse layers to inspect (None: all)."""
    collect_locations: bool = False
    """Keep every firing (sequence, position, unit, activation) for a latent-cache export (export.py)."""


@dataclasses.dataclass
class LayerStats:
    """Everything measured for one sparse layer; tensors on CPU. U units, D corpora, N contexts, W window, P tokens."""

    layer: int
    kind: str
    unit_name: str
    num_units: int
    fire_counts: torch.Tensor
    """(D, U) int64: tokens of corpus d on which unit u fired."""
    activation_sum: torch.Tensor
    """(U,) float64: Σ activation over the firing tokens."""
    contexts: TopContexts
    promoted: tuple[torch.Tensor, torch.Tensor] | None
    """(ids, values), each (U, 2, P): [:, 0] promoted, [:, 1] suppressed tokens (NaN values: not defined); None for
    kinds without an output direction."""
    routing: dict | None
    module: str = ""
    """The sparse layer's module path in the model (e.g. "transformer.h.2.mlp"): the hookpoint tools name."""
    locations: tuple[torch.Tensor, torch.Tensor] | None = None
    """(locations (F, 3) int64 (sequence, position, unit), activations (F,) float32) when collected."""
    activation_meaning: str | None = None
    """What a unit's activation is, as the layer's spec declares it (`SparseSpec.activation_meaning`)."""

    @property
    def counts(self) -> torch.Tensor:
        return self.fire_counts.sum(0)  # (U,)

    @property
    def max_activation(self) -> torch.Tensor:
        # (U,) 0 for dead units (no context: -inf); a unit that fired only below 0 keeps its negative maximum
        return torch.where(self.counts > 0, self.contexts.values[:, 0], 0.0)

    @property
    def mean_activation(self) -> torch.Tensor:
        return (self.activation_sum / self.counts.clamp_min(1)).float()  # (U,) over firing tokens; 0 for dead units


@dataclasses.dataclass
class InspectionStats:
    """The result of one inspection pass; `to_json(layer)` gives the layer_<i>.json document (report.py)."""

    model_name: str
    domains: list[str]
    domain_tokens: torch.Tensor
    """(D,) int64 tokens read per corpus."""
    layers: dict[int, LayerStats]
    settings: InspectionSettings
    token_text: Callable[[int], str]
    """Display text of a token id."""
    sequences: torch.Tensor | None = None
    """(S, T) every sequence read, in global sequence order, when locations were collected."""
    model_source: str | None = None
    """The model folder's canonical path (`inspect_folder`): the owner its report folder records; None for a model
    given in memory (its `model_name` stands in)."""

    @property
    def tokens(self) -> int:
        return int(self.domain_tokens.sum())

    def frequency(self, layer: int) -> torch.Tensor:
        """(U,) fraction of all tokens on which each unit fired."""
        return self.layers[layer].counts.double() / max(self.tokens, 1)

    def domain_rates(self, layer: int) -> torch.Tensor:
        """(D, U) fraction of each corpus's tokens on which each unit fired."""
        return self.layers[layer].fire_counts.double() / self.domain_tokens.clamp_min(1)[:, None]

    def to_json(self, layer: int) -> dict:
        from .report import layer_report

        return layer_report(self, layer)

    def write(self, output_dir: str | Path, *, overwrite: bool = False) -> list[Path]:
        """Write the report (layer_<i>.json, index.html) into `output_dir` under the report folder's rules
        (output.py): a rerun for the same model replaces its report, another model's report is refused unless
        `overwrite`, a folder that is not a report is refused."""
        from .output import ReportFolder

        folder = ReportFolder(output_dir, self.model_source or self.model_name, overwrite=overwrite)
        return folder.publish(self.files_writer())

    def files_writer(self) -> Callable[[Path], list[Path]]:
        """A function writing the report's files (layer_<i>.json and index.html) into a folder as they are (no
        folder rules: `write` has them). `expertize inspect --export delphi` adds a delphi cache beside them
        (inspect_command.py: the composition sits above both inspection and export)."""
        from .report import write_reports

        return lambda output_dir: write_reports(self, output_dir)


def sparse_layers_of(model: nn.Module) -> dict[int, nn.Module]:
    layers = model.sparse_layers() if hasattr(model, "sparse_layers") else {}
    if not layers:
        raise ValueError(f"{type(model).__name__} has no sparse layers; inspect an expertize model")
    return layers


class _LayerRecorder:
    """Hooks on one sparse layer: reads its activations (activation_hook output) and folds each forward into the
    statistics."""

    def __init__(self, index: int, layer: nn.Module, settings: InspectionSettings, num_domains: int) -> None:
        U = layer.num_units
        self.index, self.layer, self.settings = index, layer, settings
        self.fire_counts = torch.zeros(num_domains, U, dtype=torch.long)
        self.activation_sum = torch.zeros(U, dtype=torch.float64)
        device = next(layer.parameters()).device
        self.contexts = TopContexts(U, settings.top_n, settings.left, settings.right, device=device)
        self.fire_counts, self.activation_sum = self.fire_counts.to(device), self.activation_sum.to(device)
        self.effects = EffectAccumulator(layer)
        self.routing = RoutingAccumulator(layer) if has_router(layer) else None
        self.locations: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if settings.collect_locations else None
        self.batch: tuple[torch.Tensor, int, int] | None = None  # (input_ids (B, T), domain, first sequence id)
        self._code = None
        self._handles: list = []

    def attach(self) -> None:
        self._handles = [
            self.layer.activation_hook.register_forward_hook(self._on_code),
            self.layer.register_forward_hook(self._on_forward),
        ]
        self.effects.attach()
        if self.routing is not None:
            self.routing.attach()

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.effects.detach()
        if self.routing is not None:
            self.routing.detach()

    def _on_code(self, module, args, output) -> None:
        self._code = output

    @torch.no_grad()
    def _on_forward(self, module, args, output) -> None:
        input_ids, domain, first_sequence = self.batch
        code, self._code = self._code, None
        K = code.top_k_index.shape[-1]
        index = code.top_k_index.reshape(-1, K)  # (B·T, K)
        weights = code.top_k_weights.reshape(-1, K).float()  # (B·T, K)
        fired = self.layer.active_entries(weights)  # (B·T, K) bool
        token = torch.arange(index.shape[0], device=index.device)[:, None].expand_as(index)[fired]  # (P,)
        unit, value = index[fired], weights[fired]  # (P,)
        U = self.layer.num_units
        counts = torch.bincount(unit, minlength=U)  # (U,)
        self.fire_counts[domain] += counts
        # float32 within a batch, float64 across batches
        self.activation_sum += torch.zeros(U, device=value.device).index_add_(0, unit, value).double()
        self.contexts.update(unit, value, token, input_ids, index, weights, domain, first_sequence)
        self.effects.update(unit, token, counts)
        if self.routing is not None:
            self.routing.update(index, code.top_k_weights.reshape(-1, K))
        if self.locations is not None:
            T = input_ids.shape[1]
            where = torch.stack([token // T + first_sequence, token % T, unit], dim=-1)  # (P, 3)
            self.locations.append((where.cpu(), value.cpu()))

    def result(self, model: nn.Module, module: str) -> LayerStats:
        directions = self.effects.directions()
        promoted = None if directions is None else vocab_effects(model, directions, self.settings.vocab_top)
        locations = None
        if self.locations is not None:
            where = [w for w, _ in self.locations] or [torch.zeros(0, 3, dtype=torch.long)]
            values = [v for _, v in self.locations] or [torch.zeros(0)]
            locations = (torch.cat(where), torch.cat(values))
        contexts = self.contexts
        for name in ("values", "where", "domain", "tokens", "acts"):
            setattr(contexts, name, getattr(contexts, name).cpu())
        spec = self.layer.spec
        return LayerStats(
            layer=self.index, kind=spec.kind, unit_name=spec.code_unit(), activation_meaning=spec.activation_meaning,
            num_units=self.layer.num_units, fire_counts=self.fire_counts.cpu(),
            activation_sum=self.activation_sum.cpu(), contexts=contexts, promoted=promoted,
            routing=None if self.routing is None else self.routing.summary(), module=module, locations=locations,
        )


@torch.no_grad()
def collect_stats(
    model: nn.Module,
    corpora: Mapping[str, torch.Tensor],
    settings: InspectionSettings,
    token_text: Callable[[int], str],
    model_name: str = "",
    progress: Callable[[int, int], None] | None = None,
) -> InspectionStats:
    """One pass of `model` over the token sequences of each named corpus, {name: (S, T)}; every sparse layer (or
    `settings.layers`) is measured at once. `progress(done_tokens, total_tokens)` is called after each batch."""
    all_layers = sparse_layers_of(model)
    wanted = all_layers if settings.layers is None else {i: all_layers[i] for i in settings.layers}
    model.eval()
    device = next(model.parameters()).device
    recorders = [_LayerRecorder(i, layer, settings, len(corpora)) for i, layer in sorted(wanted.items())]
    domain_tokens = torch.zeros(len(corpora), dtype=torch.long)
    total = sum(int(s.numel()) for s in corpora.values())
    done, first_sequence = 0, 0
    for recorder in recorders:
        recorder.attach()
    try:
        for domain, sequences in enumerate(corpora.values()):
            for lo in range(0, sequences.shape[0], settings.batch_size):
                input_ids = sequences[lo : lo + settings.batch_size].to(device)  # (B, T)
                for recorder in recorders:
                    recorder.batch = (input_ids, domain, first_sequence)
                model(input_ids=input_ids, use_cache=False)
                first_sequence += input_ids.shape[0]
                domain_tokens[domain] += input_ids.numel()
                done += input_ids.numel()
                if progress is not None:
                    progress(done, total)
    finally:
        for recorder in recorders:
            recorder.detach()
    names = {id(m): name for name, m in model.named_modules()}
    return InspectionStats(
        model_name=model_name,
        domains=list(corpora),
        domain_tokens=domain_tokens,
        layers={r.index: r.result(model, names.get(id(r.layer), "")) for r in recorders},
        settings=settings,
        token_text=token_text,
        sequences=torch.cat(list(corpora.values())) if settings.collect_locations else None,
    )
