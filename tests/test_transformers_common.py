"""transformers' own common model tests (ModelTesterMixin, ConfigTester of the pinned transformers version; see
tests/transformers_common/README.md) plus the generation contracts, run on every family x kind — and on the native
classes as the control, so a failure that is the harness's own is told apart from an expertize defect.

The matrix is tiered by what each tier can catch (docs/native.md#transformers-own-common-tests; the measurements and
the mutations that chose it: docs/results/test_loop.md):

- the default run (`DEFAULT`): the whole battery on every family with MxD and on every kind (but the cross-layer one)
  with one family of each MLP form (tests/families.py `MLP_FORMS`: GPT-2's plain Conv1D MLP, Llama's gated Linear
  one), less the tests of the whole model's machinery (`MXD_ONLY`: compile, export, dtypes, SDPA).
  A kind reaches a family only through the MLP's form and one shared mixin, and a kind file may import only torch
  and the shared `sparse_*` files (tests/test_structure.py), so a bug of one family x kind pair needs a code path the
  layout forbids, or one in that mixin (the model's init, save and load around the layer): the next tier holds every
  pair to those.
- the opt-in run that CI runs (`-m slow`): the machinery tests on every family with MxD, the cross-layer kind's
  battery on the two MLP forms (as the default run's other kinds), and on every other pair of the product the tests that exercise the replaced MLP (`MLP_CONTRACTS`:
  save/load, initialization, training and gradient checkpointing, batching and padding, generation and its cache,
  router outputs). The pair's MLP form (gated, fused, biased) and the family's model code around the layer meet the
  kind there; every family's tester uses one activation (gelu), so the activation is not what varies.
- the full matrix (`-m full_matrix`, outside CI): the rest of every pair's battery and the native controls. They
  check again what the two tiers above check once (the model's machinery does not depend on the kind); run them
  when a family or the pinned transformers changes.

Tests that do not apply to a model are skipped in code, with the reason, in `NOT_APPLICABLE` (also in docs/native.md).
"""

import fnmatch
import functools
import unittest
from unittest import mock

import pytest
from expertize.modeling import LAYER_KINDS
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

from tests.common_testers import FamilyTester
from tests.families import FAMILY_NAMES, MLP_FORMS
from tests.kinds import KINDS
from tests.transformers_common.generation.test_utils import GenerationTesterMixin
from tests.transformers_common.test_configuration_common import ConfigTester
from tests.transformers_common.test_modeling_common import ModelTesterMixin

DEFAULT = {(family, "mxd") for family in FAMILY_NAMES} | {
    (family, kind) for family in MLP_FORMS for kind in KINDS if not LAYER_KINDS[kind][0].cross_layer}
"""The (family, kind) pairs of the default run (the module docstring says why these). A cross-layer kind's pairs are
in the opt-in run: here its layers are lone (each reads only its own latents: the JumpReLU transcoder's path with a
one-slot decoder), and what a placed CLT does inside a model is tests/test_clt.py's."""

CROSS_LAYER_ON_FORMS = {(family, kind) for family in MLP_FORMS for kind in KINDS if LAYER_KINDS[kind][0].cross_layer}
"""The cross-layer kind on one family of each MLP form: the battery of `DEFAULT`'s other kinds, in CI's opt-in run."""

MXD_ONLY = ("test_generate_compile_model_forward_fullgraph", "test_torch_export", "test_bc_torch_dtype",
            "test_eager_matches_sdpa_inference_*", "test_sdpa_can_dispatch_non_composite_models")
"""Tests of the whole model's machinery (names; `*`: the parameterized ones): torch.compile and torch.export of the
whole model, loading in another dtype, eager vs SDPA attention in three dtypes and the SDPA dispatch. They run once per family, on the
family x MxD pairs, in CI's opt-in run (the fullgraph compile alone takes 20–40 s a family on 2 cores: in the fast
suite they took it past 8 minutes). A kind meets them as it meets any forward, and its own fullgraph compile and
dtypes are tests/test_kind_contract.py's (in the default run); on the other pairs of `DEFAULT` they are in the full
matrix."""

MLP_CONTRACTS = (
    # the replaced MLP's weights: saved, loaded (safetensors, torch.save, untied), initialized (meta, missing keys)
    "test_save_load", "test_can_use_safetensors", "test_torch_save_load", "test_load_save_without_tied_weights",
    "test_can_init_all_missing_weights", "test_can_be_initialized_on_meta", "test_init_weights_can_init_buffers",
    "test_all_tensors_are_parameter_or_buffer", "test_correct_missing_keys",
    # its gradients, under gradient checkpointing too
    "test_training", "test_training_gradient_checkpointing", "test_retain_grad_hidden_states_attentions",
    # its forward on batches, padding and outputs
    "test_batching_equivalence", "test_determinism", "test_left_padding_compatibility",
    "test_model_outputs_equivalence",
    # generation through it, with the cache, and a resized vocabulary around it
    "test_greedy_generate_equals_forward_argmax", "test_generate_continue_from_past_key_values",
    "test_batched_left_padded_generation_equals_one_by_one", "test_resize_tokens_embeddings",
    # a routed kind's router outputs
    "test_moe_models_record_router_logits", "test_output_router_logits_from_config",
    "test_config",
)
"""The tests that exercise the replaced MLP (names), which the opt-in run that CI runs holds on every pair outside
`DEFAULT`. Chosen by what they can catch: each one runs the sparse layer's own code (its parameters, forward,
backward, cache path, router outputs) in the pair's MLP form; the rest of the battery checks the family's machinery,
which the family x MxD pairs hold, or the kind's graph and dtypes (`MXD_ONLY`: torch.export and loading in another
dtype took 70 % of a pair's time here), which tests/test_kind_contract.py holds per kind. docs/results/test_loop.md
shows this tier failing on the mutations the whole product caught."""

NOT_APPLICABLE: dict[str, str] = {}
"""test name -> why it does not apply to expertize models (skipped for them, run on the native classes)."""


def _name_tables() -> list[tuple[dict, dict]]:
    """transformers' static name tables with every expertize class listed beside its native parent.

    The common tests decide per class *name* what applies (headless classes train no loss, a causal LM gets
    labels, RoPE tests look for the base model class) through these tables, which list the classes built into
    transformers; a model added to transformers is listed there, so the expertize classes are too, for these tests.
    """
    from expertize.modeling import FAMILIES

    base = {f"expertize_{t}": fam.base_model_class.__name__ for t, fam in FAMILIES.items()}
    causal = {f"expertize_{t}": fam.causal_lm_class.__name__ for t, fam in FAMILIES.items()}
    return [(MODEL_MAPPING_NAMES, base), (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, causal)]


class _CommonTests(ModelTesterMixin, GenerationTesterMixin):
    family: str
    kind: str | None
    # transformers skips this init check for models added before 2023 (GPT-2...) to spare its own backlog; the
    # lazy / meta-device init path is one expertize must get right for every family.
    test_can_init_all_missing_weights_before_2023 = True

    def setUp(self):
        self.model_tester = FamilyTester(self, self.family, self.kind)
        self.all_model_classes = self.model_tester.all_model_classes
        self.config_tester = ConfigTester(self, config_class=self.model_tester.config_class,
                                          **self.model_tester.config_kwargs())
        for table, entries in _name_tables():
            patcher = mock.patch.dict(table, entries)
            patcher.start()
            self.addCleanup(patcher.stop)
        name = self._testMethodName
        if self.kind is not None and name in NOT_APPLICABLE:
            self.skipTest(NOT_APPLICABLE[name])

    def test_config(self):
        self.config_tester.run_common_tests()


def _marked(method, where: str):
    """The mixin's test `method` for one class only, marked for the run `where` ("slow" or "full_matrix"). In the
    full matrix, transformers' own `slow` mark (its GPU-only tests) is dropped: CI's `-m slow` does not collect them
    there."""

    @functools.wraps(method)
    def test(self, *args, **kwargs):
        return method(self, *args, **kwargs)

    inherited = [mark for mark in getattr(method, "pytestmark", []) if where == "slow" or mark.name != "slow"]
    test.pytestmark = [*inherited, getattr(pytest.mark, where).mark]
    return test


def _matches(test: str, names: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(test, name) for name in names)


def tier(family: str, kind: str | None, test: str) -> str:
    """Which run holds `test` on the pair (family, kind): "default", "slow" (the opt-in run CI runs) or
    "full_matrix" (the native controls and the rest of the product)."""
    if kind is None:
        return "full_matrix"
    if (family, kind) in DEFAULT and not _matches(test, MXD_ONLY):
        return "default"
    if (family, kind) in DEFAULT and kind == "mxd":  # the model's machinery, once per family: in CI, not the fast suite
        return "slow"
    if (family, kind) in CROSS_LAYER_ON_FORMS and not _matches(test, MXD_ONLY):
        return "slow"
    return "slow" if _matches(test, MLP_CONTRACTS) else "full_matrix"


def _make(family: str, kind: str | None) -> type:
    label = "Native" if kind is None else "".join(part.title() for part in kind.split("_"))
    name = f"Test{''.join(p.title() for p in family.split('_'))}{label}"
    attrs = {"family": family, "kind": kind, "__module__": __name__}
    for test in dir(_CommonTests):
        if (test.startswith("test") and callable(getattr(_CommonTests, test))
                and (where := tier(family, kind, test)) != "default"):
            attrs[test] = _marked(getattr(_CommonTests, test), where)
    return type(name, (_CommonTests, unittest.TestCase), attrs)


for _family in FAMILY_NAMES:
    for _kind in [None, *KINDS]:
        _cls = _make(_family, _kind)
        globals()[_cls.__name__] = _cls
del _family, _kind, _cls
