"""transformers' own common model tests (ModelTesterMixin, ConfigTester of the pinned transformers version; see
tests/transformers_common/README.md) plus the generation contracts, run on every family x kind — and on the native
classes as the control, so a failure that is the harness's own is told apart from an expertize defect.

The default run covers `DEFAULT`: every family with MxD, and every kind on one family of each MLP form
(tests/families.py `MLP_FORMS`: GPT-2's plain Conv1D MLP, Llama's gated Linear one). A kind reaches a family only
through the MLP's form and one shared mixin, and a kind file may import only torch and the shared `sparse_*` files
(tests/test_structure.py), so a bug of one family x kind pair needs a code path the layout forbids: the two axes
cover the ground of the matrix. On the pairs of another kind than MxD the default run leaves out the tests of the
whole model's machinery (`MXD_ONLY`). The other pairs, those tests and the native controls are marked `full_matrix`
and `slow`, which the default run leaves out (tests/conftest.py): `python -m pytest -m full_matrix` runs them.

Tests that do not apply to a model are skipped in code, with the reason, in `NOT_APPLICABLE` (also in docs/native.md).
"""

import fnmatch
import functools
import unittest
from unittest import mock

import pytest
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

from expertize.modeling import LAYER_KINDS
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

MXD_ONLY = ("test_generate_compile_model_forward_fullgraph", "test_torch_export", "test_bc_torch_dtype",
            "test_eager_matches_sdpa_inference_*")
"""Tests of the whole model's machinery (names; `*`: the parameterized ones) that the default run holds to the
family x MxD pairs: torch.compile and torch.export of the whole model, loading in another dtype, eager vs SDPA
attention in three dtypes. A kind meets them as it meets any forward, and its own fullgraph compile and dtypes are
tests/test_kind_contract.py's (in the default run); they take two thirds of a pair's time. On the other pairs of
`DEFAULT` they are marked `full_matrix` and `slow`: the opt-in run has them."""

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


def _opt_in(method):
    """The mixin's test `method` for one class only, marked for the opt-in run."""

    @functools.wraps(method)
    def test(self, *args, **kwargs):
        return method(self, *args, **kwargs)

    test.pytestmark = [*getattr(method, "pytestmark", []), pytest.mark.full_matrix.mark, pytest.mark.slow.mark]
    return test


def _make(family: str, kind: str | None) -> type:
    label = "Native" if kind is None else "".join(part.title() for part in kind.split("_"))
    name = f"Test{''.join(p.title() for p in family.split('_'))}{label}"
    attrs = {"family": family, "kind": kind, "__module__": __name__}
    if (family, kind) in DEFAULT and kind != "mxd":
        attrs.update({test: _opt_in(getattr(_CommonTests, test)) for test in dir(_CommonTests)
                      if any(fnmatch.fnmatchcase(test, name) for name in MXD_ONLY)})
    cls = type(name, (_CommonTests, unittest.TestCase), attrs)
    if (family, kind) not in DEFAULT:  # the native controls (kind None) too
        cls = pytest.mark.full_matrix(pytest.mark.slow(cls))
    return cls


for _family in FAMILY_NAMES:
    for _kind in [None, *KINDS]:
        _cls = _make(_family, _kind)
        globals()[_cls.__name__] = _cls
del _family, _kind, _cls
