"""One row per model family: the table that drives every family test (tiny configs, the native classes, what the
tests assert about the MLP and the norms around it). `tests/test_splice_roundtrip.py` asserts that its families are
exactly the bundle's `FAMILIES`, so a new family fails the suite until it has a row here; no test writes a family
list of its own.

A row holds what a person reads off the native implementation (transformers' modeling file of the family), written
independently of expertize's own tables (`expertize.modeling.FAMILIES`, `conversion/surgery/families.py`) so that
the tests can hold those to it: the MLP's activation, gating and biases, and the modules around the MLP in a
decoder block — which norm feeds it, which one (if any) normalizes its output, and the final norm.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import transformers

REFERENCE_FAMILY = "llama"
"""The family that stands for all of them in the tests that need only one."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Model sizes in the vocabulary of transformers' testers; a family's `spell` writes them in its config's names."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    activation: str | None = None
    """The MLP's activation; None keeps the family's default (the real models')."""


def _gpt2(s: Sizes) -> dict[str, Any]:
    kwargs = dict(vocab_size=s.vocab_size, n_embd=s.hidden_size, n_inner=s.intermediate_size,
                  n_layer=s.num_hidden_layers, n_head=s.num_attention_heads, n_positions=s.max_position_embeddings)
    return kwargs if s.activation is None else {**kwargs, "activation_function": s.activation}


def _neox(s: Sizes) -> dict[str, Any]:
    kwargs = dict(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                  num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                  max_position_embeddings=s.max_position_embeddings)
    return kwargs if s.activation is None else {**kwargs, "hidden_act": s.activation}


def _llama_like(activation_key: str = "hidden_act", head_dim: bool = False, **fixed) -> Callable[[Sizes], dict]:
    """Llama's config names; `activation_key`: the activation's name (Gemma: hidden_activation); `head_dim`: set it to
    hidden / heads (Gemma and Qwen3 default it to 256 / 128, whatever the hidden size); `fixed`: further fields."""

    def spell(s: Sizes) -> dict[str, Any]:
        kwargs = dict(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                      num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                      num_key_value_heads=s.num_key_value_heads, max_position_embeddings=s.max_position_embeddings,
                      **fixed)
        if head_dim:
            kwargs["head_dim"] = s.hidden_size // s.num_attention_heads
        return kwargs if s.activation is None else {**kwargs, activation_key: s.activation}

    return spell


@dataclasses.dataclass(frozen=True)
class FamilyRow:
    family: str
    """The native model_type (the key of `expertize.modeling.FAMILIES`)."""
    title: str
    """Its name in prose, as README.md and docs/native.md list it (tests/test_docs.py)."""
    native: tuple[type, type, type]
    """transformers' (config, base model, causal LM) classes."""
    spell: Callable[[Sizes], dict[str, Any]]
    """Sizes -> the family's config kwargs."""
    activation: str
    """The MLP's activation under the family's default config, in the sparse layers' spelling."""
    glu: bool
    """Gated MLP: down(act(gate x) * up x)."""
    bias: bool
    """The MLP's projections have biases."""
    attention: str
    """The attention module inside a decoder block."""
    mlp_norm: str | None
    """The norm whose output the MLP reads; None: the MLP reads the residual stream itself (OLMo-2)."""
    final_norm: str
    """The final norm's path from the causal LM."""
    attention_out_norm: str | None = None
    """A norm on the attention output before the residual add (Gemma's and OLMo-2's `post_attention_layernorm`)."""
    mlp_out_norm: str | None = None
    """A norm on the MLP output before the residual add (`post_feedforward_layernorm`)."""
    parallel: bool = False
    """Attention and MLP read the same block input (GPT-NeoX's parallel residual)."""
    token_type_ids: bool = False
    """The forward takes token type ids (GPT-2; its tester sends them)."""
    tester: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Overrides of the common tester's sizes (tests/common_testers.py) the family needs."""
    tiny: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Config fields of the tiny base model beyond its sizes (`tiny_config`)."""
    recipe: str | None = None
    """The shipped recipe a researcher starts from for this family (recipes/<name>.yaml), run end to end on the tiny
    random model by tests/test_family_recipes.py."""

    @property
    def config_class(self) -> type:
        return self.native[0]

    @property
    def sdpa(self) -> bool:
        """The native classes run with attn_implementation="sdpa" (Gemma 2's soft-capped attention does not)."""
        return bool(self.native[2]._supports_sdpa)

    def config(self, sizes: Sizes, **fields):
        """The native config of these sizes, with the row's `tiny` fields and then `fields` over them."""
        return self.config_class(**{**self.spell(sizes), **self.tiny, **fields})


def _native(prefix: str, base: str = "Model", causal: str = "ForCausalLM", config: str = "Config") -> tuple:
    return tuple(getattr(transformers, prefix + suffix) for suffix in (config, base, causal))


_SEQUENTIAL = dict(attention="self_attn", mlp_norm="post_attention_layernorm", final_norm="model.norm")
_GEMMA = dict(attention="self_attn", mlp_norm="pre_feedforward_layernorm", final_norm="model.norm",
              attention_out_norm="post_attention_layernorm", mlp_out_norm="post_feedforward_layernorm",
              activation="gelu_new", glu=True, bias=False)
_UNTIED = dict(tie_word_embeddings=False)

ROWS: dict[str, FamilyRow] = {
    row.family: row
    for row in [
        FamilyRow("gpt2", "GPT-2", _native("GPT2", causal="LMHeadModel"), _gpt2, "gelu_new", glu=False, bias=True,
                  attention="attn", mlp_norm="ln_2", final_norm="transformer.ln_f", token_type_ids=True),
        FamilyRow("gpt_neox", "GPT-NeoX", _native("GPTNeoX"), _neox, "gelu", glu=False, bias=True,
                  attention="attention", mlp_norm="post_attention_layernorm", final_norm="gpt_neox.final_layer_norm",
                  parallel=True,
                  # Two heads of 16: GPT-NeoX rotates a quarter of each head, and dynamic RoPE needs a rotary dim > 2.
                  tester=dict(num_attention_heads=2)),
        FamilyRow("llama", "Llama", _native("Llama"), _llama_like(), "silu", glu=True, bias=False, **_SEQUENTIAL,
                  tiny=_UNTIED),
        FamilyRow("mistral", "Mistral", _native("Mistral"), _llama_like(), "silu", glu=True, bias=False,
                  **_SEQUENTIAL, tiny=_UNTIED),
        FamilyRow("qwen2", "Qwen2", _native("Qwen2"), _llama_like(), "silu", glu=True, bias=False, **_SEQUENTIAL,
                  tiny=_UNTIED),
        # Qwen3: Qwen2 with q/k norms inside the attention (the MLP and its norms are Llama's).
        FamilyRow("qwen3", "Qwen3", _native("Qwen3"), _llama_like(head_dim=True), "silu", glu=True, bias=False,
                  **_SEQUENTIAL, tiny=_UNTIED, recipe="qwen3-0.6b-transcoders"),
        # OLMo-2: no norm before attention or MLP; each sublayer's output is normed before the residual add.
        FamilyRow("olmo2", "OLMo-2", _native("Olmo2"), _llama_like(), "silu", glu=True, bias=False,
                  attention="self_attn", mlp_norm=None, final_norm="model.norm",
                  attention_out_norm="post_attention_layernorm", mlp_out_norm="post_feedforward_layernorm",
                  tiny=_UNTIED, recipe="olmo2-1b-mxd"),
        # Gemma: tied embeddings (the family's default), a sliding window short enough to matter in tests, the soft
        # caps at their defaults (Gemma 2: attention 50, logits 30).
        FamilyRow("gemma2", "Gemma-2", _native("Gemma2"), _llama_like("hidden_activation", head_dim=True), **_GEMMA,
                  tiny=dict(sliding_window=4), recipe="gemma2-2b-transcoders"),
        FamilyRow("gemma3_text", "Gemma-3", _native("Gemma3", base="TextModel", config="TextConfig"),
                  _llama_like("hidden_activation", head_dim=True), **_GEMMA,
                  tiny=dict(sliding_window=4, sliding_window_pattern=2),  # every other layer global, as Gemma 2
                  recipe="gemma3-1b-transcoders"),
        # Phi-3: Llama's block and names, with one fused gate_up_proj in the MLP (gate half first) and a fused
        # qkv_proj; its default pad id (32000) lies outside a tiny vocabulary, so the tiny configs have none.
        FamilyRow("phi3", "Phi-3", _native("Phi3"), _llama_like(pad_token_id=None), "silu", glu=True, bias=False,
                  **_SEQUENTIAL),
        # StableLM: Llama's names and MLP, LayerNorms (with biases) before attention and MLP and at the end; a quarter
        # of each head rotated, as GPT-NeoX, hence two heads of 16 for the tester's dynamic RoPE.
        FamilyRow("stablelm", "StableLM", _native("StableLm"), _llama_like(), "silu", glu=True, bias=False,
                  **_SEQUENTIAL, tester=dict(num_attention_heads=2)),
    ]
}

FAMILY_NAMES = list(ROWS)

MLP_FORMS = [next(name for name in FAMILY_NAMES if ROWS[name].glu == glu) for glu in (False, True)]
"""The first family with a plain MLP and the first with a gated one (GPT-2, whose MLP is Conv1D; Llama): for tests of
what depends on the MLP's form only, not on the family. The default run covers every kind on them with transformers'
common tests (tests/test_transformers_common.py)."""
