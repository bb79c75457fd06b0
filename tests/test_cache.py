"""The activation cache (conversion/data/cache.py): capture once, train many runs from disk, exactly as live."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from expertize.conversion.cli import main as cli_main
from expertize.conversion.capture import capture_activations
from expertize.conversion.data.cache import (
    CACHE_MANIFEST, ActivationCache, CacheError, CacheMismatch, CachedActivationBatches, cached_batches,
)
from expertize.conversion.data.mlp_pairs import MlpCapture
from expertize.conversion.recipe import recipe_from_dict
from expertize.conversion.surgery.splice import load_base_model
from expertize.conversion.upcycle import activation_batches, upcycle
from tests.conftest import tiny_base_model, tiny_tokenizer


@pytest.fixture
def cache_run(tiny_run):
    """tiny_run with a light evaluation (these tests compare training, not the evaluation)."""
    tmp_path, tree = tiny_run
    tree["eval"].update(generation_prompts=0, histogram=False)
    return tmp_path, tree


def _streams(tree: dict, cache: Path, *, rank: int = 0, world_size: int = 1):
    """(live ActivationBatches, CachedActivationBatches) of the same recipe; the cache at `cache`."""
    recipe = recipe_from_dict(tree)
    base = load_base_model(tree["base_model"]).eval()
    tokenizer = tiny_tokenizer()
    steps = recipe.data.train_tokens // recipe.train.tokens_per_step
    args = (recipe, base, tokenizer, [0, 1], steps, torch.device("cpu"))
    live = activation_batches(*args, rank=rank, world_size=world_size)
    cached = cached_batches(ActivationCache(cache), *args, rank=rank, world_size=world_size)
    return live, cached


def _assert_same_batches(a, b) -> None:
    a, b = list(a), list(b)
    assert len(a) == len(b) > 0
    for step, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys()
        for layer in x:
            for u, v in zip(x[layer], y[layer]):
                assert u.dtype == v.dtype and u.shape == v.shape, (step, layer)
                assert torch.equal(u, v), f"step {step}, layer {layer} differs"


@pytest.mark.slow  # runs live and from the cache, resumed
def test_cached_batches_equal_live_batches_and_resume_exactly(cache_run):
    tmp_path, tree = cache_run
    # Shards of 20 sequences: chunk boundaries (64 sequences) fall inside shards, reads span two shards.
    cache = capture_activations(recipe_from_dict(tree), tmp_path / "cache", shard_tokens=20 * 16)
    manifest = json.loads((cache / CACHE_MANIFEST).read_text())
    assert manifest["sequences"] == 768 and manifest["tokens"] == 12_288 and manifest["layers"] == [0, 1]
    assert [s["sequences"] for s in manifest["shards"]] == [20] * 38 + [8]
    assert manifest["base"]["dtype"] == manifest["storage_dtype"] == "float32"
    assert manifest["data"]["paths"] == tree["data"]["paths"] and manifest["data"]["seed"] == 0
    live, cached = _streams(tree, cache)
    assert isinstance(cached, CachedActivationBatches)
    full = list(cached.batches())
    assert len(full) == 48
    # Special positions are excluded by default: some steps keep fewer than tokens_per_step rows, as live.
    assert min(b[0][0].shape[0] for b in full) < 256
    _assert_same_batches(live.batches(), full)
    for start in (1, 4, 13, 47):  # exact resume: inside a chunk, at a chunk boundary, the last step
        _assert_same_batches(cached.batches(start_step=start), full[start:])
    # Data parallel: each rank's cached stream is its live stream.
    for rank in (0, 1):
        live, cached = _streams(tree, cache, rank=rank, world_size=2)
        _assert_same_batches(live.batches(), cached.batches())
    # A smaller budget reads a prefix of a larger cache.
    tree["data"]["train_tokens"] = 4096
    live, cached = _streams(tree, cache)
    _assert_same_batches(live.batches(), cached.batches())


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _log(folder: Path) -> list[dict]:
    """The training log without its wall-clock fields."""
    records = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if "second" not in k} for r in records]


@pytest.mark.slow  # runs live and from the cache, resumed
def test_cache_trained_run_equals_live_run_and_resumes_exactly(cache_run, monkeypatch):
    """float32 on CPU: bit-identical weights (torch.equal), since the cached batches are bit-identical to the live
    ones (chunk of 64 sequences = 4 capture batches of 16, so the capture batches are the same)."""
    tmp_path, tree = cache_run
    live = upcycle(recipe_from_dict({**tree, "output_dir": str(tmp_path / "live")}), progress=False)
    cache = capture_activations(recipe_from_dict(tree), tmp_path / "cache")
    cached_tree = {**tree, "data": {**tree["data"], "activation_cache": str(cache)}}
    cached = upcycle(recipe_from_dict({**cached_tree, "output_dir": str(tmp_path / "cached")}), progress=False)
    reference = _weights(live)
    for name, tensor in _weights(cached).items():
        assert torch.equal(tensor, reference[name]), name
    assert _log(live) == _log(cached)

    # Killed mid-run (Ctrl-C while reading chunk 6, after the checkpoint of step 16), then resumed: same weights.
    reads = {"n": 0}
    original = CachedActivationBatches._rows

    def interrupting(self, mine):
        reads["n"] += 1
        if reads["n"] == 6:
            raise KeyboardInterrupt
        return original(self, mine)

    monkeypatch.setattr(CachedActivationBatches, "_rows", interrupting)
    resumed_recipe = recipe_from_dict({**cached_tree, "output_dir": str(tmp_path / "resumed")})
    with pytest.raises(KeyboardInterrupt):
        upcycle(resumed_recipe, progress=False)
    state = torch.load(tmp_path / "resumed" / "checkpoint" / "state.pt", weights_only=False)
    assert 0 < state["step"] < 48
    monkeypatch.setattr(CachedActivationBatches, "_rows", original)
    resumed = upcycle(resumed_recipe, progress=False)
    for name, tensor in _weights(resumed).items():
        assert torch.equal(tensor, reference[name]), name


def test_mismatched_cache_is_refused_before_any_work(cache_run, capsys):
    tmp_path, tree = cache_run
    cache = capture_activations(recipe_from_dict({**tree, "layers": [0]}), tmp_path / "cache")

    def refused(change: dict, match: str) -> None:
        changed = {**tree, **change}
        changed["data"] = {**tree["data"], **change.get("data", {}), "activation_cache": str(cache)}
        with pytest.raises(CacheMismatch, match=match) as err:
            upcycle(recipe_from_dict(changed), progress=False)
        assert "expertize capture RECIPE --output DIR" in str(err.value)
        assert "remove data.activation_cache" in str(err.value)
        assert not Path(tree["output_dir"]).exists(), "refused after the run folder was claimed"

    refused({}, r"differs in: layers \(the cache holds \[0\], the recipe also needs \[1\]\)")
    other_text = shutil.copy(tree["data"]["paths"][0], tmp_path / "other.txt")
    refused({"layers": [0], "data": {"paths": [str(other_text)]}}, r"differs in: data.paths \(the corpus files")
    refused({"layers": [0], "data": {"seed": 1}}, r"differs in: data.seed \(cache: 0, recipe: 1\)")
    refused({"layers": [0], "data": {"train_tokens": 20_000}}, r"data.train_tokens \(the cache holds 12,288 tokens")
    other_base = tmp_path / "other_base"
    tiny_base_model("llama", seed=1).save_pretrained(other_base)
    tiny_tokenizer().save_pretrained(other_base)
    refused({"layers": [0], "base_model": str(other_base)}, r"differs in: base_model \(cache: '.*base', recipe")
    refused({"layers": [0], "dtype": "bfloat16"}, r"differs in: dtype \(cache: 'float32', recipe: 'bfloat16'\)")

    # Through the CLI: one line, exit 2, nothing written.
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**tree, "data": {**tree["data"], "activation_cache": str(cache)}}))
    assert cli_main(["upcycle", str(recipe), "--no-progress"]) == 2
    assert "the activation cache" in capsys.readouterr().err and not Path(tree["output_dir"]).exists()
    # A cache with more layers, a larger budget and other excluded positions serves the recipe.
    narrower = {**tree, "layers": [0], "data": {**tree["data"], "train_tokens": 4096,
                                                 "exclude_special_positions": False}}
    assert ActivationCache(cache).mismatches(recipe_from_dict(narrower), [0]) == []


def test_interrupted_capture_leaves_no_usable_cache(cache_run, monkeypatch):
    tmp_path, tree = cache_run
    calls = {"n": 0}
    original = MlpCapture.__call__

    def interrupting(self, input_ids):
        calls["n"] += 1
        if calls["n"] == 20:
            raise KeyboardInterrupt
        return original(self, input_ids)

    monkeypatch.setattr(MlpCapture, "__call__", interrupting)
    target = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        capture_activations(recipe_from_dict(tree), target, shard_tokens=64 * 16)
    assert not target.exists() and not list(tmp_path.glob(".cache*")), "an interrupted capture left files"
    recipe = recipe_from_dict({**tree, "data": {**tree["data"], "activation_cache": str(target)}})
    with pytest.raises(CacheError, match=r"there is no folder .*cache; write it with `expertize capture RECIPE"):
        upcycle(recipe, progress=False)
    # A capture killed outright (SIGKILL: no cleanup) leaves shards in its staging folder and no manifest.
    monkeypatch.setattr(MlpCapture, "__call__", original)
    capture_activations(recipe_from_dict(tree), target, shard_tokens=64 * 16)
    killed = tmp_path / "killed"
    shutil.copytree(target, killed)
    (killed / CACHE_MANIFEST).unlink()
    with pytest.raises(CacheError, match=r"holds no cache.json, so it is not a complete activation cache"):
        ActivationCache(killed)
    (target / "shard-00003.safetensors").write_bytes(b"truncated")
    with pytest.raises(CacheError, match=r"shard .*shard-00003.safetensors is damaged: 9 bytes where cache.json recorded"):
        ActivationCache(target)
    with pytest.raises(CacheError, match="already exists; a cache is never overwritten"):
        capture_activations(recipe_from_dict(tree), target)


@pytest.mark.slow  # runs live and from the cache
def test_bfloat16_cache_round_trip(cache_run):
    tmp_path, tree = cache_run
    cache = capture_activations(recipe_from_dict(tree), tmp_path / "cache", dtype="bfloat16")
    assert json.loads((cache / CACHE_MANIFEST).read_text())["storage_dtype"] == "bfloat16"
    with safe_open(str(cache / "shard-00000.safetensors"), framework="pt") as f:
        assert f.get_tensor("layer.0.x").dtype == torch.bfloat16 and f.get_tensor("input_ids").dtype == torch.int32
    live, cached = _streams(tree, cache)
    for a, b in zip(live.batches(), cached.batches(), strict=True):
        for layer in a:
            for u, v in zip(a[layer], b[layer]):
                assert v.dtype == torch.float32  # the base model's dtype, as a live capture yields
                assert torch.equal(v, u.to(torch.bfloat16).float())  # rounded once, at capture


def test_capture_cli(cache_run, capsys):
    tmp_path, tree = cache_run
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**tree, "data": {**tree["data"], "activation_cache": str(tmp_path / "c")}}))
    assert cli_main(["capture", str(recipe), "--no-progress", "--dtype", "float16"]) == 0  # --output from the recipe
    assert "--set data.activation_cache=" in capsys.readouterr().out
    assert ActivationCache(tmp_path / "c").manifest["storage_dtype"] == "float16"
    assert cli_main(["capture", str(recipe), "--no-progress"]) == 2
    assert "already exists" in capsys.readouterr().err


def test_a_bf16_capture_is_cached_as_such_and_refused_for_an_fp32_recipe(cache_run):
    # train.capture_precision decides the pairs: the cache records it, a recipe with another one is refused, and a
    # bf16-capture cache gives the live bf16-capture batches bit for bit. A cache written before the key existed
    # was captured in fp32.
    tmp_path, tree = cache_run
    bf16 = {**tree, "train": {**tree["train"], "capture_precision": "bf16"}}
    cache = capture_activations(recipe_from_dict(bf16), tmp_path / "cache")
    manifest = json.loads((cache / CACHE_MANIFEST).read_text())
    assert manifest["base"]["capture_precision"] == "bf16" and manifest["capture_batch_sequences"] == 16
    _assert_same_batches(*(s.batches() for s in _streams(bf16, cache)))
    assert ActivationCache(cache).mismatches(recipe_from_dict(tree), [0, 1]) == [
        "train.capture_precision (cache: 'bf16', recipe: 'fp32')"]
    del manifest["base"]["capture_precision"]
    (cache / CACHE_MANIFEST).write_text(json.dumps(manifest))
    assert ActivationCache(cache).mismatches(recipe_from_dict(tree), [0, 1]) == []


def test_a_cache_written_before_the_readings_existed_matches_the_default_reading(cache_run):
    """Issue 39 added data.document_marker and data.eval_split: a cache whose manifest has neither was read with
    EOS after every document and a split by whole documents, so it matches a recipe with those defaults and is
    refused for another reading, naming the key."""
    tmp_path, tree = cache_run
    cache = capture_activations(recipe_from_dict(tree), tmp_path / "cache")
    manifest = json.loads((cache / CACHE_MANIFEST).read_text())
    for key in ("document_marker", "eval_split"):
        del manifest["stream"][key]
    (cache / CACHE_MANIFEST).write_text(json.dumps(manifest))
    assert ActivationCache(cache).mismatches(recipe_from_dict(tree), [0, 1]) == []
    bos = {**tree, "data": {**tree["data"], "document_marker": "bos"}}
    assert ActivationCache(cache).mismatches(recipe_from_dict(bos), [0, 1]) == [
        "data.document_marker (cache: 'eos', recipe: 'bos')"]
