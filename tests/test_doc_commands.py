"""Every `expertize ...` command the README and docs/ show in a shell block is one the command line accepts today
(issue 50): it parses with the real parser, a recipe it names by its shipped name or a repository path loads with its
`--set` overrides, and the flags it passes exist. A renamed flag, a removed recipe or a stale `--set` key in a page
fails here instead of on a reader's machine. (The commands a CI test also runs end to end: the quickstart and the
README's circuit-tracing section, tests/test_circuit_tracer_e2e.py.)

Synopsis lines (`[--flag ...]`, `a|b`) are usage, not commands, and are left out.
"""

import re
import shlex
from pathlib import Path

import pytest
from expertize.conversion.cli import build_parser
from expertize.conversion.recipe import load_recipe
from expertize.conversion.recipe.loader import bundled_recipes

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
_BLOCK = re.compile(r"^```(?:bash|sh|console|shell)\n(.*?)^```", re.S | re.M)


def documented_commands() -> list[tuple[str, str]]:
    """(page:line, command) for every `expertize` command line of a shell block, continuations joined, comments
    dropped; synopsis lines left out."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for block in _BLOCK.finditer(text):
            first_line = text[: block.start(1)].count("\n") + 1
            lines = block.group(1).splitlines()
            i = 0
            while i < len(lines):
                start, line = i, lines[i]
                while line.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i].strip()
                i += 1
                command = line.split(" #")[0].strip()
                if not command.startswith("expertize ") or "[" in command or "|" in command:
                    continue
                found.append((f"{page.relative_to(REPO)}:{first_line + start}", command))
    return found


COMMANDS = documented_commands()


def test_the_pages_show_commands_to_check():
    assert len(COMMANDS) >= 20, COMMANDS  # the sweep reads the pages (a broken block pattern would find none)
    assert any(c.startswith("expertize upcycle stories260k-clt") for _, c in COMMANDS)


def _recipe_source(name: str) -> str | None:
    """What a command's RECIPE names when it is a shipped recipe's name or a file of this repository (None: a
    placeholder such as RECIPE or my_recipe.yaml, nothing to load)."""
    if (REPO / name).is_file():
        return str(REPO / name)
    return name if name in bundled_recipes() else None


@pytest.mark.parametrize("where, command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_is_accepted_as_written(where, command):
    argv = shlex.split(command)[1:]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: `{command}` is refused by the command line (exit {e.code})")
    if argv[0] in ("upcycle", "capture"):
        source = _recipe_source(args.recipe)
        if source is not None:  # the overrides apply to the recipe the page names
            load_recipe(source, list(getattr(args, "set") or []))
