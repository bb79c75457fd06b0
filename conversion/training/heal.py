"""End-to-end healing: train the spliced model on text after (or instead of) layer-wise distillation.

Distillation fits each sparse layer to its MLP in isolation; errors still compound through the layers above it.
Healing trains the whole spliced model against the dense model's next-token distributions (KL(base ‖ healed), the
default) or the text itself (LM cross-entropy), plus the routed layers' auxiliary losses. The sparse layers train
fully; the rest of the model is frozen or adapted with PEFT LoRA and merged back before saving, so the saved folder
is a plain expertize model. The loop (optimizer, schedule, the sparse layers' optimizer hooks, checkpoints, logs) is
`engine.Engine`.

The log (and the trackers of `train.log_with`) also records the sparse layers' mean L0 and their dead fraction:
units that have not fired for a tenth of the healing tokens (auxk.dead_window_tokens), over every position.

    B sequences per step, L = data.context_length, V vocabulary.
"""

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from expertize.modeling import SparseLayer

from ..data.text import batch_sequences, iter_sequences
from ..recipe.data import DataConfig, token_budget_to_sequences
from .losses import kl_base_to_other, next_token_ce
from ..errors import ExpertizeError
from ..recipe import HealConfig
from ..surgery.families import attention_projections, conv1d_attention
from .auxk import DeadUnitTracker, code_l0, dead_window_tokens, fired_units
from .engine import Engine, OptimConfig, remove_hooks, run_paths
from .together import train_together

def lora_config(cfg: HealConfig, family: str):
    """The PEFT `LoraConfig` of `cfg` for a model of `family` (base model_type)."""
    from peft import LoraConfig

    targets = attention_projections(family) if cfg.lora_target_modules == "auto" else list(cfg.lora_target_modules)
    if conv1d_attention(family) and targets and cfg.lora_target_parameters:
        # PEFT switches the config to fan_in_fan_out for Conv1D targets, and its ParamWrapper refuses that setting.
        raise ValueError(
            "heal: PEFT cannot put GPT-2's Conv1D attention (lora_target_modules) and lora_target_parameters in one "
            "LoRA adapter; set heal.lora_target_modules: [] to adapt only the sparse parameters, or drop "
            "heal.lora_target_parameters"
        )
    return LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=0.0,  # PEFT's target_parameters allows no dropout; keep one setting for both
        target_modules=targets or None,
        target_parameters=list(cfg.lora_target_parameters) or None,
        fan_in_fan_out=conv1d_attention(family) and bool(targets),  # Conv1D stores weights as (in, out)
        bias="none",
    )


def sparse_layer_modules(model: nn.Module) -> dict[str, SparseLayer]:
    """Qualified name -> sparse layer, looking through PEFT wrappers (a wrapped layer is the wrapper's base layer)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, SparseLayer)}


def prepare_for_healing(model: nn.Module, cfg: HealConfig, family: str) -> nn.Module:
    """Freeze the model, wrap it with LoRA when `cfg.rest == "lora"`, and make the sparse layers trainable.

    Returns the model to train (a `PeftModel` with LoRA). Sparse parameters named in `cfg.lora_target_parameters`
    stay frozen: LoRA adapts them instead.
    """
    model.requires_grad_(False)
    layers = sparse_layer_modules(model)
    adapted = {name.split(".")[-1] for name in cfg.lora_target_parameters}
    fully_trained = [p for layer in layers.values() for name, p in layer.named_parameters() if name not in adapted]
    if cfg.rest == "lora":
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(cfg, family))
    for p in fully_trained:  # PEFT froze everything but its adapters; the sparse layers train fully
        p.requires_grad_(True)
    return model


def merge_healed(model: nn.Module) -> nn.Module:
    """Fold LoRA updates into the weights and drop the PEFT wrapper (no-op for a model without one)."""
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    return model


class Healer(Engine):
    """One healing run (single process): token batches -> KL to the base (or LM loss) + routed layers' aux."""

    name = "heal"
    section = "heal"
    ran_out_fix = "lower heal.tokens or add text"

    def __init__(
        self,
        model: nn.Module,
        base: nn.Module,
        tokenizer,
        data: DataConfig,
        cfg: HealConfig,
        *,
        family: str,
        device: torch.device,
        run_dir: Path | None = None,
        checkpoint_path: Path | None = None,
        log_path: Path | None = None,
        precision: str = "fp32",
        progress: bool = True,
        log=None,
        log_with: str = "none",
        tracking_path: Path | None = None,
    ) -> None:
        """`checkpoint_path` / `log_path` default to `run_dir/checkpoint/heal.pt` and `run_dir/heal_log.jsonl`;
        `log_with` (train.log_with) names the experiment tracker, whose files go to `tracking_path` (default:
        `tracking/` beside the log)."""
        checkpoint_path, log_path = run_paths(run_dir, checkpoint_path, log_path, "heal")
        self.cfg, self.base, self.tokenizer = cfg, base, tokenizer
        # Healing reads the train split from its start, with its own budget.
        self.data = dataclasses.replace(data, train_tokens=cfg.tokens)
        sequences = token_budget_to_sequences(cfg.tokens, data.context_length)
        total_steps = sequences // cfg.batch_sequences
        if total_steps < 1:
            raise ExpertizeError(
                f"heal.tokens={cfg.tokens} is less than one step of heal.batch_sequences={cfg.batch_sequences} x "
                f"data.context_length={data.context_length} tokens; raise heal.tokens or lower heal.batch_sequences"
            )
        model = prepare_for_healing(model, cfg, family).to(device)
        self.trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.schedule = cfg.resolved(total_steps)  # heal.warmup_steps: auto resolved (recipe/schedule_rule.py)
        super().__init__(
            model,
            self.trainable.values(),
            OptimConfig.from_config(cfg, precision=precision, warmup_steps=self.schedule.warmup_steps),
            total_steps=total_steps,
            tokens_per_step=cfg.batch_sequences * data.context_length,
            checkpoint_path=checkpoint_path,
            log_path=log_path,
            hook_layers=sparse_layer_modules(model).values(),
            device=device,
            progress=progress,
            log=log,
            log_with=log_with,
            tracking_path=tracking_path,
        )
        self.log_path = self.train_log.path
        self.sparse_layers = sparse_layer_modules(self.model)
        window = dead_window_tokens(total_steps * self.tokens_per_step, self.tokens_per_step)
        self.dead_units = {
            name: DeadUnitTracker(layer.num_units, window, device=device) for name, layer in self.sparse_layers.items()
        }
        self._codes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._hooks = [
            layer.code_hook.register_forward_hook(self._record_code(name))
            for name, layer in self.sparse_layers.items()
        ]

    def _record_code(self, name: str):
        def hook(module, args, code) -> None:
            self._codes[name] = (code.top_k_index.detach(), code.top_k_weights.detach())

        return hook

    # -- engine task ------------------------------------------------------------------------------------------------

    def model_state(self) -> dict[str, torch.Tensor]:
        """Everything healing changes: the trainable parameters and the sparse layers' buffers (e.g. router
        statistics), never the frozen bulk of the model."""
        prefixes = tuple(f"{name}." for name in sparse_layer_modules(self.model))
        state = self.model.state_dict()
        keep = set(self.trainable) | {key for key in state if key.startswith(prefixes)}
        return {key: value for key, value in state.items() if key in keep}

    def load_model_state(self, state: dict) -> None:
        missing = set(state) - set(self.model.state_dict())
        if missing:
            raise ExpertizeError(
                f"{self.checkpoint_path} does not fit this model (unknown keys {sorted(missing)[:3]}); start over "
                "with `expertize upcycle RECIPE --restart`"
            )
        self.model.load_state_dict(state, strict=False)

    def batches(self, start_step: int) -> Iterator[torch.LongTensor]:
        # The stream position is a function of the step, so a resumed run sees the same batches.
        start = start_step * self.cfg.batch_sequences
        sequences = iter_sequences(self.data, self.tokenizer, split="train", start_sequence=start)
        return (ids.to(self.device) for ids in batch_sequences(sequences, self.cfg.batch_sequences, drop_last=True))

    def begin(self, resumed: bool) -> None:
        note = self.schedule.note("heal")  # what heal.warmup_steps: auto resolved to
        if note:
            self.say(note)
        self.base.eval()
        # Dropout off for the whole model (healing fits a deterministic function); the sparse layers in training
        # mode, so that they compute their auxiliary losses and use training-time routing (e.g. batch statistics).
        self.model.eval()
        for layer in sparse_layer_modules(self.model).values():
            layer.train()

    def compute_loss(self, input_ids: torch.LongTensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The healing loss of one batch (B, L): objective + aux_loss_coef * routed layers' aux losses."""
        with self.autocast:
            out = self.model(input_ids=input_ids, use_cache=False, output_router_logits=True)
        if self.cfg.objective == "kl":
            with torch.no_grad():
                base_logits = self.base(input_ids=input_ids, use_cache=False).logits  # (B, L, V)
            objective = kl_base_to_other(base_logits, out.logits).mean()
        else:
            objective = next_token_ce(out.logits, input_ids).mean()
        aux = out.aux_loss if out.aux_loss is not None else objective.new_zeros(())
        loss = objective + self.cfg.aux_loss_coef * aux
        return loss, {"loss": loss.detach(), self.cfg.objective: objective.detach(), "aux": aux.detach()}

    def track(self, parts: dict[str, torch.Tensor]) -> None:
        """Every step: which units fired (device-side)."""
        for name, (index, weights) in self._codes.items():
            tracker = self.dead_units[name]
            active = self.sparse_layers[name].active_entries(weights)  # (T, K) bool: the kind's rule
            tracker.update_fired(fired_units(index, active, tracker.num_units), self.tokens_per_step)

    def record(self, parts: dict[str, torch.Tensor]) -> dict:
        record = {key: value.item() for key, value in parts.items()}
        l0, dead, units = [], 0, 0
        for name, (index, weights) in self._codes.items():
            tracker = self.dead_units[name]
            l0.append(code_l0(self.sparse_layers[name], index, weights))
            dead += int(tracker.dead_mask().sum())
            units += tracker.num_units
        if l0:
            record.update(l0=sum(l0) / len(l0), dead=dead, dead_fraction=dead / units)
        return record

    def extra_state(self) -> dict:
        return {"dead_units": {name: tracker.state_dict() for name, tracker in self.dead_units.items()}}

    def load_extra_state(self, state: dict) -> None:
        for name, saved in state.get("dead_units", {}).items():
            if name in self.dead_units:
                self.dead_units[name].load_state_dict(saved)

    # -- public -----------------------------------------------------------------------------------------------------

    def summary(self) -> dict:
        """What `metrics.json` records about the healing run."""
        schedule = self.schedule
        return {
            "steps": self.total_steps,
            "tokens": self.total_steps * self.tokens_per_step,
            "objective": self.cfg.objective,
            "rest": self.cfg.rest,
            "final": self.train_log.last(),
            # the schedule as it ran (`auto` resolved) and the rule's warm-up for these steps, as metrics.json's
            # train section records the distillation's
            "lr": schedule.lr,
            "warmup_steps": schedule.warmup_steps,
            "warmup_rule": schedule.warmup_rule,
            "schedule": schedule.schedule,
            "min_lr_ratio": schedule.min_lr_ratio,
        }

    def fit(self) -> nn.Module:
        """Heal (resuming from the checkpoint if there is one), then return the merged model (an expertize causal
        LM) in eval mode."""
        try:
            train_together([self])
        finally:
            self._hooks = remove_hooks(self._hooks)
        self.save_checkpoint()  # a run killed after healing resumes straight into evaluation
        model = merge_healed(self.model).eval()
        model.requires_grad_(False)
        return model
