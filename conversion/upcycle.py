"""`expertize upcycle RECIPE`: distil sparse layers for the chosen MLPs, evaluate, and write a publishable folder.

    recipe -> base model + tokenizer -> packed text -> captured (x, y) -> train -> evaluate -> splice -> save

The output folder loads with `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` and also holds
metrics.json, recipe.resolved.yaml, provenance.json (versions, seed, git commit), plots/ and README.md (model card);
with `eval.lm_eval_tasks`, lm_eval/ holds the harness's files for the base and the spliced model (benchmark.py).
While training, `checkpoint/` holds the resumable state; running the same command again resumes from it.
"""

import json
import platform
import shutil
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path

import torch
import yaml
from transformers import AutoTokenizer

from expertize import __version__
from expertize.modeling import FAMILIES, SparseLayer, build_sparse_layer

from .data.activations import ActivationBatches
from .harness.folder_eval import LmEvalPlan
from .data.capture import MlpCapture, decoder_blocks
from .data.text import iter_sequences, load_eval_sequences, token_budget_to_sequences
from .surgery.dense_init import init_moe_from_dense
from .evaluation.evaluate import evaluate_sparse_layers, spliced_ce
from .training.heal import Healer
from .publishing.model_folder import refresh_model_card
from .recipe.schema import Recipe, recipe_to_dict, resolve_layer_spec, resolve_layers
from .surgery.splice import base_family, load_base_model, splice
from .training.engine import Trainer

RESOLVED_RECIPE = "recipe.resolved.yaml"
PACKAGES = ("torch", "transformers", "accelerate", "datasets", "safetensors", "huggingface-hub", "peft", "lm-eval")


def upcycle(recipe: Recipe, *, progress: bool = True) -> Path:
    """Run the whole pipeline for `recipe`; returns the output folder. Resumes an interrupted run in place."""
    from accelerate import Accelerator

    out = Path(recipe.output_dir)
    lm_eval_plan = LmEvalPlan.from_eval_config(recipe.eval)  # unknown task names fail now, not after training
    _prepare_output_dir(out, recipe)
    accelerator = Accelerator(cpu=recipe.train.device == "cpu")
    torch.manual_seed(recipe.train.seed)

    base = load_base_model(recipe.base_model, dtype=getattr(torch, recipe.dtype)).to(accelerator.device).eval()
    base.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(recipe.base_model, revision=recipe.base_revision)
    family = base_family(base.config.model_type)
    shape = FAMILIES[family][0].mlp_shape(base.config)
    layer_ids = resolve_layers(recipe, base.config.num_hidden_layers)
    spec = resolve_layer_spec(recipe.layer, shape)
    layers: dict[int, SparseLayer] = {i: build_sparse_layer(spec) for i in layer_ids}
    init_metrics = eval_sequences = None
    if recipe.layer.init != "default":
        _init_from_dense(recipe, base, layers)
        if accelerator.is_main_process:
            eval_sequences = load_eval_sequences(recipe.data, tokenizer)  # reused by the final evaluation
            init_metrics = spliced_ce(base, layers, eval_sequences, recipe.eval.batch_sequences)

    train, data = recipe.train, recipe.data
    if recipe.heal is not None and accelerator.num_processes > 1:
        raise ValueError(
            f"heal: end-to-end healing runs on one process, but this run has {accelerator.num_processes}; run the "
            "recipe without torchrun / accelerate launch, or drop the heal: section"
        )
    total_steps, mean_outputs = 0, None
    if train.distill:
        total_steps = data.train_tokens // train.tokens_per_step
        if total_steps < 1:
            raise ValueError(
                f"data.train_tokens={data.train_tokens} is less than one step of train.tokens_per_step="
                f"{train.tokens_per_step}; raise the budget or lower tokens_per_step"
            )
        batches = activation_batches(
            recipe, base, tokenizer, layer_ids, total_steps, accelerator.device,
            rank=accelerator.process_index, world_size=accelerator.num_processes,
        )
        trainer = Trainer(
            layers, batches, train, total_steps=total_steps, run_dir=out, accelerator=accelerator, progress=progress,
            init_output_bias=recipe.layer.init == "default",
        )
        trainer.fit()
        trainer.save_checkpoint()  # a run killed during evaluation resumes straight into it
        mean_outputs = trainer.state.mean_outputs
    if not accelerator.is_main_process:
        return out

    healed = healer = None
    if recipe.heal is not None:
        # The spliced model trains in float32 whatever dtype produced the activations.
        spliced = splice(base, layers).float()
        spliced.config.router_aux_loss_coef = recipe.heal.aux_loss_coef
        healer = Healer(
            spliced, base, tokenizer, data, recipe.heal,
            family=family, run_dir=out, device=accelerator.device, precision=train.precision, progress=progress,
        )
        healed = healer.fit()
        layers = healed.sparse_layers()

    if eval_sequences is None:
        eval_sequences = load_eval_sequences(data, tokenizer)
    staging = Path(tempfile.mkdtemp(prefix=".final.", dir=out))
    try:
        metrics = evaluate_sparse_layers(
            base,
            layers,
            eval_sequences,
            recipe.eval,
            plots_dir=staging / "plots",
            mean_outputs=mean_outputs,
            spliced_model=healed,
            progress=progress,
        )
        metrics["train"] = {"steps": total_steps, "tokens": total_steps * train.tokens_per_step}
        if init_metrics is not None:
            metrics["init"] = {"method": recipe.layer.init, **init_metrics}
        if healer is not None:
            metrics["heal"] = healer.summary()
            model = healed.cpu()
        else:
            # Saved in float32 whatever dtype produced the activations (`.float()` is a no-op for a float32 base).
            model = splice(base.cpu().float(), {i: m.cpu() for i, m in layers.items()})
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        metrics["recipe_summary"] = recipe_summary(recipe, total_steps)  # the card's Training rows, for refreshes
        if lm_eval_plan is not None:
            metrics["lm_eval"] = lm_eval_plan.run(
                model, base, tokenizer, staging, device=accelerator.device, model_name=str(out),
                base_name=recipe.base_model, log=_tqdm_write if progress else None,
            )
        (staging / "metrics.json").write_text(json.dumps(metrics, indent=2), encoding="utf-8")
        (staging / RESOLVED_RECIPE).write_text(
            yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, allow_unicode=True), encoding="utf-8"
        )
        (staging / "provenance.json").write_text(json.dumps(provenance(recipe), indent=2), encoding="utf-8")
        refresh_model_card(staging)  # from config.json, metrics.json and provenance.json, as `expertize eval` does
        _publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _tqdm_write(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"expertize: {message}")


def _init_from_dense(recipe: Recipe, base, layers: dict[int, SparseLayer]) -> None:
    """Overwrite the layers with the base MLPs' weights (recipe `layer.init: split | copy`)."""
    blocks = decoder_blocks(base)
    for i, layer in layers.items():
        init_moe_from_dense(
            layer,
            blocks[i].mlp,
            recipe.layer.init,
            clustering=recipe.layer.init_clustering,
            noise_std=recipe.layer.init_noise,
            seed=recipe.train.seed + i,
            # The recipe states the activation (auto keeps the MLP's), so a switch to ReLU here is intended.
            allow_activation_change=True,
        )


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
    )


def _prepare_output_dir(out: Path, recipe: Recipe) -> None:
    """Fresh folder, or resume a run of the *same* recipe; never mix two runs in one folder."""
    resolved = recipe_to_dict(recipe)
    saved = out / "checkpoint" / RESOLVED_RECIPE
    if (out / "metrics.json").exists():
        raise FileExistsError(f"{out} already holds a finished run (metrics.json); choose another output_dir")
    if saved.is_file():
        previous = yaml.safe_load(saved.read_text(encoding="utf-8"))
        changed = _diff_keys(previous, resolved)
        if changed:
            raise ValueError(
                f"{out} holds an unfinished run of a different recipe (differs at {', '.join(changed)}); resume it "
                "with the same recipe, or choose another output_dir"
            )
        return
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not an expertize run folder; choose another output_dir")
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(yaml.safe_dump(resolved, sort_keys=False, allow_unicode=True), encoding="utf-8")


def _diff_keys(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [k for key in sorted(set(a) | set(b)) for k in _diff_keys(a.get(key), b.get(key), f"{prefix}{key}.")]
    return [] if a == b else [prefix.rstrip(".")]


def _publish(staging: Path, out: Path) -> None:
    """Move the finished files into the output folder (metrics.json last: it marks the run complete)."""
    names = sorted(p.name for p in staging.iterdir() if p.name != "metrics.json") + ["metrics.json"]
    for name in names:
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        (staging / name).replace(target)
    shutil.rmtree(out / "checkpoint", ignore_errors=True)


def recipe_summary(recipe: Recipe, total_steps: int) -> dict:
    data, train, heal = recipe.data, recipe.train, recipe.heal
    source = data.name if data.source == "hub" else ", ".join(Path(p).name for p in data.paths)
    healing = {}
    if heal is not None:
        rest = f"LoRA r={heal.lora_r} on {heal.lora_target_modules}, merged" if heal.rest == "lora" else "frozen"
        healing = {
            "healing": f"end to end, {heal.objective} objective, {heal.tokens:,} tokens, lr {heal.lr}; rest of the "
            f"model {rest}",
        }
    return {
        "training tokens": total_steps * train.tokens_per_step,
        "steps": total_steps,
        "tokens per step": train.tokens_per_step,
        "context length": data.context_length,
        "data": f"{data.source}: {source}",
        "loss": train.loss,
        "optimizer": f"AdamW (lr {train.lr}, warmup {train.warmup_steps}, {train.schedule})",
        "precision": train.precision,
        "seed": train.seed,
        **healing,
    }


def provenance(recipe: Recipe) -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "expertize": __version__,
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "packages": versions,
        "seed": recipe.train.seed,
        "base_model": recipe.base_model,
        "base_revision": recipe.base_revision,
        "eval_sequences_per_token_budget": token_budget_to_sequences(recipe.data.eval_tokens, recipe.data.context_length),
    }


def _git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
