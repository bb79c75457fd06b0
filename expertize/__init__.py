"""expertize: sparse-expert replacements for the dense MLPs of pretrained language models.

`expertize.modeling` is the Hub bundle (what travels with a saved model); `expertize.conversion` is everything else
(recipes, activation capture, training, splicing, evaluation, CLI). The front door below names the Python API of
each command, imported on first use, so `import expertize` stays light (no torch, no transformers):

    load_recipe(path, overrides) -> Recipe       upcycle(recipe) -> folder          capture_activations(recipe, dir)
    evaluate_model_folder(dir, HarnessSettings)  write_tasks_from_text(text, ...)   plot_sweep(dirs, metric, png)
    inspect_folder(dir, corpora, InspectionSettings)   specialize_folder(dir, corpora, SpecializationSettings)
    push_model(dir, repo_id)                     splice(base, {layer: sparse}) / save_model(model, dir)
    load_model(dir) -> (model, tokenizer)        text_codes(model, tokenizer, text) -> TextCodes
    decode(model, layer, code, x) -> the layer's output for a (possibly edited) code
"""

__version__ = "0.1.0"

_FRONT_DOOR = {
    "Recipe": "expertize.conversion.recipe",
    "load_recipe": "expertize.conversion.recipe",
    "upcycle": "expertize.conversion.upcycle",
    "capture_activations": "expertize.conversion.capture",
    "HarnessSettings": "expertize.conversion.harness.runner",
    "evaluate_model_folder": "expertize.conversion.harness.folder_eval",
    "write_tasks_from_text": "expertize.conversion.harness.offline_tasks",
    "plot_sweep": "expertize.conversion.evaluation.sweep",
    "InspectionSettings": "expertize.conversion.inspection",
    "inspect_folder": "expertize.conversion.inspection",
    "SpecializationSettings": "expertize.conversion.specialization",
    "specialize_folder": "expertize.conversion.specialization",
    "push_model": "expertize.conversion.publishing.push",
    "splice": "expertize.conversion.surgery.splice",
    "save_model": "expertize.conversion.surgery.splice",
    "load_model": "expertize.conversion.inspection.codes",
    "text_codes": "expertize.conversion.inspection.codes",
    "TextCodes": "expertize.conversion.inspection.codes",
    "decode": "expertize.conversion.inspection.codes",
}
"""Name -> the module that defines it (each imported on first access, PEP 562)."""

__all__ = ["__version__", *_FRONT_DOOR]

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (type checkers read the name as True)
if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily
    from expertize.conversion.capture import capture_activations
    from expertize.conversion.evaluation.sweep import plot_sweep
    from expertize.conversion.harness.folder_eval import evaluate_model_folder
    from expertize.conversion.harness.offline_tasks import write_tasks_from_text
    from expertize.conversion.harness.runner import HarnessSettings
    from expertize.conversion.inspection.codes import TextCodes, decode, load_model, text_codes
    from expertize.conversion.inspection import InspectionSettings, inspect_folder
    from expertize.conversion.publishing.push import push_model
    from expertize.conversion.recipe import Recipe, load_recipe
    from expertize.conversion.specialization import SpecializationSettings, specialize_folder
    from expertize.conversion.surgery.splice import save_model, splice
    from expertize.conversion.upcycle import upcycle


def __getattr__(name: str):
    if name not in _FRONT_DOOR:
        raise AttributeError(f"module 'expertize' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_FRONT_DOOR[name]), name)
    globals()[name] = value  # the next access skips __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_FRONT_DOOR})
