"""`expertize` command line: one entry point, subcommands that are thin layers over the Python API.

    expertize upcycle RECIPE.yaml        distil, evaluate, save a Hub-loadable folder      (conversion/upcycle.py)
    expertize eval MODEL_DIR --tasks ..  lm-eval on the model and its base, side by side  (conversion/harness/)
    expertize tasks TEXT --name NAME     offline perplexity + cloze tasks from any text   (conversion/harness/)
    expertize plot-sweep DIR ... --metric M   metric vs K per method                      (conversion/evaluation/)
    expertize push MODEL_DIR --repo-id U/N    upload to the Hugging Face Hub              (conversion/publishing/)

Heavy imports (torch, transformers, lm_eval) happen inside the subcommands, so `--help` stays fast.
"""

import argparse
import os
import sys

from .errors import ExpertizeError


def _upcycle(args: argparse.Namespace) -> int:
    from .recipe import load_recipe
    from .upcycle import upcycle, upcycle_summary

    from .progress import quiet_library_progress

    recipe = load_recipe(args.recipe, args.set)
    with quiet_library_progress(args.no_progress):
        out = upcycle(recipe, progress=not args.no_progress, restart=args.restart, log=_stderr)
    if os.environ.get("RANK", "0") == "0":  # one report under data-parallel launches
        print(upcycle_summary(out))
        print(f"expertize: wrote {out}")
    return 0


def _stderr(message: str) -> None:
    print(f"expertize: {message}", file=sys.stderr, flush=True)


def _limit(text: str) -> int | float:
    """--limit: an integer number of documents, or a fraction below 1 (0.1 = 10 %)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of documents or a fraction, got {text!r}") from None
    return int(value) if value >= 1 and value.is_integer() else value


def _eval(args: argparse.Namespace) -> int:
    from .harness.folder_eval import RECORDED, evaluate_model_folder
    from .harness.runner import HarnessSettings, comparison_markdown

    settings = HarnessSettings(
        tasks=args.tasks.split(","),
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        batch_size=args.batch_size,
        seed=args.seed,
        include_paths=args.include_path,
    )
    comparison = evaluate_model_folder(
        args.model_dir,
        settings,
        base=None if args.no_base else (args.base or RECORDED),
        output_dir=args.output,
        device=args.device,
        dtype=args.dtype,
        update_card=not args.no_card,
        log=_stderr,
        verbose=args.verbose,
    )
    print(comparison_markdown(comparison))
    from .publishing.run_folder import LM_EVAL

    output = args.output or os.path.join(args.model_dir, LM_EVAL)
    _stderr(f"wrote {output}/comparison.md, comparison.json, comparison.png and the harness's files")
    return 0


def _tasks(args: argparse.Namespace) -> int:
    from .harness.offline_tasks import BUNDLED_TASKS, bundled_tasks_dir, write_tasks_from_text

    if args.list:
        print(f"offline tasks shipped with expertize ({bundled_tasks_dir()}):")
        print("\n".join(f"  {name}" for name in BUNDLED_TASKS))
        return 0
    if not (args.text_file and args.name and args.output):
        raise ValueError("give TEXT_FILE, --name and --output (or --list to show the shipped tasks)")
    names = write_tasks_from_text(
        args.text_file, args.output, args.name, separator=args.separator, unit=args.unit, n_choices=args.choices,
        seed=args.seed, max_docs=args.max_docs, overwrite=args.overwrite,
    )
    print(f"wrote tasks {', '.join(names)} to {args.output}; run them with\n"
          f"  expertize eval MODEL_DIR --tasks {','.join(names)} --include-path {args.output}")
    return 0


def _plot_sweep(args: argparse.Namespace) -> int:
    from .evaluation.sweep import plot_sweep

    path = plot_sweep(args.model_dirs, args.metric, args.output, x=args.x)
    print(f"expertize: wrote {path} and {path.with_suffix('.json')}")
    return 0


def _push(args: argparse.Namespace) -> int:
    from .publishing.push import push_model

    url = push_model(
        args.model_dir, args.repo_id, private=args.private, revision=args.revision, token=args.token,
        include_samples=args.include_samples,
    )
    print(f"expertize: pushed {args.model_dir} to {url}")
    return 0


def _add_eval(sub) -> None:
    ev = sub.add_parser(
        "eval",
        help="run lm-evaluation-harness tasks on an expertize model and its base, side by side",
        description="Run lm-eval tasks on MODEL_DIR and on its base model with identical settings; write the "
        "harness's results_*.json and per-document samples_*.jsonl for each, a side-by-side table (comparison.md "
        "/ .json / .png), record the results in MODEL_DIR/metrics.json and regenerate MODEL_DIR/README.md. The "
        "offline tasks shipped with expertize (expertize tasks --list) are always available.",
    )
    ev.add_argument("model_dir", help="a folder written by `expertize upcycle`")
    ev.add_argument("--tasks", required=True, help="comma-separated lm-eval task, group or tag names (globs allowed)")
    base = ev.add_mutually_exclusive_group()
    base.add_argument("--base", help="base model (Hub id or folder); default: the one recorded in MODEL_DIR "
                      "(provenance.json, else recipe.resolved.yaml)")
    base.add_argument("--no-base", action="store_true", help="evaluate the model alone")
    ev.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's own)")
    ev.add_argument("--limit", type=_limit, help="documents per task, or a fraction < 1 (smoke tests only)")
    ev.add_argument("--batch-size", type=int, default=8, help="requests per forward pass (default 8)")
    ev.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ev.add_argument("--seed", type=int, help="one seed for the harness's python/numpy/torch/few-shot RNGs "
                    "(default: the harness's own seeds)")
    ev.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N, mps")
    ev.add_argument("--output", help="output folder (default MODEL_DIR/lm_eval)")
    ev.add_argument("--include-path", action="append", default=[], metavar="DIR",
                    help="a folder of extra task YAMLs (repeatable), e.g. one written by `expertize tasks`")
    ev.add_argument("--no-card", action="store_true", help="leave MODEL_DIR's metrics.json and README.md as they are")
    ev.add_argument("--verbose", action="store_true", help="show the harness's log messages")
    ev.set_defaults(func=_eval)


def _add_tasks(sub) -> None:
    ta = sub.add_parser(
        "tasks",
        help="make offline lm-eval tasks (perplexity + cloze multiple choice) from a text file",
        description="Write <name>_ppl (loglikelihood_rolling: word/byte perplexity, bits per byte) and <name>_cloze "
        "(multiple choice: which sentence or line comes next, distractors from other documents, seeded) into a "
        "self-contained folder for `expertize eval --include-path` or `lm_eval --include_path`.",
    )
    ta.add_argument("text_file", nargs="?", help="UTF-8 text: held-out text the model was not trained on")
    ta.add_argument("--name", help="task name prefix (letters, digits, underscores)")
    ta.add_argument("--output", help="folder to write the tasks into")
    ta.add_argument("--separator", default="auto", choices=["auto", "line", "blank"],
                    help="documents: one per line, or blocks separated by blank lines (default: auto)")
    ta.add_argument("--unit", default="auto", choices=["auto", "sentence", "line"],
                    help="what a cloze item asks for: the next sentence, or the next line (default: auto)")
    ta.add_argument("--choices", type=int, default=4, help="choices per cloze item (default 4)")
    ta.add_argument("--seed", type=int, default=0)
    ta.add_argument("--max-docs", type=int, help="use only the first N documents")
    ta.add_argument("--overwrite", action="store_true", help="replace tasks of the same name in --output")
    ta.add_argument("--list", action="store_true", help="list the offline tasks shipped with expertize")
    ta.set_defaults(func=_tasks)


def _metric_help() -> str:
    from .publishing.metrics_schema import metric_help  # a light import: --help stays fast

    return metric_help()


def _add_plot_sweep(sub) -> None:
    ps = sub.add_parser(
        "plot-sweep",
        help="plot a metric against K (or active parameters) per method over model folders",
        description="One line per method (layer kind) through the folders' points, the base model as a dashed line. "
        f"METRIC: {_metric_help()}.",
    )
    ps.add_argument("model_dirs", nargs="+", help="folders written by `expertize upcycle`")
    ps.add_argument("--metric", required=True)
    ps.add_argument("--x", default="k", choices=["k", "active_parameters"], help="x axis (default k)")
    ps.add_argument("--output", default="sweep.png", help="PNG path (the points go to the same name .json)")
    ps.set_defaults(func=_plot_sweep)


def _add_push(sub) -> None:
    pu = sub.add_parser(
        "push",
        help="upload a model folder to the Hugging Face Hub",
        description="Create the model repo if needed and upload the folder in one commit (never push_to_hub, "
        "which would replace the model card). Skipped: checkpoint/, hidden and temporary files, __pycache__, and "
        "lm-eval's per-document samples_*.jsonl (unless --include-samples).",
    )
    pu.add_argument("model_dir")
    pu.add_argument("--repo-id", required=True, help="USER/NAME or ORG/NAME")
    pu.add_argument("--private", action="store_true", help="create the repo private")
    pu.add_argument("--revision", help="push to this branch (created from main when missing)")
    pu.add_argument("--token", help="Hub token with write access (default: `hf auth login` / HF_TOKEN)")
    pu.add_argument("--include-samples", action="store_true", help="also upload lm-eval's samples_*.jsonl")
    pu.set_defaults(func=_push)


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
    up.add_argument("recipe", help="recipe YAML, or the name of a recipe shipped with expertize (e.g. quickstart)")
    up.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a recipe value, e.g. --set train.lr=3e-4 --set layers=[2,3] (repeatable)",
    )
    up.add_argument("--no-progress", action="store_true", help="no progress bars (ours and the libraries')")
    up.add_argument(
        "--restart", action="store_true",
        help="discard the unfinished run in output_dir (its checkpoint and logs) and start over; a finished run "
        "is never deleted",
    )
    up.set_defaults(func=_upcycle)
    _add_eval(sub)
    _add_tasks(sub)
    _add_plot_sweep(sub)
    _add_push(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ExpertizeError as err:
        # Input refused up front exits 2 (nothing was written); a run that started and failed says what it kept.
        print(f"expertize {args.command}: error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", 2)
    except (FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"expertize {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        resume = " Run the same command again to resume from the last checkpoint." if args.command == "upcycle" else ""
        print(f"expertize {args.command}: interrupted.{resume}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
