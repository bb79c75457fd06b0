"""`expertize capture` loads the base only as deep as its last target layer (conversion/surgery/trunk.py): the same
pairs as the whole model gives, the blocks it loaded in cache.json, a cache that trains."""

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from expertize.conversion.capture import capture_activations
from expertize.conversion.data.cache import CACHE_MANIFEST, ActivationCache
from expertize.conversion.data.mlp_pairs import MlpCapture, decoder_blocks
from expertize.conversion.data.text import batch_sequences, iter_sequences
from expertize.conversion.recipe import recipe_from_dict
from expertize.conversion.surgery.splice import load_base_model
from expertize.conversion.surgery.trunk import load_base_trunk
from expertize.conversion.upcycle import upcycle
from expertize.modeling import FAMILIES
from tests.conftest import tiny_base_config, tiny_tokenizer


@pytest.fixture
def deep_run(tiny_run):
    """tiny_run on a 4-block Llama, capturing block 1 only, with a small budget and a light evaluation."""
    tmp_path, tree = tiny_run
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_base_config("llama", num_layers=4)).save_pretrained(tree["base_model"])
    tree["layers"] = [1]
    tree["data"]["train_tokens"] = 2048
    tree["eval"].update(generation_prompts=0, histogram=False)
    return tmp_path, tree


def test_a_capture_of_block_1_of_4_loads_two_blocks_and_gives_the_whole_models_pairs(deep_run):
    tmp_path, tree = deep_run
    recipe = recipe_from_dict(tree)
    cache = capture_activations(recipe, tmp_path / "cache", shard_tokens=48 * 16)
    manifest = json.loads((cache / CACHE_MANIFEST).read_text())
    assert manifest["base_loaded"] == {"blocks": [0, 1], "of": 4, "head": False}

    # The reference: the whole causal LM, hooked as a live run hooks it, over the same stream and batches.
    full = load_base_model(tree["base_model"]).eval()
    capture = MlpCapture(full, [1])
    sequences = torch.stack(list(iter_sequences(recipe.data, tiny_tokenizer())))  # (S, T)
    xs, ys = zip(*(capture(batch)[1] for batch in batch_sequences(sequences, 16)))
    stored, ids = ActivationCache(cache).read(list(range(len(sequences))), [1], torch.device("cpu"), torch.float32)
    assert torch.equal(ids, sequences)
    assert torch.equal(stored[1][0], torch.cat(xs)) and torch.equal(stored[1][1], torch.cat(ys))

    # The record is never compared: the cache serves the recipe, and so does one written before the record existed.
    assert ActivationCache(cache).mismatches(recipe, [1]) == []
    del manifest["base_loaded"], manifest["processes"]
    (cache / CACHE_MANIFEST).write_text(json.dumps(manifest))
    assert ActivationCache(cache).mismatches(recipe, [1]) == []

    run = upcycle(recipe_from_dict({**tree, "data": {**tree["data"], "activation_cache": str(cache)}}),
                  progress=False)
    metrics = json.loads((Path(run) / "metrics.json").read_text())
    assert metrics["train"]["steps"] == 8 and math.isfinite(metrics["layers"]["1"]["fvu"])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_trunk_gives_the_whole_models_pairs_in_every_family(family, tmp_path, transformers_logs):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_base_config(family, num_layers=4)).save_pretrained(tmp_path)
    trunk, loaded = load_base_trunk(tmp_path, 2)
    assert loaded == {"blocks": [0, 1], "of": 4, "head": False}
    assert not _load_reports(transformers_logs)  # the blocks and the head left out on purpose are no problem to report
    assert len(decoder_blocks(trunk)) == 2
    ids = torch.randint(4, 99, (3, 16), generator=torch.Generator().manual_seed(0))
    whole = MlpCapture(load_base_model(tmp_path).eval(), [0, 1])(ids)
    part = MlpCapture(trunk.eval(), [0, 1])(ids)
    for i in (0, 1):
        assert torch.equal(whole[i][0], part[i][0]) and torch.equal(whole[i][1], part[i][1]), (family, i)


@pytest.fixture
def transformers_logs(caplog):
    """caplog with transformers' own records: its library logger does not propagate to the root logger (where caplog
    listens) unless some other package turned propagation on, as the interop extra's tools do."""
    logger = logging.getLogger("transformers")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def _load_reports(caplog) -> list[str]:
    records = {id(r): r for r in caplog.records}.values()  # once, also where the record propagates to the root too
    return [r.getMessage() for r in records if "LOAD REPORT" in r.getMessage()]


def test_a_checkpoint_missing_a_loaded_weight_is_still_reported(tmp_path, transformers_logs):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_base_config("llama", num_layers=4)).save_pretrained(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.0.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    load_base_trunk(tmp_path, 2)
    [report] = _load_reports(transformers_logs)
    assert "MISSING" in report and "layers.0.mlp.up_proj.weight" in report, report
