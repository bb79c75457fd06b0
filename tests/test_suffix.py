"""Cheap interventions are exact: replaying decoder blocks L… from the recorded prefix gives the full forward's logits
bit for bit in every family (absolute positions, parallel residual, rotary embeddings; sdpa and eager attention), and
stacked masking / steering conditions give, per document, the CE sums of full forwards under `layer.intervene`."""

import pytest
import torch

from expertize.conversion.specialization.conditions import Condition, condition_ce
from expertize.conversion.specialization.errors import SpecializationError
from expertize.conversion.specialization.suffix import SuffixRunner
from expertize.conversion.training.losses import next_token_ce
from expertize.conversion.surgery.splice import splice
from tests.conftest import FAMILY_NAMES, VOCAB, tiny_base_model
from tests.families import REFERENCE_FAMILY, ROWS
from tests.kinds import KINDS, tiny_spec
from tests.test_inspect import hand_set


def model_with(kind: str, family: str, at: int, attention: str = "sdpa"):
    """A float32 tiny model (2 blocks) with a hand-set `kind` layer at block `at` (a transcoder at the other)."""
    layers = {at: hand_set(tiny_spec(kind, activation="gelu_new"), 2), 1 - at: hand_set(tiny_spec("transcoder"), 1)}
    model = splice(tiny_base_model(family), layers).eval()
    model.set_attn_implementation(attention)
    return model


def text(S: int = 5, T: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, T) token ids and a document index per token (documents of 7 tokens, packed across contexts)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (S, T), generator=gen)
    return ids, torch.arange(S * T).reshape(S, T) // 7


# Every family with each attention its native class runs (Gemma 2's soft-capped attention has no sdpa).
ATTENTION = [(family, attention) for family in FAMILY_NAMES
             for attention in (["sdpa", "eager"] if ROWS[family].sdpa else ["eager"])]


@pytest.mark.parametrize("family, attention", ATTENTION)
def test_suffix_replay_equals_the_full_forward(family, attention):
    ids, _ = text()
    for at in (0, 1):
        model = model_with("mxd", family, at, attention)
        runner = SuffixRunner(model, at)
        prefix, logits = runner.capture(ids)
        with torch.no_grad():
            assert torch.equal(logits, model(input_ids=ids, use_cache=False).logits)
        assert torch.equal(runner.logits(prefix), logits), (family, attention, at)
        stacked = runner.logits(prefix, copies=3)  # three copies of the batch in one pass: equal to float rounding
        for c in range(3):
            torch.testing.assert_close(stacked[c * 5 : c * 5 + 5], logits, rtol=1e-5, atol=1e-5)
        runner.check(prefix, logits)


def reference_sums(model, layer, ids, documents, conditions, batch_size):
    """Per-document CE sums from full forwards under `layer.intervene`, accumulated as condition_ce does."""
    targets = torch.unique(documents[:, 1:], return_inverse=True)[1]
    n = int(targets.max()) + 1
    sums = torch.zeros(len(conditions), n, dtype=torch.float64)
    for i, c in enumerate(conditions):
        for lo in range(0, ids.shape[0], batch_size):
            batch = ids[lo : lo + batch_size]
            with torch.no_grad(), layer.intervene(steer=dict(c.steer), ablate=c.ablate):
                ce = next_token_ce(model(input_ids=batch, use_cache=False).logits, batch)
            sums[i].index_add_(0, targets[lo : lo + batch_size].reshape(-1), ce.reshape(-1).double())
    return sums


def conditions_for(num_units: int) -> list[Condition]:
    gen = torch.Generator().manual_seed(1)
    units = torch.randperm(num_units, generator=gen).tolist()
    return [
        Condition(ablate=tuple(sorted(units[:3]))), Condition(steer=((units[0], 2.5),)),
        Condition(ablate=tuple(sorted(units[3:8]))), Condition(steer=((units[5], -1.25),)), Condition(),
        Condition(ablate=(units[2],), steer=((units[7], 1.5),)),
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_conditions_equal_full_forwards_under_intervene(kind):
    """Every kind (GPT-2): ablation and steering on the suffix give the full forwards' per-document CE sums."""
    model = model_with(kind, "gpt2", 1)
    layer = model.sparse_layers()[1]
    ids, documents = text(S=3)
    conditions = conditions_for(layer.num_units)
    got = condition_ce(SuffixRunner(model, 1), layer, ids, documents, conditions, batch_size=2)
    want = reference_sums(model, layer, ids, documents, conditions, batch_size=2)
    assert torch.equal(got.conditions, want), kind
    assert torch.equal(got.base, want[4])  # the empty condition is the base CE
    assert got.tokens.sum() == 3 * 11 and got.documents == int(documents[:, 1:].max()) + 1
    stacked = condition_ce(SuffixRunner(model, 1), layer, ids, documents, conditions, batch_size=6, stack=True)
    torch.testing.assert_close(stacked.conditions, reference_sums(model, layer, ids, documents, conditions, 6),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_stacked_conditions_are_exact_in_every_family(family):
    model = model_with("transcoder", family, 0, "eager")
    layer = model.sparse_layers()[0]
    ids, documents = text(S=6)
    conditions = conditions_for(layer.num_units)
    want = reference_sums(model, layer, ids, documents, conditions, batch_size=4)
    for full_forward in (False, True):  # the suffix, and the full-forward fallback
        got = condition_ce(SuffixRunner(model, 0), layer, ids, documents, conditions, 4, full_forward=full_forward)
        assert torch.equal(got.conditions, want), (family, full_forward)


def test_a_replay_that_differs_is_refused():
    model = model_with("transcoder", REFERENCE_FAMILY, 1)
    runner = SuffixRunner(model, 1)
    prefix, logits = runner.capture(text()[0])
    with pytest.raises(SpecializationError, match="does not reproduce its full forward"):
        runner.check(prefix, logits + 1e-6)
    with pytest.raises(SpecializationError, match="not a decoder block"):
        SuffixRunner(model, 2)
