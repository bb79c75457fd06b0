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


class _Base(nn.Module):
    """Uniform over the vocabulary except `eos_logit` on EOS: a base that never expects an end of text."""

    def __init__(self, eos_logit: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.eos_logit = eos_logit

    def forward(self, input_ids, use_cache=False):
        logits = torch.zeros(*input_ids.shape, VOCAB)
        logits[..., EOS] = self.eos_logit
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
    cost = check_separators(cfg, tiny_tokenizer(), _Base(-25.0), said.append)
    assert cost.inserted >= 4 and cost.gap > 20
    assert said == [
        f"warning: data: the base model's CE on the '</s>' inserted after every line is {cost.inserted_ce:.1f} nats "
        f"against {cost.other_ce:.2f} on the other tokens ({cost.inserted} and {cost.others} targets of 8 held-out "
        f"sequences; they add {cost.excess:.2f} nats to its mean CE): it was not trained on text read this way, so "
        "its CE and every ΔCE / KL measure text it does not model. If it was trained on the raw file, read it as one "
        "stream: data.add_bos: false, and data.document_separator: file (each file one stream; hold text out with "
        "data.eval_paths). If it marks documents another way (llama2.c's models start each with BOS and never saw "
        "EOS), no reading matches it yet and this cost is in every number"]
    said.clear()
    assert check_separators(cfg, tiny_tokenizer(), _Base(0.0), said.append).gap < GAP_NATS and said == []
    # Too few inserted tokens in the probe (long documents) tell nothing.
    assert separator_warning(SeparatorCost(30.0, 3.0, 3, 1000), cfg, "</s>") is None
