"""The contract every sparse layer kind keeps, one battery driven by tests/kinds.py (a new kind is one row there)."""

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from expertize.modeling import FAMILIES, ExpertizeLlamaConfig, build_sparse_layer
from tests.common_testers import FamilyTester
from tests.kinds import KINDS, tiny_spec


def _random(layer, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer.eval()


@pytest.mark.parametrize("kind", KINDS)
def test_code_hook_sees_the_inputs_leading_shape(kind):
    """Inside a model the code at `mlp.code_hook` is (batch, seq, K), like the module's own output (batch, seq, O)."""
    model = AutoModelForCausalLM.from_config(FamilyTester(None, "llama", kind).get_config()).eval()
    seen = []
    model.model.layers[1].mlp.code_hook.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        model(torch.randint(3, 99, (3, 5)))
    (code,) = seen
    assert code.top_k_index.shape[:2] == code.top_k_weights.shape[:2] == (3, 5)
    assert code.top_k_index.shape == code.top_k_weights.shape


@pytest.mark.parametrize("kind", KINDS)
def test_inference_mode_and_hooked_edits_agree_with_no_grad(kind):
    """Every kind runs under torch.inference_mode() with the same output as under no_grad, and an edit of the code
    made by a hook reaches the output there too (inference tensors carry no version counter to detect it)."""
    layer = _random(build_sparse_layer(tiny_spec(kind)))
    x = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(1))

    def zero_in_place(module, args, code):  # what nnsight's `code_hook.output.top_k_weights[:] = 0` does
        code.top_k_weights.mul_(0)

    with torch.no_grad():
        reference = layer(x)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), reference)
        handle = layer.code_hook.register_forward_hook(zero_in_place)
        zeroed = layer(x)
        handle.remove()
    with torch.no_grad():
        handle = layer.code_hook.register_forward_hook(zero_in_place)
        torch.testing.assert_close(zeroed, layer(x))
        handle.remove()
    assert not torch.allclose(zeroed, reference)


@pytest.mark.parametrize("kind", KINDS)
def test_layer_compiles_fullgraph_with_the_eager_output(kind):
    """No host synchronization or data-dependent shape: torch.compile(fullgraph=True) traces the layer."""
    import torch._dynamo

    layer = _random(build_sparse_layer(tiny_spec(kind)))
    x = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(layer, fullgraph=True)(x), layer(x), rtol=1e-5, atol=1e-5)


def test_auto_classes_know_the_expertize_configs_in_process():
    for family in FAMILIES:
        config = FamilyTester(None, family, "mxd").get_config()
        assert type(AutoModelForCausalLM.from_config(config)) is FAMILIES[family].causal_lm_class
        assert type(AutoModel.from_config(config)) is FAMILIES[family].base_model_class
    assert isinstance(ExpertizeLlamaConfig(), ExpertizeLlamaConfig)
