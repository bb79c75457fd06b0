"""Local paths and what leaves the machine: the base model's Hub id, and public copies of a folder's records.

A run folder's own files stay truthful: provenance.json and recipe.resolved.yaml record the paths the run used, so
`expertize eval` can find the base model again. What `expertize push` uploads is a public copy: every absolute local
path in the JSON / YAML / Markdown records becomes `<local>/NAME` (its last component), the user's home `~`, and a
base model that came from the Hub is named by its Hub id. The model card names the base by its Hub id (and links
it in the `base_model` metadata) when it came from the Hub, by its folder name otherwise (no `base_model` metadata:
the Hub only accepts repository ids there). A base model shipped inside the package (the quickstart's, under
`${EXPERTIZE_ASSETS}`) is named portably, `${EXPERTIZE_ASSETS}/NAME`, in the card and in the public records: that
name finds it on any machine with expertize installed, where an absolute path would find nothing.
"""

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml

from .run_folder import strict_json

__all__ = ["ASSETS_VARIABLE", "LOCAL", "base_model_provenance", "hub_id_of", "is_local_path", "local_base_model",
           "packaged_name", "public_base_model", "public_text", "public_tree"]

LOCAL = "<local>"
ASSETS_VARIABLE = "${EXPERTIZE_ASSETS}"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# A folder in the Hugging Face cache: .../models--ORG--NAME/snapshots/<revision>[/...] (Hub names never hold "--").
_HF_CACHE = re.compile(r"models--([\w.-]+?)(?:--([\w.-]+))?[/\\]snapshots(?:[/\\]|$)")


def is_local_path(value: str) -> bool:
    """True for a string that names a local file or folder rather than a Hub id: absolute, ~ or ./ relative, more
    than one '/', a backslash, or an existing path."""
    return (
        os.path.isabs(value) or value.startswith(("~", ".")) or value.count("/") > 1 or "\\" in value
        or os.path.exists(value)
    )


def packaged_name(path: str) -> str | None:
    """`${EXPERTIZE_ASSETS}/NAME` for a path inside the installed package's assets folder (how a shipped recipe
    names it), None for any other path."""
    from ..recipe.loader import assets_dir

    if not path or not os.path.isabs(os.path.expanduser(path)):
        return None
    assets = os.path.realpath(assets_dir())
    real = os.path.realpath(os.path.expanduser(path))
    if real == assets or not real.startswith(assets + os.sep):
        return None
    return f"{ASSETS_VARIABLE}/{Path(os.path.relpath(real, assets)).as_posix()}"


def local_base_model(base_model: str) -> tuple[str, bool | None]:
    """(the name the folder's own card gives a base model that is not from the Hub, whether it is a Hub id): a
    packaged base by its portable name (no metadata), any other by its path (a truthful local record)."""
    packaged = packaged_name(base_model)
    return (packaged, False) if packaged else (base_model, None)


def hub_id_of(base_model: str) -> str | None:
    """The Hub id `base_model` came from: itself for a Hub id, ORG/NAME for a folder of the Hugging Face cache,
    None for any other local folder. Call it where the run happened (it checks whether the path exists)."""
    cached = _HF_CACHE.search(base_model)
    if cached:
        return "/".join(part for part in cached.groups() if part)
    if is_local_path(base_model):
        return None
    return base_model if _REPO_ID.match(base_model) else None


def base_model_provenance(base_model: str) -> dict[str, Any]:
    """provenance.json's base-model entries: the recipe's `base_model` as given (a truthful local record) and
    `base_model_hub_id` (None for a local folder that did not come from the Hub)."""
    return {"base_model": base_model, "base_model_hub_id": hub_id_of(base_model)}


def public_base_model(provenance: dict[str, Any] | None, base_model: str | None) -> tuple[str | None, bool]:
    """(the name a card or a pushed record gives the base model, whether that name is a Hub id).

    Uses provenance's `base_model_hub_id` when it was recorded, else guesses from the path (`hub_id_of`); a local
    folder is named by its last path component."""
    provenance = provenance or {}
    if base_model is None:
        return None, False
    if "base_model_hub_id" in provenance:
        hub_id = provenance["base_model_hub_id"]
    else:
        hub_id = hub_id_of(base_model)
    if hub_id:
        return str(hub_id), True
    return packaged_name(base_model) or Path(base_model.rstrip("/\\")).name or base_model, False


def _whole_path(value: str) -> bool:
    """An absolute path (at least two components below the root) or a ~ path, on one line."""
    if "\n" in value:
        return False
    return value.startswith("~/") or (os.path.isabs(value) and len(Path(value).parts) >= 3)


class _Scrubber:
    """Replaces local paths in strings: whole absolute paths by `<local>/NAME`, known local roots inside longer
    strings (the model folder, a local base model) likewise, and the home folder by `~`."""

    def __init__(self, roots: list[str | os.PathLike], hub_ids: dict[str, str] | None = None) -> None:
        self.hub_ids = dict(hub_ids or {})
        found = set()
        for root in roots:
            path = Path(root)
            for variant in (path, path.resolve()):
                if variant.is_absolute() and str(variant) != variant.anchor:
                    found.add(str(variant))
        self.roots = sorted(found, key=len, reverse=True)  # longest first: a folder before its parent
        home = str(Path.home())
        self.home = home if home not in ("/", "") else None

    def _local(self, path: str) -> str:
        name = Path(path.rstrip("/\\")).name
        return f"{LOCAL}/{name}" if name else LOCAL

    def text(self, value: str) -> str:
        if value in self.hub_ids:
            return self.hub_ids[value]
        if _whole_path(value) and packaged_name(value):
            return packaged_name(value)
        cached = _HF_CACHE.search(value)
        if cached and os.path.isabs(value):
            return "/".join(part for part in cached.groups() if part)
        if _whole_path(value):
            return self._local(value)
        for root in self.roots:
            value = value.replace(root, self._local(root))
        if self.home:
            value = value.replace(self.home + os.sep, "~" + os.sep)
        return value

    def tree(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {key: self.tree(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.tree(item) for item in value]
        return value


def public_tree(value: Any, roots: list[str | os.PathLike], hub_ids: dict[str, str] | None = None) -> Any:
    """`value` (parsed JSON / YAML) with local paths replaced (see `_Scrubber`); `hub_ids`: local path -> Hub id."""
    return _Scrubber(roots, hub_ids).tree(value)


def public_text(path: Path, roots: list[str | os.PathLike], hub_ids: dict[str, str] | None = None) -> str | None:
    """The public copy of a JSON, YAML or Markdown file's text; None when it needs no change (or is another
    kind of file, or does not parse)."""
    scrub = _Scrubber(roots, hub_ids)
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            data = json.loads(text)
            public, nulled = strict_json(scrub.tree(data))  # a file from before strict JSON may hold NaN
            return None if public == data and not nulled else json.dumps(public, indent=2, allow_nan=False) + "\n"
        if suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
            public = scrub.tree(data)
            return None if public == data else yaml.safe_dump(public, sort_keys=False, allow_unicode=True)
    except (json.JSONDecodeError, yaml.YAMLError):
        return None
    if suffix == ".md":
        public = text
        for root in scrub.roots:
            public = public.replace(root, scrub._local(root))
        if scrub.home:
            public = public.replace(scrub.home + os.sep, "~" + os.sep)
        return None if public == text else public
    return None
