"""Distillation: train the sparse layers of every target layer concurrently to reproduce the frozen MLPs.

The base model only produces activations (see `data/activations.py`); each sparse layer learns `y ≈ layer(x)` with
the recipe's loss. One AdamW over all layers (their losses are independent, so summing them trains each on its own).
Data parallelism goes through 🤗 Accelerate: `accelerate launch -m expertize upcycle ...` runs the same code. The
loop itself (optimizer, schedule, hooks, checkpoints, logs, trackers) is `engine.Engine`.

Dead units: one `auxk.DeadUnitTracker` per layer counts the training tokens since each unit last fired (the fired
mask is OR-reduced over ranks, so every rank agrees); a unit is dead after `train.dead_window_tokens` ("auto": a
tenth of the run, at most the paper's 10M). The log records the dead count of every layer. With `train.auxk_coef`
> 0 the layers whose kind has AuxK add `auxk_coef · auxk_loss` (Gao et al. 2024 §A.2), in which their `k_aux`
highest-scoring dead units reconstruct the main error; kinds without it (MoE-X, Monet, μMoE) train without it, and
the log says so once. With `auxk_coef` = 0 the loss, and so the whole trajectory, is exactly the plain one.
The threshold kinds (JumpReLU, CLT) add `preact_coef` times the pre-activation loss of their dead latents instead
(`dead_preact_gap`): what the training forward computes from its own pre-activations with the tracker's dead mask.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from expertize.modeling import SparseLayer

from ..data.activations import ActivationBatches
from .losses import LOSSES
from ..recipe import TrainConfig
from ..recipe.lr_rule import MEASURED_STEPS, beyond_measured
from .auxk import DeadUnitTracker, auxk_loss, code_l0, fired_units
from .balance import SelectionBalancer
from .resample import Resampler
from .code_floor import code_share_penalty
from .compute import compile_layers
from .distill_plan import DistillPlan, plan_distillation
from .engine import Engine, OptimConfig, remove_hooks, run_paths
from .together import train_together


def threshold_lr_groups(stack: nn.Module, scale: float) -> list:
    """The stack's parameters in their order, with the threshold kinds' thresholds (`threshold_parameters`) in a
    group of learning rate `scale` x lr (train.threshold_lr_scale); plain parameters where `scale` is 1, so that the
    optimizer is the one-group optimizer of a run without it."""
    params = list(stack.parameters())
    thresholds = {id(p) for m in stack.modules() if isinstance(m, SparseLayer) for p in m.threshold_parameters()}
    if scale == 1.0 or not thresholds:
        return params  # in the stack's order, as a run's checkpointed optimizer state lists them
    return [{"params": [p for p in params if id(p) not in thresholds], "lr_scale": 1.0},
            {"params": [p for p in params if id(p) in thresholds], "lr_scale": scale}]


class SparseStack(nn.Module):
    """All target layers as one module, so that DDP can wrap them: dict of inputs -> dict of outputs."""

    def __init__(self, layers: dict[int, SparseLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): layer for i, layer in sorted(layers.items())})

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # In layer order: a cross-layer transcoder's layers read the codes their earlier layers posted this pass.
        return {name: layer(inputs[name]) for name, layer in self.layers.items() if name in inputs}


@dataclass
class TrainState:
    step: int
    mean_outputs: dict[int, torch.Tensor]


class Trainer(Engine):
    """One distillation run: batches of captured (x, y) per layer -> the recipe's loss + routed layers' aux
    (+ AuxK)."""

    name = "distil"
    section = "train"
    ran_out_fix = "lower data.train_tokens or add text"

    def __init__(
        self,
        layers: dict[int, SparseLayer],
        batches: ActivationBatches,
        cfg: TrainConfig,
        *,
        total_steps: int,
        accelerator,
        run_dir: Path | None = None,
        checkpoint_path: Path | None = None,
        log_path: Path | None = None,
        progress: bool = True,
        init_output_bias: bool = True,
        log=None,
        tracking_path: Path | None = None,
        variant: str | None = None,
        plan: DistillPlan | None = None,
    ) -> None:
        """`checkpoint_path` / `log_path` default to `run_dir/checkpoint/state.pt` and `run_dir/train_log.jsonl`;
        `tracking_path` (the trackers' files, `cfg.log_with`) to `tracking/` beside the log. `variant`: the name of
        the recipe variant this trainer trains (messages then name it). `plan`: what `cfg` resolves to for this run
        (distill_plan.py; built here when not given)."""
        checkpoint_path, log_path = run_paths(run_dir, checkpoint_path, log_path, "train")
        self.layers, self.activations, self.cfg = layers, batches, cfg
        self.init_output_bias = init_output_bias  # False keeps b_dec (e.g. copied from the dense MLP)
        self.stack = SparseStack(layers).to(accelerator.device)
        first = next(iter(layers.values()))  # every layer of a run has the same spec
        self.plan = plan if plan is not None else plan_distillation(cfg, first, total_steps)
        if self.plan.steps != total_steps:
            raise ValueError(f"the plan is for {self.plan.steps} steps, the trainer for {total_steps}")
        self.schedule = self.plan.schedule  # lr and warm-up with `auto` resolved (recipe/schedule_rule.py)
        super().__init__(
            self.stack,
            threshold_lr_groups(self.stack, cfg.threshold_lr_scale),
            OptimConfig.from_config(cfg, lr=self.schedule.lr, warmup_steps=self.schedule.warmup_steps),
            total_steps=total_steps,
            tokens_per_step=cfg.tokens_per_step,
            checkpoint_path=checkpoint_path,
            log_path=log_path,
            hook_layers=layers.values(),
            accelerator=accelerator,
            progress=progress,
            log=log,
            log_with=cfg.log_with,
            tracking_path=tracking_path,
            name=None if variant is None else f"{self.name}[{variant}]",
            section=None if variant is None else f"variants[{variant}].train",
        )
        self.log_path = self.train_log.path
        compile_layers(self.stack, cfg.compile)  # in place: the parameters, state-dict keys and hooks stay
        self.loss_fn = LOSSES[cfg.loss]
        plan = self.plan
        self.window_tokens = plan.dead_window_tokens
        self.dead_units = {
            i: DeadUnitTracker(layer.num_units, self.window_tokens, device=accelerator.device)
            for i, layer in layers.items()
        }
        self.auxk_layers = set(layers) if plan.k_aux is not None else set()
        self.preact_layers = {i for i, layer in layers.items() if cfg.preact_coef > 0 and layer.supports_preact_loss}
        self.balancers = {
            i: SelectionBalancer(
                layer, cfg.balance_rate, cfg.balance_floor if cfg.balance == "floor" else None,
                # the floor's bias is a training aid; the symmetric rule's is part of the routing (never annealed)
                tuple(cfg.balance_anneal) if cfg.balance == "floor" and cfg.balance_anneal is not None else None,
            )
            for i, layer in layers.items()
            if plan.balance
        }
        self.resamplers = {
            i: Resampler(layer, plan.resample_every_tokens, until_tokens=plan.resample_until_tokens, seed=cfg.seed + i)
            for i, layer in layers.items()
            if plan.resample_every_tokens
        }
        self._step_pairs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        """Resampling layers: the step's (x, y, ŷ), detached; the error y - ŷ is formed only on a resampling step."""
        self.mean_outputs: dict[int, torch.Tensor] = {}
        # train.code_share_floor (a layer without a dense path carries everything already: its term stays 0)
        # a layer that reads other layers' codes has no dense path to floor (its share is 1 by construction)
        self.floored_layers = {i for i, layer in layers.items() if not layer.reads_other_layers} \
            if plan.code_share_floor else set()
        self._batch_share: dict[int, float] = {}
        """Floored layers: the last batch's code share (logged as `code_share`)."""
        self._codes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._hooks = [layer.code_hook.register_forward_hook(self._record_code(i)) for i, layer in layers.items()]

    @property
    def state(self) -> TrainState:
        return TrainState(step=self.step, mean_outputs=self.mean_outputs)

    def _record_code(self, index: int):
        def hook(module, args, code) -> None:
            self._codes[index] = (code.top_k_index.detach(), code.top_k_weights.detach())

        return hook

    def balance_note(self) -> str | None:
        """What the selection-bias balancing does in this run, one line (None when train.balance is none)."""
        cfg = self.cfg
        if cfg.balance == "none":
            return None
        rule = f"floor {cfg.balance_floor:g} of the fair share" if cfg.balance == "floor" else "every unit to its share"
        anneal = ("held to the end" if cfg.balance_anneal is None or cfg.balance != "floor" else
                  f"annealed to 0 between {cfg.balance_anneal[0]:.0%} and {cfg.balance_anneal[1]:.0%} of the run")
        parts = []
        if self.balancers:
            parts.append(f"balance {cfg.balance} ({rule}, rate {cfg.balance_rate:g} x lr, {anneal}) for layer(s) "
                         f"{sorted(self.balancers)}")
        without = sorted(i for i in self.layers if i not in self.balancers)
        if without:
            kinds = ", ".join(sorted({self.layers[i].spec.kind for i in without}))
            parts.append(f"layer(s) {without} ({kinds}) have no selection bias (no top K chosen by a score, or "
                         "spec.selection_bias false), so they train without balancing")
        return "; ".join(parts)

    def auxk_note(self) -> str | None:
        """What AuxK does in this run, one line (None when train.auxk_coef is 0)."""
        if self.cfg.auxk_coef == 0:
            return None
        without = sorted({layer.spec.kind for i, layer in self.layers.items() if i not in self.auxk_layers})
        parts = []
        if self.auxk_layers:
            parts.append(
                f"AuxK on (train.auxk_coef={self.cfg.auxk_coef:g}, k_aux={self.plan.k_aux}, dead after "
                f"{self.window_tokens:,} tokens) for layer(s) {sorted(self.auxk_layers)}"
            )
        if without:
            parts.append(
                f"kind(s) {', '.join(without)} have no AuxK (their units are not chosen by a top-k over their own "
                "parameters), so they train without it; set train.auxk_coef=0 to silence this note"
            )
        return "; ".join(parts)

    def preact_note(self) -> str | None:
        """What the pre-activation loss does in this run, one line (None when off)."""
        if not self.preact_layers:
            return None
        return (f"pre-activation loss on dead latents (train.preact_coef={self.cfg.preact_coef:g}, dead after "
                f"{self.window_tokens:,} tokens) for layer(s) {sorted(self.preact_layers)}")

    # -- engine task ------------------------------------------------------------------------------------------------

    def batches(self, start_step: int):
        return self.activations.batches(start_step=start_step)

    def lr_note(self) -> str | None:
        """The learning rate and warm-up `auto` resolved to, one line (None when neither is `auto`)."""
        note = self.schedule.note("train")
        if note is None:
            return None
        if self.schedule.lr_auto and beyond_measured(self.total_steps):
            note += (f"; beyond the {MEASURED_STEPS:,} steps it was measured on, the rule extrapolates: consider a "
                     "sweep (variants with train.lr 3x above and below)")
        return note

    def begin(self, resumed: bool) -> None:
        self.model.train()
        note = "; ".join(n for n in (self.lr_note(), self.balance_note(), self.auxk_note(), self.preact_note()) if n)
        if note:
            self.say(note if self.name == type(self).name else f"{self.name}: {note}")

    def first_batch(self, batch) -> None:
        self._init_output_bias(batch)
        self._init_from_inputs(batch)

    @torch.no_grad()
    def _init_from_inputs(self, batch) -> None:
        """Kinds that start from the data (`SparseLayer.init_from_inputs`, e.g. JumpReLU thresholds) set their
        parameters from the first batch's inputs; averaged over ranks, so every rank starts alike."""
        for i, (x, _) in batch.items():
            for param in self.layers[i].init_from_inputs(x):
                param.copy_(self.accelerator.reduce(param.detach().clone(), reduction="mean"))

    @torch.no_grad()
    def _init_output_bias(self, batch) -> None:
        """The paper's init: the layer's output bias (`SparseLayer.output_bias`, b_dec) = mean MLP output (on the first
        batch's tokens, averaged over ranks), for kinds that have one. The mean is kept for the evaluation's mean
        ablation either way."""
        for i, (_, y) in batch.items():
            mean = self.accelerator.reduce(y.float().mean(0), reduction="mean")
            bias = self.layers[i].output_bias
            if self.init_output_bias and bias is not None:
                bias.copy_(mean.to(bias.dtype))
            self.mean_outputs[i] = mean.cpu()

    def compute_loss(self, batch):
        for i in self.auxk_layers:  # the forward keeps its dense pre-activations for AuxK when it runs this step
            self.layers[i].keep_for_auxk = self.dead_units[i].may_have_dead
        for i in self.preact_layers:  # the forward adds the pre-activation loss of the latents dead so far
            tracker = self.dead_units[i]
            self.layers[i].dead_for_preact = tracker.dead_mask() if tracker.may_have_dead else None
            self.layers[i].preact_loss = None
        with self.autocast:
            outputs = self.model({str(i): x for i, (x, _) in batch.items()})
        losses = {i: self.loss_fn(outputs[str(i)].float(), y.float()) for i, (_, y) in batch.items()}
        for i in self.resamplers:
            x, y = batch[i]
            self._step_pairs[i] = (x.detach(), y.detach(), outputs[str(i)].detach())
        # Routed layers' own auxiliary losses (load balance, ...), already weighted by their specs.
        aux = [layer.aux_loss for layer in self.layers.values() if layer.aux_loss is not None]
        total = sum(losses.values()) + sum(aux)
        preact = {i: self.layers[i].preact_loss for i in sorted(self.preact_layers)
                  if self.layers[i].preact_loss is not None}
        for i, term in preact.items():
            total = total + self.cfg.preact_coef * term
        for i in self.preact_layers:
            self.layers[i].dead_for_preact = None  # a later forward (evaluation, healing) computes none
        for i in self.floored_layers:
            x, y = batch[i]
            code = self._codes[i]  # the forward's; the average-code pass below may run the code hook again
            with self.autocast:
                penalty, self._batch_share[i] = code_share_penalty(
                    self.layers[i], x, y, outputs[str(i)], code, self.cfg.code_share_floor)
            self._codes[i] = code
            total = total + self.cfg.code_share_coef * penalty
        auxk = {}
        for i in sorted(self.auxk_layers):
            tracker = self.dead_units[i]
            if not tracker.may_have_dead:  # no unit can be dead before a whole window has passed
                continue
            x, y = batch[i]
            with self.autocast:
                auxk[i] = auxk_loss(self.layers[i], x, y, outputs[str(i)], tracker.dead_mask(), self.plan.k_aux)
            total = total + self.cfg.auxk_coef * auxk[i]
        return total, (losses, auxk, preact)

    def track(self, parts) -> None:
        """Every step, device-side: which units fired (OR-reduced over ranks so every rank agrees on the dead masks
        AuxK and resampling act on); resampling when due; the selection biases' update."""
        reduce = (lambda t: self.accelerator.reduce(t, reduction="mean")) if self.num_processes > 1 else None
        for i in parts[0]:
            index, weights = self._codes[i]  # (T, K) each: this step's code (its kept positions only)
            fired = fired_units(index, self.layers[i].active_entries(weights), self.layers[i].num_units)  # (N,)
            if self.num_processes > 1:
                fired = self.accelerator.reduce(fired.int(), reduction="sum") > 0
            self.dead_units[i].update_fired(fired, self.tokens_per_step)  # global tokens of the step's stream
            if i in self.resamplers:
                self.resamplers[i].update_fired(fired, self.tokens_per_step)
                if self.resamplers[i].due:
                    x, y, y_hat = self._step_pairs[i]
                    self.resamplers[i].resample(x, y - y_hat, self.optimizer, reduce=reduce)
        for i, balancer in self.balancers.items():
            load, scale = balancer.step_stats(*self._codes[i])
            if reduce is not None:  # every rank moves the bias the same way
                load, scale = reduce(load), reduce(scale)
            balancer.update(load, scale, lr=self.optimizer.param_groups[0]["lr"], step_tokens=self.tokens_per_step,
                            progress=(self.step + 1) / self.total_steps)

    def record(self, parts) -> dict:
        losses, auxk, preact = parts
        per_layer, units = {}, 0
        for i, loss in losses.items():
            index, weights = self._codes[i]  # (T, K) each: this step's code
            entry = {
                "loss": loss.item(),
                "l0": code_l0(self.layers[i], index, weights),
                "dead": int(self.dead_units[i].dead_mask().sum()),
            }
            if i in auxk:
                entry["auxk"] = auxk[i].item()
            if i in preact:
                entry["preact"] = preact[i].item()
            if i in self._batch_share:
                entry["code_share"] = self._batch_share[i]
            if i in self.resamplers:
                entry["resampled"] = self.resamplers[i].resampled
            per_layer[str(i)] = entry
            units += self.layers[i].num_units
        record = {
            "loss": sum(v["loss"] for v in per_layer.values()) / len(per_layer),
            "l0": sum(v["l0"] for v in per_layer.values()) / len(per_layer),
            "dead": sum(v["dead"] for v in per_layer.values()),
            "dead_fraction": sum(v["dead"] for v in per_layer.values()) / units,
        }
        if auxk:
            record["auxk"] = sum(v.item() for v in auxk.values()) / len(auxk)
        return {**record, "layers": per_layer}

    def balance_summaries(self) -> dict[int, tuple[dict, torch.Tensor]]:
        """{layer: (what its balancing did, for metrics.json; (S,) the units whose bias it raised)} of the balanced
        layers."""
        return {i: (balancer.summary(), balancer.raised.cpu()) for i, balancer in self.balancers.items()}

    def postfix(self, record: dict) -> dict:
        return {"loss": f"{record['loss']:.4g}", "l0": f"{record['l0']:.1f}", "dead": record["dead"]}

    def model_state(self) -> dict:
        return self.accelerator.unwrap_model(self.model).state_dict()

    def load_model_state(self, state: dict) -> None:
        self.accelerator.unwrap_model(self.model).load_state_dict(state)

    def extra_state(self) -> dict:
        return {
            "mean_outputs": self.mean_outputs,
            "dead_units": {i: tracker.state_dict() for i, tracker in self.dead_units.items()},
            "resamplers": {i: resampler.state_dict() for i, resampler in self.resamplers.items()},
            "balancers": {i: balancer.state_dict() for i, balancer in self.balancers.items()},
        }

    def load_extra_state(self, state: dict) -> None:
        self.mean_outputs = state["mean_outputs"]
        # A checkpoint from before the trackers (no "dead_units") restarts the dead-unit count from this step.
        for i, saved in state.get("dead_units", {}).items():
            self.dead_units[i].load_state_dict(saved)
        for i, saved in state.get("resamplers", {}).items():
            self.resamplers[i].load_state_dict(saved)
        for i, saved in state.get("balancers", {}).items():
            self.balancers[i].load_state_dict(saved)

    # -- public -----------------------------------------------------------------------------------------------------

    def fit(self) -> dict[int, SparseLayer]:
        """Train to `total_steps` (resuming from the checkpoint if there is one); the layers, in eval mode."""
        try:
            train_together([self])
        finally:
            self.release()
        return self.layers

    def release(self) -> None:
        """Remove the code hooks and put the layers in eval mode: after training, finished or not."""
        self._hooks = remove_hooks(self._hooks)
        self.model.eval()

