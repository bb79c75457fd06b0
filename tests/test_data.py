"""The data stage: documents, train/eval split, packing, resume, budgets, and the errors a recipe author meets."""

import itertools
import json
import math
import os
import warnings
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from expertize.conversion.data.activations import ActivationBatches
from expertize.conversion.data.corpus_check import check_data
from expertize.conversion.data.text import (
    DataError,
    batch_sequences,
    document_in_eval,
    iter_documents,
    iter_sequences,
    load_eval_sequences,
    pack_sequences,
    shuffle_buffered,
    split_documents,
)
from expertize.conversion.recipe.data import DataConfig, token_budget_to_sequences
from expertize.conversion.errors import ExpertizeError
from tests.conftest import shared_data_dir

NUM_DOCS = 200
WORDS = [f"w{i}" for i in range(20)]
SPECIALS = {"[UNK]": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
UNK, BOS, EOS, PAD = 0, 1, 2, 3
T = 16


def make_documents(n: int = NUM_DOCS) -> list[str]:
    """Document i starts with its unique marker word m{i}, followed by 5..27 common words."""
    return [" ".join([f"m{i}"] + [WORDS[(i + j) % len(WORDS)] for j in range(5 + (i * 7) % 23)]) for i in range(n)]


def make_tokenizer(bos: bool = True) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose post-processor adds <s>, so forgetting add_special_tokens=False shows up."""
    vocab = dict(SPECIALS)
    for word in WORDS + [f"m{i}" for i in range(NUM_DOCS)]:
        vocab[word] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
        return PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="[UNK]", pad_token="<pad>"
        )
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="[UNK]", pad_token="<pad>")


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(make_documents()) + "\n\n", encoding="utf-8")
    return path


def data_config(corpus: Path, **overrides) -> DataConfig:
    settings = dict(
        paths=[str(corpus)],
        context_length=T,
        train_tokens=100 * T,
        eval_tokens=4 * T,
        eval_fraction=0.2,
        shuffle_buffer_documents=32,
    )
    return DataConfig(**{**settings, **overrides})


def markers(seqs, tok) -> set[str]:
    return {w for s in seqs for w in tok.convert_ids_to_tokens(s.tolist()) if w.startswith("m")}


# ---------------------------------------------------------------------------------------------------------------
# Documents and split


def test_text_document_separators(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one a\ntwo\n\n  \nthree\n\n\nfour\n", encoding="utf-8")
    docs = {
        sep: list(iter_documents(DataConfig(paths=[str(path)], document_separator=sep)))
        for sep in ("line", "blank_line", "file")
    }
    assert docs["line"] == ["one a", "two", "three", "four"]
    assert docs["blank_line"] == ["one a\ntwo", "three", "four"]
    assert docs["file"] == ["one a\ntwo\n\n  \nthree\n\n\nfour\n"]


def test_the_tail_split_holds_out_the_end_of_every_document_by_characters(tmp_path):
    """Issue 39: eval_split: tail is a raw stream's own split (the shipped tiny-gpt2-shakespeare was trained on the
    first 90 % of its file by characters, validated on the last 10 %): train + eval is the file, nothing shared."""
    text = "".join(f"line {i} of the play\n" for i in range(500))
    path = tmp_path / "play.txt"
    path.write_text(text, encoding="utf-8")
    split = split_documents(DataConfig(paths=[str(path)], document_separator="file", eval_split="tail",
                                       eval_fraction=0.1))
    (train,), (held,) = list(split.train()), list(split.eval())
    assert train + held == text and len(held) == round(0.1 * len(text))
    # Held-out files still win over the fraction (the key's documentation says so).
    other = tmp_path / "held.txt"
    other.write_text("held out\n", encoding="utf-8")
    with_files = split_documents(DataConfig(paths=[str(path)], document_separator="file", eval_split="tail",
                                            eval_paths=[str(other)]))
    assert list(with_files.eval()) == ["held out\n"] and list(with_files.train()) == [text]
    with pytest.raises(ValueError, match=r"data.eval_split must be one of \['documents', 'tail'\], got 'end'"):
        DataConfig(paths=[str(path)], eval_split="end")


def test_the_bos_marker_reads_documents_as_llama2c_trained_on_them(tmp_path, tokenizer):
    """Issue 39: data.document_marker: bos puts BOS before every document and no EOS (llama2.c's pretokenization:
    encode(text, bos=True, eos=False), concatenated); with add_bos false nothing else is inserted."""
    path = tmp_path / "stories.txt"
    docs = make_documents(6)
    path.write_text("\n".join(docs) + "\n", encoding="utf-8")
    cfg = DataConfig(paths=[str(path)], document_marker="bos", add_bos=False, context_length=8, shuffle_documents=False)
    ids = torch.cat(list(pack_sequences(iter(docs), tokenizer, cfg, "eval"))).tolist()
    stream = [t for doc in docs for t in [BOS] + tokenizer(doc, add_special_tokens=False)["input_ids"]]
    assert ids == stream[: len(ids)] and EOS not in ids and len(ids) == len(stream) - len(stream) % 8
    with pytest.raises(DataError, match="data.document_marker=bos but the tokenizer .* has no BOS token"):
        list(pack_sequences(iter(docs), make_tokenizer(bos=False), cfg, "eval"))
    with pytest.raises(ValueError, match=r"data.document_marker must be one of \['eos', 'bos'\]"):
        DataConfig(paths=[str(path)], document_marker="sep")


def test_globs_are_sorted_and_read_in_order(tmp_path):
    for name, text in [("b.txt", "bee"), ("a.txt", "ay"), ("c.md", "skip")]:
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert list(iter_documents(DataConfig(paths=[str(tmp_path / "*.txt")]))) == ["ay", "bee"]


def test_jsonl_and_parquet_read_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = ["first doc", "", None, "x y"]
    records = [{"id": i, "body": text} for i, text in enumerate(texts)]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet)
    for source, path in [("jsonl", jsonl), ("parquet", parquet)]:
        cfg = DataConfig(source=source, paths=[str(path)], text_column="body")
        assert list(iter_documents(cfg)) == ["first doc", "x y"], source


@pytest.mark.parametrize("source", ["jsonl", "parquet"])
def test_missing_text_column_names_the_columns_found(tmp_path, source):
    records = [{"id": 0, "content": "hello"}]
    path = tmp_path / f"d.{source}"
    if source == "jsonl":
        path.write_text(json.dumps(records[0]) + "\n", encoding="utf-8")
    else:
        pa = pytest.importorskip("pyarrow")
        pytest.importorskip("pyarrow.parquet").write_table(pa.Table.from_pylist(records), path)
    cfg = DataConfig(source=source, paths=[str(path)])
    with pytest.raises(ValueError, match=r"no text column 'text'.*\['id', 'content'\].*data.text_column"):
        list(iter_documents(cfg))


def test_hub_source_uses_load_dataset(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return iter([{"text": "a b"}, {"text": ""}, {"text": "c"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = DataConfig(source="hub", name="org/corpus", config="raw", split="validation")
    assert list(iter_documents(cfg)) == ["a b", "c"]
    assert calls == [("org/corpus", "raw", "validation", True)]


def test_split_is_disjoint_complete_and_stable(corpus):
    cfg = data_config(corpus)
    split = split_documents(cfg)
    train, held_out = list(split.train()), list(split.eval())
    assert not set(train) & set(held_out)
    assert sorted(train + held_out) == sorted(make_documents())
    assert list(split.eval()) == held_out  # fresh iterator, same documents
    fraction = sum(document_in_eval(i, seed=0, eval_fraction=0.05) for i in range(20_000)) / 20_000
    assert 0.04 < fraction < 0.06
    # Golden: the held-out set must not change across versions, processes or machines (blake2b, not hash()).
    assert [i for i in range(40) if document_in_eval(i, seed=0, eval_fraction=0.2)] == [6, 10, 15, 28, 32, 37]
    assert [document_in_eval(i, 0, 0.5) for i in range(64)] != [document_in_eval(i, 1, 0.5) for i in range(64)]


# ---------------------------------------------------------------------------------------------------------------
# Packing


@pytest.mark.parametrize("split", ["train", "eval"])
def test_sequences_are_full_length_bos_first_and_never_padded(corpus, tokenizer, split):
    cfg = data_config(corpus)
    seqs = list(pack_sequences(split_documents(cfg).documents(split), tokenizer, cfg, split))
    assert seqs
    for s in seqs:
        assert s.dtype == torch.long and s.shape == (T,)
        assert s[0] == BOS and BOS not in s[1:].tolist()
        assert PAD not in s.tolist() and UNK not in s.tolist()


def test_documents_are_packed_in_order_and_separated_by_eos(corpus, tokenizer):
    cfg = data_config(corpus)
    held_out = list(split_documents(cfg).eval())
    seqs = list(pack_sequences(held_out, tokenizer, cfg, "eval"))
    expected = [t for doc in held_out for t in tokenizer(doc, add_special_tokens=False)["input_ids"] + [EOS]]
    content = [t for s in seqs for t in s[1:].tolist()]  # BOS stripped
    assert len(content) == len(expected) // (T - 1) * (T - 1)  # only the ragged tail is dropped
    assert content == expected[: len(content)]


def test_bos_off_and_tokenizer_without_bos(corpus, tokenizer):
    cfg = data_config(corpus, add_bos=False)
    seqs = list(iter_sequences(cfg, tokenizer, "eval"))
    assert all(s.shape == (T,) and BOS not in s.tolist() for s in seqs)
    no_bos = make_tokenizer(bos=False)
    assert all(BOS not in s.tolist() for s in iter_sequences(data_config(corpus), no_bos, "eval"))
    with pytest.raises(ValueError, match="add_bos=true.*no BOS"):
        next(iter_sequences(data_config(corpus, add_bos=True), no_bos, "eval"))


def test_train_and_eval_never_share_a_document(corpus, tokenizer):
    cfg = data_config(corpus)
    train = list(iter_sequences(cfg, tokenizer, "train"))
    held_out = load_eval_sequences(cfg, tokenizer)
    train_markers, eval_markers = markers(train, tokenizer), markers(held_out, tokenizer)
    assert train_markers and eval_markers
    assert not train_markers & eval_markers


def test_same_seed_same_stream_other_seed_different(corpus, tokenizer):
    def run(seed):
        cfg = data_config(corpus, seed=seed)
        return torch.stack(list(iter_sequences(cfg, tokenizer))), load_eval_sequences(cfg, tokenizer)

    (train_a, eval_a), (train_b, eval_b), (train_c, eval_c) = run(0), run(0), run(1)
    assert torch.equal(train_a, train_b) and torch.equal(eval_a, eval_b)
    assert not torch.equal(train_a[: len(train_c)], train_c[: len(train_a)])
    assert markers(eval_a, tokenizer) != markers(eval_c, tokenizer)


def marker_order(seqs, tok) -> list[int]:
    return [int(w[1:]) for w in tok.convert_ids_to_tokens(torch.cat(list(seqs)).tolist()) if w.startswith("m")]


def test_train_documents_are_shuffled_eval_are_not(corpus, tokenizer):
    cfg = data_config(corpus)
    train_order = marker_order(iter_sequences(cfg, tokenizer), tokenizer)
    assert train_order != sorted(train_order)
    eval_order = marker_order(load_eval_sequences(cfg, tokenizer), tokenizer)
    assert eval_order == sorted(eval_order)
    unshuffled = marker_order(iter_sequences(data_config(corpus, shuffle_documents=False), tokenizer), tokenizer)
    assert unshuffled == sorted(unshuffled)


def test_shuffle_buffer_is_a_seeded_permutation():
    items = [str(i) for i in range(100)]
    shuffled = list(shuffle_buffered(items, buffer_size=10, seed=3))
    assert sorted(shuffled) == sorted(items) and shuffled != items
    assert shuffled == list(shuffle_buffered(items, buffer_size=10, seed=3))
    assert list(shuffle_buffered(items, buffer_size=1, seed=3)) == items
    whole = list(shuffle_buffered(items, buffer_size=1000, seed=3))  # never fills: only the final shuffle acts
    assert sorted(whole) == sorted(items) and whole != items


@pytest.mark.parametrize("split", ["train", "eval"])
def test_resume_from_start_sequence_equals_tail_of_full_run(corpus, tokenizer, split):
    cfg = data_config(corpus)
    docs = split_documents(cfg)
    full = list(pack_sequences(docs.documents(split), tokenizer, cfg, split))
    for start in (0, 1, 7, len(full) - 1, len(full), len(full) + 3):
        resumed = list(pack_sequences(docs.documents(split), tokenizer, cfg, split, start_sequence=start))
        assert len(resumed) == max(len(full) - start, 0)
        assert all(torch.equal(a, b) for a, b in zip(resumed, full[start:]))
    budgeted = list(iter_sequences(cfg, tokenizer, split))
    resumed = list(iter_sequences(cfg, tokenizer, split, start_sequence=3))
    assert len(resumed) == len(budgeted) - 3
    assert all(torch.equal(a, b) for a, b in zip(resumed, budgeted[3:]))


# ---------------------------------------------------------------------------------------------------------------
# Budgets and batches


def test_token_budget_to_sequences():
    assert token_budget_to_sequences(128, 128) == 1
    assert token_budget_to_sequences(129, 128) == 2
    assert token_budget_to_sequences(1, 128) == 1


def test_eval_budget_respected(corpus, tokenizer):
    cfg = data_config(corpus, eval_tokens=3 * T + 1)
    held_out = load_eval_sequences(cfg, tokenizer)
    assert held_out.shape == (4, T)
    assert torch.equal(held_out, load_eval_sequences(cfg, tokenizer))
    train = list(iter_sequences(data_config(corpus, train_tokens=5 * T), tokenizer))
    assert len(train) == 5


def test_short_eval_set_warns_with_both_numbers(corpus, tokenizer):
    cfg = data_config(corpus, eval_tokens=1_000_000)
    with pytest.warns(UserWarning, match=r"eval documents give only \d+ sequences.*data.eval_tokens=1,000,000"):
        held_out = load_eval_sequences(cfg, tokenizer)
    assert held_out.shape[1] == T and 0 < held_out.shape[0] < math.ceil(1_000_000 / T)
    with pytest.warns(UserWarning, match="data.train_tokens=10,000,000"):
        list(iter_sequences(data_config(corpus, train_tokens=10_000_000), tokenizer))


def test_empty_eval_set_is_an_error(corpus, tokenizer):
    cfg = data_config(corpus, context_length=100_000)
    with pytest.raises(ValueError, match="do not fill a single sequence.*context_length=100000"):
        load_eval_sequences(cfg, tokenizer)


def test_batch_sequences():
    seqs = [torch.full((T,), i) for i in range(7)]
    batches = list(batch_sequences(seqs, 3))
    assert [tuple(b.shape) for b in batches] == [(3, T), (3, T), (1, T)]
    assert torch.equal(torch.cat(batches), torch.stack(seqs))
    assert [tuple(b.shape) for b in batch_sequences(seqs, 3, drop_last=True)] == [(3, T), (3, T)]


# ---------------------------------------------------------------------------------------------------------------
# Config errors


def test_missing_file_error_names_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=f"no such file '{missing}'.*fix the path"):
        DataConfig(paths=[str(missing)])
    with pytest.raises(FileNotFoundError, match="matches no file"):
        DataConfig(paths=[str(tmp_path / "*.jsonl")])
    with pytest.raises(IsADirectoryError, match="is a directory"):
        DataConfig(paths=[str(tmp_path)])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(source="csv"), "data.source must be one of"),
        (dict(paths=[]), "data.paths is empty"),
        (dict(context_length=1), "context_length must be an integer >= 2"),
        (dict(train_tokens=0), "train_tokens must be a positive integer"),
        (dict(eval_tokens=-5), "eval_tokens must be a positive integer"),
        (dict(eval_fraction=0.0), "eval_fraction must lie strictly between 0 and 1"),
        (dict(eval_fraction=1.0), "eval_fraction must lie strictly between 0 and 1"),
        (dict(document_separator="para"), "document_separator must be one of"),
        (dict(add_bos="yes"), "add_bos must be 'auto', true or false"),
        (dict(source="hub", paths=[]), "needs data.name"),
    ],
)
def test_config_validation(corpus, overrides, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**{"paths": [str(corpus)], **overrides})


# ---------------------------------------------------------------------------------------------------------------
# Real tokenizer and corpus


def test_stories260k_real_tokenizer_and_corpus():
    root = str(shared_data_dir())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(root, "models", "stories260k"))
    cfg = DataConfig(
        paths=[os.path.join(root, "corpora", "stories260k_samples.txt")],
        context_length=64,
        train_tokens=20_000,
        eval_tokens=5_000,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the budgets fit the corpus: no shortfall warning
        train = torch.stack(list(iter_sequences(cfg, tok)))  # (S, T)
        held_out = load_eval_sequences(cfg, tok)  # (S, T)
    assert train.shape == (token_budget_to_sequences(20_000, 64), 64)
    assert held_out.shape == (token_budget_to_sequences(5_000, 64), 64)
    for seqs in (train, held_out):
        assert (seqs[:, 0] == tok.bos_token_id).all() and not (seqs[:, 1:] == tok.bos_token_id).any()
        assert (seqs == tok.eos_token_id).any()  # documents are separated
        assert ((seqs >= 0) & (seqs < tok.vocab_size)).all()
    first_held_out_document = next(split_documents(cfg).eval())
    assert tok.decode(held_out[0], skip_special_tokens=True).strip()[:40] == first_held_out_document[:40]


# ----------------------------------------------------------------------------------------------------------------
# Up-front checks (check_data): what the corpus can give the run, before any training


def _sequences_training_reads(cfg: DataConfig, tokenizer) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sum(1 for _ in iter_sequences(cfg, tokenizer, split="train"))


@pytest.mark.parametrize("bos", [True, False])
def test_check_data_counts_exactly_what_training_reads(corpus, bos):
    """The largest budget check_data accepts is exactly the train stream's length: one token more is refused."""
    tok = make_tokenizer(bos=bos)
    cfg = data_config(corpus, train_tokens=10**6)
    available = _sequences_training_reads(cfg, tok)  # the whole train split, shuffled as training reads it
    assert 0 < available < token_budget_to_sequences(10**6, T)
    with pytest.raises(DataError) as info:
        check_data(cfg, tok)
    message = str(info.value)
    assert f"the train split holds only {available * T:,} tokens" in message
    assert f"pack into {available:,} sequences of data.context_length={T}" in message
    assert f"lower data.train_tokens to at most {available * T:,}, or add text to the corpus" in message
    assert "zero tokens" not in message

    report = check_data(cfg, tok, train_tokens=available * T)
    assert report.train_sequences == report.train_sequences_needed == available
    assert report.add_bos is bos and not report.streamed
    with pytest.raises(DataError, match=f"at most {available * T:,}"):
        check_data(cfg, tok, train_tokens=available * T + 1)


def test_check_data_passes_a_sufficient_corpus_and_stops_early(corpus, tokenizer):
    cfg = data_config(corpus)  # 100 sequences of T out of ~190 available
    report = check_data(cfg, tokenizer)
    assert (report.train_sequences, report.train_sequences_needed) == (100, 100)
    assert (report.eval_sequences, report.eval_sequences_wanted) == (4, 4)
    assert "train split covers 100 sequences of 16 tokens (1,600 tokens)" in report.summary()
    assert isinstance(DataError("x"), ExpertizeError)


def test_check_data_names_the_budget_key_it_checks(corpus, tokenizer):
    cfg = data_config(corpus)
    with pytest.raises(DataError, match=r"fewer than the 62,500 that heal.tokens=1,000,000 needs; lower heal.tokens"):
        check_data(cfg, tokenizer, train_tokens=1_000_000, train_key="heal.tokens")


def test_check_data_empty_held_out_split_blank_line_without_blank_lines(tmp_path, tokenizer):
    """One file without blank lines read with document_separator: blank_line is one document: nothing held out."""
    path = tmp_path / "one_paragraph.txt"
    path.write_text("\n".join(make_documents()) + "\n", encoding="utf-8")
    cfg = data_config(path, document_separator="blank_line", seed=0)  # document 0 falls in train at seed 0
    assert not document_in_eval(0, 0, cfg.eval_fraction)
    with pytest.raises(DataError) as info:
        check_data(cfg, tokenizer)
    message = str(info.value)
    assert "the held-out split is empty" in message and "gives 1 document(s)" in message
    assert "set data.document_separator: line (one document per line), hold out the end of every document with " \
           "data.eval_split: tail, give held-out files in data.eval_paths, or raise data.eval_fraction" in message
    # Issue 39: every setting the refusal names resolves it, applied as written.
    assert check_data(data_config(path, document_separator="line"), tokenizer).eval_sequences == 4
    assert check_data(data_config(path, document_separator="blank_line", eval_split="tail"), tokenizer).eval_sequences
    held = tmp_path / "held.txt"
    held.write_text("\n".join(make_documents()[:12]) + "\n", encoding="utf-8")
    assert check_data(data_config(path, document_separator="blank_line", eval_paths=[str(held)]), tokenizer)


def test_check_data_empty_train_split(tmp_path, tokenizer):
    path = tmp_path / "one.txt"
    path.write_text(" ".join(WORDS * 10), encoding="utf-8")
    seed = next(s for s in range(100) if document_in_eval(0, s, 0.2))  # the only document is held out
    with pytest.raises(DataError, match=r"the train split is empty: all 1 document\(s\).*each file is one document"):
        check_data(data_config(path, document_separator="file", seed=seed), tokenizer)
    path.write_text(" ".join(WORDS * 10) + "\n" + " ".join(WORDS), encoding="utf-8")  # two documents
    both_out = next(s for s in range(1000) if document_in_eval(0, s, 0.2) and document_in_eval(1, s, 0.2))
    with pytest.raises(DataError, match=r"all 2 document\(s\).*fall in the held-out split.*add documents, hold out "
                                        r"the end of every document with data.eval_split: tail, give held-out files "
                                        r"in data.eval_paths, or lower data.eval_fraction"):
        check_data(data_config(path, document_separator="line", seed=both_out), tokenizer)


def test_check_data_held_out_split_shorter_than_a_sequence(corpus, tokenizer):
    with pytest.raises(DataError, match=r"held-out split \(\d+ of 200 documents.*less than one sequence of "
                                        r"data.context_length=100000"):
        check_data(data_config(corpus, context_length=100_000), tokenizer)


def _tokenizer_yielding_nothing() -> PreTrainedTokenizerFast:
    """A broken tokenizer: its normalizer deletes every character, so every document becomes zero tokens."""
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1}, unk_token="[UNK]"))
    backend.normalizer = normalizers.Replace(Regex(r"[\s\S]"), "")
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="[UNK]")


def test_check_data_reports_a_tokenizer_yielding_zero_tokens(corpus):
    with pytest.raises(DataError) as info:
        check_data(data_config(corpus), _tokenizer_yielding_nothing())
    message = str(info.value)
    assert "turns all 32 documents of the first documents of data.paths" in message
    assert "into zero tokens" in message and "tokenizer files" in message
    assert "add text" not in message


@pytest.mark.parametrize("suffix, compress", [(".gz", "gzip"), (".bz2", "bz2"), (".xz", "lzma")])
def test_compressed_corpora_are_read_as_the_plain_file(tmp_path, corpus, suffix, compress):
    import importlib

    module = importlib.import_module(compress)
    packed = tmp_path / ("packed.txt" + suffix)
    packed.write_bytes(module.compress(corpus.read_bytes()))
    plain, compressed = data_config(corpus), data_config(packed)
    assert list(iter_documents(compressed)) == list(iter_documents(plain)) != []
    records = tmp_path / ("records.jsonl" + suffix)  # the format is the name's without the compression suffix
    records.write_bytes(module.compress(b'{"text": "w1 w2"}\n{"text": "w3"}\n'))
    assert list(iter_documents(data_config(records))) == ["w1 w2", "w3"]


def test_compressed_files_that_cannot_be_read_say_how_to_decompress(tmp_path, corpus):
    import gzip

    zstd = tmp_path / "corpus.txt.zst"
    zstd.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 8)
    with pytest.raises(DataError, match=r"data\.paths: '.*corpus\.txt\.zst' is zstd-compressed; decompress it "
                                        r"\(zstd -d FILE\)"):
        DataConfig(paths=[str(zstd)])
    held = tmp_path / "held.zip"
    held.write_bytes(b"PK\x03\x04")
    with pytest.raises(DataError, match=r"data\.eval_paths: .* is a zip archive; decompress it \(unzip FILE\)"):
        DataConfig(paths=[str(corpus)], eval_paths=[str(held)])
    hidden = tmp_path / "hidden.txt"  # gzip under a plain-text name: said so, not "convert it with iconv"
    hidden.write_bytes(gzip.compress(corpus.read_bytes()))
    with pytest.raises(DataError, match=r"'.*hidden\.txt' is gzip-compressed, not text; decompress it \(gunzip -k "
                                        r"FILE\) or, for gzip / bzip2 / xz, name it with its \.gz"):
        list(iter_documents(data_config(hidden)))
    parquet = tmp_path / "t.parquet.gz"
    parquet.write_bytes(gzip.compress(b"x"))
    with pytest.raises(DataError, match="is a compressed parquet file; decompress it"):
        DataConfig(paths=[str(parquet)])


def test_check_data_unreadable_and_missing_files(tmp_path, corpus, tokenizer):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 w1 w2\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"'.*latin1.txt' is not UTF-8 text \(invalid continuation byte at byte 3\); "
                                        r"convert it to UTF-8"):
        check_data(data_config(latin1), tokenizer)
    cfg = data_config(corpus)
    corpus.unlink()  # removed after the recipe was loaded
    with pytest.raises(DataError, match=f"no such file '{corpus}'"):
        check_data(cfg, tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "w1 w2"}\nnot json\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl:2 is not valid JSON"):
        check_data(data_config(bad, source="jsonl"), tokenizer)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n", encoding="utf-8")
    with pytest.raises(DataError, match=r"holds no document \(no non-empty text\); add text"):
        check_data(data_config(empty), tokenizer)


def test_check_data_streamed_hub_corpus_is_probed_not_counted(monkeypatch, tokenizer):
    datasets = pytest.importorskip("datasets")
    records = [{"text": doc} for doc in make_documents(50)]
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config, split, streaming: iter(records))
    cfg = DataConfig(source="hub", name="org/corpus", context_length=T, train_tokens=10**9)
    report = check_data(cfg, tokenizer)  # far more than 50 documents give: checked while streaming instead
    assert report.streamed and report.train_sequences is None and report.eval_sequences is None
    assert "checked while streaming" in report.summary()
    with pytest.raises(DataError, match="into zero tokens"):
        check_data(cfg, _tokenizer_yielding_nothing())

    def offline(name, config, split, streaming):
        raise ConnectionError("offline mode is enabled")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"cannot read the hub dataset 'org/corpus'.*ConnectionError.*HF_HUB_OFFLINE"):
        check_data(cfg, tokenizer)


# ----------------------------------------------------------------------------------------------------------------
# Activation batches: every token of the budget reaches a step


def _token_capture(input_ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """A stand-in for MlpCapture: x = y = the token ids, (B*T, 1), so batches can be traced back to tokens."""
    ids = input_ids.reshape(-1, 1).float()
    return {0: (ids, ids)}


@pytest.mark.parametrize("world_size", [1, 2])
def test_activation_batches_cover_the_budget_when_chunks_are_not_whole_steps(corpus, tokenizer, world_size):
    """Chunks of 6 sequences x 16 tokens = 96 tokens are not whole steps of 40: steps span chunks, no token is
    dropped, so ceil(train_tokens / T) sequences give train_tokens // tokens_per_step steps; resuming at any step
    gives the tail of the full run."""
    tokens_per_step, train_tokens = 40, 40 * 32  # 80 sequences: whole sequences for every rank
    cfg = data_config(corpus, train_tokens=train_tokens)

    def make(rank: int) -> ActivationBatches:
        return ActivationBatches(
            _token_capture, lambda start: iter_sequences(cfg, tokenizer, "train", start), context_length=T,
            tokens_per_step=tokens_per_step, shuffle_buffer_tokens=90, capture_batch_sequences=4, seed=1,
            device=torch.device("cpu"), rank=rank, world_size=world_size,
        )

    steps = train_tokens // tokens_per_step
    for rank in range(world_size):
        full = [b[0][0] for b in itertools.islice(make(rank).batches(), steps)]
        assert len(full) == steps and all(x.shape == (tokens_per_step // world_size, 1) for x in full)
        for start in (1, 2, 7, steps - 1):
            resumed = [b[0][0] for b in itertools.islice(make(rank).batches(start), steps - start)]
            assert all(torch.equal(a, b) for a, b in zip(resumed, full[start:], strict=True))
    assert len(list(make(world_size - 1).batches())) == steps  # then the text ends (the trainer reports it)
