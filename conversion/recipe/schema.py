"""The recipe's dataclass tree (`Recipe`): what `expertize upcycle RECIPE` reads, one dataclass per section.

    base_model: gpt2              # Recipe
    layers: [8]
    layer: {kind: mxd, k: 32, match_transcoder: 32}   # LayerConfig (layer_config.py)
    data: {...}                   # DataConfig (data.py)
    train: {...}                  # TrainConfig
    heal: {...}                   # HealConfig (heal_config.py, optional)
    eval: {...}                   # EvalConfig
    output_dir: runs/gpt2-mxd-l8

Each dataclass checks its own values on construction (from YAML through `loader.py`, or from Python). What a layer
kind allows (its fields, unit count, matching conventions, init modes) is read from the kind's spec class in
`expertize.modeling.LAYER_KINDS`; nothing here names a kind.
"""

import dataclasses
import re
from pathlib import Path
from typing import Literal

from .data import DataConfig, token_budget_to_sequences
from .schedule_rule import MIN_LR_RATIO, SCHEDULE, WARMUP_FRACTION, ResolvedSchedule, check_warmup, resolve_schedule
from .heal_config import HealConfig
from .layer_config import ONE_KIND_PER_RECIPE, LayerConfig
from .variants import VariantConfig, check_variants
from .coerce import RecipeError, check_field_types, check_minimum

__all__ = ["EvalConfig", "HealConfig", "LayerConfig", "Recipe", "RecipeError", "TrainConfig"]


@dataclasses.dataclass
class TrainConfig:
    """Optimization of the sparse layers against the frozen MLPs (recipe section `train:`)."""

    lr: float | Literal["auto"] = "auto"
    """Peak learning rate (AdamW). "auto": the rule of recipe/lr_rule.py for the run's number of steps (about 1e-2
    for a few hundred steps, lower for longer runs), the rate measured best on four real models
    (docs/results/dead_units.md); the resolved value is logged and recorded in metrics.json. A fixed rate that is
    too low leaves the layer under-trained (3x too low erased MxD's advantage over the transcoder); the paper
    recipes keep the papers' 1e-4."""

    warmup_steps: int | Literal["auto"] = "auto"
    """Linear warm-up from 0 to `lr` over this many steps. "auto": a tenth of the run's steps (recipe/
    schedule_rule.py), the warm-up `lr: auto` was measured with; the resolved value is logged and recorded in
    metrics.json. A number must be below the run's steps (preflight refuses it otherwise); the paper recipes keep
    the MxD paper's 5,000 (for its 117,000-step run)."""

    schedule: Literal["constant", "cosine", "linear"] = SCHEDULE
    """Learning rate after warm-up: "cosine" (default) or "linear" decay to lr * min_lr_ratio, or "constant" (MxD
    paper). Cosine to 0.1 lr is the schedule the `lr: auto` rule was measured under (recipe/schedule_rule.py)."""

    min_lr_ratio: float = MIN_LR_RATIO
    """Final learning rate of the cosine / linear schedules, as a fraction of `lr` (0.1: the measured schedule's)."""

    tokens_per_step: int = 4096
    """Activation rows (tokens) per optimizer step (MxD paper: 4,096)."""

    loss: Literal["nmse", "fvu", "mse"] = "nmse"
    """Training loss: "nmse" (MxD paper: mean over tokens of ||y - ŷ||² / ||y||, per output dim), "fvu" (fraction
    of variance unexplained) or "mse"."""

    precision: Literal["fp32", "bf16"] = "fp32"
    """Arithmetic of the sparse layers' training: "fp32" (MxD paper) or "bf16" autocast."""

    seed: int = 0
    """Seed of the sparse layers' initialization and of the activation shuffle."""

    checkpoint_every: int = 1000
    """Write a resumable checkpoint every this many steps (0: only at the end)."""

    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; null: no clipping."""

    weight_decay: float = 0.0
    """AdamW weight decay (MxD paper: 0)."""

    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas [beta1, beta2]."""

    shuffle_buffer_tokens: int = 65536
    """Captured activations are shuffled across sequences in a buffer of this many tokens (MxD paper: 524,288)."""

    capture_batch_sequences: int | Literal["auto"] = "auto"
    """Sequences per base-model forward when capturing activations: "auto" = on a GPU, the largest power of two
    whose forward fits in a quarter of the free memory, up to 65,536 tokens per forward; on a CPU 32
    (data/mlp_pairs.py's `capture_batch_size`); or a number, used as given."""

    capture_precision: Literal["fp32", "bf16"] = "fp32"
    """Arithmetic of the base model's capture forward: "fp32" (MxD paper) or "bf16" autocast (the weights stay in
    `dtype`, the matmuls and attention run in bf16, the captured pairs are handed on in `dtype`); its fidelity cost
    is measured in docs/results/speed.md. Needs `dtype: float32`."""

    tf32: bool = True
    """On a CUDA GPU with TF32 tensor cores (A100, H100, ...), run the fp32 matmuls of the capture and of the
    training in TF32 (10-bit mantissa products, fp32 sums); the evaluation always runs in full fp32. No effect on a
    CPU. provenance.json records whether it was in effect."""

    compile: bool = False
    """torch.compile the sparse layers' forward (its backward follows): fewer kernels on a GPU, a compile of tens of
    seconds first. Same loss and gradients as eager up to float rounding (tests/test_compute.py)."""

    log_every: int = 50
    """Log the training metrics every this many steps."""

    device: str = "auto"
    """"auto" (cuda when available, else cpu), "cpu", "cuda", "cuda:N" or "mps"."""

    distill: bool = True
    """Layer-wise distillation on captured activations. false: skip it (e.g. a MoE initialized from the dense MLP
    and then healed end to end; needs a `heal:` section)."""

    auxk_coef: float = 0.0
    """AuxK (Gao et al. 2024, §A.2; training/auxk.py): weight of the auxiliary loss in which the `auxk_k` highest
    scoring *dead* units (not fired for `dead_window_tokens` tokens) reconstruct the main path's error (the paper's
    coefficient is 1/32); 0 (default) disables it. Off by default: on the quickstart it left more units dead than no
    handling at all (50 % -> 72 % at K = 8: revived units turn into generalists; benchmarks/dead_units.py), while
    the default `balance: floor` leaves none. Kinds without AuxK (moe_x, monet_*, mumoe_*) train without it, with a note."""

    preact_coef: float = 0.001
    """The pre-activation loss on dead latents (`dead_preact_gap` in modeling/jumprelu_transcoders.py) for the
    threshold kinds (jumprelu_transcoder, clt): weight of how far below its threshold each dead latent's
    pre-activations sit on the tokens it is nearest to firing on, which pushes the latents that neither the
    distillation nor the L0 loss reaches back over their threshold; 0 disables it. Other kinds ignore it (their dead
    units are handled by `balance`). Dead means not fired for `dead_window_tokens` tokens. Small on purpose: on the
    quickstart 0.001 left 3 % of the latents dead (51 % without) at 1.04x the KL, while 0.01 to 1 cost 1.1x to 9x
    the KL (docs/results/dead_units.md)."""

    threshold_lr_scale: float = 1.0
    """The threshold kinds' (jumprelu_transcoder, clt) thresholds train at this multiple of the learning rate (one
    AdamW parameter group of their own, following the same schedule); the other parameters at the learning rate.
    Other kinds ignore it. 1 by default: lower keeps more latents alive but costs fidelity and misses the target L0
    (SmolLM2-135M layer 5: 0.3 left 4.2 % dead against 5.6 % at 1.06x the KL, 0.1 2.5 % at 1.57x;
    docs/results/dead_units.md)."""

    code_share_floor: float = 0.0
    """Train the layer so that its per-token code carries at least this share of what it explains (training/
    code_floor.py): each batch adds `code_share_coef` x max(0, floor − the batch's code share) to the loss, pushing
    only the output with the batch's *average* code away from the MLP's; 0 (default) disables it. Opt-in and not a
    default: on tiny-gpt2-shakespeare MxD trained with a floor of 0.5 reached a code share of 1.0 at 2.7x the TopK
    transcoder's KL, worse than a narrower d_hidden at the same share (docs/results/code_share.md)."""

    code_share_coef: float = 1.0
    """Weight of the `code_share_floor` term (in units of the batch's FVU)."""

    auxk_k: int | Literal["auto"] = "auto"
    """k_aux, the dead units AuxK uses per token: "auto" = min(512, d_out / 2) (the paper's 512 for wide models,
    sparsify's d / 2 below 1024 dims) or a number."""

    dead_window_tokens: int | Literal["auto", "interval"] = "auto"
    """A unit is dead when it has not fired for this many training tokens (used by AuxK and the logged dead count):
    "auto" = min(10M (the paper's), 1/40 of the run's training tokens), in whole steps; "interval" = the window in
    which a unit at its fair share K / N fires 50 times (training/resample.py's rule); or a number."""

    balance: Literal["none", "bias", "floor"] = "floor"
    """Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2; training/balance.py): every kind that chooses a top K
    (mxd, transcoders, routed_neurons, moe_x's router) gets a per-unit selection bias, added to the scores only to
    choose (never to weight), moved after every step by `balance_rate` x the learning rate x the scores' scale. It is
    part of the saved model (routing at inference uses it).
    "floor" (default): the bias rises only for a unit chosen on fewer than `balance_floor` x its fair share K / units
    of the tokens and decays back to 0 above it, so rare units are kept alive while frequent units keep their natural
    rates (on the quickstart: 0 % dead at K = 8, 16, 32 and a lower FVU than no handling; benchmarks/dead_units.py).
    "bias": DeepSeek's symmetric rule, every unit pushed toward exactly K / units (up below, down above); it also
    stops an MxD code collapsing at a too-high learning rate, but costs fidelity wherever the natural rates are
    unequal (FVU up to 1.6x on the tiny transcoder rows). "none": plain top-K."""

    balance_floor: float = 0.3
    """`balance: floor`: keep every unit chosen on at least this fraction of its fair share K / units of the tokens
    (the bias rises below it and decays to 0 above it, so frequent units keep their natural rates). 0.3 left fewer
    dead units than 0.1 on the quickstart (0 % vs 1.7 % at K = 8) at equal or lower FVU."""

    balance_rate: float = 10.0
    """Step of the selection-bias update per training step, as a multiple of the step's learning rate, in units of
    the mean |selected score| (`train.balance: bias`): it keeps pace with the scores, which AdamW moves by about one
    learning rate per step."""

    balance_anneal: list[float] | None = dataclasses.field(default_factory=lambda: [0.5, 0.8])
    """`balance: floor` only: [start, end], fractions of the run's steps: the floor rule runs until `start`, then the
    selection bias decays linearly to exactly 0 at `end`, and the rest of the run trains plain top-K; the saved model
    routes without a bias. A held floor bias keeps choosing rarely-positive units at inference in place of better
    ones (it cost up to 1.6x the KL of no handling), while the annealed floor revives units at no cost in FVU or KL
    (benchmarks/dead_units.py, docs/results/dead_units.md). null: the bias is held to the end and saved (routing at
    inference uses it). The symmetric `balance: bias` is part of the routing, as in DeepSeek-V3, and is never
    annealed: removing it after training left 81 % of a synthetic layer's units dead (tests/test_balance.py)."""

    resample_every_tokens: int | Literal["auto"] = 0
    """Resampling of dead units (Bricken et al. 2023; training/resample.py): every this many training tokens, units
    that have not fired since the last check are re-pointed at inputs with a large error and their optimizer
    moments reset (kinds with `resample_units`: mxd, transcoders, routed_neurons), until 60 % of the run. "auto":
    the window in which a unit at its fair share K / N fires 50 times; 0: off."""

    log_with: Literal[
        "none", "tensorboard", "wandb", "trackio", "aim", "comet_ml", "mlflow", "clearml", "dvclive", "swanlab"
    ] = "none"
    """Experiment tracker (🤗 Accelerate's trackers) that receives loss, L0, dead fraction, lr and throughput at each
    log interval, for distillation and healing: "none", "tensorboard" (event files in OUTPUT_DIR/tracking/; needs
    `pip install "expertize[tracking]"`), "wandb", ... (the tracker's package must be installed)."""

    def resolved(self, total_steps: int, factor: float = 1.0) -> ResolvedSchedule:
        """The schedule of a distillation of `total_steps` steps for a kind whose `auto_lr_factor` is `factor`: `lr`
        and `warmup_steps`, or the rules' values where they are "auto" (recipe/schedule_rule.py)."""
        return resolve_schedule(self, total_steps, lr_factor=factor, warmup_fraction=WARMUP_FRACTION)

    def __post_init__(self) -> None:
        check_field_types(self, "train")
        if self.lr != "auto" and not self.lr > 0:
            raise ValueError(f'train.lr: must be > 0 or "auto", got {self.lr}')
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio: must lie in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"train.weight_decay: must be >= 0, got {self.weight_decay}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"train.grad_clip: must be > 0 (or null for no clipping), got {self.grad_clip}")
        if self.capture_batch_sequences != "auto" and self.capture_batch_sequences < 1:
            raise ValueError(f'train.capture_batch_sequences: must be >= 1 or "auto", got {self.capture_batch_sequences}')
        check_minimum(self, "train", 1, ("tokens_per_step", "shuffle_buffer_tokens", "log_every"))
        if self.warmup_steps != "auto" and self.warmup_steps < 0:
            raise ValueError(f'train.warmup_steps: must be >= 0 or "auto", got {self.warmup_steps}')
        check_minimum(self, "train", 0, ("checkpoint_every", "seed"))
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"train.betas: expected two numbers in [0, 1) such as [0.9, 0.999], got {self.betas}")
        if self.shuffle_buffer_tokens < self.tokens_per_step:
            raise ValueError(
                f"train.shuffle_buffer_tokens={self.shuffle_buffer_tokens} is smaller than one step "
                f"(train.tokens_per_step={self.tokens_per_step}); raise it to at least tokens_per_step"
            )
        if not 0.0 <= self.code_share_floor < 1.0:
            raise ValueError(f"train.code_share_floor: must be in [0, 1) (0 disables it), got {self.code_share_floor}")
        if not self.code_share_coef > 0:
            raise ValueError(f"train.code_share_coef: must be > 0, got {self.code_share_coef}")
        if not self.preact_coef >= 0:
            raise ValueError(f"train.preact_coef: must be >= 0 (0 disables the pre-activation loss), got {self.preact_coef}")
        if not self.threshold_lr_scale > 0:
            raise ValueError(f"train.threshold_lr_scale: must be > 0, got {self.threshold_lr_scale}")
        if not self.auxk_coef >= 0:
            raise ValueError(f"train.auxk_coef: must be >= 0 (0 disables AuxK), got {self.auxk_coef}")
        if self.balance_anneal is not None and not (
            len(self.balance_anneal) == 2 and 0.0 <= self.balance_anneal[0] <= self.balance_anneal[1] <= 1.0
        ):
            raise ValueError(
                "train.balance_anneal: expected [start, end] with 0 <= start <= end <= 1 (fractions of the run, e.g. "
                f"[0.5, 0.8]) or null to hold the bias to the end, got {self.balance_anneal}"
            )
        if not self.balance_rate > 0:
            raise ValueError(f"train.balance_rate: must be > 0, got {self.balance_rate}")
        if self.auxk_k != "auto" and self.auxk_k < 1:
            raise ValueError(f'train.auxk_k: must be >= 1 or "auto", got {self.auxk_k}')
        if self.dead_window_tokens not in ("auto", "interval") and self.dead_window_tokens < 1:
            raise ValueError(f'train.dead_window_tokens: must be >= 1, "auto" or "interval", got {self.dead_window_tokens}')
        if self.resample_every_tokens != "auto" and self.resample_every_tokens < 0:
            raise ValueError(
                f'train.resample_every_tokens: must be >= 0 (0: off) or "auto", got {self.resample_every_tokens}'
            )
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise ValueError(f"train.device: expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', got {self.device!r}")


@dataclasses.dataclass
class EvalConfig:
    """Evaluation after training, on the held-out documents of `data` (recipe section `eval:`)."""

    batch_sequences: int = 16
    """Sequences per forward pass of the evaluation."""

    generation_prompts: int = 32
    """Held-out prompts whose greedy continuations are compared between the base and the spliced model (MxD paper:
    512); 0 skips the comparison."""

    prompt_tokens: int = 4
    """Tokens of each prompt."""

    continuation_tokens: int = 32
    """Tokens generated after each prompt."""

    histogram: bool = True
    """Record how often each expert / latent fires (dead and dense units)."""

    lm_eval_tasks: list[str] = dataclasses.field(default_factory=list)
    """lm-evaluation-harness task names to run on the base and the spliced model after training (empty: none), e.g.
    [expertize_stories_ppl, expertize_stories_cloze] (offline tasks shipped with expertize) or [hellaswag]."""

    lm_eval_num_fewshot: int | None = None
    """Few-shot examples per lm-eval prompt; null: each task's default."""

    lm_eval_limit: int | float | None = None
    """Documents per lm-eval task (a fraction when < 1); null: all of them. Partial results: smoke tests only."""

    lm_eval_batch_size: int = 8
    """Requests per forward pass of the lm-eval runs."""

    lm_eval_include_paths: list[str] = dataclasses.field(default_factory=list)
    """Extra folders of lm-eval task YAMLs (e.g. written by `expertize tasks`); the shipped offline tasks are
    always available."""

    def __post_init__(self) -> None:
        check_field_types(self, "eval")
        check_minimum(self, "eval", 1, ("batch_sequences", "prompt_tokens", "continuation_tokens",
                                        "lm_eval_batch_size"))
        check_minimum(self, "eval", 0, ("generation_prompts",))
        if self.lm_eval_num_fewshot is not None and self.lm_eval_num_fewshot < 0:
            raise ValueError(f"eval.lm_eval_num_fewshot: must be >= 0 (or null), got {self.lm_eval_num_fewshot}")
        if self.lm_eval_limit is not None and not self.lm_eval_limit > 0:
            raise ValueError(
                f"eval.lm_eval_limit: must be > 0 (documents per task, or a fraction < 1) or null, got "
                f"{self.lm_eval_limit}"
            )
        if any(not task.strip() for task in self.lm_eval_tasks):
            raise ValueError(f"eval.lm_eval_tasks: empty task name in {self.lm_eval_tasks}")
        for path in self.lm_eval_include_paths:
            if not Path(path).is_dir():
                raise ValueError(f"eval.lm_eval_include_paths: {path!r} is not a folder of task YAMLs")


@dataclasses.dataclass(kw_only=True)
class Recipe:
    """Everything `expertize upcycle` needs: which MLPs of which model become which sparse layer, and how."""

    base_model: str
    """Dense model to convert: a Hub id (gpt2, meta-llama/Llama-3.2-3B) or a local directory."""

    base_revision: str | None = None
    """Hub revision (branch, tag or commit) of base_model; null: the default branch."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype the base model is loaded in (it only produces the activations the sparse layers learn from)."""

    device_map: Literal["auto", "balanced", "balanced_low_0", "sequential"] | dict[str, int | str] | None = None
    """Spread the base over devices with accelerate's big-model loading (transformers' `device_map`): a strategy, or
    {module: device} with a GPU index, "cpu" or "disk"; null: the whole base on train.device. A target layer's MLP
    must run where it is placed (not "disk", nor "cpu" in a map with GPUs); the sparse layers train on train.device.
    Not with heal: or eval.lm_eval_tasks (surgery/placement.py)."""

    max_memory: dict[int | str, int | str] | None = None
    """With device_map: the most each device may hold, e.g. {0: 20GiB, 1: 20GiB, cpu: 64GiB} (transformers' name)."""

    offload_folder: str | None = None
    """With device_map: the folder receiving the weights of modules placed on "disk" (needed when any are)."""

    layers: list[int] | Literal["all"] = dataclasses.field(metadata=ONE_KIND_PER_RECIPE)
    """Decoder layer indices whose MLPs are replaced, e.g. [8], or "all"."""

    layer: LayerConfig = dataclasses.field(default_factory=LayerConfig, metadata=ONE_KIND_PER_RECIPE)
    """The sparse layer used at every index in `layers`."""

    data: DataConfig
    """Text the activations are captured on."""

    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Optimization."""

    heal: HealConfig | None = None
    """End-to-end healing of the spliced model after distillation; null: none."""

    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Evaluation after training."""

    output_dir: str
    """Folder receiving checkpoints, metrics, recipe.resolved.yaml and the converted model (with `variants:`, the
    folder holding one such folder per variant)."""

    variants: list[VariantConfig] = dataclasses.field(default_factory=list)
    """Variants of the sparse layer and its optimizer trained together on one activation stream, one model folder
    each (output_dir/NAME); see recipe/variants.py. Empty: one model, in output_dir."""

    def __post_init__(self) -> None:
        check_field_types(self, "")
        for name in ("base_model", "output_dir"):
            if not getattr(self, name).strip():
                raise ValueError(f"{name}: must not be empty")
        if isinstance(self.layers, list):
            if not self.layers:
                raise ValueError('layers: empty; list the layer indices to convert, e.g. [8], or write "all"')
            negative = [i for i in self.layers if i < 0]
            if negative:
                raise ValueError(f"layers: indices count from 0, got {negative}")
            duplicates = sorted({i for i in self.layers if self.layers.count(i) > 1})
            if duplicates:
                raise ValueError(f"layers: index {duplicates[0]} appears more than once in {self.layers}")
        check_variants(self.variants, self.train.distill)
        if self.train.capture_precision == "bf16" and self.dtype != "float32":
            raise ValueError(
                f"train.capture_precision: bf16 autocasts a float32 base model, but dtype is {self.dtype} (the whole "
                "base already runs in it); set dtype: float32, or capture_precision: fp32"
            )
        if not self.train.distill and self.heal is None:
            raise ValueError(
                "train.distill is false and there is no heal: section, so nothing would train; add a heal: section "
                "or set train.distill: true"
            )

    def distill_steps(self) -> int:
        """Optimizer steps of the layer-wise distillation: data.train_tokens // train.tokens_per_step (0 with
        train.distill: false). Preflight refuses a distilling recipe whose budget is less than one step."""
        return self.data.train_tokens // self.train.tokens_per_step if self.train.distill else 0

    def heal_steps(self) -> int:
        """Optimizer steps of the healing: the heal.tokens budget in sequences of data.context_length,
        // heal.batch_sequences (0 without a heal: section)."""
        if self.heal is None:
            return 0
        return token_budget_to_sequences(self.heal.tokens, self.data.context_length) // self.heal.batch_sequences

    def heal_schedule(self) -> ResolvedSchedule | None:
        """The healing's schedule with `auto` resolved (None without a heal: section)."""
        return None if self.heal is None else self.heal.resolved(self.heal_steps())

    def run_steps(self) -> dict[str, int]:
        """Optimizer steps of each training stage: {"train": ..., "heal": ...} (a stage that does not run is left
        out). Distillation: `distill_steps`; healing: `heal_steps`."""
        steps = {}
        if self.train.distill:
            steps["train"] = self.distill_steps()
        if self.heal is not None:
            steps["heal"] = self.heal_steps()
        return steps

    def check_warmups(self) -> None:
        """Refuse a warm-up (train: or heal:) that is not shorter than its stage: the learning rate would never
        reach its peak. Preflight calls it before the run folder is claimed (`preflight.plan_variants`); it is not a
        load-time check, so that the recipe of a run made under the former defaults (5,000 warm-up steps) still
        loads."""
        data, train, heal = self.data, self.train, self.heal
        counted = {
            "train": f"data.train_tokens={data.train_tokens:,} // train.tokens_per_step={train.tokens_per_step:,}"
        }
        if heal is not None:
            counted["heal"] = (f"heal.tokens={heal.tokens:,} in sequences of data.context_length="
                               f"{data.context_length} // heal.batch_sequences={heal.batch_sequences}")
        for section, steps in self.run_steps().items():
            check_warmup(section, getattr(self, section).warmup_steps, steps, counted[section])
