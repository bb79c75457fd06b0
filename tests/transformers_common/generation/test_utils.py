"""Stand-in (written for expertize, not transformers' file) for `tests/generation/test_utils.py`, which the
transformers sdist does not ship and `test_modeling_common` imports `GenerationTesterMixin` from.

The contracts `generate()` and its clients (pipelines, lm-eval, vLLM-style batchers) rely on, each checked against a
reference that needs no trust in the model: a plain forward, the same call without padding, one prompt at a time, or
the dynamic cache. The same mixin runs on the native transformers classes as a control (tests/test_transformers_common.py),
so a failure that is the harness's own shows up there too.

Testers provide, besides transformers' tester API, `native_causal_lm_class` (the native class whose behaviour is the
reference for signature-driven features) and `generation_inputs(batch)` -> (input_ids, attention_mask, extra kwargs).
"""

import copy
import inspect

import torch
from transformers import GenerationMixin
from transformers.cache_utils import Cache

NEW_TOKENS = 4


class GenerationTesterMixin:
    test_compile_generate = True
    """`torch.compile(fullgraph=True)` + static-cache generation (seconds per model on CPU)."""

    # -- helpers ------------------------------------------------------------------------------------------------

    def _generative_models(self):
        """(model, input_ids, attention_mask, extra kwargs) per generative class, in eval mode, greedy-ready."""
        for model_class in self.all_generative_model_classes:
            config, _ = self.model_tester.prepare_config_and_inputs_for_common()
            torch.manual_seed(0)
            model = model_class(config).eval()
            model.generation_config.pad_token_id = self.model_tester.pad_token_id
            model.generation_config.eos_token_id = None  # never stop early: every call generates NEW_TOKENS tokens
            input_ids, attention_mask, extra = self.model_tester.generation_inputs(batch=2)
            yield model, input_ids, attention_mask, extra

    @staticmethod
    def _greedy(model, input_ids, attention_mask=None, **kwargs):
        kwargs.setdefault("max_new_tokens", NEW_TOKENS)
        return model.generate(input_ids, attention_mask=attention_mask, do_sample=False, **kwargs)

    @staticmethod
    def _extend(extra, length):
        """Per-token kwargs (GPT-2's token_type_ids) extended to `length` with their last column, as `generate`
        extends them while decoding."""
        return {key: torch.cat([v, v[:, -1:].expand(-1, length - v.shape[1])], dim=-1) for key, v in extra.items()}

    def _left_padded(self, prompts):
        """Left-pad a list of 1-D prompts: (input_ids, attention_mask), each (B, S)."""
        width = max(len(p) for p in prompts)
        pad = self.model_tester.pad_token_id
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = prompt
            mask[row, width - len(prompt) :] = 1
        return ids, mask

    # -- the contracts --------------------------------------------------------------------------------------------

    def test_inherits_generation_mixin(self):
        for model_class in self.all_generative_model_classes:
            self.assertTrue(issubclass(model_class, GenerationMixin))
            self.assertTrue(model_class.can_generate())

    def test_greedy_generate_equals_forward_argmax(self):
        """The cached decoding loop picks the argmax of a full forward over the sequence so far."""
        for model, input_ids, mask, extra in self._generative_models():
            with torch.no_grad():
                out = self._greedy(model, input_ids, mask, **extra)
                ids, m = input_ids, mask
                for _ in range(NEW_TOKENS):
                    step = self._extend(extra, ids.shape[1])
                    logits = model(ids, attention_mask=m, use_cache=False, **step).logits[:, -1]
                    ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=-1)
                    m = torch.cat([m, torch.ones_like(m[:, :1])], dim=-1)
            self.assertEqual(out.tolist(), ids.tolist())

    def test_greedy_generate_dict_outputs(self):
        """return_dict_in_generate with scores, logits, hidden states and attentions: every field is filled."""
        n_layers = self.model_tester.num_hidden_layers
        for use_cache in (True, False):
            for model, input_ids, mask, extra in self._generative_models():
                model.set_attn_implementation("eager")  # attention weights need the eager kernel
                out = self._greedy(
                    model, input_ids, mask, use_cache=use_cache, return_dict_in_generate=True, output_scores=True,
                    output_logits=True, output_hidden_states=True, output_attentions=True, **extra,
                )
                self.assertEqual(len(out.scores), NEW_TOKENS)
                self.assertEqual(len(out.logits), NEW_TOKENS)
                self.assertIsNotNone(out.hidden_states, "output_hidden_states=True returned no hidden states")
                self.assertIsNotNone(out.attentions, "output_attentions=True returned no attentions")
                self.assertEqual(len(out.hidden_states), NEW_TOKENS)
                for step in out.hidden_states:
                    self.assertEqual(len(step), n_layers + 1)
                    self.assertTrue(all(isinstance(h, torch.Tensor) for h in step))
                for step in out.attentions:
                    self.assertEqual(len(step), n_layers)
                if use_cache:
                    self.assertIsInstance(out.past_key_values, Cache)

    def test_sample_generate_is_seeded_and_top_k_1_is_greedy(self):
        for model, input_ids, mask, extra in self._generative_models():
            runs = []
            for _ in range(2):
                torch.manual_seed(7)
                runs.append(model.generate(input_ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW_TOKENS,
                                           **extra).tolist())
            self.assertEqual(runs[0], runs[1])
            top1 = model.generate(input_ids, attention_mask=mask, do_sample=True, top_k=1, max_new_tokens=NEW_TOKENS,
                                  **extra)
            self.assertEqual(top1.tolist(), self._greedy(model, input_ids, mask, **extra).tolist())

    def test_beam_search_generate(self):
        for model, input_ids, mask, extra in self._generative_models():
            out = model.generate(
                input_ids, attention_mask=mask, do_sample=False, num_beams=3, num_return_sequences=2,
                max_new_tokens=NEW_TOKENS, return_dict_in_generate=True, output_scores=True, **extra,
            )
            batch, length = input_ids.shape
            self.assertEqual(tuple(out.sequences.shape), (batch * 2, length + NEW_TOKENS))
            self.assertEqual(tuple(out.sequences_scores.shape), (batch * 2,))
            self.assertTrue(torch.isfinite(out.sequences_scores).all())
            # One beam is greedy search.
            one_beam = model.generate(input_ids, attention_mask=mask, do_sample=False, num_beams=1,
                                      max_new_tokens=NEW_TOKENS, **extra)
            self.assertEqual(one_beam.tolist(), self._greedy(model, input_ids, mask, **extra).tolist())

    def test_left_padding_compatibility(self):
        """Next-token logits of a prompt equal those of the same prompt behind left padding, given the attention mask
        (and position ids from it, where the forward signature takes them, as `generate` builds them)."""
        for model, input_ids, mask, extra in self._generative_models():
            mask = torch.ones_like(input_ids)
            pad = torch.full((input_ids.shape[0], 3), self.model_tester.pad_token_id, dtype=torch.long)
            padded_ids = torch.cat([pad, input_ids], dim=1)
            padded_mask = torch.cat([torch.zeros_like(pad), mask], dim=1)
            kwargs, padded_kwargs = {}, {}
            if "position_ids" in inspect.signature(model.forward).parameters:
                kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
                padded_kwargs["position_ids"] = (padded_mask.cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad():
                plain = model(input_ids, attention_mask=mask, **kwargs).logits[:, -1]
                padded = model(padded_ids, attention_mask=padded_mask, **padded_kwargs).logits[:, -1]
            torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)

    def test_batched_left_padded_generation_equals_one_by_one(self):
        """What batching clients (pipelines, lm-eval `generate_until`) rely on: the batch changes nothing."""
        for model, input_ids, _, _ in self._generative_models():
            gen = torch.Generator().manual_seed(3)
            prompts = [torch.randint(3, self.model_tester.vocab_size, (n,), generator=gen) for n in (2, 5, 3, 6)]
            ids, mask = self._left_padded(prompts)
            batched = self._greedy(model, ids, mask)[:, ids.shape[1] :]
            for row, prompt in enumerate(prompts):
                alone = self._greedy(model, prompt[None], torch.ones_like(prompt[None]))[0, len(prompt) :]
                self.assertEqual(batched[row].tolist(), alone.tolist(), f"prompt {row} (length {len(prompt)})")

    def test_generate_builds_the_attention_mask_from_padding(self):
        """Without an attention mask, `generate` infers one from the pad token (when it is not the EOS token)."""
        for model, _, _, _ in self._generative_models():
            gen = torch.Generator().manual_seed(4)
            prompts = [torch.randint(3, self.model_tester.vocab_size, (n,), generator=gen) for n in (3, 6)]
            ids, mask = self._left_padded(prompts)
            self.assertEqual(self._greedy(model, ids).tolist(), self._greedy(model, ids, mask).tolist())

    def test_past_key_values_format(self):
        for model, input_ids, mask, extra in self._generative_models():
            with torch.no_grad():
                out = model(input_ids, attention_mask=mask, use_cache=True, **extra)
            self.assertIsInstance(out.past_key_values, Cache)
            self.assertEqual(out.past_key_values.get_seq_length(), input_ids.shape[1])
            self.assertEqual(len(out.past_key_values.layers), self.model_tester.num_hidden_layers)

    def test_generate_continue_from_past_key_values(self):
        for model, input_ids, mask, extra in self._generative_models():
            full = self._greedy(model, input_ids, mask, max_new_tokens=2 * NEW_TOKENS, **extra)
            first = self._greedy(model, input_ids, mask, return_dict_in_generate=True, **extra)
            seq = first.sequences
            resumed = self._greedy(
                model, seq, torch.cat([mask, torch.ones_like(seq[:, input_ids.shape[1] :])], dim=1),
                past_key_values=first.past_key_values, **self._extend(extra, seq.shape[1]),
            )
            self.assertEqual(resumed.tolist(), full.tolist())

    def test_generate_from_inputs_embeds(self):
        for model, input_ids, mask, extra in self._generative_models():
            embeds = model.get_input_embeddings()(input_ids)
            from_embeds = model.generate(inputs_embeds=embeds, attention_mask=mask, do_sample=False,
                                         max_new_tokens=NEW_TOKENS, **extra)
            from_ids = self._greedy(model, input_ids, mask, **extra)[:, input_ids.shape[1] :]
            self.assertEqual(from_embeds.tolist(), from_ids.tolist())

    def test_generate_with_static_cache(self):
        for model, input_ids, mask, extra in self._generative_models():
            static = self._greedy(model, input_ids, mask, cache_implementation="static", **extra)
            self.assertEqual(static.tolist(), self._greedy(model, input_ids, mask, **extra).tolist())

    def test_generate_compile_model_forward_fullgraph(self):
        """Compiled static-cache decoding (`torch.compile(fullgraph=True)`): no graph break, the eager tokens."""
        if not self.test_compile_generate:
            self.skipTest("compiled generation is not tested for this tester (test_compile_generate = False)")
        import torch._dynamo

        for model, input_ids, mask, extra in self._generative_models():
            eager = self._greedy(model, input_ids, mask, cache_implementation="static", **extra)
            torch._dynamo.reset()
            compiled = copy.copy(model)
            compiled.forward = torch.compile(model.forward, fullgraph=True, dynamic=False)
            out = self._greedy(compiled, input_ids, mask, cache_implementation="static", **extra)
            self.assertEqual(out.tolist(), eager.tolist())

    def test_logits_to_keep_as_native(self):
        """`generate` asks the forward for last-position logits only when its signature takes `logits_to_keep`."""
        native = self.model_tester.native_causal_lm_class
        for model, input_ids, mask, extra in self._generative_models():
            self.assertEqual(model._supports_logits_to_keep(), native._supports_logits_to_keep(model))
            if model._supports_logits_to_keep():
                with torch.no_grad():
                    full = model(input_ids, attention_mask=mask, **extra).logits
                    last = model(input_ids, attention_mask=mask, logits_to_keep=1, **extra).logits
                self.assertEqual(last.shape[1], 1)
                torch.testing.assert_close(last[:, -1], full[:, -1])

    def test_assisted_and_prompt_lookup_decoding_match_greedy(self):
        for model, input_ids, mask, extra in self._generative_models():
            greedy = self._greedy(model, input_ids[:1], mask[:1]).tolist()
            assistant = copy.deepcopy(model)
            assisted = self._greedy(model, input_ids[:1], mask[:1], assistant_model=assistant)
            self.assertEqual(assisted.tolist(), greedy)
            lookup = self._greedy(model, input_ids[:1], mask[:1], prompt_lookup_num_tokens=2)
            self.assertEqual(lookup.tolist(), greedy)

    def test_generate_under_inference_mode(self):
        for model, input_ids, mask, extra in self._generative_models():
            reference = self._greedy(model, input_ids, mask, **extra)
            with torch.inference_mode():
                out = self._greedy(model, input_ids, mask, **extra)
                logits = model(input_ids, attention_mask=mask, **extra).logits
            self.assertEqual(out.tolist(), reference.tolist())
            self.assertTrue(torch.isfinite(logits).all())
