"""The recipe's `heal:` section (`HealConfig`): end-to-end healing of the spliced model after distillation.

Checked on construction, as every section of the recipe's dataclass tree (schema.py).
"""

import dataclasses
from typing import Literal

from .coerce import check_field_types, check_minimum
from .schedule_rule import HEAL_MIN_LR_RATIO, HEAL_SCHEDULE, HEAL_WARMUP_FRACTION, ResolvedSchedule, resolve_schedule

__all__ = ["HealConfig"]


@dataclasses.dataclass
class HealConfig:
    """End-to-end healing after distillation (recipe section `heal:`; leave it out for none).

    The spliced model trains on text: the sparse layers fully, the rest of the model frozen or adapted with LoRA
    (merged into the weights before saving). Routed layers' auxiliary losses are added, times
    `router_aux_loss_coef`. Runs on one process.
    """

    tokens: int = 1_000_000
    """Healing budget in tokens (sequences of data.context_length from the train split, from its start)."""

    batch_sequences: int = 8
    """Sequences per optimizer step."""

    objective: Literal["kl", "lm"] = "kl"
    """"kl": KL(base ‖ healed) of the next-token distributions (match the dense model's outputs); "lm": next-token
    cross-entropy on the text."""

    lr: float = 1e-4
    """Peak learning rate (AdamW) of everything that trains."""

    warmup_steps: int | Literal["auto"] = "auto"
    """Linear warm-up steps. "auto": a tenth of the healing steps, as for the distillation (recipe/schedule_rule.py;
    the former default, 100, was a tenth of a default-budget run); a number must be below the healing steps."""

    schedule: Literal["constant", "cosine", "linear"] = HEAL_SCHEDULE
    """Learning rate after warm-up: "cosine" (default) or "linear" decay to lr * min_lr_ratio, or "constant"."""

    min_lr_ratio: float = HEAL_MIN_LR_RATIO
    """Final learning rate of the cosine / linear schedules, as a fraction of `lr` (0.1, as for the distillation)."""

    rest: Literal["frozen", "lora"] = "frozen"
    """The non-sparse weights: "frozen", or "lora" (PEFT LoRA on `lora_target_modules`, merged before saving)."""

    lora_r: int = 8
    """LoRA rank."""

    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_r)."""

    lora_target_modules: list[str] | Literal["auto"] = "auto"
    """Modules LoRA adapts (PEFT suffix names); "auto": the attention projections of the base family (GPT-2
    attn.c_attn, attn.c_proj; GPT-NeoX attention.query_key_value, attention.dense; Llama-like q/k/v/o_proj); []:
    none (with lora_target_parameters)."""

    lora_target_parameters: list[str] = dataclasses.field(default_factory=list)
    """Sparse-layer parameters adapted by LoRA instead of trained fully (PEFT `target_parameters`, e.g.
    ["mlp.W_enc", "mlp.W_dec"] for MoE-X's 3-D expert weights). Needs rest: lora."""

    aux_loss_coef: float = 1.0
    """Factor on the routed layers' auxiliary losses (router_aux_loss_coef of the saved config)."""

    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; null: no clipping."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    log_every: int = 10
    """Log the healing metrics every this many steps."""

    checkpoint_every: int = 200
    """Write a resumable checkpoint every this many steps (0: none until the end)."""

    def resolved(self, total_steps: int) -> ResolvedSchedule:
        """The schedule of a healing run of `total_steps` steps: `warmup_steps`, or the rule's when "auto"
        (recipe/schedule_rule.py); healing has no lr rule."""
        return resolve_schedule(self, total_steps, lr_factor=None, warmup_fraction=HEAL_WARMUP_FRACTION)

    def __post_init__(self) -> None:
        check_field_types(self, "heal")
        if not self.lr > 0:
            raise ValueError(f"heal.lr: must be > 0, got {self.lr}")
        check_minimum(self, "heal", 1, ("tokens", "batch_sequences", "lora_r", "log_every"))
        if self.warmup_steps != "auto" and self.warmup_steps < 0:
            raise ValueError(f'heal.warmup_steps: must be >= 0 or "auto", got {self.warmup_steps}')
        check_minimum(self, "heal", 0, ("checkpoint_every", "weight_decay", "aux_loss_coef"))
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"heal.min_lr_ratio: must lie in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"heal.grad_clip: must be > 0 (or null for no clipping), got {self.grad_clip}")
        if self.rest != "lora":
            for name, is_set in (
                ("lora_target_parameters", bool(self.lora_target_parameters)),
                ("lora_target_modules", self.lora_target_modules != "auto"),
            ):
                if is_set:
                    raise ValueError(f"heal.{name}: LoRA settings need heal.rest: lora (it is {self.rest!r})")
        if self.lora_target_modules != "auto" and not self.lora_target_modules and not self.lora_target_parameters:
            raise ValueError(
                'heal.lora_target_modules: empty and no heal.lora_target_parameters; list module names or write "auto"'
            )
