"""The `inspect` / `specialize` flags are generated from the settings they fill (conversion/cli_flags.py): each
settings field (and each `specialize_folder` keyword) with a flag has the settings' default, so the two cannot drift,
and the parsed flags build the settings."""

import argparse
import dataclasses
import inspect
import subprocess
import sys

import pytest

from expertize.conversion.cli import build_parser, specialization_settings
from expertize.conversion.inspect_command import inspection_settings
from expertize.conversion.inspection import InspectionSettings
from expertize.conversion.specialization import SpecializationSettings, specialize_folder

FLAGLESS = {"inspect": {"collect_locations"}, "specialize": {"stack_conditions"}}
"""Fields without a flag of their own (collect_locations: set by --export delphi; stack_conditions: Python only)."""


def _subcommand(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command].add_later_flags()


def _defaults(command: str) -> dict:
    return {a.dest: a.default for a in _subcommand(command)._actions}


@pytest.mark.parametrize("command, settings", [("inspect", InspectionSettings), ("specialize", SpecializationSettings)])
def test_every_settings_field_flag_has_the_settings_default(command, settings):
    defaults = _defaults(command)
    for field in dataclasses.fields(settings):
        if field.name in FLAGLESS[command]:
            assert field.name not in defaults, f"{field.name} has a flag now: drop it from FLAGLESS"
            continue
        assert field.name in defaults, f"{settings.__name__}.{field.name} has no --{field.name.replace('_', '-')}"
        assert defaults[field.name] == getattr(settings(), field.name), field.name


def test_specialize_keyword_flags_have_specialize_folders_defaults():
    defaults = _defaults("specialize")
    keywords = inspect.signature(specialize_folder).parameters
    for name in ("fit_tokens", "eval_tokens", "context_length", "eval_fraction", "document_tokens"):
        assert defaults[name] == keywords[name].default, name


def test_parsed_flags_build_the_settings():
    parse = build_parser().parse_args
    assert inspection_settings(parse(["inspect", "m"])) == InspectionSettings()
    assert specialization_settings(parse(["specialize", "m"])) == SpecializationSettings()
    args = parse(["inspect", "m", "--top-n", "3", "--layers", "1,2", "--export", "delphi", "--tokens", "64"])
    assert inspection_settings(args) == InspectionSettings(top_n=3, layers=(1, 2), collect_locations=True, tokens=64)
    args = parse(["specialize", "m", "--probe-k", "1,2", "--full-forward", "--ratio", "3", "--tokens", "99"])
    assert specialization_settings(args) == SpecializationSettings(probe_ks=(1, 2), full_forward=True, ratio=3.0)
    assert args.fit_tokens == 99


@pytest.mark.slow  # subprocesses (~3 s): in CI's opt-in run, off the fast suite's 8 minutes
def test_help_shows_the_generated_defaults_and_the_top_level_parser_stays_light():
    text = _subcommand("specialize").format_help()
    assert "--probe-k PROBE_K" in text and "(default 1,2,4,8,16)" in text and "(default 2)" in text
    assert "--tokens TOKENS" in text and "(default 32768)" in text
    # `expertize --help` (and every other subcommand) does not import the settings' modules (transformers).
    code = ("import sys; from expertize.conversion.cli import build_parser; build_parser().format_help(); "
            "print(sorted(m for m in sys.modules if m.startswith(('expertize.conversion.inspection', "
            "'expertize.conversion.specialization', 'transformers'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
