"""A saved expertize model folder: what makes one, what it records, and its model card rebuilt from those records.

    MODEL_DIR/
        config.json              model_type "expertize_<family>", auto_map -> the remote-code files, sparse_layers
        model.safetensors        (or model.safetensors.index.json + its shards)
        configuration_expertize.py, modeling_expertize.py, <one file per layer kind>.py
        tokenizer files
        metrics.json             `expertize upcycle`'s evaluation, "recipe_summary" (the card's Training rows) and
                                 "lm_eval" (eval.lm_eval_tasks, or added by `expertize eval`); schema: metrics_schema.py
        recipe.resolved.yaml, provenance.json, plots/, train_log.jsonl     (`expertize upcycle`)
        README.md                the model card, rebuilt from the files above by `refresh_model_card`

The names of the records are run_folder.py's; the card names the base model as local_paths.public_base_model says.
"""

import json
import os
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import ModelCard

from expertize.modeling.sparse_layers import spec_from_dict

from ..checks import check_weight_file
from ..errors import ExpertizeError
from .card import UNKNOWN_LICENSE, CardInputs, render_model_card, write_model_card
from .local_paths import local_base_model, public_base_model
from .metrics_schema import Metrics, load_metrics
from .run_folder import METRICS, MODEL_CARD, PROVENANCE, RESOLVED_RECIPE, write_json

__all__ = [
    "ModelFolderError",
    "card_license",
    "check_model_folder",
    "load_metrics",
    "read_metrics",
    "read_provenance",
    "recorded_base_model",
    "refresh_model_card",
    "render_card_from_folder",
    "weight_files",
    "write_metrics",
]

EXPERTIZE_PREFIX = "expertize_"
PRODUCED_BY = (
    "point at a folder written by `expertize upcycle` (its output_dir) or by expertize.conversion.surgery.splice.save_model"
)


class ModelFolderError(ExpertizeError, ValueError):
    """A folder is not a (complete) saved expertize model; the message names what is missing and the fix."""


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors weights of a saved model: model.safetensors, or the shards its index lists."""
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [model_dir / name for name in shards]
    return []


def check_model_folder(model_dir: str | os.PathLike, *, read_weights: bool = True) -> dict[str, Any]:
    """The folder's config.json as a dict, after checking that the folder is a loadable expertize model.

    Checks: config.json with an expertize model_type and an auto_map whose files are present (the remote code that
    `trust_remote_code=True` runs), safetensors weights (every shard of a sharded checkpoint) whose headers read and
    whose sizes match them (checks.check_weight_file; `read_weights=False` leaves them out, for readers of the records
    alone), and sparse layers of kinds this version knows.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelFolderError(f"{path} is not a folder; {PRODUCED_BY}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelFolderError(f"{path} has no config.json, so it is not a saved model; {PRODUCED_BY}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelFolderError(f"{config_file} is not valid JSON ({e}); re-save the model") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFolderError(f"{config_file} cannot be read ({e}); check its permissions") from None
    model_type = str(config.get("model_type", ""))
    if not model_type.startswith(EXPERTIZE_PREFIX):
        raise ModelFolderError(
            f"{path} holds a {model_type or 'model without model_type'!r} model, not an expertize model (its "
            f"config.json model_type does not start with {EXPERTIZE_PREFIX!r}); {PRODUCED_BY}"
        )
    auto_map = config.get("auto_map") or {}
    if "AutoModelForCausalLM" not in auto_map:
        raise ModelFolderError(
            f"{config_file} has no auto_map entry for AutoModelForCausalLM, so trust_remote_code cannot load it; "
            "re-save the model with save_pretrained of an expertize model class"
        )
    missing_code = sorted(
        {f"{ref.split('--')[-1].split('.')[0]}.py" for ref in auto_map.values()}
        - {p.name for p in path.glob("*.py")}
    )
    if missing_code:
        raise ModelFolderError(
            f"{path} lacks the remote-code file(s) {', '.join(missing_code)} named by config.json's auto_map; "
            "re-save the model (save_pretrained copies them)"
        )
    weights = weight_files(path)
    if not weights:
        raise ModelFolderError(f"{path} has no weights (model.safetensors or model.safetensors.index.json)")
    absent = [w.name for w in weights if not w.is_file()]
    if absent:
        raise ModelFolderError(f"{path} lacks weight shard(s) {', '.join(absent)} listed in its index")
    for weight in weights if read_weights else ():
        check_weight_file(weight)  # a truncated download or copy is named as damaged, before anything loads it
    for index, spec in (config.get("sparse_layers") or {}).items():
        try:
            spec_from_dict(spec)
        except (ValueError, TypeError) as e:
            raise ModelFolderError(
                f"{config_file}: sparse layer {index}: {e}; the folder was written by a newer expertize (upgrade it: "
                "pip install -U expertize) or its config.json was edited"
            ) from None
    return config


def read_provenance(model_dir: str | os.PathLike) -> dict[str, Any]:
    """provenance.json of the folder ({} when it has none)."""
    path = Path(model_dir) / PROVENANCE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def recorded_base_model(model_dir: str | os.PathLike) -> str | None:
    """The base model a folder was made from, as the run named it (a Hub id or a local path): provenance.json's
    base_model, else recipe.resolved.yaml's."""
    path = Path(model_dir)
    base = read_provenance(path).get("base_model")
    if base:
        return str(base)
    recipe = path / RESOLVED_RECIPE
    if recipe.is_file():
        base = (yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}).get("base_model")
        if base:
            return str(base)
    return None


def read_metrics(model_dir: str | os.PathLike) -> dict[str, Any]:
    """metrics.json of the folder as a plain dict ({} when it has none); `load_metrics` gives the typed view."""
    path = Path(model_dir) / METRICS
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def write_metrics(model_dir: str | os.PathLike, metrics: dict[str, Any] | Metrics) -> Path:
    """Replace metrics.json atomically, as strict JSON (a non-finite float is written as null)."""
    path = Path(model_dir) / METRICS
    write_json(path, metrics.to_dict() if isinstance(metrics, Metrics) else metrics)
    return path


def card_license(model_dir: str | os.PathLike) -> str | None:
    """The license the folder's card gives: the one set in its README.md's metadata (by the user, or rendered from
    the records) when it is not the placeholder, else provenance.json's `base_license` (the base model's); None when
    unknown."""
    readme = Path(model_dir) / MODEL_CARD
    if readme.is_file():
        try:
            stated = ModelCard.load(readme).data.license
        except (OSError, ValueError):
            stated = None
        if isinstance(stated, str) and stated and stated != UNKNOWN_LICENSE:
            return stated
    return read_provenance(model_dir).get("base_license") or None


def _hub_datasets(model_dir: Path) -> list[str]:
    """The Hub datasets the layers were trained on (recipe.resolved.yaml's data.name for data.source hub); local text
    files are never listed as Hub datasets."""
    recipe = model_dir / RESOLVED_RECIPE
    data = ((yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}).get("data") or {}) if recipe.is_file() else {}
    return [str(data["name"])] if data.get("source") == "hub" and data.get("name") else []


def _card_inputs(model_dir: Path, base_model: str | None, public: bool, repo_id: str | None) -> CardInputs:
    config = check_model_folder(model_dir)
    layers = config.get("sparse_layers") or {}
    recorded = recorded_base_model(model_dir)
    if recorded is None and base_model is None:
        raise ModelFolderError(
            f"{model_dir} records no base model (no provenance.json or recipe.resolved.yaml); name it (--base)"
        )
    # A Hub base is named (and linked) by its Hub id, also when it was read from a local Hub-cache snapshot. A
    # local base folder: by its folder name in a public card (no local path leaves the machine), by its path in
    # the folder's own card (a truthful local record, as provenance.json is).
    name, is_hub_id = public_base_model(read_provenance(model_dir) if recorded else {}, recorded or base_model)
    hub_flag: bool | None = is_hub_id
    if not is_hub_id and not public:
        name, hub_flag = local_base_model(recorded or base_model)  # a packaged base by its portable name
    metrics = load_metrics(model_dir)
    tasks = metrics.lm_eval.tasks if metrics.lm_eval is not None else {}
    summary = metrics.recipe_summary
    metrics.lm_eval, metrics.recipe_summary = None, {}
    return CardInputs(
        base_model=name,
        base_model_is_hub_id=hub_flag,
        repo_id=repo_id,
        layers={int(i): spec for i, spec in layers.items()},
        recipe_summary=summary,
        metrics=metrics if metrics.evaluated else None,
        lm_eval={task: {key: m.to_dict() for key, m in entry.metrics.items()} for task, entry in tasks.items()},
        lm_eval_details={task: entry.details() for task, entry in tasks.items()},
        license=card_license(model_dir),
        datasets=_hub_datasets(model_dir),
    )


def render_card_from_folder(
    model_dir: str | os.PathLike, *, base_model: str | None = None, repo_id: str | None = None, public: bool = True
) -> ModelCard:
    """The model card (`huggingface_hub.ModelCard`) of a saved folder, from its config, metrics and recipe;
    `base_model` is used only when the folder records none. `public` (the card `expertize push` uploads): a local
    base is named by its folder name, never its path."""
    model_dir = Path(model_dir)
    return render_model_card(model_dir, _card_inputs(model_dir, base_model, public, repo_id))


def refresh_model_card(
    model_dir: str | os.PathLike, *, base_model: str | None = None, repo_id: str | None = None,
    public: bool = False,
) -> Path:
    """Rewrite MODEL_DIR/README.md from the folder's records (after `expertize eval` adds lm-eval results).

    The folder's own card names a local base by its path (`public=False`); `expertize push` uploads the public
    card (`render_card_from_folder`), which never holds a local path."""
    model_dir = Path(model_dir)
    return write_model_card(model_dir, _card_inputs(model_dir, base_model, public, repo_id))
