"""TransformerLens 4.x adapters for expertize folders: `TransformerBridge` with hooks on every sparse layer's code.

Registered through TransformerLens's own mechanism, the `transformer_lens.architectures` entry-point group
(pyproject.toml, one entry per family: `ExpertizeLlamaForCausalLM` -> `ExpertizeLlamaForCausalLMAdapter`), which its
`ArchitectureAdapterFactory` reads when it first selects an adapter. Each adapter is the family's native one (Llama,
Mistral, Qwen2, Qwen3, OLMo-2, Gemma-2, Gemma-3 text, GPT-2, GPT-NeoX) with the block's MLP made to fit both kinds of
block: the dense MLP's projections become optional, and an optional `code` component wraps the sparse layer's
`code_hook`. Hook names:

    blocks.{i}.mlp.hook_in / hook_out     the MLP's (sparse layer's) input and output, as for any model
    blocks.{i}.mlp.code.hook_out          the sparse code's weights, (batch, pos, K): read or replace them
    blocks.{i}.mlp.code.hook_index        their unit ids, (batch, pos, K): selected, not all fired; a slot fired
                                          where its weight (hook_out) is nonzero (`SparseCode.fired`)

How to build one (the adapter is found by architecture name, `config.architectures[0]`):

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, attn_implementation="eager")
    bridge = build_bridge_from_module(model, model.config.architectures[0], hf_config=model.config,
                                      tokenizer=AutoTokenizer.from_pretrained(folder, trust_remote_code=True))

(`transformer_lens.model_bridge.sources.build_bridge_from_module`). `TransformerBridge.boot_transformers(folder)`
refuses: TransformerLens 4.3.0 settles the architecture in `determine_architecture_from_hf_config`
(model_bridge/sources/_hf_format.py), which looks only in its built-in table (`SUPPORTED_ARCHITECTURES`), before the
factory that holds registered adapters is asked; it raises "Could not determine supported architecture from config".
Weight processing (`enable_compatibility_mode`, fold_ln) rewrites dense MLP weights and is not supported for sparse
layers: the bridge runs each layer's own forward.
"""

from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES
from transformer_lens.hook_points import HookPoint
from transformer_lens.model_bridge.generalized_components.base import GeneralizedComponent

from expertize.modeling import FAMILIES

__all__ = ["ADAPTERS", "SparseCodeBridge"]


class SparseCodeBridge(GeneralizedComponent):
    """Wraps a sparse layer's `code_hook` (the identity on its `SparseCode`): `hook_index` fires on the unit ids and
    `hook_out` on the weights, (batch, pos, K) each; what the hooks return is the code the layer decodes."""

    def __init__(self, name: str, **kwargs) -> None:
        super().__init__(name, **kwargs)
        self.hook_index = HookPoint()

    def forward(self, code):
        index = self.hook_index(code.top_k_index)
        weights = self.hook_out(code.top_k_weights)
        return self.original_component(type(code)(index, weights))


def _native_architecture(causal_lm_class: type) -> str:
    """The transformers class an expertize causal LM extends, e.g. "LlamaForCausalLM"."""
    return next(c.__name__ for c in causal_lm_class.__mro__ if c.__module__.startswith("transformers.models."))


def _adapter(causal_lm_class: type) -> type:
    native = SUPPORTED_ARCHITECTURES[_native_architecture(causal_lm_class)]

    def __init__(self, cfg) -> None:
        native.__init__(self, cfg)
        mlp = self.component_mapping["blocks"].submodules["mlp"]
        for projection in mlp.submodules.values():  # a sparse layer has none of the dense MLP's projections
            projection.optional = True
        mlp.submodules["code"] = SparseCodeBridge("code_hook", optional=True)  # a dense block has no code

    name = f"{causal_lm_class.__name__}Adapter"
    return type(name, (native,), {"__init__": __init__, "__module__": __name__, "__doc__": (
        f"{native.__name__} for {causal_lm_class.__name__}: dense or sparse MLP per block, the code hooked."
    )})


ADAPTERS: dict[str, type] = {
    family.causal_lm_class.__name__: _adapter(family.causal_lm_class) for family in FAMILIES.values()
}
"""Architecture name (config.json `architectures`) -> its adapter class; the entry points name these classes."""

globals().update({adapter.__name__: adapter for adapter in ADAPTERS.values()})
