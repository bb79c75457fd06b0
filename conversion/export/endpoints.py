"""Both ends of an export: the expertize folder it reads (checked, its base model named) and the output folder it
writes whole or not at all.

The tools load the *base* model, never the expertize folder (sparsify and circuit-tracer hook their coders into it;
delphi's loader reads its tokenizer), so every file written names the base by a name they can load: the Hub id the
folder records (provenance.json's `base_model_hub_id`, or a Hub id as `base_model`; recipe.resolved.yaml when there
is no provenance.json), else the recorded local folder when it holds a base model here. A folder recording neither
(e.g. one written by `save_model` alone: transformers 5 leaves the base's path out of config.json) is refused up
front; `--base-model` names the base.
"""

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from ..checks import check_output_location
from ..publishing.local_paths import public_base_model
from ..publishing.model_folder import check_model_folder, read_provenance, recorded_base_model
from ..publishing.run_folder import staging_folder
from ..surgery.splice import EXPERTIZE_PREFIX, local_model_type
from .expressible import ExportError

__all__ = ["EXPORT_RECORD", "base_model_name", "staged_output"]

EXPORT_RECORD = "expertize_export.json"
"""Written at the top of every export: the source folder, the target, the base model, the layers and hookpoints."""


def _loadable_folder(path: str) -> str | None:
    """`path` made absolute when it is a local folder holding a base (non-expertize) model, else None."""
    folder = Path(os.path.expanduser(os.path.expandvars(path)))
    if not (folder / "config.json").is_file() or local_model_type(folder).startswith(EXPERTIZE_PREFIX):
        return None
    return str(folder.resolve())


def base_model_name(model_dir: str | os.PathLike, override: str | None = None) -> str:
    """The name by which the tools load the base model of `model_dir` (see the module docstring)."""
    if override:
        return override
    recorded = recorded_base_model(model_dir)
    if recorded:
        name, is_hub_id = public_base_model(read_provenance(model_dir), recorded)
        if is_hub_id:
            return name
        local = _loadable_folder(recorded)
        if local:
            return local
    raise ExportError(
        f"{model_dir} does not name a loadable base model (recorded: {recorded or 'none'}); the tools load the "
        "base, so name it: --base-model HUB_ID_OR_FOLDER"
    )


def checked_source(model_dir: str | os.PathLike) -> dict:
    """config.json of an expertize folder checked to be whole and to have sparse layers."""
    config = check_model_folder(model_dir)
    if not config.get("sparse_layers"):
        raise ExportError(f"{model_dir} has no sparse layers in its config.json; there is nothing to export")
    return config


@contextlib.contextmanager
def staged_output(output: str | os.PathLike, *, need_bytes: int = 0) -> Iterator[Path]:
    """A fresh staging folder beside `output` that becomes `output` when the block ends without an error, and is
    removed otherwise: an export is never left half-written. `output` must not exist (or be an empty folder)."""
    output = Path(os.path.expanduser(str(output)))
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ExportError(f"OUTPUT {str(output)!r} already exists and is not empty; choose a new folder")
    check_output_location(output, what="OUTPUT", need_bytes=need_bytes)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(output.parent, f".{output.name}.")  # the output itself once renamed: not private
    try:
        yield staging
        if output.exists():
            output.rmdir()  # empty (checked above)
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
