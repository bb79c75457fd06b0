"""How far one recipe travels through conversion/ on its way through `upcycle` (issue 49): the modules it enters, the
distinct calls that cross from one module into another, and how many of those go back into a module that is still
waiting on the call stack (control returning up to a caller's module before that caller is done: the back and forth
a pipeline of stages avoids).

    python benchmarks/upcycle_path.py                      # this checkout
    python benchmarks/upcycle_path.py --root /tmp/old      # any other checkout of the repository (a git worktree)

The quickstart recipe runs for real (shrunk to a few steps: the path, not the model, is measured) under
`sys.setprofile`; every Python call whose code lies in ROOT/conversion/ is a *visit* to that file's module. Counted:

- **modules**: conversion/ modules visited;
- **crossings**: distinct (caller function, callee function) pairs whose modules differ — the nearest conversion/
  frame below the callee is the caller, so a callback through torch counts as the crossing it is;
- **returns**: those crossings whose callee's module is already on the call stack below the caller (it called out
  and is called back before it returned);
- **climbs**: crossings whose callee's room stands on a higher floor than the caller's (tests/test_floors.py's
  `FLOORS` of the measured tree): a lower floor calling up, through an object or function handed down.

Each count is of distinct pairs, not of calls, so a loop of a thousand steps counts its crossings once. `--root`
imports the package from that tree (its expertize/, modeling/, conversion/, recipes/ folders, as pyproject.toml maps
them), so two commits compare under one interpreter.
"""

import argparse
import importlib.abc
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"expertize": "expertize", "expertize.modeling": "modeling", "expertize.conversion": "conversion",
            "expertize.recipes": "recipes", "expertize.model_cards": "model_cards"}
"""pyproject.toml's package-dir: the import name of each top folder."""
SHRINK = ["data.train_tokens=8192", "data.eval_tokens=2048", "train.checkpoint_every=4", "train.log_every=2",
          "eval.generation_prompts=2"]
"""Overrides that keep every stage of the quickstart but make it seconds long."""


class TreeFinder(importlib.abc.MetaPathFinder):
    """Imports the `expertize` packages from `root` (ahead of the installed copy); their subpackages follow from the
    packages' __path__."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name not in PACKAGES:
            return None
        folder = self.root / PACKAGES[name]
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def floors(root: Path) -> dict[str, int]:
    """Room -> floor, from the measured tree's tests/test_floors.py ({} where it has none)."""
    path = root / "tests" / "test_floors.py"
    if not path.exists():
        return {}
    spec = importlib.util.spec_from_file_location("_measured_floors", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.floor_of()


class PathTracer:
    """A `sys.setprofile` function that records the crossings between conversion/ modules."""

    def __init__(self, conversion: Path) -> None:
        self.prefix = str(conversion) + os.sep
        self.stack: list[tuple[str, str]] = []  # (module, function) of the conversion/ frames now running
        self.crossings: set[tuple[str, str, str, str]] = set()
        self.returns: set[tuple[str, str, str, str]] = set()
        self.modules: set[str] = set()

    def module_of(self, filename: str) -> str | None:
        if not filename.startswith(self.prefix):
            return None
        return filename[len(self.prefix):].removesuffix(".py").replace(os.sep, "/")

    def __call__(self, frame, event, arg) -> None:
        if event not in ("call", "return"):
            return
        module = self.module_of(frame.f_code.co_filename)
        if module is None:
            return
        if event == "return":
            if self.stack:
                self.stack.pop()
            return
        function = frame.f_code.co_qualname
        self.modules.add(module)
        if self.stack and self.stack[-1][0] != module:
            edge = (*self.stack[-1], module, function)
            self.crossings.add(edge)
            if any(m == module for m, _ in self.stack[:-1]):
                self.returns.add(edge)
        self.stack.append((module, function))


def room(module: str) -> str:
    return module.split("/")[0]


def measure(root: Path) -> dict:
    sys.meta_path.insert(0, TreeFinder(root))
    from expertize.conversion.recipe import load_recipe
    from expertize.conversion.upcycle import upcycle

    with tempfile.TemporaryDirectory() as scratch:
        recipe = load_recipe("quickstart", [*SHRINK, f"output_dir={scratch}/run"])
        tracer = PathTracer(root / "conversion")
        sys.setprofile(tracer)
        try:
            upcycle(recipe)
        finally:
            sys.setprofile(None)
    floor = floors(root)
    climbs = {e for e in tracer.crossings
              if room(e[0]) in floor and room(e[2]) in floor and floor[room(e[2])] > floor[room(e[0])]}
    return {"modules": len(tracer.modules), "crossings": len(tracer.crossings), "returns": len(tracer.returns),
            "climbs": len(climbs) if floor else None, "return_edges": sorted(tracer.returns),
            "climb_edges": sorted(climbs)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO, help="a checkout of the repository (default: this one)")
    parser.add_argument("--list", action="store_true", help="also list the returns and climbs, caller -> callee")
    args = parser.parse_args()
    root = args.root.resolve()
    if not (root / "conversion" / "upcycle.py").exists():
        print(f"error: {root} is not a checkout of this repository (no conversion/upcycle.py)", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = measure(root)
    print("| tree | modules | crossings | returns | climbs |\n|---|---|---|---|---|")
    climbs = "—" if result["climbs"] is None else result["climbs"]
    print(f"| {root} | {result['modules']} | {result['crossings']} | {result['returns']} | {climbs} |")
    if args.list:
        for title, edges in (("returns", result["return_edges"]), ("climbs", result["climb_edges"])):
            print(f"\n{title}:")
            for caller, caller_fn, callee, callee_fn in edges:
                print(f"  {caller}:{caller_fn} -> {callee}:{callee_fn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
