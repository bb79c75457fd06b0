"""What each run holds: transformers' common tests on every family with MxD and on every kind with one family of each
MLP form (a gated one and GPT-2's Conv1D) in the default run; the MLP's contracts on every other pair in the opt-in
run CI runs (`-m slow`); the rest of the product and the native controls in the full matrix (`-m full_matrix`),
derived from tests/families.py and tests/kinds.py; and the rule of tests/conftest.py that leaves the opt-in tests
out of a run without `-m` unless the command line names them."""

import dataclasses
from pathlib import Path

import pytest
from expertize.modeling import LAYER_KINDS
from transformers.pytorch_utils import Conv1D

import tests.test_transformers_common as common
from tests.conftest import OPT_IN, OPT_IN_MARKS, named_on_the_command_line, opted_out, tiny_base_model
from tests.families import FAMILY_NAMES, ROWS
from tests.kinds import KINDS


def _marks(obj) -> set[str]:
    return {mark.name for mark in getattr(obj, "pytestmark", [])}


def _classes() -> dict[tuple[str, str | None], type]:
    """(family, kind or None for the native classes) -> its class of transformers' common tests."""
    return {(value.family, value.kind): value for value in vars(common).values()
            if isinstance(value, type) and issubclass(value, common._CommonTests) and value is not common._CommonTests}


def _tests(cls) -> list[str]:
    return [name for name in dir(cls) if name.startswith("test") and callable(getattr(cls, name))]


def _runs(cls) -> dict[str, set[str]]:
    """The tests of `cls` by the run that holds them: "default", "slow" (CI's opt-in run) or "full_matrix".
    transformers' own `slow` tests (GPU-only) count where the expertize mark puts them."""
    runs: dict[str, set[str]] = {"default": set(), "slow": set(), "full_matrix": set()}
    for name in _tests(cls):
        marks = _marks(getattr(cls, name))
        runs["full_matrix" if "full_matrix" in marks else "slow" if name in _own_slow(cls, name) else "default"].add(
            name)
    return runs


def _own_slow(cls, name: str) -> set[str]:
    """{name} when the expertize matrix put `name` in CI's opt-in run (not transformers' own `slow` mark)."""
    marks = [mark.name for mark in getattr(getattr(cls, name), "pytestmark", [])]
    inherited = [mark.name for mark in getattr(getattr(common._CommonTests, name), "pytestmark", [])]
    return {name} if marks.count("slow") > inherited.count("slow") else set()


def _default(classes) -> set[tuple[str, str | None]]:
    return {pair for pair, cls in classes.items() if "test_save_load" in _runs(cls)["default"]}


def _mlp_is_conv1d(family: str) -> bool:
    model = tiny_base_model(family)
    return any(isinstance(m, Conv1D) for name, m in model.named_modules() if ".mlp." in f".{name}.")


def test_the_matrix_is_every_family_by_every_kind_and_native():
    assert set(_classes()) == {(family, kind) for family in FAMILY_NAMES for kind in [None, *KINDS]}


def test_the_default_run_covers_every_family_with_mxd_and_every_kind_on_a_glu_and_a_conv1d_family():
    """Every kind but the cross-layer ones, whose lone layers run the JumpReLU path (tests/test_transformers_common.py
    `DEFAULT`; a placed CLT is tests/test_clt.py's)."""
    default = _default(_classes())
    assert {(family, "mxd") for family in FAMILY_NAMES} <= default
    kinds = [kind for kind in KINDS if not LAYER_KINDS[kind][0].cross_layer]
    assert len(kinds) == len(KINDS) - 1
    every_kind = [family for family in FAMILY_NAMES if {(family, kind) for kind in kinds} <= default]
    assert any(ROWS[family].glu for family in every_kind), every_kind
    assert any(_mlp_is_conv1d(family) for family in every_kind), every_kind
    assert len(every_kind) == 2, "the default run covers every kind on two families (one per MLP form), no more"
    assert default == {(f, "mxd") for f in FAMILY_NAMES} | {(f, kind) for f in every_kind for kind in kinds}


def test_the_mlp_contracts_name_tests_of_the_battery():
    """A renamed test in transformers would silently drop out of CI's tier: every name must be one of the mixin's."""
    names = set(_tests(common._CommonTests))
    assert set(common.MLP_CONTRACTS) <= names, sorted(set(common.MLP_CONTRACTS) - names)
    assert len(set(common.MLP_CONTRACTS)) == len(common.MLP_CONTRACTS) >= 20


def test_every_other_pair_runs_the_mlp_contracts_in_ci_and_the_rest_in_the_full_matrix():
    classes = _classes()
    default = _default(classes)
    runs_of_default_pair = _runs(classes[("llama", "transcoder")])["default"]
    assert len(common.CROSS_LAYER_ON_FORMS) == 2
    for pair, cls in classes.items():
        runs = _runs(cls)
        if pair[1] is None:  # the native controls: all of them in the full matrix
            assert not runs["default"] and not runs["slow"], pair
        elif pair in common.CROSS_LAYER_ON_FORMS:  # the battery of the other kinds' default pairs, in CI's run
            assert runs["slow"] == runs_of_default_pair and not runs["default"], pair
        elif pair not in default:
            assert runs["slow"] == set(common.MLP_CONTRACTS) and not runs["default"], pair
        # nothing of the full matrix also carries `slow` (CI's `-m slow` would collect it)
        assert all("slow" not in _marks(getattr(cls, name)) for name in runs["full_matrix"]), pair


def test_the_default_pairs_of_other_kinds_leave_the_machinery_tests_to_the_full_matrix():
    classes = _classes()
    machinery = _runs(classes[("llama", "transcoder")])["full_matrix"]
    assert {"test_generate_compile_model_forward_fullgraph", "test_torch_export",
            "test_sdpa_can_dispatch_non_composite_models"} <= machinery
    sdpa = [name for name in dir(common._CommonTests) if name.startswith("test_eager_matches_sdpa_inference_")]
    assert len(machinery) == 4 + len(sdpa) and len(sdpa) > 1
    for pair in _default(classes):
        runs = _runs(classes[pair])
        assert runs["full_matrix"] == (set() if pair[1] == "mxd" else machinery), pair
        assert not machinery & runs["default"], pair
        # the model's machinery once per family, in CI's opt-in run (not the fast suite)
        assert runs["slow"] == (machinery if pair[1] == "mxd" else set()), pair
    # The mixin's own tests stay unmarked: each class gets its own marked copies.
    assert not _runs(common._CommonTests)["full_matrix"] and not _runs(common._CommonTests)["slow"]


def test_the_marks_are_registered_and_the_default_run_has_no_mark_expression():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    ini = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["tool"]["pytest"]
    names = {marker.split(":")[0] for marker in ini["ini_options"]["markers"]}
    assert set(OPT_IN_MARKS) <= names
    # A -m in addopts would be replaced by a user's own -m (`-m "not slow"` would bring the matrix back).
    assert "-m" not in ini["ini_options"]["addopts"].split()


# -- the rule of tests/conftest.py, on stand-ins of pytest's items and config -----------------------------------------


@dataclasses.dataclass
class _Item:
    nodeid: str
    marks: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        return Path.cwd() / self.nodeid.partition("::")[0]

    def get_closest_marker(self, name):
        return name if name in self.marks else None


class _Config:
    def __init__(self, *args: str):
        self.args = list(args)
        self.invocation_params = type("Params", (), {"dir": Path.cwd()})()


@pytest.mark.parametrize(
    ("args", "markexpr", "kept"),
    [
        (["tests"], "", {"plain"}),
        (["tests/test_a.py"], "", {"plain"}),
        (["tests"], OPT_IN, {"plain", "opt", "class"}),  # pytest's -m then selects; the rule steps aside
        (["tests"], "not slow", {"plain", "opt", "class"}),
        (["tests/test_a.py::test_opt"], "", {"plain", "opt"}),
        (["tests/test_a.py::test_o"], "", {"plain"}),  # a prefix of a name is not the name
        (["tests/test_a.py::TestC"], "", {"plain", "class"}),
        (["tests/test_b.py::test_opt"], "", {"plain"}),
    ],
)
def test_the_default_run_leaves_out_the_opt_in_tests_unless_named_or_a_mark_expression_is_given(args, markexpr, kept):
    items = {"plain": _Item("tests/test_a.py::test_plain"), "opt": _Item("tests/test_a.py::test_opt[x]", (OPT_IN,)),
             "class": _Item("tests/test_a.py::TestC::test_m", ("full_matrix",))}
    named = named_on_the_command_line(_Config(*args))
    assert {key for key, item in items.items() if not opted_out(item, markexpr, named)} == kept

