"""The token cache (conversion/data/token_cache.py, data.token_cache): a round trip gives the live stream's sequences
without tokenizing, a changed text or tokenizer is a miss, a larger budget rewrites the entry, an unfinished stream
writes nothing, and the cache is not part of a run's identity."""

import dataclasses
import os
import warnings
from pathlib import Path

import pytest
import torch

import expertize.conversion.data.token_cache as token_cache
from expertize.conversion.data.text import iter_sequences
from expertize.conversion.publishing.run_folder import run_identity
from expertize.conversion.recipe.data import DataConfig
from tests.conftest import tiny_tokenizer, write_corpus


@pytest.fixture
def data(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=200)
    return DataConfig(source="text", paths=[str(corpus)], context_length=16, train_tokens=1024, eval_tokens=64,
                      eval_fraction=0.1, token_cache=str(tmp_path / "tokens"))


def _all(data, tokenizer, start=0):
    return list(token_cache.train_sequences(data, tokenizer)(start))


def _live(data, tokenizer, start=0):
    return list(iter_sequences(data, tokenizer, split="train", start_sequence=start))


def _no_tokenizing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the text was tokenized although the cache holds the ids")

    monkeypatch.setattr(token_cache, "iter_sequences", refuse)


def _equal(got, want) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))


def test_a_cached_stream_is_the_live_stream_without_tokenizing(data, monkeypatch):
    tokenizer = tiny_tokenizer()
    live = _live(data, tokenizer)
    assert len(live) == 64
    assert _equal(_all(data, tokenizer), live)  # a miss: tokenized, and written on the way
    files = sorted(p.name for p in Path(data.token_cache).iterdir())
    assert [f.rsplit(".", 1)[1] for f in files] == ["bin", "json"]
    _no_tokenizing(monkeypatch)
    assert _equal(_all(data, tokenizer), live)
    assert _equal(_all(data, tokenizer, start=10), live[10:])  # a resumed run reads from its position
    shorter = dataclasses.replace(data, train_tokens=160)  # a smaller budget is served from the front
    assert _equal(_all(shorter, tokenizer), live[:10])


def test_an_edited_text_or_another_tokenizer_is_a_miss(data, monkeypatch):
    tokenizer = tiny_tokenizer()
    _all(data, tokenizer)
    key = token_cache.token_cache_key(data, tokenizer)
    corpus = data.paths[0]
    text = open(corpus, encoding="utf-8").read()
    edited = text.replace("w1 ", "w2 ", 1)
    assert len(edited) == len(text)  # same size: only the modification time tells
    with open(corpus, "w", encoding="utf-8") as f:
        f.write(edited)
    stat = os.stat(corpus)
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a coarse clock may not have moved
    assert token_cache.token_cache_key(data, tokenizer) != key
    assert _equal(_all(data, tokenizer), _live(data, tokenizer))  # the edit is read, not the stale ids

    other = tiny_tokenizer()
    other.add_tokens(["w1w2"])  # a changed vocabulary
    assert token_cache.token_cache_key(data, other) != token_cache.token_cache_key(data, tokenizer)
    assert token_cache.token_cache_key(dataclasses.replace(data, seed=1), tokenizer) != \
        token_cache.token_cache_key(data, tokenizer)  # another shuffle / split
    assert token_cache.token_cache_key(dataclasses.replace(data, train_tokens=99), tokenizer) == \
        token_cache.token_cache_key(data, tokenizer)  # the budget is not in the key


def test_a_longer_budget_rewrites_the_entry_and_a_short_corpus_is_served_with_the_warning(data, monkeypatch):
    tokenizer = tiny_tokenizer()
    _all(data, tokenizer)
    longer = dataclasses.replace(data, train_tokens=2048)
    assert _equal(_all(longer, tokenizer), _live(longer, tokenizer))  # a miss: 128 sequences now cached
    huge = dataclasses.replace(data, train_tokens=10**6)  # more than the corpus holds
    with pytest.warns(UserWarning, match="the train documents give only"):
        live = _all(huge, tokenizer)
    _no_tokenizing(monkeypatch)
    with pytest.warns(UserWarning, match=f"give only {len(live):,} sequences"):
        assert _equal(_all(huge, tokenizer), live)  # exhausted: served, with the live stream's warning
    assert _equal(_all(longer, tokenizer), live[:128])


def test_an_unfinished_stream_writes_nothing_and_a_damaged_entry_is_a_miss(data):
    tokenizer = tiny_tokenizer()
    folder = Path(data.token_cache)
    stream = token_cache.train_sequences(data, tokenizer)(0)
    next(stream)
    stream.close()  # the run stopped before the end of its stream
    assert not any(folder.iterdir())
    _all(data, tokenizer)
    (bin_file,) = folder.glob("*.bin")
    with open(bin_file, "r+b") as f:
        f.truncate(bin_file.stat().st_size - 4)
    assert _equal(_all(data, tokenizer), _live(data, tokenizer))  # tokenized again, and rewritten whole
    assert bin_file.stat().st_size == 64 * 16 * 4


def test_a_folder_that_cannot_be_written_warns_and_the_run_goes_on(data, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    unwritable = dataclasses.replace(data, token_cache=str(blocker / "tokens"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _all(unwritable, tiny_tokenizer())
    assert _equal(got, _live(data, tiny_tokenizer()))
    assert any("data.token_cache: could not write" in str(w.message) for w in caught)


def test_the_token_cache_is_not_part_of_a_runs_identity(tmp_path):
    tree = {"base_model": "gpt2", "data": {"paths": [], "token_cache": str(tmp_path / "a")}, "output_dir": "x"}
    other = {"base_model": "gpt2", "data": {"paths": [], "token_cache": None}, "output_dir": "x"}
    assert run_identity(tree) == run_identity(other)


@pytest.mark.slow  # two upcycle runs
def test_an_upcycle_run_writes_the_cache_and_the_next_run_trains_from_it_alike(tiny_run, monkeypatch):
    import yaml
    from safetensors.torch import load_file

    from expertize.conversion.cli import main

    tmp_path, tree = tiny_run
    tree["data"]["token_cache"] = str(tmp_path / "tokens")
    tree["eval"].update(generation_prompts=0, histogram=False)
    for name in ("first", "second"):
        tree["output_dir"] = str(tmp_path / name)
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(yaml.safe_dump(tree))
        assert main(["upcycle", str(recipe), "--no-progress"]) == 0
        assert len(list((tmp_path / "tokens").glob("*.json"))) == 1  # the first run's stream, read to its end
        _no_tokenizing(monkeypatch)  # the second run must read the ids
    first, second = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("first", "second"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
