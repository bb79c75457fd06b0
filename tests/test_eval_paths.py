"""`data.eval_paths`: an explicit held-out file. The run evaluates on its documents and trains on every document of
`data.paths` except copies of them, instead of the hash split (which cannot say "evaluate on the text this model was
not trained on"); bad values are refused naming data.eval_paths; upcycle's metrics come from the held-out file."""

import json

import pytest
import torch

from expertize.conversion.data.corpus_check import check_data
from expertize.conversion.data.documents import DataError
from expertize.conversion.data.text import load_eval_sequences, pack_sequences, split_documents
from expertize.conversion.recipe.data import DataConfig
from tests.conftest import tiny_base_model, tiny_tokenizer, write_corpus


def corpora(tmp_path):
    train = write_corpus(tmp_path / "train.txt", n_docs=200)
    docs = train.read_text().splitlines()
    held = tmp_path / "held.txt"
    held.write_text("\n".join([f"w{i} w{i + 1} w{i + 2} w{i + 3}" for i in range(40)] + docs[:3]), encoding="utf-8")
    return train, held, docs


def test_held_out_files_are_all_eval_and_never_trained_on(tmp_path):
    train, held, docs = corpora(tmp_path)
    cfg = DataConfig(source="text", paths=[str(train)], eval_paths=[str(held)], context_length=16, eval_tokens=160)
    split = split_documents(cfg)
    held_docs = held.read_text().splitlines()
    assert list(split.eval()) == held_docs
    assert list(split.train()) == docs[3:]  # every train document but the 3 copied into the held-out file
    tok = tiny_tokenizer()
    expected = torch.stack(list(pack_sequences(iter(held_docs), tok, cfg, "eval"))[:10])
    assert torch.equal(load_eval_sequences(cfg, tok), expected)
    hashed = DataConfig(source="text", paths=[str(train)], context_length=16, eval_fraction=0.1)
    assert set(split_documents(hashed).eval()) < set(docs)  # without it: the hash split of data.paths, as before


def test_bad_held_out_files_are_refused_naming_the_key(tmp_path):
    train, held, docs = corpora(tmp_path)
    cases = [
        (dict(eval_paths=str(held)), "data.eval_paths must be a list of files"),
        (dict(eval_paths=[str(tmp_path / "none.txt")]), "data.eval_paths: no such file"),
        (dict(source="hub", paths=[], name="x", eval_paths=[str(held)]), "local sources"),
    ]
    for overrides, message in cases:
        with pytest.raises((ValueError, OSError), match=message):
            DataConfig(**{"source": "text", "paths": [str(train)], **overrides})
    tok = tiny_tokenizer()
    short = tmp_path / "short.txt"
    short.write_text("w1 w2\n", encoding="utf-8")
    cfg = DataConfig(source="text", paths=[str(train)], eval_paths=[str(short)], context_length=16,
                     train_tokens=256, eval_tokens=64)
    with pytest.raises(DataError, match="held-out files data.eval_paths .* less than one sequence"):
        check_data(cfg, tok)
    cfg = DataConfig(source="text", paths=[str(train)], eval_paths=[str(train)], context_length=16,
                     train_tokens=256, eval_tokens=64)
    with pytest.raises(DataError, match="also appears in the held-out files data.eval_paths"):
        check_data(cfg, tok)
    # A held-out file that cannot be read is blamed on data.eval_paths, not on data.paths.
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 w1 w2\n".encode("latin-1"))
    cfg = DataConfig(source="text", paths=[str(train)], eval_paths=[str(latin1)], context_length=16,
                     train_tokens=256, eval_tokens=64)
    with pytest.raises(DataError, match=r"^data\.eval_paths: '.*latin1\.txt' is not UTF-8 text .* or remove it from "
                                        r"data\.eval_paths$"):
        check_data(cfg, tok)
    with pytest.raises(DataError, match=r"^data\.eval_paths: '.*latin1\.txt' is not UTF-8"):
        list(split_documents(cfg).train())  # the train split reads the held-out files too (to leave them out)


def test_upcycle_measures_on_the_held_out_file(tiny_run):
    from expertize.conversion.training.losses import next_token_ce
    from expertize.conversion.recipe import recipe_from_dict
    from expertize.conversion.upcycle import upcycle

    tmp_path, tree = tiny_run
    train, held, _ = corpora(tmp_path)
    tree["data"].update(paths=[str(train)], eval_paths=[str(held)], train_tokens=1024, eval_tokens=96)
    tree["train"]["warmup_steps"] = "auto"  # 4 steps: the fixture's 5 would be refused (longer than the run)
    tree["layers"], tree["eval"]["generation_prompts"] = [0], 0
    recipe = recipe_from_dict(tree, source="test")
    upcycle(recipe, progress=False)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    resolved = (tmp_path / "run" / "recipe.resolved.yaml").read_text()
    assert str(held) in resolved
    ids = load_eval_sequences(recipe.data, tiny_tokenizer())  # the held-out file's sequences
    base = tiny_base_model("llama")
    with torch.no_grad():
        ce = next_token_ce(base(input_ids=ids).logits, ids)
    assert metrics["eval_tokens"] == ids.numel()
    assert metrics["ce"]["base"] == pytest.approx(float(ce.double().mean()), rel=1e-5)
