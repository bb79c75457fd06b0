"""The documentation as a reader meets it on GitHub: the front page stays a front page, every relative link (and its
#anchor) lands, and the reference pages cover every layer kind and every recipe key."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_MAX_LINES = 150
PAGES = sorted([README, REPO / "CONTRIBUTING.md", *(REPO / "docs").rglob("*.md")])

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text outside fenced blocks and inline code (where a `[x](y)` is not a link)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def github_anchor(heading: str) -> str:
    """The id GitHub gives a Markdown heading: lower case, punctuation dropped (letters, digits, '-', '_' and
    spaces kept), spaces as '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")  # a link's text, no code marks
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading id of `page`, with GitHub's -1, -2 ... suffixes for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text(encoding="utf-8"))):
        slug = github_anchor(heading)
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def relative_links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page.read_text(encoding="utf-8")))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: ... are not checked


def test_anchor_rule_matches_github():
    assert github_anchor("`expertize upcycle`: the main job") == "expertize-upcycle-the-main-job"
    assert github_anchor("When lm-eval and ΔCE disagree") == "when-lm-eval-and-δce-disagree"
    assert github_anchor("Variants: several layers on one activation stream") == (
        "variants-several-layers-on-one-activation-stream")
    assert github_anchor("End-to-end healing") == "end-to-end-healing"


def test_link_finder_reads_links_and_images_but_not_code():
    page = "[a](x.md) ![img](y.png) [b](https://e.org) `[c](z.md)`\n```\n[d](w.md)\n```\n[e](v.md#part)\n"
    assert [t for t in _LINK.findall(_prose(page))] == ["x.md", "y.png", "https://e.org", "v.md#part"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file: {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(REPO)})")
    assert not broken, f"{page.relative_to(REPO)}: broken links:\n  " + "\n  ".join(broken)


def test_readme_is_a_front_page_with_install_quickstart_and_tests():
    text = README.read_text(encoding="utf-8")
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move reference text into a docs/ page and link it")
    assert 'pip install -e ".[dev]"' in text
    assert "expertize upcycle quickstart" in text
    assert "python -m pytest -q" in text  # the command .ci/run runs and a newcomer copies
    assert "trust_remote_code=True" in text


def test_every_layer_kind_is_documented():
    from expertize.modeling import LAYER_KINDS

    for page in (README, REPO / "docs" / "kinds.md"):
        text = page.read_text(encoding="utf-8")
        missing = [kind for kind in LAYER_KINDS if f"`{kind}`" not in text]
        assert not missing, f"{page.relative_to(REPO)} does not list the layer kinds {missing}"


def _default(field: dataclasses.Field, hint) -> str:
    """A field's default as docs/recipes.md writes it: YAML spelling, "required", or "section" for a nested one."""
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        if dataclasses.is_dataclass(hint):
            return "section"  # a section's own keys are rows of their own
        value = field.default_factory()
    else:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return value if isinstance(value, str) else repr(value)


def _recipe_keys() -> dict[str, str]:
    """Every key a recipe can set, as the docs write it (`base_model`, `layer.kind`, ..., `variants[].name`), and its
    default."""
    from expertize.conversion.recipe import Recipe

    keys = {}

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            hint = hints[field.name]
            keys[prefix + field.name] = _default(field, hint)
            is_list = typing.get_origin(hint) is list
            for arg in (hint, *typing.get_args(hint)):
                if dataclasses.is_dataclass(arg):
                    walk(arg, f"{prefix}{field.name}{'[]' if is_list else ''}.")

    walk(Recipe, "")
    return keys


def test_every_model_family_is_documented():
    """README's first paragraph and docs/native.md's families table name every family of the family table (which
    tests/test_splice_roundtrip.py holds equal to the bundle's FAMILIES); native.md gives each its model_type."""
    from tests.families import ROWS

    intro = README.read_text().split("\n## ")[0]
    native = (REPO / "docs" / "native.md").read_text()
    assert not [row.title for row in ROWS.values() if row.title not in intro], "README.md's first paragraph"
    rows = {line.split("|")[2].strip() for line in native.splitlines()
            if line.startswith("| ") and line.count("|") > 3}
    assert not [f for f in ROWS if f"`{f}`" not in rows], "docs/native.md's families table (model_type column)"
    assert not [row.title for row in ROWS.values() if row.title not in native], "docs/native.md"


def test_every_recipe_key_is_documented_with_its_default():
    keys = _recipe_keys()
    assert {"layer.kind", "data.paths", "train.lr", "heal.rest", "eval.lm_eval_tasks", "variants[].name"} <= set(keys)
    assert keys["train.lr"] == "auto" and keys["base_model"] == "required" and keys["heal"] == "null"
    text = (REPO / "docs" / "recipes.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `([^`]+)` \| `([^`]*)` \|", text, re.M))
    missing = [key for key in keys if key not in rows]
    assert not missing, f"docs/recipes.md has no row for the recipe keys {missing}"
    stale = [f"{key}: documented {rows[key]!r}, the default is {default!r}" for key, default in keys.items()
             if rows[key] not in (default, "section")]
    assert not stale, "docs/recipes.md states stale defaults:\n  " + "\n  ".join(stale)


def test_the_train_keys_a_variant_may_set_are_the_ones_the_code_accepts():
    """docs/recipes.md's `variants[].train` row and docs/upcycle.md's "What a variant may change" list exactly
    VARIANT_TRAIN_KEYS (the keys a variant's `train:` is checked against), so a key the code accepts is never missing
    from the docs (they once lacked balance, balance_floor, balance_rate and resample_every_tokens)."""
    from expertize.conversion.recipe import VARIANT_TRAIN_KEYS

    row = re.search(r"^\| `variants\[\]\.train` \|.*$", (REPO / "docs" / "recipes.md").read_text("utf-8"), re.M)
    upcycle = (REPO / "docs" / "upcycle.md").read_text(encoding="utf-8")
    bullet = re.search(r"^- \*\*What a variant may change\*\*.*?(?=^- \*\*)", upcycle, re.M | re.S)
    for where, text in (("recipes.md", row.group(0)), ("upcycle.md", bullet.group(0))):
        listed = re.findall(r"`(\w+)`", text[text.index("("):].split(")")[0])  # the parenthesized list
        assert sorted(listed) == sorted(VARIANT_TRAIN_KEYS), f"docs/{where} lists {listed}"


def test_every_command_has_a_page_naming_each_of_its_flags():
    """docs/<command>.md exists for every subcommand, names each of its flags, and the front page links it."""
    import argparse

    from expertize.conversion.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    readme = README.read_text(encoding="utf-8")
    problems = []
    for command, parser in sub.choices.items():
        page = REPO / "docs" / f"{command}.md"
        if not page.exists():
            problems.append(f"expertize {command}: no docs/{command}.md")
            continue
        if f"docs/{command}.md" not in readme:
            problems.append(f"expertize {command}: README.md does not link docs/{command}.md")
        text = page.read_text(encoding="utf-8")
        parser.format_help()  # a subcommand may add its flags on first use (conversion/cli_flags.py's `later`)
        flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
        problems += [f"docs/{command}.md does not name {flag}" for flag in flags if not re.search(
            rf"{re.escape(flag)}(?![\w-])", text)]
    assert not problems, "\n".join(problems)


RESULT_PAGES = sorted(p for p in (REPO / "docs" / "results").glob("*.md") if p.name != "README.md")
_TABLE_RULE = re.compile(r"^\|(?:\s*:?-+:?\s*\|)+\s*$", re.M)
_MACHINE_LOAD = re.compile(r"other jobs|shared with|load average|load \d|quiet moment|busy cores", re.I)


@pytest.mark.parametrize("page", RESULT_PAGES, ids=lambda p: p.name)
def test_every_results_table_is_stamped(page):
    """A results table says how to regenerate it, on what budget and at which commit; not how busy the machine was."""
    text = page.read_text(encoding="utf-8")
    for section in re.split(r"^## ", text, flags=re.M):
        if not _TABLE_RULE.search(_FENCE.sub("", section)):
            continue
        title = section.splitlines()[0]
        for stamp in ("**Command**", "**Budget**", "**Commit**"):
            assert stamp in section, f"docs/results/{page.name}, section {title!r}: no {stamp} line above its table"
        assert re.search(r"\*\*Commit\*\*[^\n]*`[0-9a-f]{7,40}`", section), (
            f"docs/results/{page.name}, section {title!r}: the **Commit** line names no commit hash in backticks")
    load = _MACHINE_LOAD.findall(text)
    assert not load, f"docs/results/{page.name}: machine-load prose {load}; state the budget, not the machine's load"


def test_one_spelling_of_distil():
    """Prose says "distil" (the stage's name, `expertize upcycle`'s help); `train.distill` is a key, not prose."""
    offenders = [f"{page.relative_to(REPO)}: {word!r}" for page in PAGES
                 for word in re.findall(r"\bdistills?\b", _prose(page.read_text(encoding="utf-8")), re.I)]
    assert not offenders, "write 'distil' / 'distils' in prose:\n  " + "\n  ".join(offenders)
