"""`expertize upcycle RECIPE`: distil sparse layers for the chosen MLPs, evaluate, and write a publishable folder.

    preflight (everything checkable: base config, layers, spec, device, memory, corpus, lm-eval tasks)
      -> claim the run folder -> base model -> sparse layers (+ init from the dense MLP)
      -> distil (captured activations) -> heal (optional, end to end) -> evaluate -> assemble and publish

The output folder loads with `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` and also holds
metrics.json, recipe.resolved.yaml, provenance.json, plots/ and README.md (model card); the folder's layout is
`publishing/run_folder.py`'s. While training, `checkpoint/` holds the resumable state; running the same command
again resumes from it, and `restart=True` (`--restart`) discards it.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from expertize.modeling import SparseLayer, build_sparse_layer

from .data.activations import ActivationBatches
from .data.cache import cached_batches, open_matching_cache
from .data.capture import MlpCapture, excluded_token_ids
from .data.text import iter_sequences, load_eval_sequences
from .errors import RunFailed
from .evaluation.evaluate import evaluate_sparse_layers, spliced_ce
from .preflight import RunPlan, plan_run
from .publishing.metrics_schema import load_metrics
from .publishing.model_folder import refresh_model_card
from .publishing.records import provenance, recipe_summary
from .publishing.run_folder import PROVENANCE, RESOLVED_RECIPE, RunFolder
from .recipe import Recipe, recipe_to_dict
from .surgery.dense_init import init_moe_from_dense
from .surgery.families import decoder_blocks
from .surgery.splice import load_base_model, splice
from .training.device import make_accelerator, world_size
from .training.distill import Trainer
from .training.errors import RunInterrupted
from .training.heal import Healer
from .training.log import plot_loss_curve

Log = Callable[[str], None]
LOSS_PLOT = "loss.png"


def upcycle(recipe: Recipe, *, progress: bool = True, restart: bool = False, log: Log | None = None) -> Path:
    """Run the whole pipeline for `recipe`; returns the output folder. Resumes an interrupted run of the same
    recipe in place; `restart=True` discards an unfinished run first. `log` receives one-line status messages."""
    say = log or (lambda message: None)
    resolved = recipe_to_dict(recipe)
    folder = RunFolder(recipe.output_dir, is_main_process=_is_main_rank())
    folder.check_claimable(resolved, restart=restart)  # output_dir problems first: they are the cheapest to find
    plan = plan_run(recipe, world_size=world_size())
    open_matching_cache(recipe, plan.layer_ids)  # data.activation_cache: a mismatched cache is refused before the claim
    accelerator = make_accelerator(plan.device)
    folder.is_main_process = accelerator.is_main_process
    if accelerator.is_main_process:
        folder.claim(resolved, restart=restart)
    accelerator.wait_for_everyone()
    if folder.is_resume:
        say(f"resuming the unfinished run in {folder.root}")
    try:
        return _run(plan, folder, accelerator, progress=progress, say=say)
    except KeyboardInterrupt as interrupt:
        if isinstance(interrupt, RunInterrupted):
            raise
        raise RunInterrupted(
            f"interrupted outside training; the last checkpoint in {folder.checkpoint_dir} is kept. Run the same "
            "command again to resume"
        ) from None


@dataclass
class Trained:
    """What training produced: the layers, the distillation's mean MLP outputs (for mean ablation) and summaries."""

    layers: dict[int, SparseLayer]
    steps: int = 0
    mean_outputs: dict[int, torch.Tensor] | None = None
    healed_model: torch.nn.Module | None = None
    heal_summary: dict | None = None
    init_metrics: dict | None = None
    eval_sequences: torch.Tensor | None = field(default=None, repr=False)


def _run(plan: RunPlan, folder: RunFolder, accelerator, *, progress: bool, say: Log) -> Path:
    torch.manual_seed(plan.recipe.train.seed)
    base = load_base(plan, accelerator.device)
    trained = build_layers(plan, base, accelerator)
    distil(plan, base, trained, folder, accelerator, progress=progress, say=say)
    if not accelerator.is_main_process:
        return folder.root
    heal(plan, base, trained, folder, accelerator, progress=progress, say=say)
    publish(plan, base, trained, folder, accelerator, progress=progress, say=say)
    return folder.root


# -- stages ------------------------------------------------------------------------------------------------------------


def load_base(plan: RunPlan, device: torch.device):
    """The frozen base model on `device`, in the recipe's dtype (it only produces activations)."""
    base = load_base_model(plan.recipe.base_model, dtype=getattr(torch, plan.recipe.dtype)).to(device).eval()
    base.requires_grad_(False)
    return base


def build_layers(plan: RunPlan, base, accelerator) -> Trained:
    """One sparse layer per target layer; `layer.init: split | copy` overwrites them with the base MLPs' weights and
    records what that costs before any training (ΔCE at initialization)."""
    recipe = plan.recipe
    trained = Trained(layers={i: build_sparse_layer(plan.spec) for i in plan.layer_ids})
    if recipe.layer.init == "default":
        return trained
    blocks = decoder_blocks(base)
    for i, layer in trained.layers.items():
        init_moe_from_dense(
            layer, blocks[i].mlp, recipe.layer.init,
            clustering=recipe.layer.init_clustering, noise_std=recipe.layer.init_noise, seed=recipe.train.seed + i,
            # The recipe states the activation (auto keeps the MLP's), so a switch to ReLU here is intended.
            allow_activation_change=True,
        )
    if accelerator.is_main_process:
        trained.eval_sequences = load_eval_sequences(recipe.data, plan.tokenizer)  # reused by the final evaluation
        trained.init_metrics = {
            "method": recipe.layer.init,
            **spliced_ce(base, trained.layers, trained.eval_sequences, recipe.eval.batch_sequences),
        }
    return trained


def distil(plan: RunPlan, base, trained: Trained, folder: RunFolder, accelerator, *, progress: bool, say: Log) -> None:
    """Layer-wise distillation from captured activations (skipped with `train.distill: false`)."""
    recipe = plan.recipe
    if not recipe.train.distill:
        return
    cache = open_matching_cache(recipe, plan.layer_ids)  # None: capture live; else read the pairs from disk
    stream = activation_batches if cache is None else partial(cached_batches, cache)
    batches = stream(
        recipe, base, plan.tokenizer, plan.layer_ids, plan.distill_steps, accelerator.device,
        rank=accelerator.process_index, world_size=accelerator.num_processes,
    )
    trainer = Trainer(
        trained.layers, batches, recipe.train, total_steps=plan.distill_steps, accelerator=accelerator,
        checkpoint_path=folder.train_state, log_path=folder.train_log, progress=progress,
        init_output_bias=recipe.layer.init == "default", log=say,
    )
    trainer.fit()
    trainer.save_checkpoint()  # a run killed during evaluation resumes straight into it
    trained.steps, trained.mean_outputs = plan.distill_steps, trainer.mean_outputs


def heal(plan: RunPlan, base, trained: Trained, folder: RunFolder, accelerator, *, progress: bool, say: Log) -> None:
    """End-to-end healing of the spliced model (the recipe's `heal:` section), on one process."""
    recipe = plan.recipe
    if recipe.heal is None:
        return
    # The spliced model trains in float32 whatever dtype produced the activations.
    spliced = splice(base, trained.layers).float()
    spliced.config.router_aux_loss_coef = recipe.heal.aux_loss_coef
    healer = Healer(
        spliced, base, plan.tokenizer, recipe.data, recipe.heal, family=plan.family, device=accelerator.device,
        checkpoint_path=folder.heal_state, log_path=folder.heal_log, precision=recipe.train.precision,
        progress=progress, log=say, log_with=recipe.train.log_with,
    )
    trained.healed_model = healer.fit()
    trained.layers = trained.healed_model.sparse_layers()
    trained.heal_summary = healer.summary()


def publish(plan: RunPlan, base, trained: Trained, folder: RunFolder, accelerator, *, progress: bool, say: Log) -> None:
    """Evaluate, save the model and its records into a staging folder, and move it in (metrics.json last)."""
    recipe = plan.recipe
    if trained.eval_sequences is None:
        trained.eval_sequences = load_eval_sequences(recipe.data, plan.tokenizer)
    with folder.staging() as stage:
        metrics = evaluate_sparse_layers(
            base, trained.layers, trained.eval_sequences, recipe.eval, plots_dir=stage.plots_dir,
            mean_outputs=trained.mean_outputs, spliced_model=trained.healed_model, progress=progress,
            exclude_token_ids=excluded_token_ids(recipe.data, plan.tokenizer),
        )
        plot_loss_curve([folder.train_log, folder.heal_log], stage.plots_dir / LOSS_PLOT)
        metrics["train"] = {"steps": trained.steps, "tokens": trained.steps * recipe.train.tokens_per_step}
        if trained.init_metrics is not None:
            metrics["init"] = trained.init_metrics
        if trained.heal_summary is not None:
            metrics["heal"] = trained.heal_summary
            model = trained.healed_model.cpu()
        else:
            # Saved in float32 whatever dtype produced the activations (`.float()` is a no-op for a float32 base).
            model = splice(base.cpu().float(), {i: m.cpu() for i, m in trained.layers.items()})
        model.save_pretrained(stage.path)
        plan.tokenizer.save_pretrained(stage.path)
        metrics["recipe_summary"] = recipe_summary(recipe, trained.steps)  # the card's Training rows
        if plan.lm_eval is not None:
            metrics["lm_eval"] = plan.lm_eval.run(
                model, base, plan.tokenizer, stage.path, device=accelerator.device, model_name=str(folder.root),
                base_name=recipe.base_model, log=say if progress else None,
            )
        nulled = stage.write_metrics(metrics)
        if nulled:
            raise RunFailed(
                f"the evaluation of the trained model gave non-finite values ({', '.join(nulled[:5])}), so the "
                f"result is broken and was not published; the training checkpoint in {folder.checkpoint_dir} is "
                "kept. Check train.precision / dtype (bf16 overflow), or lower train.lr and start over with --restart"
            )
        stage.write_yaml(RESOLVED_RECIPE, recipe_to_dict(recipe))
        stage.write_json(PROVENANCE, provenance(recipe, device=accelerator.device))
        refresh_model_card(stage.path)  # from config.json, metrics.json and provenance.json, as `expertize eval` does
        folder.publish(stage)


def activation_batches(
    recipe: Recipe, base, tokenizer, layer_ids: list[int], total_steps: int, device: torch.device,
    *, rank: int = 0, world_size: int = 1,
) -> ActivationBatches:
    """The recipe's training stream: packed train split -> captured (x, y) at `layer_ids` -> shuffled step batches."""
    train, data = recipe.train, recipe.data
    return ActivationBatches(
        MlpCapture(base, layer_ids),
        lambda start: iter_sequences(data, tokenizer, split="train", start_sequence=start),
        context_length=data.context_length,
        tokens_per_step=train.tokens_per_step,
        # Never buffer beyond the run's budget (the stream ends there).
        shuffle_buffer_tokens=min(train.shuffle_buffer_tokens, total_steps * train.tokens_per_step),
        capture_batch_sequences=train.capture_batch_sequences,
        seed=train.seed,
        device=device,
        rank=rank,
        world_size=world_size,
        exclude_token_ids=excluded_token_ids(data, tokenizer),
    )


def upcycle_summary(folder: str | Path) -> str:
    """The key results of a finished run folder, a few lines for the end of `expertize upcycle`."""
    return "\n".join(f"expertize: {line}" for line in load_metrics(folder).summary_lines())


def _is_main_rank() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"
