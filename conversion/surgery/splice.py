"""Splicing: build an expertize model from a base checkpoint and trained sparse layers, and save it.

Like nanoGPT's `from_pretrained`: every key of the new model is accounted for — native weights are copied from the base
under their own names and shapes (checked one by one), the replaced MLPs' weights are dropped, and the sparse layers'
weights are inserted. Nothing else changes.
"""

import copy
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from expertize.modeling import SparseLayer, SparseSpec

from ..publishing.run_folder import staging_folder
from .families import EXPERTIZE_PREFIX, base_family, family_info

__all__ = [
    "EXPERTIZE_PREFIX",
    "base_family",
    "expertize_config",
    "load_base_model",
    "load_expertize_model",
    "save_model",
    "splice",
    "splice_and_save",
]

# Config keys that describe the base class, not the architecture: the expertize config sets its own.
_CLASS_KEYS = ("model_type", "architectures", "auto_map", "transformers_version", "sparse_layers")


def load_base_model(
    base: str | os.PathLike | PreTrainedModel, dtype: torch.dtype | None = None, **placement: Any
) -> PreTrainedModel:
    """A causal LM from a hub id, a local dir or an already loaded module (returned as is). `placement`:
    accelerate's loading arguments (device_map, max_memory, offload_folder: surgery/placement.py)."""
    if isinstance(base, PreTrainedModel):
        return base
    if local_model_type(base).startswith(EXPERTIZE_PREFIX):
        return load_expertize_model(base, dtype=dtype, **placement)
    config = AutoConfig.from_pretrained(base)
    base_family(config.model_type)  # fail before loading weights
    return AutoModelForCausalLM.from_pretrained(base, dtype=dtype, **placement)


def local_model_type(path: str | os.PathLike) -> str:
    """model_type from a local folder's config.json ("" for hub ids or folders without one)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return ""
    return json.loads(config_file.read_text(encoding="utf-8")).get("model_type", "")


def load_expertize_model(path: str | os.PathLike, dtype: torch.dtype | None = None, **placement: Any) -> PreTrainedModel:
    """Load a saved expertize model with this library's classes (no remote code needed in-process)."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a saved model folder: it has no config.json")
    # AutoConfig would ask for trust_remote_code for our model_type; the family is all we need from config.json.
    model_type = local_model_type(path)
    if not model_type.startswith(EXPERTIZE_PREFIX):
        raise ValueError(f"{path} is not an expertize model (config.json has model_type {model_type!r})")
    return family_info(model_type).causal_lm_class.from_pretrained(path, dtype=dtype, **placement)


def expertize_config(base_config, specs: Mapping[int, SparseSpec]):
    """The expertize config for `base_config` with `specs` at their layers (added to any existing sparse layers)."""
    family = family_info(base_config.model_type)
    fields = {k: v for k, v in base_config.to_dict().items() if k not in _CLASS_KEYS}
    sparse_layers = dict(getattr(base_config, "sparse_layers", {}) or {})
    sparse_layers.update({str(i): spec.to_dict() for i, spec in specs.items()})
    return family.config_class(sparse_layers=sparse_layers, **fields)


def splice(
    base: str | os.PathLike | PreTrainedModel,
    layers: Mapping[int, SparseLayer],
    *,
    dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """Return an expertize causal LM: `base` with `.mlp` of each layer in `layers` replaced by that sparse layer.

    `base` is a hub id, a local dir or a loaded causal LM (GPT-2, GPT-NeoX/Pythia, Llama, Mistral, Qwen2, or an
    expertize model, whose existing sparse layers are kept unless replaced). The sparse layers are copied, not shared.
    """
    base_model = load_base_model(base, dtype=dtype)
    for index, layer in layers.items():
        if not isinstance(layer, SparseLayer):
            raise TypeError(
                f"layer {index}: expected a sparse layer (expertize.modeling.SparseLayer), got {type(layer).__name__}"
            )
    family = family_info(base_model.config.model_type)
    config = expertize_config(base_model.config, {int(i): layer.spec for i, layer in layers.items()})
    model = family.causal_lm_class(config).to(dtype=next(base_model.parameters()).dtype)

    state = _spliced_state_dict(model, base_model, {int(i): m for i, m in layers.items()}, family.blocks_path)
    model.load_state_dict(state, strict=True)
    model.generation_config = copy.deepcopy(base_model.generation_config)
    model.config.name_or_path = base_model.config.name_or_path
    return model.eval() if not base_model.training else model


def _spliced_state_dict(
    model: nn.Module, base_model: nn.Module, layers: dict[int, SparseLayer], blocks_path: str
) -> dict[str, torch.Tensor]:
    target = model.state_dict()
    replaced = tuple(f"{blocks_path}.{i}.mlp." for i in layers)
    state = {k: v for k, v in base_model.state_dict().items() if not k.startswith(replaced)}
    for index, layer in layers.items():
        state.update({f"{blocks_path}.{index}.mlp.{k}": v for k, v in layer.state_dict().items()})
    missing = sorted(set(target) - set(state))
    unexpected = sorted(set(state) - set(target))
    if missing or unexpected:
        raise ValueError(
            f"cannot splice: the base checkpoint does not fit the expertize model; missing keys {missing[:5]}, "
            f"unexpected keys {unexpected[:5]}"
        )
    for key, value in state.items():
        if value.shape != target[key].shape:
            raise ValueError(f"cannot splice: {key} has shape {tuple(value.shape)} in the source but the expertize "
                             f"model expects {tuple(target[key].shape)}")
    return state


def save_model(model: PreTrainedModel, output_dir: str | os.PathLike, tokenizer=None, overwrite: bool = False) -> Path:
    """Save model (safetensors + remote-code files), tokenizer and generation config to `output_dir`, atomically:
    everything is written to a temporary sibling folder that replaces `output_dir` only once complete.

    `tokenizer` defaults to the base model's, loaded from where `splice` recorded it (`config.name_or_path`): every
    command that reads the folder (inspect, specialize, eval) needs one. When it cannot be loaded, nothing is written
    and the error says to pass it; `tokenizer=False` saves the model alone."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not overwrite:
        raise FileExistsError(f"{output_dir} already exists; choose another folder or pass overwrite=True")
    if tokenizer is None:
        tokenizer = base_tokenizer(model)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(output_dir.parent, f".{output_dir.name}.")  # becomes the folder: as mkdir makes one
    try:
        model.save_pretrained(staging)
        if tokenizer is not False:
            tokenizer.save_pretrained(staging)
        stale = [p.name for p in staging.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        assert not stale, f"non-safetensors weights written: {stale}"
        if output_dir.exists():
            shutil.rmtree(output_dir)
        os.replace(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output_dir


def base_tokenizer(model: PreTrainedModel):
    """The tokenizer of the model `model` was spliced from (`config.name_or_path`: a folder or a Hub id); a
    ValueError naming the fix when there is none to load."""
    source = getattr(model.config, "name_or_path", "") or ""
    try:
        if source:
            return AutoTokenizer.from_pretrained(source)
        problem = "the model records no base (config.name_or_path is empty)"
    except (OSError, ValueError) as e:
        problem = f"the base model's tokenizer cannot be loaded from {source!r} ({type(e).__name__})"
    raise ValueError(
        f"save_model: no tokenizer given and {problem}; pass it, save_model(model, dir, tokenizer) (inspect, "
        "specialize and eval read it), or save the model alone with tokenizer=False"
    )


def splice_and_save(
    base: str | os.PathLike | PreTrainedModel,
    layers: Mapping[int, SparseLayer],
    output_dir: str | os.PathLike,
    *,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> PreTrainedModel:
    """`splice` then `save_model`; the tokenizer defaults to the base's when `base` is a path or hub id."""
    if tokenizer is None and not isinstance(base, PreTrainedModel):
        tokenizer = AutoTokenizer.from_pretrained(base)
    model = splice(base, layers, dtype=dtype)
    save_model(model, output_dir, tokenizer=tokenizer, overwrite=overwrite)
    return model
