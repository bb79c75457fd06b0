"""transformers' own common model tests (ModelTesterMixin, ConfigTester of the pinned transformers version; see
tests/transformers_common/README.md) plus the generation contracts, run on every family x kind — and on the native
classes as the control, so a failure that is the harness's own is told apart from an expertize defect.

Tests that do not apply to a model are skipped in code, with the reason, in `NOT_APPLICABLE` (also in docs/native.md).
"""

import unittest
from unittest import mock

import pytest
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

from tests.common_testers import FamilyTester
from tests.families import FAMILY_NAMES, REFERENCE_FAMILY
from tests.kinds import KINDS
from tests.transformers_common.generation.test_utils import GenerationTesterMixin
from tests.transformers_common.test_configuration_common import ConfigTester
from tests.transformers_common.test_modeling_common import ModelTesterMixin

# The default run covers every family with MxD (and natively, the control) and every kind on the reference family
# (Llama); the rest of the matrix is marked slow.
DEFAULT = {(family, "mxd") for family in FAMILY_NAMES} | {(REFERENCE_FAMILY, kind) for kind in KINDS}

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


def _make(family: str, kind: str | None) -> type:
    label = "Native" if kind is None else "".join(part.title() for part in kind.split("_"))
    name = f"Test{''.join(p.title() for p in family.split('_'))}{label}"
    cls = type(name, (_CommonTests, unittest.TestCase), {"family": family, "kind": kind, "__module__": __name__})
    if kind is not None and (family, kind) not in DEFAULT:
        cls = pytest.mark.slow(cls)
    return cls


for _family in FAMILY_NAMES:
    for _kind in [None, *KINDS]:
        _cls = _make(_family, _kind)
        globals()[_cls.__name__] = _cls
del _family, _kind, _cls
