"""The base model loaded only as deep as a capture reads: the embeddings and decoder blocks 0..depth-1, without the
later blocks, the LM head and the logit soft cap (`expertize capture`; MlpCapture stops the forward after the last
target MLP, so nothing above it ever runs).

How: transformers builds the model from a copy of its config with `num_hidden_layers = depth` (and the per-layer
lists sized to it), as the headless class (AutoModel: no LM head), and loads its weights from the unchanged
checkpoint; the later blocks' and the head's tensors are checkpoint keys the model has no place for, so they are
never read into memory. The blocks that are loaded are the full model's, computed by the same code, so the
activations they give are bit for bit the full model's (tests/test_capture_partial.py).

The headless model is wrapped (`BaseTrunk`) under the causal LM's attribute name (`model`, `transformer`, `gpt_neox`),
so that `decoder_blocks` and the capture hooks find block i at the path they use on the causal LM.
"""

import contextlib
import copy
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PreTrainedModel

from .families import EXPERTIZE_PREFIX, base_family, family_info
from .placement import BasePlacement
from .splice import load_base_model, local_model_type

__all__ = ["BaseTrunk", "PER_LAYER_KEYS", "load_base_trunk", "truncated_config"]

PER_LAYER_KEYS = ("layer_types", "mlp_layer_types")
"""Config lists with one entry per decoder block (transformers 5: Qwen2/3's and Gemma-2/3's attention kinds; its
config validation wants them as long as num_hidden_layers), cut to the blocks that are built."""


class BaseTrunk(nn.Module):
    """A headless base model (its first blocks) under the causal LM's attribute for it, so that the causal LM's
    blocks path (`model.layers`, `transformer.h`) reaches its blocks. Its forward is the headless model's."""

    def __init__(self, headless: PreTrainedModel, attribute: str) -> None:
        super().__init__()
        self.config = headless.config
        self._attribute = attribute
        self.add_module(attribute, headless)

    def forward(self, input_ids: torch.Tensor, **kwargs) -> Any:
        return getattr(self, self._attribute)(input_ids=input_ids, **kwargs)


def truncated_config(config, depth: int):
    """A copy of `config` describing only its first `depth` decoder blocks."""
    blocks = config.num_hidden_layers
    config = copy.deepcopy(config)
    config.num_hidden_layers = depth  # GPT-2's n_layer through its attribute_map
    for key in PER_LAYER_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)) and len(value) == blocks:
            setattr(config, key, list(value[:depth]))
    return config


def load_base_trunk(
    base: str | os.PathLike | PreTrainedModel, depth: int, dtype: torch.dtype | None = None,
    placement: BasePlacement | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """(the base model as deep as `depth` blocks, what was loaded: {"blocks": [0, depth - 1], "of": the base's
    blocks, "head": whether the LM head was loaded}). A module already loaded and a saved expertize model are
    returned whole (`load_base_model`): an expertize config also carries its sparse layers by block index and its
    causal LM class wires them in, so cutting it is not the plain config edit a native base needs, and captures of an
    expertize base (its remaining dense layers) are rare; the record says so."""
    if isinstance(base, PreTrainedModel) or local_model_type(base).startswith(EXPERTIZE_PREFIX):
        model = load_base_model(base, dtype=dtype, **({} if placement is None else placement.load_kwargs()))
        blocks = model.config.num_hidden_layers
        return model, {"blocks": [0, blocks - 1], "of": blocks, "head": True}
    config = AutoConfig.from_pretrained(base)
    base_family(config.model_type)  # fail before loading weights
    blocks = config.num_hidden_layers
    if not 1 <= depth <= blocks:
        raise ValueError(f"cannot load {depth} blocks of {base}: it has {blocks}")
    attribute, _, inner_path = family_info(config.model_type).blocks_path.partition(".")
    with _load_report_held() as held:
        headless, info = AutoModel.from_pretrained(
            base, config=truncated_config(config, depth), dtype=dtype, output_loading_info=True,
            **({} if placement is None else trunk_placement(placement, attribute, inner_path, depth)),
        )
    if _unforeseen(headless, info, inner_path, depth):  # anything but the parts left out on purpose: say it
        for record in held:
            logging.getLogger(record.name).handle(record)
    return BaseTrunk(headless, attribute), {"blocks": [0, depth - 1], "of": blocks, "head": False}


def trunk_placement(placement: BasePlacement, attribute: str, inner_path: str, depth: int) -> dict[str, Any]:
    """The causal LM's placement (its module names: `model.layers.3`) as the headless trunk's loading arguments
    (`layers.3`): entries of the blocks from `depth` on and of the head (outside `attribute`) dropped."""
    later = re.compile(rf"{re.escape(inner_path)}\.(\d+)(\.|$)")
    device_map = {}
    for name, device in placement.device_map.items():
        if name == "" or name == attribute:
            device_map[""] = device
        elif name.startswith(attribute + "."):
            inner = name[len(attribute) + 1:]
            block = later.match(inner)
            if block is None or int(block[1]) < depth:
                device_map[inner] = device
    return {**placement.load_kwargs(), "device_map": device_map}


def _unforeseen(headless: nn.Module, info: dict, inner_path: str, depth: int) -> bool:
    """Whether loading met anything besides the checkpoint keys of the blocks from `depth` on and of the LM head:
    a missing or mismatched weight, or an unused key of the headless model's own parts."""
    if info["missing_keys"] or info["mismatched_keys"] or info.get("error_msgs"):
        return True
    prefix = headless.base_model_prefix
    own = {name for name, _ in headless.named_children()}
    own |= {name for name, _ in headless.named_parameters(recurse=False)}
    later = re.compile(rf"{re.escape(inner_path)}\.(\d+)\.")
    for key in info["unexpected_keys"]:
        inner = key.removeprefix(f"{prefix}.")
        if inner == key and key.split(".")[0] not in own:
            continue  # outside the headless model: the LM head (lm_head, embed_out)
        match = later.match(inner)
        if match is None or int(match[1]) < depth:
            return True
    return False


@contextlib.contextmanager
def _load_report_held() -> Iterator[list[logging.LogRecord]]:
    """Holds back transformers' load report (one warning of modeling_utils' logger) while the trunk loads: it lists
    every key of the blocks left out, which is the point, not a problem. `_unforeseen` decides whether to let it
    through after all."""
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in str(record.msg):
            held.append(record)
            return False
        return True

    logger = logging.getLogger("transformers.modeling_utils")
    logger.addFilter(hold)
    try:
        yield held
    finally:
        logger.removeFilter(hold)
