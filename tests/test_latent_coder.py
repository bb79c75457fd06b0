"""The transcoder kinds share one block (modeling/latent_coder.py, issue 49) without changing what they save or
say: the parameters in the order their checkpoints hold them, their counts, and their fields' documentation, which
a recipe's error messages and --help read through the base class."""

import pytest
import torch

from expertize.conversion.recipe import field_docs
from expertize.modeling import (
    JumpReluTranscoderLayer,
    JumpReluTranscoderSpec,
    SkipTranscoderSpec,
    TranscoderLayer,
    TranscoderSpec,
)
from expertize.modeling.latent_coder import LatentCoderLayer

I, O, L = 12, 10, 40


@pytest.mark.parametrize("layer_cls, spec, names", [
    (TranscoderLayer, TranscoderSpec(d_in=I, d_out=O, num_latents=L, k=4), ["W_enc", "b_enc", "W_dec", "b_dec"]),
    (TranscoderLayer, SkipTranscoderSpec(d_in=I, d_out=O, num_latents=L, k=4, selection_bias=True),
     ["W_enc", "b_enc", "W_dec", "b_dec", "W_skip", "b_select"]),
    (JumpReluTranscoderLayer, JumpReluTranscoderSpec(d_in=I, d_out=O, num_latents=L, k=4, skip_connection=True),
     ["W_enc", "b_enc", "threshold_exponent", "W_dec", "b_dec", "W_skip"]),
])
def test_each_kind_keeps_its_parameters_in_its_checkpoint_order_and_counts_them(layer_cls, spec, names):
    layer = layer_cls(spec)
    assert isinstance(layer, LatentCoderLayer)
    assert list(layer.state_dict()) == names
    assert spec.num_parameters() == sum(p.numel() for p in layer.parameters())


def test_the_same_seed_starts_each_kind_where_it_started_before_the_block():
    """The draws of the old per-kind __init__: W_enc then (without a skip path) W_dec, both U(±1/√fan_in)."""
    torch.manual_seed(0)
    layer = JumpReluTranscoderLayer(JumpReluTranscoderSpec(d_in=I, d_out=O, num_latents=L, k=4))
    torch.manual_seed(0)
    W_enc = torch.empty(L, I).uniform_(-1 / I**0.5, 1 / I**0.5)
    W_dec = torch.empty(L, O).uniform_(-1 / L**0.5, 1 / L**0.5)
    assert torch.equal(layer.W_enc, W_enc) and torch.equal(layer.W_dec, W_dec)
    assert torch.allclose(layer.threshold, torch.full((L,), 1e-3))


def test_fields_documented_on_the_shared_spec_are_read_for_each_kind():
    assert field_docs(TranscoderSpec)["num_latents"] == "L: dictionary size."
    assert field_docs(SkipTranscoderSpec)["k"] == "Active latents per token."
    assert field_docs(JumpReluTranscoderSpec)["k"].startswith("The target L0")  # restated in its own words
    assert field_docs(TranscoderSpec)["selection_bias"].startswith("A per-latent bias")


@pytest.mark.parametrize("spec_cls, words", [
    (TranscoderSpec, "TopK cannot select more latents than exist"),
    (JumpReluTranscoderSpec, "the target L0 cannot exceed the latents that exist"),
])
def test_a_k_above_the_latents_is_refused_in_the_kinds_words(spec_cls, words):
    with pytest.raises(ValueError, match=f"{spec_cls.kind}.k=50 exceeds {spec_cls.kind}.num_latents=40: {words}"):
        spec_cls(d_in=I, d_out=O, num_latents=L, k=50)
