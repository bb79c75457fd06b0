"""Before training, upcycle measures what the tokens its text reading inserts (an EOS after every document) cost the
base model, and warns when they cost far more than the text (conversion/data/separators.py)."""

import math

import pytest
import torch
from torch import nn

from expertize.conversion.data.separators import (
    GAP_NATS, SeparatorCost, check_separators, separator_cost, separator_warning,
)
from expertize.conversion.recipe.data import DataConfig
from tests.conftest import VOCAB, tiny_tokenizer, write_corpus

EOS = 2


BOS = 1


class _Base(nn.Module):
    """Uniform over the vocabulary except `eos_logit` on EOS (a base that never expects an end of text) and
    `bos_logit` on BOS."""

    def __init__(self, eos_logit: float, bos_logit: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.eos_logit, self.bos_logit = eos_logit, bos_logit

    def forward(self, input_ids, use_cache=False):
        logits = torch.zeros(*input_ids.shape, VOCAB)
        logits[..., EOS] = self.eos_logit
        logits[..., BOS] = self.bos_logit
        return type("Out", (), {"logits": logits})


def test_separator_cost_splits_eos_targets_from_the_rest():
    ids = torch.tensor([[1, 5, 6, EOS, 7, EOS], [1, 8, EOS, 9, 10, 11]])  # 3 EOS targets, 7 others (position 0 never)
    cost = separator_cost(_Base(-20.0), ids, EOS)
    others = math.log(VOCAB - 1 + math.exp(-20.0))  # CE of any other token under these logits
    assert (cost.inserted, cost.others) == (3, 7)
    assert cost.inserted_ce == pytest.approx(20.0 + others) and cost.other_ce == pytest.approx(others)
    assert cost.excess == pytest.approx(20.0 * 3 / 10)  # the mean CE over all 10 targets minus the others' mean


def test_the_warning_names_the_numbers_and_the_reading_that_fixes_it(tmp_path):
    cfg = DataConfig(paths=[str(write_corpus(tmp_path / "c.txt", 200))], context_length=16, eval_fraction=0.3)
    said = []
    # A base that never saw EOS nor BOS inside its text (trained on one raw stream).
    cost = check_separators(cfg, tiny_tokenizer(), _Base(-25.0, -25.0), said.append)
    assert cost.inserted >= 4 and cost.gap > 20
    assert said == [
        f"warning: data: the base model's CE on the '</s>' inserted after every line is {cost.inserted_ce:.1f} nats "
        f"against {cost.other_ce:.2f} on the other tokens ({cost.inserted} and {cost.others} targets of 8 held-out "
        f"sequences; they add {cost.excess:.2f} nats to its mean CE): it was not trained on text read this way, so "
        "its CE and every ΔCE / KL measure text it does not model. The reading that matches it: if it was trained "
        "on the raw file, read it as one stream: data.add_bos: false, data.document_separator: file and "
        "data.eval_split: tail (each file one stream, its end held out; or give held-out files in "
        "data.eval_paths); if it marks documents with BOS, set data.document_marker: bos and data.add_bos: false; "
        "documents cut off mid-text (samples of a fixed length) cost this under any reading"]
    # llama2.c's reading measured and off too (stories260k's samples are cut at a fixed length): said, not offered.
    both_off = separator_warning(cost, cfg, "</s>", SeparatorCost(14.0, 1.3, 8, 2032))
    assert ("The reading that matches it: BOS before every document instead (llama2.c's reading) costs it 14.0 nats, "
            "above the bound too; if it was trained on the raw file") in both_off
    said.clear()
    assert check_separators(cfg, tiny_tokenizer(), _Base(0.0), said.append).gap < GAP_NATS and said == []
    # Too few inserted tokens in the probe (long documents) tell nothing.
    assert separator_warning(SeparatorCost(30.0, 3.0, 3, 1000), cfg, "</s>") is None


def test_the_fix_the_warning_names_gives_a_run_that_reads_clean(tmp_path):
    """Issue 39: every warning's fix, applied as written, works: the stream reading is accepted by the data checks
    (before: its held-out split was refused as empty) and inserts nothing the base must predict."""
    from expertize.conversion.data.corpus_check import check_data

    path = write_corpus(tmp_path / "c.txt", 200)
    stream = DataConfig(paths=[str(path)], context_length=16, eval_fraction=0.3, train_tokens=256, eval_tokens=64,
                        add_bos=False, document_separator="file", eval_split="tail")
    assert check_data(stream, tiny_tokenizer()).eval_sequences == 4
    said = []
    check_separators(stream, tiny_tokenizer(), _Base(-25.0, -25.0), said.append)
    assert said == []


def test_a_base_that_starts_documents_with_bos_is_offered_llama2c_reading(tmp_path):
    """A base that expects BOS before each document but never EOS (llama2.c, stories260k): the warning measures
    that reading and recommends it; applied, the check is quiet."""
    cfg = DataConfig(paths=[str(write_corpus(tmp_path / "c.txt", 200))], context_length=32, eval_fraction=0.3)
    said = []
    check_separators(cfg, tiny_tokenizer(), _Base(-25.0, 0.0), said.append)
    assert len(said) == 1 and said[0].endswith(
        "The reading that matches it: its documents start with BOS and no EOS (llama2.c's reading: "
        f"{math.log(VOCAB - 1 + math.exp(-25.0)):.2f} nats on those BOS tokens): set data.document_marker: bos and "
        "data.add_bos: false")
    said.clear()
    bos_reading = DataConfig(paths=cfg.paths, context_length=32, eval_fraction=0.3, document_marker="bos",
                             add_bos=False)
    cost = check_separators(bos_reading, tiny_tokenizer(), _Base(-25.0, 0.0), said.append)
    assert said == [] and cost.inserted >= 4


SHIPPED_LOCAL = ("quickstart", "stories260k-mxd", "stories260k-clt")
"""The shipped recipes whose base and text ship with the package (the others name Hub models)."""


@pytest.mark.parametrize("name", SHIPPED_LOCAL)
def test_no_shipped_recipe_warns_about_its_own_reading(name):
    """Issue 50: the stories260k recipes read their text as llama2.c trained the model (BOS before every story), and
    once warned that the inserted BOS cost the base 14 nats: the shipped samples were cut at a fixed length, so no
    reading could give the model its own text. With complete stories (scripts/sample_stories260k.py) every shipped
    recipe's reading is one its base reads as its own, measured as `upcycle` measures it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from expertize.conversion.data.separators import reading_cost, reading_warning
    from expertize.conversion.recipe import load_recipe

    recipe = load_recipe(name)
    tokenizer = AutoTokenizer.from_pretrained(recipe.base_model)
    base = AutoModelForCausalLM.from_pretrained(recipe.base_model).eval()
    cost = reading_cost(recipe.data, tokenizer, base)
    assert reading_warning(recipe.data, tokenizer, base, cost=cost) is None, cost
