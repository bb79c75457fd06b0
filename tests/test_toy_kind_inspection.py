"""A kind that conversion/ has never heard of (tests/toy_kind.py, registered for the test only) goes through
`expertize inspect` with its own meaning, unit name, routing statistics and vocabulary effects, all read from what the
kind declares (issue 20: adding a kind touches its own file and the registry, never conversion/). The numbers are
checked against brute force over the corpus, as tests/test_inspect.py does for the real kinds."""

import json

import pytest
import torch

from expertize.conversion.cli import main
from expertize.conversion.inspection import LAYER_SCHEMA, validate
from expertize.conversion.publishing.card import CardInputs, render_model_card
from expertize.conversion.surgery.splice import save_model, splice
from expertize.modeling import build_sparse_layer
from tests.conftest import D_MODEL, tiny_base_model, tiny_tokenizer, write_corpus
from tests.test_inspect import _vocab_logits, corpora, hand_set, layer_inputs, run
from tests.toy_kind import (
    TOY_ACTIVATION_MEANING,
    TOY_CITATION,
    TOY_CODE_UNIT,
    TOY_TINY_FIELDS,
    ToySpec,
    toy_kind,  # noqa: F401 (the fixture)
)


def toy_spec(kind: str) -> ToySpec:
    return ToySpec(d_in=D_MODEL, d_out=D_MODEL, **TOY_TINY_FIELDS[kind])


def toy_model(kind: str, family: str = "gpt2"):
    """A float64 tiny model with the toy kind at layer 1 (hand-set weights: spread-out codes, non-zero decoder)."""
    return splice(tiny_base_model(family), {1: hand_set(toy_spec(kind), 3)}).double().eval()


def test_the_engine_reads_meaning_routing_and_effects_from_the_toy_kind(toy_kind):
    model = toy_model(toy_kind)
    sequences = corpora()
    stats = run(model, sequences, vocab_top=4)
    layer = model.sparse_layers()[1]
    report = stats.to_json(1)
    validate(report, LAYER_SCHEMA)
    assert (report["kind"], report["unit_name"], report["activation"]) == (
        toy_kind, TOY_CODE_UNIT, TOY_ACTIVATION_MEANING
    )

    # Routing: the kind declares router_distribution = "scores", so the load is its top-K assignments and the
    # entropy that of the softmax over its recorded scores s = W_enc x + b_enc.
    x = layer_inputs(model, layer, sequences)
    with torch.no_grad():
        scores = torch.nn.functional.linear(x, layer.W_enc, layer.b_enc)  # (tokens, L)
    L, K = layer.num_units, layer.spec.k
    top = scores.topk(K, dim=-1).indices
    load = torch.bincount(top.reshape(-1), minlength=L).double() / top.numel()
    p = scores.double().softmax(-1)
    routing = report["routing"]
    assert routing["experts"] == L and routing["entropy_of"] == "softmax of router scores"
    assert routing["load"] == pytest.approx(load.tolist())
    assert routing["router_entropy"] == pytest.approx(float(-(p * p.log()).sum(-1).mean()))
    assert not layer.record_router_outputs and layer.router_logits is None  # the pass leaves the layer as it was

    # Vocabulary effects: through its output_directions (W_dec rows), the final norm and the unembedding.
    ids, values = stats.layers[1].promoted
    for unit in range(L):
        logits = _vocab_logits(model, layer.W_dec[unit])
        assert ids[unit, 0].tolist() == logits.topk(4).indices.tolist()
        assert ids[unit, 1].tolist() == (-logits).topk(4).indices.tolist()
        torch.testing.assert_close(values[unit, 0].double(), logits.topk(4).values, rtol=1e-4, atol=1e-5)
    assert all(len(u["promoted_tokens"]) == 4 for u in report["units"])


def test_expertize_inspect_reports_a_saved_toy_model(toy_kind, tmp_path, capsys):
    """The command itself, in-process (the registration is this process's): folder checks, loading, the pass, the
    reports and the explorer."""
    torch.manual_seed(0)
    model = splice(tiny_base_model("llama"), {1: build_sparse_layer(toy_spec(toy_kind))})
    folder = save_model(model, tmp_path / "model", tiny_tokenizer())
    corpus = write_corpus(tmp_path / "a.txt", 60)
    out = tmp_path / "report"
    code = main(["inspect", str(folder), "--corpus", f"plain={corpus}", "--tokens", "400", "--context-length", "16",
                 "--output", str(out), "--top-n", "3", "--vocab-top", "5", "--no-progress"])
    assert code == 0
    report = json.loads((out / "layer_1.json").read_text(encoding="utf-8"))
    validate(report, LAYER_SCHEMA)
    assert (report["kind"], report["unit_name"], report["activation"]) == (
        toy_kind, TOY_CODE_UNIT, TOY_ACTIVATION_MEANING
    )
    assert report["routing"]["experts"] == TOY_TINY_FIELDS[toy_kind]["num_latents"]
    assert sum(report["routing"]["load"]) == pytest.approx(1.0)
    assert all(len(u["promoted_tokens"]) == len(u["suppressed_tokens"]) == 5 for u in report["units"])
    assert TOY_ACTIVATION_MEANING in (out / "index.html").read_text(encoding="utf-8")
    assert f"layer 1 ({toy_kind})" in capsys.readouterr().out


def test_a_model_card_names_and_cites_the_toy_kind(toy_kind, tmp_path):
    """The card reads a kind's title, unit and citation from the registry when it renders (a kind registered after
    import included; the citations were a table frozen at import before)."""
    card = str(render_model_card(tmp_path, CardInputs(base_model="tiny-gpt2", layers={1: toy_spec(toy_kind).to_dict()},
                                                      recipe_summary={}, metrics=None)))
    assert ToySpec.title in card and TOY_CITATION in card
