"""Reading and writing recipes: the strict YAML loader behind `expertize upcycle RECIPE`.

    RECIPE (a YAML file, or the name of a recipe shipped with the package: quickstart, paper/mxd-gpt2-l8-mxd)
        ─► YAML (floats such as 3e-4 read as numbers; duplicate keys rejected; merge keys `<<: *anchor`; ${VAR}
            read as text even unquoted in a flow list `[${VAR}/a.txt]`)
        ─► `--set key=value` overrides (dotted keys, values parsed as YAML; `key=null` resets a key that takes
            no null to its default)
        ─► ${VAR} expansion in every string (environment variables; ${EXPERTIZE_ASSETS} defaults to the installed
            package's assets folder)
        ─► the dataclasses of `schema.py`, every key and type checked (an unknown key is an error naming it, the
            file and the valid keys)

Relative paths (data.paths, a local base_model, output_dir) are relative to the current working directory, as in
every command-line tool, not to the recipe file: ship recipes with `${EXPERTIZE_DATA}/...` style paths instead.
"""

import copy
import importlib.resources
import os
import re
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from .coerce import (
    RecipeError,
    Source,
    build,
    dataclass_in,
    did_you_mean,
    init_field_names,
    join,
    plain,
    strip_optional,
    unknown_key_message,
)
from .schema import Recipe

__all__ = ["assets_dir", "bundled_recipes", "load_recipe", "recipe_from_dict", "recipe_to_dict", "save_recipe",
           "variant_recipes"]

PLACEMENT_KEYS = ("device_map", "max_memory", "offload_folder")
"""Where the base's weights sit (surgery/placement.py): not what a run computes."""

BUNDLED_PACKAGE = "expertize.recipes"
"""The package whose YAML files are the recipes callable by name (`expertize upcycle quickstart`)."""


def load_recipe(path: str | os.PathLike, overrides: Iterable[str] = ()) -> Recipe:
    """Read a recipe file (or a bundled recipe by name) strictly, apply `--set` style overrides ("train.lr=3e-4",
    "layers=[2,3]"), expand ${VARS} in strings and validate every key and value."""
    text, source = _read_recipe(path)
    try:
        tree = read_yaml(text)
    except yaml.YAMLError as e:
        raise RecipeError(f"{source}: not valid YAML: {_restore_text(str(e))}") from None
    if tree is None:
        raise RecipeError(f"{source}: the recipe is empty; start from one of the shipped recipes (recipes/*.yaml)")
    return recipe_from_dict(tree, overrides, source=source)


def recipe_from_dict(tree: Mapping[str, Any], overrides: Iterable[str] = (), source: str = "<recipe>") -> Recipe:
    """`load_recipe` for an already-parsed mapping; `source` names it in error messages."""
    src = Source(source, root=Recipe)
    if not isinstance(tree, Mapping):
        raise RecipeError(f"{source}: a recipe is a mapping of sections (base_model:, layers:, ...), got "
                          f"{type(tree).__name__}")
    tree = copy.deepcopy(dict(tree))
    for override in overrides:
        _apply_override(tree, override, src)
    tree = _expand_vars(tree, "", src)
    recipe = build(Recipe, tree, "", src)
    if recipe.variants:  # each variant is a recipe of its own: its mistakes are found now, not after training
        variant_recipes(recipe, source)
    return recipe


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """Plain, YAML/JSON-able dict of every field (defaults included, env vars expanded); `recipe_from_dict` of it
    gives an equal Recipe. An empty `variants:` is left out: a one-model recipe resolves as it always did; so are
    the base's placement keys when unset (device_map, max_memory, offload_folder)."""
    tree = plain(recipe)
    if not tree.get("variants"):
        tree.pop("variants", None)
    for key in PLACEMENT_KEYS:  # a base on one device resolves as it always did (the keys came later)
        if tree.get(key) is None:
            tree.pop(key, None)
    return tree


def variant_recipes(recipe, source: str = "<recipe>") -> list:
    """The recipes of `recipe.variants`, in order: [(name, Recipe)]; [] when there are none. Each is validated as
    a recipe of its own; an error names the variant."""
    base = recipe_to_dict(recipe)
    del base["variants"]
    out = []
    for variant in recipe.variants:
        tree = {**base, "output_dir": f"{recipe.output_dir.rstrip('/')}/{variant.name}"}
        other_kind = variant.layer.get("kind", base["layer"]["kind"]) != base["layer"]["kind"]
        tree["layer"] = dict(variant.layer) if other_kind else {**base["layer"], **variant.layer}
        tree["train"] = {**base["train"], **variant.train}
        out.append((variant.name, recipe_from_dict(tree, source=f"{source} variants[{variant.name}]")))
    return out


def save_recipe(recipe: Recipe, path: str | os.PathLike) -> None:
    """Write `recipe_to_dict(recipe)` as YAML (e.g. `recipe.resolved.yaml` in the output folder)."""
    text = yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, default_flow_style=None, allow_unicode=True)
    Path(path).write_text(text, encoding="utf-8")


# ----------------------------------------------------------------------------------------------------------------
# Recipe files and bundled recipes


def bundled_recipes() -> dict[str, Any]:
    """The recipes shipped in the installed package, by name ("quickstart", "paper/mxd-gpt2-l8-mxd", ...) ->
    importlib.resources Traversable of the YAML file."""
    found: dict[str, Any] = {}

    def walk(folder, prefix: str) -> None:
        for entry in sorted(folder.iterdir(), key=lambda e: e.name):
            if entry.is_dir() and not entry.name.startswith(("_", ".")):
                walk(entry, f"{prefix}{entry.name}/")
            elif entry.is_file() and entry.name.endswith((".yaml", ".yml")):
                found[prefix + entry.name.rsplit(".", 1)[0]] = entry

    walk(importlib.resources.files(BUNDLED_PACKAGE), "")
    return found


def _read_recipe(path: str | os.PathLike) -> tuple[str, str]:
    """(YAML text, source name for messages) of a recipe file, else of the bundled recipe of that name."""
    file = Path(path)
    if file.is_file():
        return file.read_text(encoding="utf-8"), str(file)
    if file.is_dir():
        raise RecipeError(f"recipe {str(file)!r} is a folder; give a recipe YAML file or a bundled recipe name")
    bundled = bundled_recipes()
    name = file.as_posix().removeprefix("recipes/")
    name = name.rsplit(".", 1)[0] if name.endswith((".yaml", ".yml")) else name
    if name in bundled:
        resource = bundled[name]
        return resource.read_text(encoding="utf-8"), str(resource)
    raise RecipeError(
        f"recipe file {str(file)!r} does not exist (relative to {os.getcwd()!r}) and is not the name of a bundled "
        f"recipe{did_you_mean(name, bundled)}; give the path of a recipe YAML file or one of the bundled recipes: "
        f"{', '.join(bundled)}"
    )


# ----------------------------------------------------------------------------------------------------------------
# YAML, overrides and variables


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader that reads 3e-4 as a float (YAML 1.2; PyYAML's 1.1 rules need a dot), rejects duplicate keys and
    takes merge keys (`<<: *defaults`: the anchored mapping's keys, overridden by the mapping's own)."""

    def compose_mapping_node(self, anchor):
        # Duplicates are looked for in the mapping as written, before merge keys are flattened into it (a key that
        # overrides a merged one is not a duplicate).
        node = super().compose_mapping_node(anchor)
        seen: dict[tuple[str, str], int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = (key_node.tag, key_node.value)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key_node.value!r} (first at line {seen[key] + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return node


_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)

# `${NAME}` is read as a plain run of characters wherever it stands: inside a flow list or mapping (`paths:
# [${DATA}/x.txt]`) its braces would otherwise be YAML syntax. Each ${NAME} is swapped for a mark made of
# private-use characters (valid in any YAML scalar, never in a recipe) before parsing and swapped back after.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARKED = re.compile(rf"\${_MARK_OPEN}([A-Za-z_][A-Za-z0-9_]*){_MARK_CLOSE}")


def _restore_text(text: str) -> str:
    return _MARKED.sub(r"${\1}", text)


def _restore(value: Any) -> Any:
    if isinstance(value, dict):
        return {_restore(k): _restore(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore(v) for v in value]
    return _restore_text(value) if isinstance(value, str) else value


def read_yaml(text: str) -> Any:
    """A recipe's YAML (or an override's value) as Python data, with the recipe rules: 3e-4 is a float, duplicate
    keys are refused, merge keys work, and ${NAME} stays the text `${NAME}` wherever it stands (expanded later)."""
    marked = _VARIABLE.sub(lambda m: f"${_MARK_OPEN}{m[1]}{_MARK_CLOSE}", text)
    return _restore(yaml.load(marked, Loader=_RecipeLoader))


def _apply_override(tree: dict[str, Any], text: str, src: Source) -> None:
    key, sep, raw_value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(f"--set {text}: expected KEY=VALUE with a dotted key, e.g. train.lr=3e-4 or layers=[2,3]")
    try:
        value = read_yaml(raw_value)
    except yaml.YAMLError as e:
        raise RecipeError(f"--set {text}: the value is not valid YAML: {_restore_text(str(e))}") from None
    parts = key.split(".")
    where = f"--set {text}"
    tp: Any = Recipe
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i])
        cls = dataclass_in(tp)
        if cls is not None:
            names = init_field_names(cls)
            if part not in names:
                raise RecipeError(f"{where}: {unknown_key_message(prefix, part, names, Recipe)}")
            tp = get_type_hints(cls)[part]
        elif get_origin(strip_optional(tp)) in (dict, Mapping):
            tp = get_args(strip_optional(tp))[1] if get_args(strip_optional(tp)) else Any
        else:
            raise RecipeError(f"{where}: {prefix!r} is a value, not a section; set it with --set {prefix}=VALUE")
    node = tree
    for part in parts[:-1]:
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise RecipeError(f"{where}: cannot set {key!r}: {part!r} holds {node!r} in {src.name}, not a section")
    if value is None and not _accepts_null(tp):
        # `--set KEY=null` on a key that takes no null resets it to its default: a command-line kind switch must be
        # able to drop a key the file sets (layer.k for a kind without a top-k).
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value
    src.overrides[key] = text


def _accepts_null(tp: Any) -> bool:
    return tp is Any or tp is type(None) or (get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp))


def assets_dir() -> Path:
    """The installed package's assets folder (the quickstart's tiny model and text): ${EXPERTIZE_ASSETS}."""
    return Path(str(importlib.resources.files("expertize") / "assets"))


_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_VARIABLE_HINTS = {"EXPERTIZE_DATA": "/path/to/data, the folder holding models/ and corpora/"}
# Variables with a value of their own when the environment does not set them.
_BUILTIN_VARIABLES = {"EXPERTIZE_ASSETS": assets_dir}


def _expand_vars(value: Any, key: str, src: Source) -> Any:
    """Replace ${NAME} by the environment variable NAME (or a built-in's value) in every string (keys left alone)."""
    if isinstance(value, dict):
        return {k: _expand_vars(v, join(key, k), src) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_vars(v, f"{key}[{i}]", src) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        name = match[1]
        found = os.environ.get(name)
        if not found and name in _BUILTIN_VARIABLES:
            return str(_BUILTIN_VARIABLES[name]())
        if not found:
            state = "is not set" if found is None else "is empty"
            what = _VARIABLE_HINTS.get(name, "...")
            raise src.error(
                key,
                f"{key}: {value!r} uses the environment variable {name}, which {state}; set it "
                f"(export {name}={what}) or give the value with --set {key}=...",
            )
        return found

    return _VARIABLE.sub(substitute, value)
