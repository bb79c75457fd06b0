"""Strict, explained conversion of parsed YAML values to the typed fields of a dataclass tree.

Every error names the dotted key path (`train.lr`, `layers[1]`), the value, what was expected and, where one is
close, the key or choice that was probably meant. Used by the recipe loader (`loader.py`) and by the dataclasses of
`schema.py`, which type-check values given from Python too.

Numbers: an integer is accepted where a number is expected, and a float with an integral value (4.8e8) where an
integer is expected; booleans are never numbers, and no number field accepts inf or nan.
"""

import ast
import dataclasses
import difflib
import inspect
import math
import textwrap
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from ..errors import ExpertizeError

__all__ = [
    "RecipeError", "Source", "build", "check_field_types", "check_minimum", "did_you_mean", "field_docs", "plain",
]


class RecipeError(ExpertizeError, ValueError):
    """A recipe (file, override or field value) is invalid; the message names the key, the value and the fix."""


class Source:
    """Where recipe values come from, for error messages: the file, or the `--set` override that set a key.

    `root` is the dataclass at the top of the tree: an unknown key is looked up in its other sections (`lr:` at the
    top level -> "did you mean 'train.lr'?").
    """

    def __init__(self, name: str, root: type | None = None) -> None:
        self.name = name
        self.root = root
        self.overrides: dict[str, str] = {}

    def where(self, key: str) -> str:
        for set_key, text in reversed(self.overrides.items()):
            if key == set_key or key.startswith(set_key + ".") or key.startswith(set_key + "["):
                return f"--set {text}"
        return self.name

    def error(self, key: str, message: str) -> RecipeError:
        return RecipeError(f"{self.where(key)}: {message}")


class _Mismatch(Exception):
    """The value does not have the expected type (a union tries its next option)."""

    def __init__(self, key: str, value: Any, expected: str, hint: str = "") -> None:
        super().__init__(f"{key}: expected {expected}, got {value!r} ({type(value).__name__}){hint}")
        self.key = key


class _Invalid(Exception):
    """The value has the right type but no field accepts it (inf, nan); no union option would either."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


def build(cls: type, raw: Any, prefix: str, src: Source) -> Any:
    """Instantiate dataclass `cls` from the mapping `raw` at dotted key `prefix`, checking every key and type."""
    if raw is None:  # a section whose keys are all commented out
        raw = {}
    if not isinstance(raw, Mapping):
        raise src.error(
            prefix, f"{prefix}: expected a section (a mapping of keys), got {raw!r} ({type(raw).__name__})"
        )
    names = init_field_names(cls)
    for name in raw:
        if name not in names:
            raise src.error(join(prefix, str(name)), unknown_key_message(prefix, str(name), names, src.root))
    hints = get_type_hints(cls)
    kwargs, missing = {}, []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = join(prefix, f.name)
        if f.name in raw:
            try:
                kwargs[f.name] = coerce(raw[f.name], hints[f.name], key, src)
            except (_Mismatch, _Invalid) as e:
                # A field may say what a value of the wrong type usually means (e.g. a kind per layer: a mapping or a
                # list where one value belongs); a mistyped scalar ('ALL') has its own suggestion.
                structured = isinstance(raw[f.name], (dict, list))
                hint = (f.metadata.get("mismatch_hint", "")
                        if isinstance(e, _Mismatch) and e.key == key and structured else "")
                raise src.error(e.key, str(e) + hint) from None
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            missing.append(f.name)
    if missing:
        docs = field_docs(cls)
        listed = "; ".join(f"{join(prefix, name)} ({docs.get(name, 'no description')})" for name in missing)
        raise RecipeError(f"{src.name}: missing required key(s): {listed}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError, OSError) as e:
        message = str(e)
        if prefix and not message.startswith((prefix + ".", prefix + ":", prefix + " ")):
            message = f"{prefix}: {message}"
        touched = [text for key, text in src.overrides.items() if not prefix or key.split(".")[0] == prefix]
        where = src.name + (f" with --set {' --set '.join(touched)}" if touched else "")
        raise RecipeError(f"{where}: {message}") from None


_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
_PLURALS = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}


def describe(tp: Any) -> str:
    """A type hint in words: "an integer", "one of 'a', 'b'", "a list of numbers", ..."""
    origin, args = get_origin(tp), get_args(tp)
    if tp in _NAMES:
        return _NAMES[tp]
    if origin is Literal:
        if len(args) == 1:
            return repr(args[0])
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin in (list, tuple):
        return f"a list of {_PLURALS[args[0]]}" if args and args[0] in _PLURALS else "a list"
    if dataclasses.is_dataclass(tp):
        return "a section (a mapping of keys)"
    if origin in (dict, Mapping):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, key: str, src: Source) -> Any:
    """`value` checked against the type hint `tp` (and converted: int -> float, integral float -> int, lists)."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return coerce(value, option, key, src)
            except _Mismatch as e:
                errors.append((option, e))
        # A list with a bad item: report the item, not the whole union.
        for option, error in errors:
            if isinstance(value, list) and get_origin(option) in (list, tuple) and error.key != key:
                raise error
        raise _Mismatch(key, value, describe(tp), _list_hint(value, options))
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        hint = did_you_mean(value, [a for a in args if isinstance(a, str)]) if isinstance(value, str) else ""
        raise _Mismatch(key, value, describe(tp), hint)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # YAML reads .inf, .nan and 1e999 as floats; no setting means them
                raise _Invalid(key, f"must be a finite number, got {value}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
    elif origin in (list, tuple):
        if isinstance(value, (list, tuple)):
            item_type = args[0] if args else Any
            items = [coerce(v, item_type, f"{key}[{i}]", src) for i, v in enumerate(value)]
            return items if origin is list else tuple(items)
        raise _Mismatch(key, value, describe(tp), _list_hint(value, [tp]))
    elif origin in (dict, Mapping) or tp in (dict, Mapping):
        if isinstance(value, Mapping):
            key_type, value_type = args if args else (Any, Any)
            return {
                coerce(k, key_type, join(key, str(k)), src): coerce(v, value_type, join(key, str(k)), src)
                for k, v in value.items()
            }
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping) or value is None:
            return build(tp, value, key, src)
    elif isinstance(tp, type):
        if isinstance(value, tp):
            return value
    else:
        return value
    raise _Mismatch(key, value, describe(tp))


def _list_hint(value: Any, options: list[Any]) -> str:
    """The likely fix of a value that fits none of `options`: a word close to one of their fixed words (`ALL` for
    "all"), else a one-item list (`8` for [8]) when the value would be a valid item of one of their lists."""
    words = [a for o in options if get_origin(o) is Literal for a in get_args(o) if isinstance(a, str)]
    if isinstance(value, str) and words:
        exact = [w for w in words if w.lower() == value.lower()]
        hint = f" (did you mean {exact[0]!r}? it is written in lower case)" if exact else did_you_mean(value, words)
        if hint:
            return hint
    for option in options:
        if get_origin(option) in (list, tuple) and isinstance(value, (str, int, float)):
            try:
                coerce(value, get_args(option)[0] if get_args(option) else Any, "", Source("<hint>"))
            except (_Mismatch, _Invalid):
                continue
            return f"; for a single item write [{value}]"
    return ""


def check_field_types(obj: Any, prefix: str) -> None:
    """Type-check (and normalize) the fields of a dataclass built directly in Python, not through the loader."""
    hints = get_type_hints(type(obj))
    src = Source("<python>")
    for f in dataclasses.fields(obj):
        try:
            setattr(obj, f.name, coerce(getattr(obj, f.name), hints[f.name], join(prefix, f.name), src))
        except (_Mismatch, _Invalid) as e:
            raise ValueError(str(e)) from None


def check_minimum(obj: Any, prefix: str, minimum: int, names: Iterable[str]) -> None:
    """Refuse the first field of `names` below `minimum`, naming its key ("train.log_every: must be >= 1, got 0")."""
    for name in names:
        if getattr(obj, name) < minimum:
            raise ValueError(f"{join(prefix, name)}: must be >= {minimum}, got {getattr(obj, name)}")


def plain(value: Any) -> Any:
    """A dataclass tree as plain dicts, lists and scalars (YAML/JSON-able)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise RecipeError(f"cannot serialise the non-finite number {value}")
    return value


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass, by field name (for --help and error messages), its bases' included:
    a field a class restates takes the class's own words."""
    docs = {}
    for owner in reversed(cls.__mro__[:-1]):  # object has no source
        docs.update(_own_field_docs(owner))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings written in `cls`'s own body."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


# ----------------------------------------------------------------------------------------------------------------
# Key paths and suggestions


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


KEY_ALIASES = {
    "learning_rate": "lr",
    "lr_scheduler_type": "schedule",
    "lr_scheduler": "schedule",
    "max_grad_norm": "grad_clip",
    "gradient_clipping": "grad_clip",
    "max_seq_length": "context_length",
    "seq_len": "context_length",
    "block_size": "context_length",
    "top_k": "k",
    "topk": "k",
    "model_name_or_path": "base_model",
}
"""What other training tools name a recipe key (transformers' TrainingArguments, SAE libraries): `train.learning_rate`,
or a misspelling of it such as `train.lerning_rate`, is `train.lr`. Read only for a key that matches none."""


def _alias_of(name: str) -> str | None:
    """The recipe's name for `name` when it is (a close misspelling of) another tool's name for a key."""
    close = difflib.get_close_matches(name.lower(), list(KEY_ALIASES), n=1, cutoff=0.8)
    return KEY_ALIASES[close[0]] if close else None


def unknown_key_message(prefix: str, name: str, names: list[str], root: type | None = None) -> str:
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    alias = _alias_of(name)
    if not close and alias in names:  # another tool's name: learning_rate (or lerning_rate) -> lr
        close = [alias]
    hint = f" (did you mean {join(prefix, close[0])!r}?)" if close else ""
    if not hint and root is not None:  # a key put in the wrong section: `lr:` at the top level -> train.lr
        elsewhere = [key for key in all_keys(root) if key.rsplit(".", 1)[-1] in (name, alias)]
        if elsewhere:
            hint = f" (did you mean {elsewhere[0]!r}?)"
    under = f"under {prefix!r}" if prefix else "at the top level"
    return f"unknown key {join(prefix, name)!r}{hint}; valid keys {under}: {', '.join(names)}"


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of the dataclass tree under `cls`, sections included."""
    keys = []
    hints = get_type_hints(cls)
    for name in init_field_names(cls):
        key = join(prefix, name)
        keys.append(key)
        inner = dataclass_in(hints[name])
        if inner is not None:
            keys.extend(all_keys(inner, key))
    return keys


def init_field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def strip_optional(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def dataclass_in(tp: Any) -> type | None:
    """The dataclass a field's type hint holds (through `X | None`), else None."""
    tp = strip_optional(tp)
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def field_default(cls: type, name: str) -> Any:
    """The field's default (dataclasses.MISSING when it has none)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default
