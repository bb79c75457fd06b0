"""Everything `expertize upcycle` can check before it touches the output folder or trains a step.

A run that fails after claiming its folder locks it (the corrected command would be refused as "a different
recipe") and a run that fails after training wastes the training. So every check that needs only configs, a
tokenizer and the corpus runs here, first: the base model's config (not its weights), the layer indices and the
sparse layer spec against the MLP's shape (K > N, sizes), the context length against the base's positions, the
device, the memory the layers will need, the output folder (writable, with room for the model and checkpoints), the
corpus (enough tokens for the budget, a non-empty held-out split, a working tokenizer) and the lm-eval task names.

The result, a `RunPlan`, holds what the later stages need so that nothing is resolved twice.
"""

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from expertize.modeling import MlpShape, SparseSpec

from .checks import check_output_location
from .errors import ExpertizeError
from .evaluation.stacking import check_not_sparse
from .harness.folder_eval import LmEvalPlan
from .data.text import stream_train_tokens
from .recipe import Recipe, resolve_layer_spec, resolve_layers
from .surgery.families import EXPERTIZE_PREFIX, base_family, check_context_length, family_info, mlp_shape
from .surgery.placement import BasePlacement, resolve_placement
from .surgery.splice import local_model_type

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
BYTES_PER_TRAINED_PARAMETER = 16
"""fp32 weight + gradient + AdamW's two moments: what one trained parameter costs during distillation."""


class BaseModelError(ExpertizeError):
    """`base_model` cannot be used: missing, not a causal LM expertize supports, or not reachable offline."""


@dataclass
class RunPlan:
    """What preflight resolved; the stages read it instead of resolving again."""

    recipe: Recipe
    base_config: Any
    """The base model's transformers config (weights not loaded yet)."""
    family: str
    shape: MlpShape
    layer_ids: list[int]
    spec: SparseSpec
    device: torch.device
    distill_steps: int
    lm_eval: LmEvalPlan | None
    tokenizer: Any
    placement: BasePlacement | None = None
    """The base spread over devices (recipe device_map; surgery/placement.py), or None: on `device`."""


def base_model_config(base_model: str, revision: str | None = None):
    """The config of `base_model` (a local folder or a Hub id), with errors that say what to do.

    An expertize folder is a valid base (sparse layers are added to the ones it has); it is read with this
    library's classes, never through remote code (which would stop to ask whether to trust it).
    """
    from transformers import AutoConfig

    path = Path(os.path.expanduser(base_model))
    if path.exists():
        if not path.is_dir():
            raise BaseModelError(f"base_model {base_model!r} is a file; point it at a model folder or a Hub id")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise BaseModelError(
                f"base_model {base_model!r} is a folder without config.json, so it holds no transformers model; "
                "point it at a folder written by save_pretrained (config.json + weights) or at a Hub id"
            )
        model_type = local_model_type(path)
        if model_type.startswith(EXPERTIZE_PREFIX):
            return family_info(model_type).config_class.from_pretrained(path)
        return AutoConfig.from_pretrained(path)
    if base_model.startswith((".", "/", "~")) or base_model.count("/") > 1 or not _HUB_ID.match(base_model):
        raise BaseModelError(
            f"base_model {base_model!r} does not exist (relative paths are relative to {os.getcwd()!r}); fix the "
            "path, or give a Hub id such as 'gpt2' or 'EleutherAI/pythia-410m'"
        )
    try:
        return AutoConfig.from_pretrained(base_model, revision=revision)
    except OSError as e:
        if _offline():
            raise BaseModelError(
                f"base_model {base_model!r} is not a local folder and is not in the Hugging Face cache, and the Hub "
                "is offline (HF_HUB_OFFLINE=1); download it where you have a connection (`hf download "
                f"{base_model}`), or point base_model at a local copy"
            ) from None
        raise BaseModelError(
            f"base_model {base_model!r} could not be loaded from the Hugging Face Hub ({_first_line(e)}); check the "
            "id (and base_revision), your connection and `hf auth login` for gated models"
        ) from None
    except ValueError as e:  # an architecture transformers does not know
        raise BaseModelError(f"base_model {base_model!r}: {_first_line(e)}") from None


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_tokenizer(base_model: str, revision: str | None = None):
    """The base model's tokenizer; never runs remote code (an expertize folder holds a standard tokenizer)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(base_model, revision=revision, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise BaseModelError(
            f"the tokenizer of base_model {base_model!r} could not be loaded ({_first_line(e)}); the folder or repo "
            "needs the tokenizer files saved next to the model (tokenizer.save_pretrained)"
        ) from None


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on `device` (None when unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def check_memory(
    spec: SparseSpec | list[SparseSpec], num_layers: int, device: torch.device, free: int | None = None
) -> int:
    """Refuse sparse layers whose training state cannot fit on `device`; returns the estimate in bytes. A list of
    specs: variants trained together (all on the device at once).

    The estimate counts only the trained layers' fp32 weights, gradients and AdamW moments, a lower bound of what
    the run needs, so a refusal is never a false alarm."""
    specs = spec if isinstance(spec, list) else [spec]
    parameters = sum(s.num_parameters() for s in specs)
    need = parameters * BYTES_PER_TRAINED_PARAMETER * num_layers
    free = available_memory(device) if free is None else free
    if free is not None and need > free:
        per = f"{parameters:,} parameters per layer" + (f" over {len(specs)} variants" if len(specs) > 1 else "")
        fewer = ", train fewer variants at once" if len(specs) > 1 else ""
        raise ExpertizeError(
            f"the sparse layers need at least {need / 2**30:.1f} GiB on {device} ({per} x {num_layers} layer(s) x "
            f"{BYTES_PER_TRAINED_PARAMETER} bytes for weights, gradients and AdamW state) but only "
            f"{free / 2**30:.1f} GiB is free; make the layer smaller (layer.match_transcoder, layer.num_experts / "
            f"num_latents), convert fewer layers{fewer}, or use a device with more memory"
        )
    return need


def plan_variants(recipes: list[Recipe], *, world_size: int = 1, variants: bool = False) -> list[RunPlan]:
    """`plan_run` of the first recipe, then of each other variant what differs (its layer spec, checked against
    the same MLP shape), and the memory of all variants together. The variants share everything else (see
    recipe/variants.py), so the corpus is read and checked once. `variants`: the recipes are a recipe's variants
    (a refused warm-up names its variant)."""
    # Each recipe's warm-up against its stages' steps (configs only: first of all).
    for recipe in recipes:
        try:
            recipe.check_warmups()
        except ExpertizeError as e:
            if not (variants or len(recipes) > 1):
                raise
            raise type(e)(f"variant {Path(recipe.output_dir).name!r}: {e}") from None
    # A folder that cannot be written is the cheapest thing to find out: before the corpus is read. (Variants'
    # folders, output_dir/NAME, all lie on the same disk.)
    check_output_location(recipes[0].output_dir, what="output_dir")
    first = plan_run(recipes[0], world_size=world_size, check_layer_memory=len(recipes) == 1)
    plans = [first]
    for recipe in recipes[1:]:
        try:
            spec = resolve_layer_spec(recipe.layer, first.shape, recipe.train.balance)
        except ExpertizeError as e:
            raise type(e)(f"variant {Path(recipe.output_dir).name!r}: {e}") from None
        plans.append(dataclasses.replace(first, recipe=recipe, spec=spec))
    if len(plans) > 1:
        check_memory([plan.spec for plan in plans], len(first.layer_ids), first.device)
    check_output_location(recipes[0].output_dir, what="output_dir", need_bytes=output_bytes(plans))
    return plans


def output_bytes(plans: list[RunPlan]) -> int:
    """A lower bound of what a run writes into its output folder (so that a refusal is never a false alarm): per
    model the sparse layers' weights and their checkpoint (weights and AdamW's two moments, fp32), and the base
    model's weights, as large as its local weight files at the recipe's dtype at most."""
    per_model = 0
    first = plans[0]
    base = Path(os.path.expanduser(first.recipe.base_model))
    if base.is_dir():
        files = [f for pattern in ("*.safetensors", "pytorch_model*.bin") for f in base.glob(pattern)]
        on_disk = sum(f.stat().st_size for f in files)
        itemsize = getattr(torch, first.recipe.dtype).itemsize
        per_model += on_disk * min(1.0, itemsize / 4)
    layers = len(first.layer_ids)
    return int(sum(per_model + plan.spec.num_parameters() * layers * (4 + 12) for plan in plans))


def plan_run(recipe: Recipe, *, world_size: int = 1, check_layer_memory: bool = True) -> RunPlan:
    """Resolve and check everything about `recipe` that needs no training; raises ExpertizeError on a problem."""
    from .data.corpus_check import check_data
    from .training.compute import check_precision
    from .device import resolve_device

    lm_eval = LmEvalPlan.from_eval_config(recipe.eval)  # unknown task names fail now, not after training
    config = base_model_config(recipe.base_model, recipe.base_revision)
    family = base_family(config.model_type)
    shape = mlp_shape(config)
    layer_ids = resolve_layers(recipe, config.num_hidden_layers)
    check_not_sparse(recipe.base_model, config, layer_ids)  # an expertize base: only its dense layers
    spec = resolve_layer_spec(recipe.layer, shape, recipe.train.balance)
    device = resolve_device(recipe.train.device)
    check_precision(recipe, device)
    model = f"base_model {recipe.base_model!r}"
    check_context_length(recipe.data.context_length, config, setting="data.context_length", model=model)
    generated = recipe.eval.prompt_tokens + recipe.eval.continuation_tokens  # the greedy-continuation match
    check_context_length(generated, config, setting="eval.prompt_tokens + eval.continuation_tokens", model=model)
    placement = resolve_placement(recipe, config, layer_ids)  # a map that cannot run the target layers: refused now
    if check_layer_memory:
        check_memory(spec, len(layer_ids), device)

    train = recipe.train
    distill_steps = recipe.distill_steps()
    if train.distill and distill_steps < 1:
        raise ExpertizeError(
            f"data.train_tokens={recipe.data.train_tokens} is less than one step of train.tokens_per_step="
            f"{train.tokens_per_step}; raise the budget or lower tokens_per_step"
        )
    if recipe.heal is not None and world_size > 1:
        raise ExpertizeError(
            f"heal: end-to-end healing runs on one process, but this run has {world_size}; run the recipe without "
            "torchrun / accelerate launch, or drop the heal: section"
        )
    tokenizer = load_tokenizer(recipe.base_model, recipe.base_revision)
    # The train split must cover the larger of the two budgets that read it (distillation's and healing's).
    # Distillation on several processes reads a little more (data.text.stream_train_tokens).
    budgets = {"data.train_tokens": stream_train_tokens(recipe.data, world_size) if train.distill else 0,
               "heal.tokens": recipe.heal.tokens if recipe.heal is not None else 0}
    key = max(budgets, key=budgets.get)
    check_data(recipe.data, tokenizer, train_tokens=budgets[key], train_key=key)
    return RunPlan(
        recipe=recipe,
        base_config=config,
        family=family,
        shape=shape,
        layer_ids=layer_ids,
        spec=spec,
        device=device,
        distill_steps=distill_steps,
        lm_eval=lm_eval,
        tokenizer=tokenizer,
        placement=placement,
    )
