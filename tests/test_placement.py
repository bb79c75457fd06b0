"""A base spread over devices and disk with accelerate's big-model loading (issue 38): the recipe's device_map,
max_memory and offload_folder. On these CPU machines the "devices" are the CPU and the disk: part of a tiny base is
forced onto the disk, and the run must give the numbers of the plain run (the same weights, metrics and records).
A map that cannot run the target layers is refused before any weight is read."""

import json

import pytest
from safetensors.torch import load_file

from expertize.conversion.errors import ExpertizeError
from expertize.conversion.publishing.run_folder import run_identity
from expertize.conversion.recipe import recipe_from_dict
from expertize.conversion.surgery.splice import load_base_model
from expertize.conversion.upcycle import upcycle
from tests.conftest import tiny_base_config, tiny_tokenizer

from transformers import AutoModelForCausalLM
import torch


@pytest.fixture
def deep_run(tiny_run):
    """tiny_run's recipe on a 4-layer Llama, converting layer 1 only."""
    tmp_path, tree = tiny_run
    torch.manual_seed(0)
    base = tmp_path / "base4"
    AutoModelForCausalLM.from_config(tiny_base_config("llama", num_layers=4)).save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    tree = {**tree, "base_model": str(base), "layers": [1],
            "data": {**tree["data"], "train_tokens": 4096},
            "train": {**tree["train"], "checkpoint_every": 100}}
    return tmp_path, tree


DISK_MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "disk",
            "model.layers.1": "cpu", "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu",
            "lm_head": "cpu"}


def test_a_base_partly_on_disk_gives_the_plain_runs_numbers(deep_run):
    tmp_path, tree = deep_run
    plain = upcycle(recipe_from_dict({**tree, "output_dir": str(tmp_path / "plain")}), progress=False)
    offload = tmp_path / "offload"
    spread = upcycle(recipe_from_dict({**tree, "output_dir": str(tmp_path / "spread"), "device_map": DISK_MAP,
                                       "offload_folder": str(offload)}), progress=False)
    # the disk blocks really hold no weights in memory (safetensors checkpoints are read in place, so the offload
    # folder may stay empty): what the run loaded is what this loads
    held = load_base_model(tree["base_model"], device_map=DISK_MAP, offload_folder=str(offload))
    assert held.model.layers[2].mlp.up_proj.weight.is_meta and not held.model.layers[1].mlp.up_proj.weight.is_meta
    weights = load_file(plain / "model.safetensors"), load_file(spread / "model.safetensors")
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        torch.testing.assert_close(weights[1][key], weights[0][key], rtol=0, atol=1e-6, msg=key)
    metrics = [json.loads((folder / "metrics.json").read_text()) for folder in (plain, spread)]
    assert _numbers(metrics[1]) == pytest.approx(_numbers(metrics[0]), rel=1e-5, abs=1e-7)
    assert metrics[1]["layers"]["1"]["fvu"] > 0 and len(_numbers(metrics[0])) > 50  # a real comparison
    provenance = json.loads((spread / "provenance.json").read_text())
    assert provenance["base_placement"]["device_map"]["model.layers.2"] == "disk"
    # the spliced folder loads as any model folder and holds every layer's weights
    reloaded = AutoModelForCausalLM.from_pretrained(spread, trust_remote_code=True)
    assert type(reloaded.model.layers[1].mlp).__name__ != type(reloaded.model.layers[0].mlp).__name__


def _numbers(tree, key: str = "") -> dict[str, float]:
    """Every number of a metrics.json by its path (strings, e.g. the verdict's words, are compared through them)."""
    if isinstance(tree, dict):
        return {k: v for name, value in tree.items() for k, v in _numbers(value, f"{key}.{name}").items()}
    if isinstance(tree, list):
        return {k: v for i, value in enumerate(tree) for k, v in _numbers(value, f"{key}[{i}]").items()}
    return {key: float(tree)} if isinstance(tree, (int, float)) and not isinstance(tree, bool) else {}


def _refusal(tree, **keys) -> str:
    with pytest.raises(ExpertizeError) as caught:
        upcycle(recipe_from_dict({**tree, **keys}), progress=False)
    return str(caught.value)


def test_a_target_layer_on_disk_is_refused_before_any_work(deep_run):
    tmp_path, tree = deep_run
    on_disk = {**DISK_MAP, "model.layers.1": "disk"}
    message = _refusal(tree, device_map=on_disk, offload_folder=str(tmp_path / "off"))
    assert "model.layers.1 -> disk: layer 1 is a target layer" in message
    assert "place model.layers.1 on a device explicitly" in message
    assert not (tmp_path / "run").exists()  # refused before the run folder was claimed


def test_placement_mistakes_are_named(deep_run):
    tmp_path, tree = deep_run
    assert "offload_folder is not set" in _refusal(tree, device_map=DISK_MAP)
    assert "max_memory is set but device_map is not" in _refusal(tree, max_memory={"cpu": "1GiB"})
    assert "device_map with a heal: section" in _refusal(tree, device_map="auto", heal={"tokens": 1024})
    partial = {k: v for k, v in DISK_MAP.items() if k != "model.layers.1"}
    assert "device_map names no device for layer 1's MLP" in _refusal(
        tree, device_map=partial, offload_folder=str(tmp_path / "off"))


def test_auto_is_resolved_as_transformers_resolves_it_and_checked(deep_run):
    """With too little memory for the CPU, "auto" puts the later blocks on disk: layer 1 still fits and runs; a
    budget that leaves layer 1 on disk is refused naming what "auto" resolved to."""
    from expertize.conversion.preflight import base_model_config
    from expertize.conversion.surgery.placement import resolve_placement

    tmp_path, tree = deep_run
    config = base_model_config(tree["base_model"])
    roomy = resolve_placement(recipe_from_dict({**tree, "device_map": "auto"}), config, [1])
    assert set(map(str, roomy.device_map.values())) == {"cpu"} and not roomy.offloads
    tight = recipe_from_dict({**tree, "device_map": "sequential", "max_memory": {"cpu": 1}, "offload_folder":
                              str(tmp_path / "off")})
    with pytest.raises(ExpertizeError, match=r"device_map: sequential resolved to .*-> disk: layer 1 is a target"):
        resolve_placement(tight, config, [1])


def test_the_placement_is_not_part_of_the_runs_identity(deep_run):
    _, tree = deep_run
    spread = {**tree, "device_map": DISK_MAP, "offload_folder": "/tmp/x", "max_memory": {"cpu": "2GiB"}}
    assert run_identity(tree) == run_identity(spread)


def test_a_capture_with_part_of_the_base_on_disk_writes_the_plain_captures_pairs(deep_run):
    """`expertize capture` loads only blocks 0..1 (surgery/trunk.py) and places them as the causal LM's map says:
    block 0 on disk, block 1 on the CPU; the entries of the blocks it never loads and of the head are dropped."""
    from expertize.conversion.capture import capture_activations
    from expertize.conversion.data.cache import ActivationCache

    tmp_path, tree = deep_run
    tree = {**tree, "data": {**tree["data"], "train_tokens": 2048}}
    plain = capture_activations(recipe_from_dict(tree), tmp_path / "plain-cache")
    recipe = recipe_from_dict({**tree, "device_map": DISK_MAP, "offload_folder": str(tmp_path / "off")})
    spread = capture_activations(recipe, tmp_path / "spread-cache")
    rows = list(range(ActivationCache(plain).sequences))
    a = ActivationCache(plain).read(rows, [1], torch.device("cpu"), torch.float32)
    b = ActivationCache(spread).read(rows, [1], torch.device("cpu"), torch.float32)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0][1][0], b[0][1][0]) and torch.equal(a[0][1][1], b[0][1][1])
