"""Tiny model testers in the shape transformers' own testers have (`prepare_config_and_inputs_for_common`,
`batch_size`, `seq_length`, ...), for every supported family, native or with one sparse layer spliced in.

Sizes follow transformers' `CausalLMModelTester` (batch 13, sequence 7, vocabulary 99, hidden 32, 2 layers, MLP width
37). Decoder layer 1 is sparse and layer 0 native, so hidden states before the sparse layer can be compared with the
native model's.
"""

import torch

from expertize.modeling import FAMILIES
from tests.families import ROWS, Sizes
from tests.kinds import tiny_spec

SPARSE_LAYER = 1


def _ids(shape, low, high, seed):
    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed))


class FamilyTester:
    """transformers' tester API for one family, native (`kind=None`) or with a `kind` layer at `SPARSE_LAYER`."""

    batch_size = 13
    seq_length = 7
    vocab_size = 99
    hidden_size = 32
    intermediate_size = 37
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    max_position_embeddings = 512
    type_vocab_size = 16  # GPT-2 embeds token types with its token embeddings: keep them inside any resized vocabulary
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    is_training = True

    def __init__(self, parent, family: str, kind: str | None):
        self.parent, self.family, self.kind = parent, family, kind
        self.row = ROWS[family]
        for name, value in self.row.tester.items():  # sizes the family needs (e.g. GPT-NeoX's heads)
            setattr(self, name, value)
        native_config, native_base, native_causal = self.row.native
        self.native_config_class, self.native_causal_lm_class = native_config, native_causal
        self.native_model_classes = (native_base, native_causal)
        if kind is None:
            self.config_class, self.base_model_class, self.causal_lm_class = native_config, native_base, native_causal
        else:
            fam = FAMILIES[family]
            self.config_class, self.base_model_class, self.causal_lm_class = (
                fam.config_class, fam.base_model_class, fam.causal_lm_class,
            )
        self.use_token_type_ids = self.row.token_type_ids  # GPT-2's forward takes them (its tester sends them)

    @property
    def all_model_classes(self):
        return (self.base_model_class, self.causal_lm_class)

    def native_config_kwargs(self) -> dict:
        sizes = Sizes(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                      intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                      num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                      max_position_embeddings=self.max_position_embeddings, activation="gelu")
        return dict(self.row.spell(sizes), **self.row.tiny, pad_token_id=self.pad_token_id,
                    bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id)

    def config_kwargs(self) -> dict:
        kwargs = self.native_config_kwargs()
        if self.kind is not None:
            shape = self.config_class(**kwargs).mlp_shape()
            spec = tiny_spec(self.kind, shape.d_model, shape.d_hidden, shape.activation, shape.glu)
            kwargs["sparse_layers"] = {str(SPARSE_LAYER): spec}
        return kwargs

    def get_config(self):
        return self.config_class(**self.config_kwargs())

    def prepare_config_and_inputs_for_common(self):
        input_ids = _ids((self.batch_size, self.seq_length), 0, self.vocab_size, seed=0)
        inputs = {"input_ids": input_ids, "attention_mask": torch.tril(torch.ones_like(input_ids))}
        if self.use_token_type_ids:
            inputs["token_type_ids"] = _ids((self.batch_size, self.seq_length), 0, self.type_vocab_size, seed=1)
        return self.get_config(), inputs

    def generation_inputs(self, batch: int):
        """(input_ids, attention_mask, extra forward kwargs) of real tokens (no pad / BOS / EOS ids)."""
        input_ids = _ids((batch, self.seq_length), 3, self.vocab_size, seed=2)
        extra = {}
        if self.use_token_type_ids:
            extra["token_type_ids"] = torch.zeros_like(input_ids)
        return input_ids, torch.ones_like(input_ids), extra
