"""`expertize` command line: one entry point, subcommands that are thin layers over the Python API."""

import argparse
import os
import sys

from .recipe import RecipeError


def _upcycle(args: argparse.Namespace) -> int:
    from .recipe import load_recipe
    from .upcycle import upcycle

    recipe = load_recipe(args.recipe, args.set)
    out = upcycle(recipe, progress=not args.no_progress)
    if os.environ.get("RANK", "0") == "0":  # one report under data-parallel launches
        print(f"expertize: wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertize", description="Turn the dense MLPs of a pretrained LM into sparse experts."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser(
        "upcycle",
        help="distil sparse layers for a recipe's MLPs, evaluate, and write a Hub-loadable folder",
        description="Run a recipe end to end; running it again on the same output_dir resumes an interrupted run. "
        "Data-parallel: `accelerate launch --multi_gpu -m expertize upcycle RECIPE` on GPUs, "
        "`torchrun --nproc_per_node N -m expertize upcycle RECIPE` on CPUs (gloo).",
    )
    up.add_argument("recipe", help="recipe YAML (see recipes/)")
    up.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a recipe value, e.g. --set train.lr=3e-4 --set layers=[2,3] (repeatable)",
    )
    up.add_argument("--no-progress", action="store_true", help="no progress bars")
    up.set_defaults(func=_upcycle)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (RecipeError, FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"expertize {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
