"""`expertize upcycle RECIPE`: distil sparse layers for the chosen MLPs, evaluate, and write a publishable folder.

    preflight (everything checkable: base config, layers, spec, device, memory, corpus, lm-eval tasks)
      -> claim the run folder -> base model -> build_layers (+ init from the dense MLP)   -> Built
      -> distil (captured activations)                                                  -> Distilled
      -> heal (optional, end to end)                                                    -> Healed | None
      -> evaluate (held-out metrics and every stage's record)                           -> Metrics (typed)
      -> publish (the model, metrics.json, records and card, staged then moved in)

Each stage returns one record and reads only the records before it (and the plan, RunPlan); metrics.json is written
from the typed `Metrics` (publishing/metrics_schema.py), every section present (null where a stage did not run).

The output folder loads with `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` and also holds
metrics.json, recipe.resolved.yaml, provenance.json, plots/ and README.md (model card); the folder's layout is
`publishing/run_folder.py`'s. While training, `checkpoint/` holds the resumable state; running the same command
again resumes from it, and `restart=True` (`--restart`) discards it.

A recipe with `variants:` (recipe/variants.py) runs the same stages for every variant at once: one base model, one
activation stream (captured once, or read once from the activation cache) feeding every variant's trainer step by
step (`training.engine.train_together`), then healing and publishing per variant into output_dir/NAME. A finished
variant folder is skipped on a rerun; a variant that diverges stops alone, the others are published, and the run
then fails naming it.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from expertize.modeling import SparseLayer, build_sparse_layer, link_cross_layer

from .data.streams import activation_batches  # noqa: F401  (upcycle.activation_batches: benchmarks, tests)
from .data.cache import cached_batches, open_matching_cache
from .data.mlp_pairs import excluded_token_ids
from .data.separators import check_separators
from .data.text import load_eval_sequences
from .errors import RunFailed
from .evaluation.evaluate import evaluate_sparse_layers, spliced_ce
from .evaluation.shared_passes import AblationMemo
from .evaluation.stacking import stacking_metrics
from .preflight import RunPlan, plan_variants
from .evaluation.reading import quality_verdict
from .publishing.metrics_schema import (
    BalanceSummary, HealSummary, InitMetrics, LmEval, Metrics, StackingMetrics, TrainSummary, load_metrics,
)
from .publishing.model_folder import refresh_model_card
from .publishing.records import example_prompt, provenance, recipe_summary
from .publishing.variants_table import VARIANTS_TABLE, write_variants_table
from .publishing.run_folder import METRICS, PROVENANCE, RESOLVED_RECIPE, RunFolder, RunFolderTaken
from .recipe import Recipe, recipe_to_dict, variant_recipes
from .recipe.schedule_rule import ResolvedSchedule
from .surgery.dense_init import init_moe_from_dense
from .surgery.families import decoder_blocks
from .surgery.placement import is_dispatched
from .surgery.splice import load_base_model, splice
from .training.compute import compute_record, matmul_precision
from .device import make_accelerator, world_size
from .training.distill import Trainer
from .training.distill_plan import DistillPlan, plan_distillation
from .training.engine import rng_state, set_rng_state
from .training.together import train_together
from .training.errors import RunInterrupted
from .training.heal import Healer
from .training.log import loss_drop_last_fifth, plot_loss_curve

Log = Callable[[str], None]
LOSS_PLOT = "loss.png"


def upcycle(recipe: Recipe, *, progress: bool = True, restart: bool = False, log: Log | None = None) -> Path:
    """Run the whole pipeline for `recipe`; returns the output folder (with variants: the folder holding theirs).
    Resumes an interrupted run of the same recipe in place; a finished run of the same recipe is returned as it is
    (nothing is trained; a different recipe's is refused); `restart=True` discards an unfinished run first (with
    variants: the unfinished variants; finished ones are kept and skipped). `log` receives one-line status
    messages."""
    say = log or (lambda message: None)
    main = _is_main_rank()
    # The folder the command names is locked for the whole run (for variants: the folder holding them); a second
    # `upcycle` on it, `--restart` included, is refused naming this process.
    guard = RunFolder(recipe.output_dir, is_main_process=main)
    guard.check_not_busy()
    if recipe.variants:
        runs = pending_variants(recipe, restart=restart, is_main_process=main, say=say)
        if not runs:
            say(f"every variant in {recipe.output_dir} is finished; nothing to train")
            if main:
                write_variants_table(recipe.output_dir, [v.name for v in recipe.variants])
            return Path(recipe.output_dir)
    else:
        if guard.is_finished and not restart:
            changed = guard.finished_recipe_differs(recipe_to_dict(recipe))
            if not changed:  # a rerun of a finished run (a notebook cell run twice): its folder, as for variants
                say(f"{guard.root} holds this recipe's finished run; nothing to train (to train again, choose another "
                    "output_dir or delete that folder)")
                return guard.root
            raise RunFolderTaken(
                f"{guard.root} holds a finished run of a different recipe (differs at {'; '.join(changed)}); choose "
                f"another output_dir, or delete {guard.root} if you no longer need that model"
            )
        guard.check_claimable(recipe_to_dict(recipe), restart=restart)  # output_dir problems first: the cheapest
        runs = [(recipe, guard)]
    plans = plan_variants([r for r, _ in runs], world_size=world_size(), variants=bool(recipe.variants))
    # data.activation_cache: a mismatch is refused now
    open_matching_cache(plans[0].recipe, plans[0].layer_ids, world_size=world_size())
    accelerator = make_accelerator(plans[0].device)
    folders = [folder for _, folder in runs]
    try:
        claim(runs, guard, accelerator.is_main_process, restart=restart)
        accelerator.wait_for_everyone()
        for folder in folders:
            if folder.is_resume:
                say(f"resuming the unfinished run in {folder.root}")
        _run(plans, folders, accelerator, progress=progress, say=say)
    except KeyboardInterrupt as interrupt:
        if isinstance(interrupt, RunInterrupted):
            raise
        raise RunInterrupted(
            f"interrupted outside training; the last checkpoint in {folders[0].checkpoint_dir} is kept. Run the same "
            "command again to resume"
        ) from None
    finally:
        for folder in (*folders, guard):
            folder.unlock()
    if not recipe.variants:
        return folders[0].root
    if accelerator.is_main_process:
        write_variants_table(recipe.output_dir, [v.name for v in recipe.variants])
    return Path(recipe.output_dir)


def claim(runs: list[tuple[Recipe, RunFolder]], guard: RunFolder, is_main_process: bool, *, restart: bool) -> None:
    """Take the run folders (after every check has passed): lock the folder the command names (`guard`; with
    variants, the folder holding them) and claim each run's folder (its own lock, the recipe's identity).
    Main process only; the locks are held until `RunFolder.unlock` or the process ends."""
    guard.is_main_process = is_main_process
    guard.lock()
    for run_recipe, folder in runs:
        folder.is_main_process = is_main_process
        if is_main_process:
            folder.claim(recipe_to_dict(run_recipe), restart=restart)


def pending_variants(
    recipe: Recipe, *, restart: bool, is_main_process: bool = True, say: Log = lambda message: None
) -> list[tuple[Recipe, RunFolder]]:
    """The variants still to run, each with its folder, checked as claimable (nothing written). A finished variant
    folder of the same recipe is skipped; of another recipe it is an error (the variant's name is taken)."""
    parent = RunFolder(recipe.output_dir)
    if parent.is_finished or parent.claimed_recipe_path.is_file():
        raise RunFolderTaken(
            f"output_dir {parent.root} holds a single-model run, but this recipe has variants, which need a folder "
            "of their own (one subfolder per variant); choose another output_dir"
        )
    pending = []
    for name, variant in variant_recipes(recipe):
        folder = RunFolder(variant.output_dir, is_main_process=is_main_process)
        resolved = recipe_to_dict(variant)
        if folder.is_finished:
            changed = folder.finished_recipe_differs(resolved)
            if changed:
                raise RunFolderTaken(
                    f"variant {name!r}: {folder.root} holds a finished run of a different recipe (differs at "
                    f"{'; '.join(changed)}); rename the variant, or delete {folder.root} if you no longer need it"
                )
            say(f"variant {name!r} is finished ({folder.root}); skipped")
            continue
        folder.check_claimable(resolved, restart=restart)
        pending.append((variant, folder))
    return pending


@dataclass(frozen=True)
class Built:
    """`build_layers`: one run's sparse layers before training (trained in place by `distil`), the plan of their
    distillation, and what an initialization from the dense MLP cost."""

    layers: dict[int, SparseLayer]
    distill: DistillPlan
    """What the recipe's train: section resolves to for these layers (training/distill_plan.py): decided once here,
    read by the trainer, the evaluation (what was in effect) and the records."""
    rng: Any = field(repr=False)
    """The torch RNG state right after the layers were built: where this run's training draws from."""
    init_metrics: dict | None = None
    """ΔCE at initialization (`layer.init: split | copy`); None for the layer's own init."""
    eval_sequences: torch.Tensor | None = field(default=None, repr=False)
    """The held-out sequences, when the initialization already loaded them (reused by the evaluation)."""


@dataclass(frozen=True)
class Distilled:
    """`distil`: what one run's distillation produced besides the layers it trained in place."""

    rng: Any = field(repr=False)
    """The torch RNG state after the distillation (healing draws from it, as the run would alone)."""
    steps: int = 0
    mean_outputs: dict[int, torch.Tensor] | None = field(default=None, repr=False)
    """The MLP outputs' training mean per layer (the mean ablation's constant); None: no distillation."""
    balance: dict[int, tuple[dict, torch.Tensor]] = field(default_factory=dict, repr=False)
    """The balanced layers' (summary, raised units) (Trainer.balance_summaries)."""
    compute: dict | None = None
    """How the capture and the training ran (`training.compute.compute_record`), for provenance.json."""


@dataclass(frozen=True)
class Healed:
    """`heal`: the spliced model trained end to end (the recipe's heal: section)."""

    model: torch.nn.Module = field(repr=False)
    summary: dict
    schedule: ResolvedSchedule


def _run(plans: list[RunPlan], folders: list[RunFolder], accelerator, *, progress: bool, say: Log) -> None:
    base = load_base(plans[0], accelerator.device)
    if accelerator.is_main_process:  # before training: does the base read the text as the data section reads it?
        check_separators(plans[0].recipe.data, plans[0].tokenizer, base, say)
    built = []
    for plan in plans:
        torch.manual_seed(plan.recipe.train.seed)  # each variant is built as it would be alone
        built.append(build_layers(plan, base, accelerator))
    distilled, diverged = distil(plans, base, built, folders, accelerator, progress=progress, say=say)
    if not accelerator.is_main_process:
        return
    memo = AblationMemo(share_base=len(plans) > 1)  # the variants' base and ablated eval forwards: computed once
    for plan, made, trained, folder in zip(plans, built, distilled, folders):
        if folder.root.name in diverged:
            continue
        set_rng_state(trained.rng)  # healing draws from this run's RNG, as it would alone (e.g. LoRA's init)
        healed = heal(plan, base, made, folder, accelerator, progress=progress, say=say)
        publish(plan, base, made, trained, healed, folder, accelerator, progress=progress, say=say, ablation_memo=memo)
        if not is_dispatched(base):
            # publish saves from the base moved to the CPU in float32; the next variant evaluates on the run's device.
            base.to(device=accelerator.device, dtype=getattr(torch, plan.recipe.dtype))
    if diverged:
        names = ", ".join(sorted(diverged))
        raise RunFailed(
            f"variant(s) {names} diverged and were not published (the other variants were): "
            + " | ".join(str(error) for error in diverged.values())
            + " (set the variant's own train: keys in variants:; --restart keeps the finished variants)"
        )


# -- stages ------------------------------------------------------------------------------------------------------------


def load_base(plan: RunPlan, device: torch.device):
    """The frozen base model in the recipe's dtype (it only produces activations): on `device`, or spread as the
    plan's placement says (the recipe's device_map)."""
    dtype = getattr(torch, plan.recipe.dtype)
    if plan.placement is not None:
        base = load_base_model(plan.recipe.base_model, dtype=dtype, **plan.placement.load_kwargs()).eval()
    else:
        base = load_base_model(plan.recipe.base_model, dtype=dtype).to(device).eval()
    base.requires_grad_(False)
    return base


def build_layers(plan: RunPlan, base, accelerator) -> Built:
    """One sparse layer per target layer; `layer.init: split | copy` overwrites them with the base MLPs' weights and
    records what that costs before any training (ΔCE at initialization)."""
    recipe = plan.recipe
    layers = {i: build_sparse_layer(plan.spec.at_layer(i, plan.layer_ids)) for i in plan.layer_ids}
    link_cross_layer(layers)  # a CLT's layers share their codes (each other kind: nothing to link)
    distill = plan_distillation(recipe.train, next(iter(layers.values())), plan.distill_steps)
    if recipe.layer.init == "default":
        return Built(layers, distill, rng=rng_state())
    blocks = decoder_blocks(base)
    for i, layer in layers.items():
        init_moe_from_dense(
            layer, blocks[i].mlp, recipe.layer.init, family=base.config.model_type,
            clustering=recipe.layer.init_clustering, noise_std=recipe.layer.init_noise, seed=recipe.train.seed + i,
            # The recipe states the activation (auto keeps the MLP's), so a switch to ReLU here is intended.
            allow_activation_change=True,
        )
    eval_sequences = init_metrics = None
    if accelerator.is_main_process:
        eval_sequences = load_eval_sequences(recipe.data, plan.tokenizer)  # reused by the final evaluation
        init_metrics = {
            "method": recipe.layer.init,
            **spliced_ce(base, layers, eval_sequences, recipe.eval.batch_sequences),
        }
    return Built(layers, distill, rng=rng_state(), init_metrics=init_metrics, eval_sequences=eval_sequences)


def distil(
    plans: list[RunPlan], base, built: list[Built], folders: list[RunFolder], accelerator, *, progress: bool,
    say: Log,
) -> tuple[list[Distilled], dict[str, Exception]]:
    """Layer-wise distillation from captured activations (skipped with `train.distill: false`): every run (the
    variants of a recipe) trains on one stream, captured once. Returns each run's record and the variants that
    diverged, by name (their records are not to be published)."""
    recipe = plans[0].recipe
    if not recipe.train.distill:
        return [Distilled(rng=run.rng) for run in built], {}
    # None: capture live; else read the pairs from disk
    cache = open_matching_cache(recipe, plans[0].layer_ids, world_size=accelerator.num_processes)
    stream = activation_batches if cache is None else partial(cached_batches, cache)
    batches = stream(
        recipe, base, plans[0].tokenizer, plans[0].layer_ids, plans[0].distill_steps, accelerator.device,
        rank=accelerator.process_index, world_size=accelerator.num_processes,
    )
    compute = compute_record(
        recipe, accelerator.device, attention=base.config._attn_implementation,
        capture_batch_sequences=None if cache is not None else batches.capture_batch_sequences,
    )
    trainers = []
    for plan, run, folder in zip(plans, built, folders):
        set_rng_state(run.rng)  # the trainer starts from this run's RNG (MxD's random K draws from it)
        trainers.append(Trainer(
            run.layers, batches, plan.recipe.train, total_steps=plan.distill_steps, accelerator=accelerator,
            checkpoint_path=folder.train_state, log_path=folder.train_log, progress=progress,
            init_output_bias=plan.recipe.layer.init == "default", log=say,
            variant=folder.root.name if len(plans) > 1 else None, plan=run.distill,
        ))
    try:
        # TF32 for the capture (run lazily by the batches) and the training; the evaluation stays in full fp32
        with matmul_precision(accelerator.device, recipe.train.tf32):
            diverged = train_together(trainers)
    finally:
        for trainer in trainers:
            trainer.release()
    distilled = []
    for plan, run, trainer in zip(plans, built, trainers):
        if trainer in diverged:
            distilled.append(Distilled(rng=run.rng, compute=compute))
            continue
        with trainer.own_rng(len(trainers) > 1):
            trainer.save_checkpoint()  # a run killed during evaluation resumes straight into it
            rng = rng_state()
        distilled.append(Distilled(rng=rng, steps=plan.distill_steps, mean_outputs=trainer.mean_outputs,
                                   balance=trainer.balance_summaries(), compute=compute))
    return distilled, {folder.root.name: diverged[trainer] for trainer, folder in zip(trainers, folders)
                       if trainer in diverged}


def heal(plan: RunPlan, base, built: Built, folder: RunFolder, accelerator, *, progress: bool, say: Log
         ) -> Healed | None:
    """End-to-end healing of the spliced model (the recipe's `heal:` section), on one process; None without one."""
    recipe = plan.recipe
    if recipe.heal is None:
        return None
    # The spliced model trains in float32 whatever dtype produced the activations.
    spliced = splice(base, built.layers).float()
    spliced.config.router_aux_loss_coef = recipe.heal.aux_loss_coef
    healer = Healer(
        spliced, base, plan.tokenizer, recipe.data, recipe.heal, family=plan.family, device=accelerator.device,
        checkpoint_path=folder.heal_state, log_path=folder.heal_log, precision=recipe.train.precision,
        progress=progress, log=say, log_with=recipe.train.log_with,
    )
    with matmul_precision(accelerator.device, recipe.train.tf32):
        model = healer.fit()
    return Healed(model, healer.summary(), healer.schedule)


def evaluate(
    plan: RunPlan, base, built: Built, distilled: Distilled, healed: Healed | None, folder: RunFolder,
    eval_sequences: torch.Tensor, plots_dir: Path, accelerator, *, progress: bool, say: Log,
    ablation_memo: AblationMemo | None = None,
) -> Metrics:
    """The run's metrics.json, typed: the held-out evaluation of its layers (in the healed model when it was healed),
    what the stages before recorded (balancing, initialization, healing, the distillation's summary) and, for a base
    that is itself an expertize model, the cost against the dense model it came from."""
    recipe = plan.recipe
    layers = built.layers if healed is None else healed.model.sparse_layers()
    metrics = Metrics.from_dict(evaluate_sparse_layers(
        base, layers, eval_sequences, recipe.eval, plots_dir=plots_dir,
        mean_outputs=distilled.mean_outputs, spliced_model=None if healed is None else healed.model,
        progress=progress, exclude_token_ids=excluded_token_ids(recipe.data, plan.tokenizer),
        ablation_memo=ablation_memo, raised_units={i: raised for i, (_, raised) in distilled.balance.items()},
        plan=built.distill,
    ))
    for i, (summary, _) in distilled.balance.items():
        metrics.layers[str(i)].balance = BalanceSummary.from_dict(summary, f"layers.{i}.balance")
    stacked = stacking_metrics(
        recipe.base_model, plan.base_config, eval_sequences, metrics.ce.spliced,
        batch_sequences=recipe.eval.batch_sequences, dtype=getattr(torch, recipe.dtype), device=accelerator.device,
        log=say,
    )
    if stacked is not None:  # base_model is an expertize folder: the cost against the dense model it came from
        metrics.stacking = StackingMetrics.from_dict(stacked, "stacking")
    metrics.train = TrainSummary.from_dict(train_summary(
        built.distill, distilled.steps, folder.train_log, recipe.train.code_share_floor), "train")
    if built.init_metrics is not None:
        metrics.init = InitMetrics.from_dict(built.init_metrics, "init")
    if healed is not None:
        metrics.heal = HealSummary.from_dict(healed.summary, "heal")
    return metrics


def publish(
    plan: RunPlan, base, built: Built, distilled: Distilled, healed: Healed | None, folder: RunFolder, accelerator,
    *, progress: bool, say: Log, ablation_memo: AblationMemo | None = None,
) -> None:
    """Evaluate, assemble the model and its records in a staging folder, and move it in (metrics.json last)."""
    recipe = plan.recipe
    eval_sequences = built.eval_sequences
    if eval_sequences is None:
        eval_sequences = load_eval_sequences(recipe.data, plan.tokenizer)
    with folder.staging() as stage:
        metrics = evaluate(plan, base, built, distilled, healed, folder, eval_sequences, stage.plots_dir,
                           accelerator, progress=progress, say=say, ablation_memo=ablation_memo)
        plot_loss_curve([folder.train_log, folder.heal_log], stage.plots_dir / LOSS_PLOT)
        if healed is not None:
            model = healed.model.cpu()
        else:
            # Saved in float32 whatever dtype produced the activations (`.float()` is a no-op for a float32 base). A
            # base spread with device_map holds no weights where it is offloaded: the folder is spliced from the
            # checkpoint itself, loaded whole on the CPU (docs/scale.md: the saving host needs the model's memory).
            source = plan.recipe.base_model if is_dispatched(base) else base.cpu().float()
            model = splice(source, {i: m.cpu() for i, m in built.layers.items()}, dtype=torch.float32)
        model.save_pretrained(stage.path)
        plan.tokenizer.save_pretrained(stage.path)
        metrics.recipe_summary = recipe_summary(  # the card's Training rows
            recipe, distilled.steps, built.distill.schedule, None if healed is None else healed.schedule)
        metrics.example_prompt = example_prompt(eval_sequences, plan.tokenizer)  # the card's example
        if plan.lm_eval is not None:
            metrics.lm_eval = LmEval.from_dict(plan.lm_eval.run(
                model, base, plan.tokenizer, stage.path, device=accelerator.device, model_name=str(folder.root),
                base_name=recipe.base_model, log=say if progress else None,
            ), "lm_eval")
        verdict = quality_verdict(metrics)
        metrics.verdict = None if verdict is None else verdict.to_dict()
        nulled = stage.write_metrics(metrics)
        if nulled:
            raise RunFailed(
                f"the evaluation of the trained model gave non-finite values ({', '.join(nulled[:5])}), so the "
                f"result is broken and was not published; the training checkpoint in {folder.checkpoint_dir} is "
                "kept. Check train.precision / dtype (bf16 overflow), or lower train.lr and start over with --restart"
            )
        stage.write_yaml(RESOLVED_RECIPE, recipe_to_dict(recipe))
        compute = distilled.compute or compute_record(  # no distillation: only the settings and the base
            recipe, accelerator.device, attention=base.config._attn_implementation)
        record = provenance(recipe, device=accelerator.device, compute=compute)
        if plan.placement is not None:  # which device held which modules of the base
            record["base_placement"] = plan.placement.record()
        stage.write_json(PROVENANCE, record)
        refresh_model_card(stage.path)  # from config.json, metrics.json and provenance.json, as `expertize eval` does
        folder.publish(stage)


def train_summary(distill: DistillPlan, steps: int, log_path: Path, code_share_floor: float) -> dict:
    """metrics.json's `train`: the distillation's steps and tokens, its peak learning rate and warm-up beside the
    rules' for this many steps (recipe/lr_rule.py, schedule_rule.py: the plan's, distill_plan.py), the schedule
    after the warm-up, and how much its loss still fell over the last fifth (evaluation/reading.py reads the rate,
    the schedule and the drop to say when a run looks under-trained)."""
    out = {"steps": steps, "tokens": steps * distill.tokens_per_step}
    if steps:
        schedule = distill.schedule
        out.update(lr=schedule.lr, lr_rule=schedule.lr_rule, warmup_steps=schedule.warmup_steps,
                   warmup_rule=schedule.warmup_rule, schedule=schedule.schedule, min_lr_ratio=schedule.min_lr_ratio,
                   loss_drop_last_fifth=loss_drop_last_fifth(log_path),
                   code_share_floor=code_share_floor)
    return out


def upcycle_summary(folder: str | Path) -> str:
    """The key results of a finished run folder, a few lines for the end of `expertize upcycle` (a ratio over a
    near-zero denominator with its caveat: evaluation/headline.py), each followed by what a good and a bad value look
    like (evaluation/reading.py); for the folder of a recipe's variants, their table (variants.md)."""
    from .evaluation.headline import headline_lines
    from .evaluation.reading import reading_lines

    folder = Path(folder)
    table = folder / VARIANTS_TABLE
    if not (folder / METRICS).is_file() and table.is_file():
        return table.read_text(encoding="utf-8").rstrip("\n")
    metrics = load_metrics(folder)
    guide = reading_lines(metrics)
    lines = headline_lines(metrics) + (["how to read these:"] + [f"  {line}" for line in guide] if guide else [])
    return "\n".join(f"expertize: {line}" for line in lines)


def _is_main_rank() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"
