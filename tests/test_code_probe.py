"""How much of a layer's fidelity its per-token code carries, and what a saved selection bias changes
(conversion/evaluation/code_probe.py), with the health warnings they feed (evaluation/health.py)."""

import pytest
import torch

from expertize.conversion.evaluation.code_probe import CodeProbe, _fvu
from expertize.conversion.evaluation.health import code_health
from expertize.modeling import build_sparse_layer
from expertize.modeling.sparse_code import SparseCode
from tests.conftest import D_MODEL
from tests.kinds import KINDS, randomized, tiny_spec


def _probe(layer, x, y) -> dict:
    probe = CodeProbe(layer)
    with torch.no_grad():
        probe.update(x, y, layer.encode(x))
        return probe.summary()


def _mean_code_output(layer, x):
    """The layer's output with every token's code replaced by the code's mean, written out by hand: (T, O)."""
    with torch.no_grad():
        code = layer.encode(x).flat()
        mean = torch.zeros(layer.num_units, dtype=x.dtype).index_add_(
            0, code.top_k_index.reshape(-1), code.top_k_weights.reshape(-1)) / x.shape[0]
        outputs = []
        for row in x:
            handle = layer.code_hook.register_forward_hook(
                lambda m, a, c: SparseCode(torch.arange(layer.num_units).expand(*c.top_k_index.shape[:-1], -1),
                                           mean.expand(*c.top_k_index.shape[:-1], -1)))
            outputs.append(layer(row[None]))
            handle.remove()
    return torch.cat(outputs)


def test_a_transcoders_fidelity_is_all_its_code():
    """A transcoder's average code decodes to one constant vector: without the per-token code it explains nothing
    (FVU 1 against its own output), so the code carries all of its fidelity."""
    layer = randomized(build_sparse_layer(tiny_spec("transcoder")), dtype=torch.float32, std=0.3).eval()
    x = torch.randn(300, D_MODEL, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = layer(x)
    out = _probe(layer, x, y)
    assert out["fvu_mean_code"] == pytest.approx(1.0, abs=1e-6)
    assert out["code_share"] == pytest.approx(1.0)
    assert code_health(dead_fraction=0.0, l0=4.0, k=4, effective_units=None, num_units=64,
                       code_share=out["code_share"]) == []


def test_a_layer_whose_fidelity_is_its_dense_path_is_warned():
    """An MxD whose gate picks the same K experts with nearly the same weights on every token (a huge gate bias on
    them, tiny gate weights): it still reconstructs its target through the dense path Dᵀz, but the per-token code
    carries almost none of that, so the code share is near 0 and the health warning says "dense path"."""
    layer = randomized(build_sparse_layer(tiny_spec("mxd")), dtype=torch.float32, std=0.3).eval()
    k = layer.spec.k
    with torch.no_grad():
        layer.W_gate.mul_(1e-3)
        layer.b_gate.zero_()
        layer.b_gate[:k] = 10.0
    x = torch.randn(200, D_MODEL, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = layer(x) + 0.01 * torch.randn(200, D_MODEL, generator=torch.Generator().manual_seed(2))
    out = _probe(layer, x, y)
    assert out["code_share"] < 0.01 and out["fvu_mean_code"] < 0.01
    warnings = code_health(dead_fraction=0.0, l0=float(k), k=k, effective_units=None, num_units=64,
                           code_share=out["code_share"])
    assert [w.split(":")[0] for w in warnings] == ["dense path"] and "0% of the variance" in warnings[0]


@pytest.mark.parametrize("kind", KINDS)
def test_the_average_code_replaces_every_tokens_code_in_every_kind(kind):
    """The probe's mean-code output equals the hand-written replacement through `code_hook`, token by token, for
    every kind (each decodes a dense code of all its units)."""
    layer = randomized(build_sparse_layer(tiny_spec(kind)), dtype=torch.float64, std=0.3).eval()
    x = torch.randn(40, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y = layer(x) + 0.1 * torch.randn(40, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    out = _probe(layer, x, y)
    assert out["fvu_mean_code"] == pytest.approx(_fvu(y, _mean_code_output(layer, x)), rel=1e-9)
    assert 0.0 <= out["code_share"] <= 1.0


def test_a_saved_selection_bias_is_measured_and_warned_and_a_zero_one_is_not():
    layer = randomized(build_sparse_layer({**tiny_spec("transcoder"), "selection_bias": True}),
                       dtype=torch.float32, std=0.3).eval()
    x = torch.randn(256, D_MODEL, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        layer.b_select.zero_()
        y = layer(x)
        assert _probe(layer, x, y)["bias_altered"] == 0.0
        layer.b_select[:8] = 5.0  # eight units chosen wherever they are positive at all
        out = _probe(layer, x, y)
    k = layer.spec.k
    with torch.no_grad():
        biased = layer.encode(x).top_k_index
        layer.b_select.zero_()
        plain = layer.encode(x).top_k_index
    expected = sum(len(set(b.tolist()) - set(p.tolist())) for b, p in zip(biased, plain)) / (len(x) * k)
    assert out["bias_altered"] == pytest.approx(expected) and expected > 0.05
    warnings = code_health(dead_fraction=0.0, l0=4.0, k=4, effective_units=None, num_units=64,
                           bias_altered=out["bias_altered"])
    assert warnings and warnings[0].startswith("selection bias:") and "balance_anneal" in warnings[0]


def test_the_raised_units_that_fire_on_held_out_tokens_are_counted():
    layer = randomized(build_sparse_layer({**tiny_spec("transcoder"), "selection_bias": True}),
                       dtype=torch.float32, std=0.3).eval()
    with torch.no_grad():
        layer.b_select.zero_()
    x = torch.randn(128, D_MODEL, generator=torch.Generator().manual_seed(6))
    probe = CodeProbe(layer)
    with torch.no_grad():
        code = layer.encode(x)
        probe.update(x, layer(x), code)
    fired = torch.zeros(layer.num_units, dtype=torch.bool)
    fired[code.top_k_index.reshape(-1)[code.top_k_weights.reshape(-1) > 0]] = True
    raised = torch.zeros(layer.num_units, dtype=torch.bool)
    raised[::2] = True
    assert probe.summary(raised)["raised_firing"] == int((raised & fired).sum())
