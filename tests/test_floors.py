"""The floors of conversion/ (issue 36): a room never imports a room on a higher floor, and no module imports itself
back through others.

A *room* is a top-level module of conversion/ (`checks.py` -> "checks") or a package (`data/` -> "data"). `FLOORS`
lists them from the ground up, each floor with what it holds; a module may import its own room, any room on its own
floor and any room below. Imports are read with `ast` from every .py file, those inside functions and under
`if TYPE_CHECKING:` included (a deferred import is still the dependency it names), relative and absolute
(`expertize.conversion.x`) alike. The second rule holds modules, not rooms: the import graph of conversion/'s
modules has no cycle (two modules of one room that import each other count, as do packages' `__init__.py` files).

Both rules also run on a broken copy of the tree, where they must fail naming the file and line (or the cycle), so
neither can pass by reading nothing. CONTRIBUTING.md's "Floors" section is this table in prose.
"""

import ast
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONVERSION = REPO / "conversion"
PACKAGE = "expertize.conversion"

FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("the vocabulary: user-facing errors, progress bars", ("errors", "progress")),
    ("settings and the checks made before any work: the recipe's dataclasses and rules, devices, paths, disks",
     ("recipe", "device", "checks")),
    ("folders and records: run folders, metrics.json, provenance, the card, number formats", ("publishing",)),
    ("the model's anatomy: family facts, splicing, dense initialization", ("surgery",)),
    ("text and activations: documents, tokens, the MLP hooks, the activation cache", ("data",)),
    ("what runs on a model: training engines, per-unit inspection, lm-evaluation-harness, the shared CLI flags",
     ("training", "inspection", "harness", "cli_flags")),
    ("what reads a trained layer: held-out evaluation, exports, specialization", ("evaluation", "export",
                                                                                 "specialization")),
    ("the commands' own modules: preflight, inspect, export", ("preflight", "inspect_command", "export_command")),
    ("the pipelines: upcycle and capture", ("upcycle", "capture")),
    ("the command line and the package's face", ("cli", "__init__")),
]


def floor_of() -> dict[str, int]:
    return {room: level for level, (_, rooms) in enumerate(FLOORS) for room in rooms}


def module_name(path: Path, root: Path) -> str:
    """'data.documents' for conversion/data/documents.py, 'data' for data/__init__.py, '__init__' for the root."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> Iterator[tuple[str, int]]:
    """(imported conversion module, line) for every import in `path` (any depth, TYPE_CHECKING blocks included).
    `from . import x` names the module x where x is one, else the package."""
    package = list(path.relative_to(root).parent.parts)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not node.module or not (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
                    continue
                base = node.module[len(PACKAGE):].strip(".").split(".") if node.module != PACKAGE else []
            else:
                if node.level - 1 > len(package):
                    continue  # above conversion/ (expertize.modeling through `...`): not a room
                base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            for alias in node.names:
                candidate = base + [alias.name]
                yield (".".join(candidate) if _is_module(root, candidate) else ".".join(base) or "__init__",
                       node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    yield alias.name[len(PACKAGE) + 1:], node.lineno


def _is_module(root: Path, parts: list[str]) -> bool:
    where = root.joinpath(*parts)
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def floor_violations(root: Path) -> list[str]:
    """Every import from a lower floor to a higher one, and every room on no floor."""
    floors, problems = floor_of(), []
    for path in _files(root):
        source = module_name(path, root)
        room = source.split(".")[0]
        where = path.relative_to(root.parent)
        if room not in floors:
            problems.append(f"{where}: the room {room!r} is on no floor; add it to FLOORS in tests/test_floors.py "
                            "(and CONTRIBUTING.md's Floors) on the floor of what it holds")
            continue
        for target, line in imports_of(path, root):
            other = target.split(".")[0]
            if other == room:
                continue
            if other not in floors:
                problems.append(f"{where}:{line}: imports {target}, whose room {other!r} is on no floor")
            elif floors[other] > floors[room]:
                problems.append(
                    f"{where}:{line}: imports {target} ({other!r}, floor {floors[other]}: {FLOORS[floors[other]][0]}) "
                    f"from {room!r} (floor {floors[room]}): a lower floor never imports a higher one; move the code "
                    "it needs down, or the caller up"
                )
    return problems


def import_cycles(root: Path) -> list[list[str]]:
    """The strongly connected components of more than one module of conversion/'s import graph (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for path in _files(root):
        source = module_name(path, root)
        graph.setdefault(source, set()).update(t for t, _ in imports_of(path, root) if t != source)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the ~150 modules
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_every_room_is_on_a_floor_and_no_floor_imports_a_higher_one():
    problems = floor_violations(CONVERSION)
    assert not problems, "\n".join(problems)


def test_the_modules_of_conversion_import_no_cycle():
    cycles = import_cycles(CONVERSION)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_every_floor_room_exists():
    """A room renamed or removed leaves the table: it must follow, so that the table stays the house's."""
    rooms = {module_name(p, CONVERSION).split(".")[0] for p in _files(CONVERSION)}
    assert set(floor_of()) == rooms


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "conversion"
    shutil.copytree(CONVERSION, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _append(file: Path, text: str) -> int:
    """Append `text` to `file`; the line number its first line lands on."""
    lines = file.read_text(encoding="utf-8").splitlines()
    file.write_text("\n".join(lines) + "\n" + text, encoding="utf-8")
    return len(lines) + 1 + next(i for i, line in enumerate(text.splitlines()) if "import" in line)


@pytest.mark.slow  # a broken copy of the repository checked (~3 s): in CI's opt-in run, off the fast suite's 8 minutes
def test_a_climb_in_a_broken_copy_is_named_by_file_and_line(tmp_path):
    root = _copy(tmp_path)
    # The delphi composition that once sat inside the inspection report (issue 36), as a deferred import.
    line = _append(root / "inspection" / "stats.py",
                   "\n\ndef _climb():\n    from ..export.delphi import export_delphi\n    return export_delphi\n")
    problems = floor_violations(root)
    assert len(problems) == 1
    assert problems[0].startswith(f"conversion/inspection/stats.py:{line}: imports export.delphi ('export', floor 6")
    assert "a lower floor never imports a higher one" in problems[0]
    # absolute imports count too
    _append(root / "recipe" / "coerce.py", "\n\nfrom expertize.conversion.data.text import DataError\n")
    assert any(p.startswith("conversion/recipe/coerce.py:") and "imports data.text" in p for p in floor_violations(root))


def test_a_room_on_no_floor_is_named(tmp_path):
    root = _copy(tmp_path)
    (root / "scratch.py").write_text("from .errors import ExpertizeError\n", encoding="utf-8")
    assert floor_violations(root) == [
        "conversion/scratch.py: the room 'scratch' is on no floor; add it to FLOORS in tests/test_floors.py "
        "(and CONTRIBUTING.md's Floors) on the floor of what it holds"
    ]


def test_a_cycle_in_a_broken_copy_is_named(tmp_path):
    root = _copy(tmp_path)
    # variants.py once imported the loader that imports the schema that imports variants.py (issue 36).
    _append(root / "recipe" / "variants.py", "\n\ndef _back():\n    from .loader import recipe_to_dict\n")
    assert import_cycles(root) == [["recipe.loader", "recipe.schema", "recipe.variants"]]
    assert floor_violations(root) == []  # one room: only the cycle rule sees it
