"""`expertize`'s front door (expertize/__init__.py): each command's Python API by name, imported on first use."""

import subprocess
import sys

import pytest

import expertize
from expertize.conversion.capture import capture_activations
from expertize.conversion.evaluation.sweep import plot_sweep
from expertize.conversion.harness.folder_eval import evaluate_model_folder
from expertize.conversion.harness.offline_tasks import write_tasks_from_text
from expertize.conversion.harness.runner import HarnessSettings
from expertize.conversion.inspection import InspectionSettings, inspect_folder
from expertize.conversion.inspection.codes import TextCodes, decode, load_model, text_codes
from expertize.conversion.publishing.push import push_model
from expertize.conversion.recipe import Recipe, load_recipe
from expertize.conversion.specialization import SpecializationSettings, specialize_folder
from expertize.conversion.surgery.splice import save_model, splice
from expertize.conversion.upcycle import upcycle

DOCUMENTED = {
    "Recipe": Recipe, "load_recipe": load_recipe, "upcycle": upcycle, "capture_activations": capture_activations,
    "HarnessSettings": HarnessSettings, "evaluate_model_folder": evaluate_model_folder,
    "write_tasks_from_text": write_tasks_from_text, "plot_sweep": plot_sweep,
    "InspectionSettings": InspectionSettings, "inspect_folder": inspect_folder,
    "SpecializationSettings": SpecializationSettings, "specialize_folder": specialize_folder,
    "push_model": push_model, "splice": splice, "save_model": save_model,
    "load_model": load_model, "text_codes": text_codes, "TextCodes": TextCodes, "decode": decode,
}
"""Each front-door name and the object it must be (where the commands and docs define it)."""


def test_every_front_door_name_is_the_documented_object():
    assert sorted(expertize.__all__) == sorted(["__version__", *DOCUMENTED])
    for name, obj in DOCUMENTED.items():
        assert getattr(expertize, name) is obj, name
    namespace = {}
    exec(f"from expertize import {', '.join(DOCUMENTED)}", namespace)
    assert all(namespace[name] is obj for name, obj in DOCUMENTED.items())
    assert set(DOCUMENTED) <= set(dir(expertize))
    with pytest.raises(AttributeError, match="module 'expertize' has no attribute 'upcylce'"):
        expertize.upcylce


@pytest.mark.slow  # 5-25 s (subprocesses or a whole upcycle): in CI's opt-in run, off the fast suite's 8 minutes
def test_import_expertize_loads_no_torch_until_a_name_is_used():
    code = ("import sys, expertize; heavy = ('torch', 'transformers', 'expertize.conversion'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m.startswith(heavy))); "
            "expertize.load_recipe; print('expertize.conversion.recipe' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == ["[]", "True"]
