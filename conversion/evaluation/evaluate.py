"""Evaluate trained sparse layers against the base model on held-out sequences.

Three views, following the MxD paper's protocol (§3 of shared/papers/digests/mxd.md):

1. Reconstruction of each target MLP on held-out tokens (MLP input captured from the *base* model): the paper's
   normalized MSE, relative MSE, FVU, MSE, plus L0 and dead units of the sparse code, over the positions that do not
   hold an excluded token (`exclude_token_ids`: the special tokens with data.exclude_special_positions).
2. Next-token cross-entropy with every target MLP replaced at once by its sparse layer ("spliced"), by zeros
   ("zero ablation") and by its mean output ("mean ablation"), KL(base ‖ spliced) and CE loss recovered.
3. Output faithfulness (paper App. B.1): greedy continuations of held-out prompts by the base and the spliced model,
   and the fraction of prompts whose first n generated tokens are identical.

Memory: sequences are processed `cfg.batch_sequences` at a time and only running sums are kept.

    S eval sequences, L tokens per sequence, B batch, P prompts, C continuation tokens, N units, d model width.
"""

import contextlib
import math
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from expertize.modeling import SparseLayer

from ..data.mlp_pairs import kept_positions, replaced_mlps
from .code_probe import CodeProbe
from .shared_passes import AblationMemo, Replay, base_pass, base_pass_bytes, memo_key
from .health import InEffect, code_health
from ..training.losses import kl_base_to_other, next_token_ce
from .metrics import ReconstructionStats
from .plots import plot_firing_frequency, plot_match_curve
from ..recipe import EvalConfig
from ..training.distill_plan import DistillPlan

__all__ = ["evaluate_sparse_layers", "generation_match_curve", "plot_firing_frequency", "plot_match_curve", "spliced_ce"]


# ----------------------------------------------------------------------------------------------------------------
# Modules swapped in for the target MLPs


class _CastToLayer(nn.Module):
    """Runs `layer` on the hidden states moved to the layer's device and dtype, and returns the model's."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        tensor = next(iter(layer.parameters()), None)
        if tensor is None:
            tensor = next(iter(layer.buffers()), None)
        self.device, self.dtype = (None, None) if tensor is None else (tensor.device, tensor.dtype)

    def cast(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states if self.dtype is None else hidden_states.to(self.device, self.dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer(self.cast(hidden_states)).to(hidden_states.device, hidden_states.dtype)

    def encode(self, hidden_states: torch.Tensor):
        return self.layer.encode(self.cast(hidden_states))


class _ConstantMlp(nn.Module):
    """An MLP ablation: outputs the same vector (zeros, or the mean MLP output) at every position."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("value", value, persistent=False)  # (d,)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        value = self.value.to(hidden_states.device, hidden_states.dtype)
        return value.expand(*hidden_states.shape[:-1], value.shape[-1])  # (B, L, d)


@contextlib.contextmanager
def _eval_mode(*modules: nn.Module) -> Iterator[None]:
    """Put modules in eval mode (no random K, no dropout) and restore each submodule's own flag afterwards."""
    saved = [(m, m.training) for module in modules for m in module.modules()]
    try:
        for module in modules:
            module.eval()
        yield
    finally:
        for m, training in saved:
            m.training = training


def _model_device(model: nn.Module) -> torch.device:
    return getattr(model, "device", None) or next(model.parameters()).device


# ----------------------------------------------------------------------------------------------------------------
# Running sums


class _UnitFiring:
    """How often each unit of one sparse layer fires (is active by the layer's rule, `active_entries`), and the mean
    L0 of its code."""

    def __init__(self, layer: SparseLayer, in_effect: InEffect | None = None) -> None:
        self.num_units, self.k, self.active = layer.num_units, getattr(layer, "target_l0", None), layer.active_entries
        self.thresholded = bool(getattr(layer, "l0_is_trained_target", False))  # k: a trained target, no top K
        self.in_effect = in_effect
        self.counts: torch.Tensor | None = None  # (N,) int64
        self.nonzero = 0
        self.tokens = 0

    def update(self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        index = top_k_index.reshape(-1, top_k_index.shape[-1])  # (T, K)
        fired = self.active(top_k_weights.reshape(index.shape))  # (T, K) bool
        counts = torch.bincount(index[fired], minlength=self.num_units)[: self.num_units]  # (N,)
        self.counts = counts if self.counts is None else self.counts + counts
        self.nonzero += int(fired.sum())
        self.tokens += index.shape[0]

    def summary(self) -> dict:
        dead = int((self.counts == 0).sum())
        p = self.counts.double() / max(int(self.counts.sum()), 1)  # (N,) share of the firings
        entropy = float(-(p[p > 0] * p[p > 0].log()).sum())  # nats; log N when every unit fires equally often
        out = {
            "l0": self.nonzero / self.tokens,
            "dead_units": dead,
            "dead_fraction": dead / self.num_units,
            "num_units": self.num_units,
            "usage_entropy": entropy,
            "effective_units": math.exp(entropy),
        }
        return out


class _CeSums:
    """Token-weighted sums of next-token CE under each model variant, and of KL(base ‖ spliced)."""

    def __init__(self) -> None:
        self.sums = {"base": 0.0, "spliced": 0.0, "zero_ablation": 0.0, "mean_ablation": 0.0}
        self.kl_base_spliced = 0.0
        self.predicted_tokens = 0

    def add(self, name: str, logits: torch.Tensor, input_ids: torch.Tensor) -> None:
        self.sums[name] += _ce_sum(logits, input_ids)

    def summary(self) -> dict:
        n = self.predicted_tokens
        ce = {name: total / n for name, total in self.sums.items()}
        return {
            "base": ce["base"],
            "spliced": ce["spliced"],
            "delta": ce["spliced"] - ce["base"],
            "kl_base_spliced": self.kl_base_spliced / n,
            "zero_ablation": ce["zero_ablation"],
            "mean_ablation": ce["mean_ablation"],
            "ce_recovered_zero": _ce_recovered(ce["zero_ablation"], ce["spliced"], ce["base"]),
            "ce_recovered_mean": _ce_recovered(ce["mean_ablation"], ce["spliced"], ce["base"]),
            "predicted_tokens": n,
        }


def _ce_sum(logits: torch.Tensor, input_ids: torch.Tensor) -> float:
    return float(next_token_ce(logits, input_ids).double().sum())


class _Positions:
    """Which positions the reconstruction metrics cover (all but `exclude_token_ids`), how many, and the sum of the
    MLP outputs over *every* position (for the mean ablation, which replaces the MLP at every position)."""

    def __init__(self, exclude_token_ids: Collection[int]) -> None:
        self.excluded_ids = sorted({int(i) for i in exclude_token_ids})
        self.kept = self.excluded = 0
        self.output_sums: dict[int, torch.Tensor] = {}  # layer -> Σ y over every position, (d,) float64
        self.output_counts: dict[int, int] = {}

    def keep(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        keep = kept_positions(input_ids, self.excluded_ids)  # (B*L,) or None
        n_kept = input_ids.numel() if keep is None else int(keep.sum())
        self.kept += n_kept
        self.excluded += input_ids.numel() - n_kept
        return keep

    def add_outputs(self, layer: int, y: torch.Tensor) -> None:
        if not self.excluded_ids:  # the reconstruction stats see every position: their mean is the one
            return
        total = y.double().sum(0)  # (d,)
        self.output_sums[layer] = self.output_sums[layer] + total if layer in self.output_sums else total
        self.output_counts[layer] = self.output_counts.get(layer, 0) + y.shape[0]

    def mean_output(self, layer: int, stats: ReconstructionStats) -> torch.Tensor:
        """The mean MLP output over every position, (d,) float64."""
        if not self.excluded_ids:
            return stats.mean_output()
        return self.output_sums[layer] / self.output_counts[layer]

    def summary(self) -> dict:
        """metrics.json's `reconstruction_positions`."""
        return {
            "exclude_special_positions": bool(self.excluded_ids),
            "excluded_token_ids": self.excluded_ids,
            "tokens": self.kept,
            "excluded_tokens": self.excluded,
        }


def _ce_recovered(ablated: float, spliced: float, base: float) -> float | None:
    """(CE_ablated − CE_spliced) / (CE_ablated − CE_base): 1 = as good as the base MLP, 0 = as bad as the ablation.
    None when the ablation does not change the CE (the ratio is undefined)."""
    gap = ablated - base
    return None if gap == 0 else (ablated - spliced) / gap + 0.0  # + 0.0: no -0.0 in the report


def _logits(model: nn.Module, input_ids: torch.Tensor, replay: "Replay | None" = None) -> torch.Tensor:
    """(B, L, V): the model's forward of `input_ids`, or, with `replay`, only its blocks from the first sparse layer's
    on (the same logits bit for bit: `Replay`)."""
    if replay is not None and replay.runner is not None:
        return replay.runner.logits(replay.prefix)
    return model(input_ids=input_ids, use_cache=False).logits


# ----------------------------------------------------------------------------------------------------------------
# Entry point


@torch.no_grad()
def evaluate_sparse_layers(
    model: nn.Module,
    layers: Mapping[int, SparseLayer],
    eval_sequences: torch.LongTensor,
    cfg: EvalConfig,
    *,
    plots_dir: Path | None = None,
    mean_outputs: Mapping[int, torch.Tensor] | None = None,
    spliced_model: nn.Module | None = None,
    progress: bool = True,
    exclude_token_ids: Collection[int] = (),
    ablation_memo: AblationMemo | None = None,
    raised_units: Mapping[int, torch.Tensor] | None = None,
    plan: DistillPlan | None = None,
) -> dict:
    """Reconstruction, CE and generation faithfulness of `layers` spliced into the base causal LM `model`.

    ablation_memo: shared by evaluations whose ablated forwards coincide (a recipe's variants): see AblationMemo.
    raised_units: {layer: (S,) bool} the units whose selection bias the training's balancing raised; the report then
    counts how many of them fire on the held-out tokens (`raised_firing`, code_probe.py).

    plan: the distillation plan the layers were trained under (what was in effect); the code-health warnings then
    leave out the fixes it already used (health.InEffect). None: the general advice.

    exclude_token_ids: positions holding one of these tokens (`data.mlp_pairs.excluded_token_ids`: the special tokens)
    are left out of the reconstruction metrics (NMSE, FVU, MSE, L0, dead units, firing histogram); CE, KL and the
    ablations always cover every position. Recorded under `reconstruction_positions`.

    spliced_model: the converted model to compare with the base when it differs from "`model` with `layers`
    swapped in", e.g. after end-to-end healing also changed attention weights; `layers` are then its sparse layers
    and their reconstruction is still measured on the base model's MLP inputs.

    eval_sequences: (S, L) held-out token ids. mean_outputs: {layer: (d,)} MLP output used by the mean ablation
    (the trainer passes the training mean); None: the mean over the eval tokens. Returns a JSON-able dict with keys
    `layers`, `ce`, `generation` (None when cfg.generation_prompts is 0), `eval_tokens` and
    `reconstruction_positions`. With `plots_dir` (and cfg.histogram for the firing histograms) PNGs are written
    there and their paths reported.
    """
    if not layers:
        raise ValueError("evaluate_sparse_layers needs at least one sparse layer")
    if eval_sequences.ndim != 2 or eval_sequences.shape[0] == 0 or eval_sequences.shape[1] < 2:
        raise ValueError(
            f"eval_sequences must be (sequences, tokens) with at least one sequence of >= 2 tokens, "
            f"got shape {tuple(eval_sequences.shape)}"
        )
    if mean_outputs is not None:
        missing = sorted(set(layers) - set(mean_outputs))
        if missing:
            raise ValueError(f"mean_outputs has no mean for layer(s) {missing}; give one per layer or pass None")
    indices = sorted(layers)
    spliced = {i: _CastToLayer(layers[i]) for i in indices}
    d_model = model.get_input_embeddings().embedding_dim
    zeros = {i: _ConstantMlp(torch.zeros(d_model)) for i in indices}

    others = () if spliced_model is None else (spliced_model,)
    with _eval_mode(model, *others, *layers.values()):
        stats = {i: ReconstructionStats() for i in indices}
        in_effect = {i: None if plan is None else InEffect.of(plan, layers[i]) for i in indices}
        firing = {i: _UnitFiring(layers[i], in_effect[i]) for i in indices}
        probes = {i: CodeProbe(layers[i]) for i in indices}
        ce = _CeSums()
        positions = _Positions(exclude_token_ids)
        means = None if mean_outputs is None else {i: _ConstantMlp(mean_outputs[i].detach()) for i in indices}
        memo = ablation_memo or AblationMemo()
        key = memo_key(model, eval_sequences, indices, mean_outputs, cfg.batch_sequences)
        replay = Replay(model, indices, spliced_model)

        def ablated(item: tuple, mlps: Mapping[int, nn.Module], input_ids: torch.Tensor, at: Replay | None) -> float:
            def compute() -> float:
                with replaced_mlps(model, mlps):
                    return _ce_sum(_logits(model, input_ids, at), input_ids)

            return memo.value(key, item, compute)

        for b, input_ids in enumerate(_batches(model, eval_sequences, cfg.batch_sequences, progress, "eval")):
            runner = replay.runner

            def base() -> tuple:
                return base_pass(model, input_ids, indices, runner)

            passed = memo.value(key, ("base", b), base, base_pass_bytes) if memo.share_base else base()
            at = replay.at(passed)
            _reconstruction_and_ce(model, input_ids, passed, spliced, stats, firing, ce, spliced_model, positions,
                                   probes, at)
            ce.sums["zero_ablation"] += ablated(("zero", b), zeros, input_ids, at)
            if means is not None:
                ce.sums["mean_ablation"] += ablated(("mean", b), means, input_ids, at)
        if means is None:  # mean ablation needs the mean over all eval tokens first: a second pass
            means = {i: _ConstantMlp(positions.mean_output(i, stats[i]).float()) for i in indices}
            batches = _batches(model, eval_sequences, cfg.batch_sequences, progress, "eval (mean ablation)")
            for b, input_ids in enumerate(batches):
                ce.sums["mean_ablation"] += ablated(("eval mean", b), means, input_ids, None)
        generation = _generation_faithfulness(model, spliced, eval_sequences, cfg, progress, spliced_model)
        probed = {i: probes[i].summary(None if raised_units is None else raised_units.get(i)) for i in indices}

    eval_tokens = eval_sequences.numel()
    report_layers = {}
    for i in indices:
        histogram = None
        if plots_dir is not None and cfg.histogram:
            histogram = str(
                plot_firing_frequency(
                    firing[i].counts.cpu(), firing[i].tokens, Path(plots_dir) / f"firing_frequency_layer{i}.png",
                    layer=i,
                )
            )
        code = firing[i].summary()
        probe = probed[i]
        report_layers[str(i)] = {**stats[i].as_dict(), **code, **probe, "firing_frequency_histogram": histogram}
        report_layers[str(i)]["health"] = code_health(
            dead_fraction=code["dead_fraction"], l0=code["l0"], k=firing[i].k, thresholded=firing[i].thresholded,
            effective_units=code["effective_units"],
            num_units=code["num_units"], code_share=probe["code_share"], bias_altered=probe["bias_altered"],
            in_effect=firing[i].in_effect,
        )
    if generation is not None:
        plot = None
        if plots_dir is not None:
            plot = str(plot_match_curve(generation["match_curve"], Path(plots_dir) / "generation_match.png"))
        generation["match_curve_plot"] = plot
    return {
        "layers": report_layers,
        "ce": ce.summary(),
        "generation": generation,
        "eval_tokens": eval_tokens,
        "reconstruction_positions": positions.summary(),
    }


@torch.no_grad()
def spliced_ce(
    model: nn.Module,
    layers: Mapping[int, SparseLayer],
    eval_sequences: torch.LongTensor,
    batch_sequences: int = 16,
    progress: bool = False,
) -> dict:
    """Next-token CE of the base causal LM `model` and of `model` with `layers` swapped in, and their difference:
    the cheap check of an initialization (e.g. the ΔCE a GELU -> ReLU switch costs before training)."""
    spliced = {i: _CastToLayer(layers[i]) for i in sorted(layers)}
    ce = _CeSums()
    with _eval_mode(model, *layers.values()):
        for input_ids in _batches(model, eval_sequences, batch_sequences, progress, "ce"):
            ce.predicted_tokens += input_ids.shape[0] * (input_ids.shape[1] - 1)
            ce.add("base", _logits(model, input_ids), input_ids)
            with replaced_mlps(model, spliced):
                ce.add("spliced", _logits(model, input_ids), input_ids)
    summary = ce.summary()
    return {"base": summary["base"], "spliced": summary["spliced"], "delta": summary["spliced"] - summary["base"]}


def _batches(
    model: nn.Module, sequences: torch.Tensor, batch_size: int, progress: bool, desc: str
) -> Iterator[torch.Tensor]:
    from tqdm.auto import tqdm

    device = _model_device(model)
    starts = range(0, sequences.shape[0], batch_size)
    for start in tqdm(starts, desc=desc, unit="batch", disable=not progress):
        yield sequences[start : start + batch_size].to(device)  # (B, L)


def _reconstruction_and_ce(
    model: nn.Module,
    input_ids: torch.Tensor,
    passed: tuple[dict, torch.Tensor],
    spliced: Mapping[int, _CastToLayer],
    stats: Mapping[int, ReconstructionStats],
    firing: Mapping[int, _UnitFiring],
    ce: _CeSums,
    spliced_model: nn.Module | None = None,
    positions: "_Positions | None" = None,
    probes: Mapping[int, CodeProbe] | None = None,
    replay: Replay | None = None,
) -> None:
    """One batch: the base forward's (`passed`) MLP (x, y) pairs and base logits; then the spliced run (the
    ablated runs are the caller's), replayed from the base forward's prefix where `replay` holds one."""
    positions = positions or _Positions(())
    captured, base_logits, _ = passed  # {layer: (x, y)}, each (B*L, d); (B, L, V); the prefix (`replay`'s)
    keep = positions.keep(input_ids)  # (B*L,) bool or None: the positions the reconstruction metrics cover
    for i, (x, y) in captured.items():
        positions.add_outputs(i, y)  # every position: the mean ablation replaces the MLP everywhere
        if keep is not None:
            x, y = x[keep], y[keep]
        stats[i].update(spliced[i](x), y)
        code = spliced[i].encode(x)
        firing[i].update(*code)
        if probes is not None:
            x = spliced[i].cast(x)
            probes[i].update(x, y.to(x.dtype), code)
    del captured
    ce.predicted_tokens += input_ids.shape[0] * (input_ids.shape[1] - 1)
    ce.add("base", base_logits, input_ids)
    if spliced_model is not None:
        spliced_logits = _logits(spliced_model, input_ids)
    else:
        with replaced_mlps(model, spliced):
            spliced_logits = _logits(model, input_ids, replay)
    ce.add("spliced", spliced_logits, input_ids)
    ce.kl_base_spliced += float(kl_base_to_other(base_logits, spliced_logits).double().sum())
    del base_logits, spliced_logits


# ----------------------------------------------------------------------------------------------------------------
# Output faithfulness (MxD paper App. B.1)


def generation_match_curve(base_tokens: torch.Tensor, other_tokens: torch.Tensor) -> list[float]:
    """Entry n-1: fraction of prompts whose first n generated tokens are identical in both, for n = 1..C.

    base_tokens, other_tokens: (P, C) generated ids (prompts excluded). The curve never increases: a prompt counts
    at n only if every one of its first n tokens matches.
    """
    if base_tokens.shape != other_tokens.shape or base_tokens.ndim != 2:
        raise ValueError(
            f"expected two (prompts, tokens) tensors of the same shape, got {tuple(base_tokens.shape)} and "
            f"{tuple(other_tokens.shape)}"
        )
    same = (base_tokens == other_tokens).long()  # (P, C)
    prefix_same = same.cumprod(dim=1)  # (P, C): 1 while every token so far matches
    return prefix_same.double().mean(dim=0).tolist()


def _generation_faithfulness(
    model: nn.Module,
    spliced: Mapping[int, nn.Module],
    eval_sequences: torch.Tensor,
    cfg: EvalConfig,
    progress: bool,
    spliced_model: nn.Module | None = None,
) -> dict | None:
    n_prompts = min(cfg.generation_prompts, eval_sequences.shape[0])
    if n_prompts == 0:
        return None
    if cfg.prompt_tokens > eval_sequences.shape[1]:
        raise ValueError(
            f"eval.prompt_tokens={cfg.prompt_tokens} is longer than the eval sequences ({eval_sequences.shape[1]} "
            "tokens, data.context_length); lower eval.prompt_tokens"
        )
    prompts = eval_sequences[:n_prompts, : cfg.prompt_tokens]  # (P, prompt_tokens)
    base = _greedy_continuations(model, prompts, cfg, progress, "generate (base)")
    if spliced_model is not None:
        other = _greedy_continuations(spliced_model, prompts, cfg, progress, "generate (spliced)")
    else:
        with replaced_mlps(model, spliced):
            other = _greedy_continuations(model, prompts, cfg, progress, "generate (spliced)")
    curve = generation_match_curve(base, other)
    return {"match_curve": curve, "match_at_end": curve[-1], "n_prompts": n_prompts}


def _greedy_continuations(
    model: nn.Module, prompts: torch.Tensor, cfg: EvalConfig, progress: bool, desc: str
) -> torch.Tensor:
    """Exactly `cfg.continuation_tokens` greedy tokens after each prompt (EOS suppressed until then): (P, C)."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    out = []
    for input_ids in _batches(model, prompts, cfg.batch_sequences, progress, desc):
        generated = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=cfg.continuation_tokens,
            min_new_tokens=cfg.continuation_tokens,
            pad_token_id=pad,
        )  # (B, prompt_tokens + C)
        out.append(generated[:, input_ids.shape[1] :].cpu())
    return torch.cat(out)  # (P, C)
