"""What a reader sees as a unit's activation (`SparseLayer.activation_hook`; issue 22): the code hook for kinds whose
code weight is the unit's contribution scale, and for routed neurons (whose code weight is a router gate, so "fires"
only means "selected") the neuron's contribution |g·h|. Inspection's statistics and specialization's pooled codes read
it; interventions still edit the code (the gates)."""

import pytest
import torch

from expertize.conversion.inspection.stats import InspectionSettings, collect_stats
from expertize.conversion.specialization.passes import pooled_codes
from expertize.conversion.surgery.splice import splice
from expertize.modeling import build_sparse_layer
from tests.conftest import tiny_base_model
from tests.kinds import KINDS, tiny_spec


def _routed(seed: int = 0):
    torch.manual_seed(seed)
    layer = build_sparse_layer(tiny_spec("routed_neurons"))
    with torch.no_grad():  # a nonzero decoder, so the output depends on every contribution
        layer.W_dec.normal_()
    return layer


def _contribution_by_hand(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, |g·h|) from the layer's own parts: encode's gates times the selected neurons' activations."""
    flat = x.reshape(-1, x.shape[-1])
    code = layer.encode(x).flat()
    h = layer.neuron_activations(flat, code.top_k_index)
    return code.top_k_index, (code.top_k_weights * h).abs()


@pytest.mark.parametrize("kind", KINDS)
def test_other_kinds_read_their_code(kind):
    layer = build_sparse_layer(tiny_spec(kind))
    if kind == "routed_neurons":
        assert layer.activation_hook is layer.contribution_hook is not layer.code_hook
    else:
        assert layer.activation_hook is layer.code_hook


def test_routed_neurons_activation_is_the_contribution_not_the_gate():
    layer = _routed()
    x = torch.randn(2, 5, layer.spec.d_in)
    seen = {}
    layer.activation_hook.register_forward_hook(lambda m, a, out: seen.setdefault("act", out))
    layer.code_hook.register_forward_hook(lambda m, a, out: seen.setdefault("code", out))
    layer(x)
    index, contribution = _contribution_by_hand(layer, x)
    assert seen["act"].top_k_index.shape == (2, 5, layer.spec.k)  # the code's shape, like code_hook
    assert torch.equal(seen["act"].top_k_index.reshape(-1, layer.spec.k), index)
    torch.testing.assert_close(seen["act"].top_k_weights.reshape(-1, layer.spec.k), contribution)
    # ... which is not what the code (the softmax gates, summing to 1 per token) holds
    assert not torch.allclose(seen["act"].top_k_weights, seen["code"].top_k_weights)
    torch.testing.assert_close(seen["code"].top_k_weights.sum(-1), torch.ones(2, 5))


def test_the_contribution_view_is_read_only_and_interventions_edit_the_gates():
    layer = _routed()
    x = torch.randn(3, layer.spec.d_in)
    reference = layer(x)
    handle = layer.activation_hook.register_forward_hook(
        lambda m, a, out: type(out)(out.top_k_index, torch.zeros_like(out.top_k_weights)))
    torch.testing.assert_close(layer(x), reference)  # replacing the view changes nothing
    handle.remove()
    unit = int(layer.encode(x).top_k_index[0, 0])
    with layer.intervene(ablate=[unit]):
        seen = {}
        layer.activation_hook.register_forward_hook(lambda m, a, out: seen.setdefault("act", out))
        changed = layer(x)
    assert not torch.allclose(changed, reference)  # ablation still removes the neuron's output
    listed = seen["act"].top_k_index == unit
    assert listed.any() and torch.all(seen["act"].top_k_weights[listed] == 0)  # and the view shows it gone


def test_inspection_and_pooled_codes_read_the_contribution():
    model = splice(tiny_base_model("llama"), {1: _routed()})
    layer = model.sparse_layers()[1]
    torch.manual_seed(1)
    tokens = torch.randint(3, model.config.vocab_size, (4, 12))
    contributions = {}
    layer.activation_hook.register_forward_hook(lambda m, a, out: contributions.setdefault(len(contributions), out))
    stats = collect_stats(model, {"a": tokens}, InspectionSettings(batch_size=4, top_n=2), str)
    (code,) = contributions.values()
    dense = torch.zeros(4 * 12, layer.num_units, dtype=torch.float64)
    dense.scatter_add_(1, code.top_k_index.reshape(48, -1), code.top_k_weights.reshape(48, -1).double())
    fired = (dense > 0).sum(0)
    expected_mean = (dense.sum(0) / fired.clamp_min(1)).float()
    layer_stats = stats.layers[1]
    torch.testing.assert_close(layer_stats.mean_activation, expected_mean)
    torch.testing.assert_close(layer_stats.max_activation, dense.max(0).values.float())
    pooled = pooled_codes(model, layer, tokens, torch.ones(4, 12, dtype=torch.bool), batch_size=4)
    torch.testing.assert_close(pooled, dense.view(4, 12, -1).mean(1).float())
