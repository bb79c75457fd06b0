"""Subcommand flags generated from the settings they fill (issue 20): a flag for a field of a settings dataclass (or a
keyword of the function it configures) takes its default, and its docstring as help, from there, so the CLI never
re-declares a default. `Subcommand` adds such flags only when its subcommand runs or prints its help: the settings'
modules import transformers, which `expertize --help` and the other subcommands need not load. Also the argparse
types of flags only the CLI has (--limit, --layers).
"""

import argparse
import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator

from .checks import at_least, non_negative_int, positive_int


class Subcommand(argparse.ArgumentParser):
    """A subcommand's parser whose flags may be added on first use (`later`): flags generated from a settings
    dataclass import the module that defines it (with transformers), which `expertize --help` and the other
    subcommands need not load."""

    later: Callable[[argparse.ArgumentParser], None] | None = None

    def add_later_flags(self) -> "Subcommand":
        add, self.later = self.later, None
        if add is not None:
            add(self)
        return self

    def parse_known_args(self, args=None, namespace=None):
        self.add_later_flags()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.add_later_flags()
        return super().format_help()


def setting_flag(parser, owner, name: str, flag: str | None = None, *, help: str | None = None, **kwargs) -> None:
    """`flag` (default --NAME with dashes) for the setting `name` of `owner`, a settings dataclass (its field) or a
    function (its keyword): the default is the owner's, the help its field docstring unless `help` is given, with
    the default appended. The parsed value lands in args.NAME, so the settings are built from the same names."""
    default = _default_of(owner, name)
    if help is None:
        from .recipe.coerce import field_docs

        doc = field_docs(owner)[name]
        help = doc[0].lower() + doc[1:].rstrip(".")
    if kwargs.get("action") == "store_true":
        if default is not False:
            raise ValueError(f"{owner.__name__}.{name}: a store_true flag needs the default False, not {default!r}")
    else:
        kwargs["default"] = default
        if default is not None:  # "text (default 8)", or "text (a note; default 8)"
            shown = f"default {_shown(default)}"
            help = f"{help[:-1]}; {shown})" if help.endswith(")") else f"{help} ({shown})"
    flag = flag or "--" + name.replace("_", "-")
    if kwargs.get("action") != "store_true" and flag != "--" + name.replace("_", "-"):
        kwargs.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())  # the usage names the flag
    parser.add_argument(flag, dest=name, help=help, **kwargs)


def _default_of(owner, name: str):
    """The default of field `name` of a dataclass, or of keyword `name` of a function."""
    if dataclasses.is_dataclass(owner):
        field = {f.name: f for f in dataclasses.fields(owner)}[name]
        return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    return inspect.signature(owner).parameters[name].default


def _shown(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (tuple, list)):
        return ",".join(_shown(v) for v in value)
    return str(value)


def settings_from(args: argparse.Namespace, owner, **given):
    """`owner`'s settings from the parsed flags of the same names (`setting_flag`), plus `given`."""
    names = {f.name for f in dataclasses.fields(owner)} - set(given)
    return owner(**{name: getattr(args, name) for name in names if hasattr(args, name)}, **given)


def corpus_pass_flags(parser, settings, *, corpus_help: str) -> None:
    """The flags of one pass of a model folder over named corpora, shared by `inspect` and `export --to delphi`:
    --corpus (repeatable), the `settings` dataclass's (`InspectionSettings`) tokens, layers, context_length and
    batch_size, and --device."""
    parser.add_argument("--corpus", action="append", default=[], metavar="NAME=PATH", help=corpus_help)
    setting_flag(parser, settings, "tokens", type=positive_int)
    setting_flag(parser, settings, "layers", type=layer_list,
                 help="comma-separated sparse layer indices (default: all)")
    setting_flag(parser, settings, "context_length", type=at_least(2, "tokens per sequence"),
                 help="tokens per sequence, at most the model's positions")
    setting_flag(parser, settings, "batch_size", type=positive_int, help="sequences per forward pass")
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda, cuda:N, mps (default cpu)")
    reading_flags(parser)


def reading_flags(parser, separator: bool = True) -> None:
    """--add-bos, --document-marker, --document-separator (unless not `separator`: `specialize` splits corpora by
    their own documents): how a command reads its corpora (data/run_reading.py); default: as the folder's run read
    its text."""
    parser.add_argument("--add-bos", choices=["auto", "true", "false"],
                        help="start every packed sequence with BOS (default: as the folder's run read its text, "
                        "its recipe.resolved.yaml's data.add_bos; auto without one)")
    parser.add_argument("--document-marker", choices=["eos", "bos"],
                        help="EOS after every document, or BOS before it as llama2.c's models read (default: the "
                        "run's data.document_marker; eos without one)")
    if not separator:
        parser.set_defaults(document_separator=None)
        return
    parser.add_argument("--document-separator", choices=["auto", "line", "blank_line", "file"],
                        help="how a .txt corpus splits into documents: auto (lines, or blank-line blocks when it has "
                        "them), line, blank_line, or file: one raw stream (default: file when the run read its text "
                        "as one stream, else auto)")


def reading_of(args, model_dir):
    """The `TextReading` the parsed reading flags ask for, over the one the folder's run recorded."""
    from .data.run_reading import TextReading

    return TextReading.of_folder(model_dir).overridden(args.add_bos, args.document_marker, args.document_separator)


# -- the types of the commands' own flags (conversion/checks.py holds those the recipe shares) -------------------------


def lm_eval_limit(text: str) -> int | float:
    """--limit: an integer number of documents, or a fraction below 1 (0.1 = 10 %)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of documents or a fraction, got {text!r}") from None
    if not 0 < value < float("inf"):  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be above 0 (documents, or a fraction such as 0.1), got {text}")
    return int(value) if value >= 1 and value.is_integer() else value


def layer_list(text: str) -> tuple[int, ...]:
    """--layers 2,3: layer indices (0 or more)."""
    return tuple(non_negative_int(p.strip()) for p in text.split(",") if p.strip())


def say(message: str) -> None:
    """One status line of a command on stderr."""
    import sys

    print(f"expertize: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def house_warnings() -> Iterator[None]:
    """While a command runs, expertize's own warnings (`ExpertizeWarning`) print as its other warnings do, one
    `expertize: warning: ...` line through `say`, not as Python's `path:line: UserWarning` and the source line.
    Other libraries' warnings print as they always do."""
    import warnings

    from .errors import ExpertizeWarning

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, ExpertizeWarning):
            say(f"warning: {message}")
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def token_progress(command: str) -> Callable[[int, int], None]:
    """The one-line progress of a pass over tokens on stderr (`expertize COMMAND: done / total tokens`, redrawn in
    place); the caller ends the line when the pass is over."""
    import sys

    def report(done: int, total: int) -> None:
        print(f"\rexpertize: {command}: {done:,} / {total:,} tokens", end="", file=sys.stderr, flush=True)

    return report
