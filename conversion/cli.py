"""`expertize` command line: one entry point, subcommands that are thin layers over the Python API.

    expertize upcycle RECIPE.yaml        distil, evaluate, save a Hub-loadable folder      (conversion/upcycle.py)
    expertize eval MODEL_DIR --tasks ..  lm-eval on the model and its base, side by side  (conversion/harness/)
    expertize tasks TEXT --name NAME     offline perplexity + cloze tasks from any text   (conversion/harness/)
    expertize plot-sweep DIR ... --metric M   metric vs K per method                      (conversion/evaluation/)
    expertize push MODEL_DIR --repo-id U/N    upload to the Hugging Face Hub              (conversion/publishing/)
    expertize inspect MODEL_DIR --corpus N=P  what every unit responds to (JSON + HTML)   (conversion/inspection/)
    expertize specialize MODEL_DIR ...        domain masking, probing, steering           (conversion/specialization/)
    expertize capture RECIPE --output DIR     the activation cache                        (conversion/capture.py)
    expertize export MODEL_DIR --to T OUT     layers for sparsify / circuit-tracer / delphi (conversion/export/)

Heavy imports (torch, transformers, lm_eval) happen inside the subcommands, so `--help` stays fast.
"""

import argparse
import os
import sys

from .checks import at_least, int_list, non_negative_int, positive_float, positive_int
from .cli_flags import Subcommand, lm_eval_limit, reading_flags, reading_of, setting_flag, settings_from
from .cli_flags import house_warnings
from .cli_flags import say as _stderr
from .errors import ExpertizeError
from .export_command import add_export
from .inspect_command import add_inspect


def _upcycle(args: argparse.Namespace) -> int:
    from .recipe import load_recipe
    from .progress import quiet_library_progress
    from .upcycle import upcycle, upcycle_summary

    recipe = load_recipe(args.recipe, args.set)
    with quiet_library_progress(args.no_progress):
        out = upcycle(recipe, progress=not args.no_progress, restart=args.restart, log=_stderr)
    if os.environ.get("RANK", "0") == "0":  # one report under data-parallel launches
        print(upcycle_summary(out))
        print(f"expertize: wrote {out}")
    return 0


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
        force=args.force,
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
    from .checks import check_output_location

    # The task files hold the documents about twice (the rolling texts and the cloze items) plus their YAML.
    text_bytes = os.path.getsize(args.text_file) if os.path.isfile(args.text_file) else 0
    check_output_location(args.output, what="--output", need_bytes=2 * text_bytes)
    from .harness.offline_tasks import model_token_limit

    count, limit = model_token_limit(args.model) if args.model else (None, None)
    if args.model is None and args.max_tokens is None:
        _stderr("tasks: the cloze items are not fitted to a model's context; for a model with a short context "
                "(the quickstart's 128 positions) pass --model MODEL_DIR or --max-tokens N")
    names = write_tasks_from_text(
        args.text_file, args.output, args.name, separator=args.separator, unit=args.unit, n_choices=args.choices,
        seed=args.seed, max_docs=args.max_docs, overwrite=args.overwrite, max_tokens=args.max_tokens or limit,
        count_tokens=count, show_progress=not args.no_progress,
    )
    print(f"wrote tasks {', '.join(names)} to {args.output}; run them with\n"
          f"  expertize eval MODEL_DIR --tasks {','.join(names)} --include-path {args.output}")
    return 0


def _plot_sweep(args: argparse.Namespace) -> int:
    from .checks import check_output_location
    from .evaluation.sweep import plot_sweep

    check_output_location(args.output, what="--output", file=True)  # its folders are created (as documented)
    path = plot_sweep(args.model_dirs, args.metric, args.output, x=args.x, base=not args.no_base)
    print(f"expertize: wrote {path} and {path.with_suffix('.json')}")
    return 0


def _push(args: argparse.Namespace) -> int:
    from .publishing.push import PushError, dry_run, left_out, license_warning, push_model

    choice = dict(include_samples=args.include_samples, include_reports=args.include_reports)
    if args.dry_run:
        files = dry_run(args.model_dir, args.repo_id, **choice)
        where = f" to {args.repo_id}" if args.repo_id else ""
        print(f"expertize: --dry-run: would upload {len(files)} files ({_mib(sum(files.values()))}){where}:")
        for rel, size in files.items():
            print(f"  {rel}  {_mib(size)}")
    elif args.repo_id is None:
        raise PushError("--repo-id USER/NAME is required (only --dry-run works without it)")
    else:
        url = push_model(args.model_dir, args.repo_id, private=args.private, revision=args.revision,
                         token=args.token, **choice)
        print(f"expertize: pushed {args.model_dir} to {url}")
    skipped = {} if args.include_reports else left_out(args.model_dir, include_samples=args.include_samples)
    if skipped:
        shown = ", ".join(f"{name} ({_mib(size)})" for name, size in sorted(skipped.items()))
        verb = "would not upload" if args.dry_run else "not uploaded"
        _stderr(f"{verb} (not part of the model): {shown}; --include-reports uploads them")
    warning = license_warning(args.model_dir)
    if warning:
        _stderr(f"warning: {warning}")
    return 0


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"


def _specialize(args: argparse.Namespace) -> int:
    import json

    from .checks import check_output_location, resolve_device
    from .inspection import parse_corpora
    from .specialization import specialize_folder

    settings = specialization_settings(args)
    if not 0 < args.eval_fraction < 1:
        from .specialization import SpecializationError

        raise SpecializationError(f"--eval-fraction must be between 0 and 1, got {args.eval_fraction}; e.g. 0.3")
    device = resolve_device(args.device, "--device")
    corpora = parse_corpora(args.corpus)
    eval_corpora = parse_corpora(args.eval_corpus, flag="--eval-corpus")
    if args.json:
        check_output_location(args.json, what="--json", file=True)
    report = specialize_folder(
        args.model_dir, corpora, settings, layer=args.layer, fit_tokens=args.fit_tokens,
        eval_tokens=args.eval_tokens, context_length=args.context_length, eval_fraction=args.eval_fraction,
        base=args.base, device=device, progress=not args.no_progress, eval_corpora=eval_corpora,
        document_tokens=args.document_tokens, reading=reading_of(args, args.model_dir),
    )
    print(report.format())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report.to_json(), f, indent=1)
        _stderr(f"wrote {args.json}")
    return 0


def specialization_settings(args: argparse.Namespace):
    """The `SpecializationSettings` of parsed `specialize` flags."""
    from .specialization import SpecializationSettings

    return settings_from(args, SpecializationSettings)


def _add_specialize(sub) -> None:
    sp = sub.add_parser(
        "specialize",
        help="do the sparse units specialize to domains? domain masking, sparse probing and steering",
        description="Split each named domain corpus by document (seeded hash) into fit and held-out documents; on "
        "the fit side assign units to domains (Monet's rule), pick steering units and train probes; on the held-out "
        "side report ΔCE of ablating each domain's units (vs random live units), k-sparse probe F1 and the CE drop "
        "from steering a domain's unit (vs a random live unit).",
    )
    sp.later = _specialize_flags
    sp.set_defaults(func=_specialize)


def _specialize_flags(sp) -> None:
    """The `specialize` flags; those of `SpecializationSettings`' fields and `specialize_folder`'s keywords take
    their defaults (and the fields' docstrings)."""
    from .specialization import SpecializationSettings as S, specialize_folder as run

    sp.add_argument("model_dir", help="an expertize model folder")
    sp.add_argument("--corpus", action="append", default=[], metavar="NAME=PATH",
                    help="a domain corpus (.txt or .jsonl); give at least two")
    sp.add_argument("--layer", type=int, help="the sparse layer (default: the model's only one)")
    sp.add_argument("--base", help="the dense base model (folder or hub id) for the probing baseline on its MLP "
                    "neurons (default: no baseline)")
    setting_flag(sp, run, "fit_tokens", "--tokens", type=at_least(2, "tokens"), help="fit tokens per domain")
    setting_flag(sp, run, "eval_tokens", type=at_least(2, "tokens"), help="held-out tokens per domain")
    setting_flag(sp, run, "eval_fraction", type=float, help="documents held out")
    sp.add_argument("--eval-corpus", action="append", default=[], metavar="NAME=PATH",
                    help="an explicit held-out file for domain NAME: its --corpus is then all fit, this file all eval "
                    "(instead of the hash split); repeat per domain")
    setting_flag(sp, run, "document_tokens", type=positive_int,
                  help="at most this many tokens from each document, so a budget spreads over more documents "
                  "(narrower, more trustworthy intervals; default: whole documents)")
    setting_flag(sp, S, "bootstrap", type=at_least(0, "replicates"))
    setting_flag(sp, S, "full_forward", action="store_true",
                  help="measure every masking / steering condition by a full forward (default: replay only the "
                  "blocks from the sparse layer up, bit for bit the same CE)")
    setting_flag(sp, run, "context_length", type=at_least(2, "tokens per context"),
                  help="tokens per context, at most the model's positions")
    setting_flag(sp, S, "ratio", type=positive_float, help="assignment ratio of Monet's rule")
    setting_flag(sp, S, "probe_ks", "--probe-k", type=int_list, help="k of the k-sparse probes")
    setting_flag(sp, S, "probe_top", type=positive_int, help="units tried as 1-D probes per domain")
    setting_flag(sp, S, "steer_scale", type=float, help="λ in units of the unit's mean activation")
    setting_flag(sp, S, "seed", type=int, help="split, controls and probes seed")
    setting_flag(sp, S, "batch_size", type=positive_int, help="sequences per forward pass")
    sp.add_argument("--device", default="cpu", help="auto, cpu, cuda, cuda:N, mps (default cpu)")
    reading_flags(sp, separator=False)
    sp.add_argument("--json", help="also write the full report as JSON to this file")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")


def _capture(args: argparse.Namespace) -> int:
    from .capture import capture_activations
    from .progress import quiet_library_progress
    from .recipe import load_recipe

    recipe = load_recipe(args.recipe, args.set)
    with quiet_library_progress(args.no_progress):
        out = capture_activations(recipe, args.output, dtype=args.dtype, shard_tokens=args.shard_tokens,
                                  log=None if args.no_progress else _stderr, progress=not args.no_progress)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every process returns the cache: one says so
        print(f"expertize: wrote the activation cache {out}; train from it with\n"
              f"  expertize upcycle {args.recipe} --set data.activation_cache={out}")
    return 0


def _add_capture(sub) -> None:
    ca = sub.add_parser(
        "capture",
        help="capture a recipe's MLP inputs/outputs once into an activation cache that many upcycle runs train from",
        description="Run the base model over the recipe's training text (its data: section and train_tokens budget) "
        "and write the (input, output) pairs of its target MLPs to DIR as safetensors shards, with cache.json "
        "recording the base model, layers and data section that produced them. `upcycle` reads them when "
        "data.activation_cache names DIR (and refuses a cache captured for another model, layers or data). The "
        "folder appears only once the capture is complete.",
    )
    ca.add_argument("recipe", help="recipe YAML, or the name of a recipe shipped with expertize (e.g. quickstart)")
    ca.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe value, as for upcycle (repeatable)")
    ca.add_argument("--output", help="the cache folder to create (default: the recipe's data.activation_cache)")
    ca.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="stored precision (default: the base model's, the recipe's dtype)")
    ca.add_argument("--shard-tokens", type=positive_int,
                    help="tokens per shard file (default: about 256 MiB per shard)")
    ca.add_argument("--no-progress", action="store_true", help="no progress lines (ours and the libraries')")
    ca.set_defaults(func=_capture)


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
    ev.add_argument("--num-fewshot", type=non_negative_int, help="few-shot examples (default: each task's own)")
    ev.add_argument("--limit", type=lm_eval_limit, help="documents per task, or a fraction < 1 (smoke tests only)")
    ev.add_argument("--batch-size", type=positive_int, default=8, help="requests per forward pass (default 8)")
    ev.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ev.add_argument("--seed", type=int, help="one seed for the harness's python/numpy/torch/few-shot RNGs "
                    "(default: the harness's own seeds)")
    ev.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N, mps")
    ev.add_argument("--output", help="output folder (default MODEL_DIR/lm_eval)")
    ev.add_argument("--include-path", action="append", default=[], metavar="DIR",
                    help="a folder of extra task YAMLs (repeatable), e.g. one written by `expertize tasks`")
    ev.add_argument("--no-card", action="store_true", help="leave MODEL_DIR's metrics.json and README.md as they are")
    ev.add_argument("--verbose", action="store_true", help="show the harness's log messages")
    ev.add_argument("--force", action="store_true",
                    help="compare with a base whose tokenizer differs from the model's (refused without it: such a "
                    "base is not the model's base, and only tokenizer-free metrics such as bits per byte and "
                    "accuracy compare across tokenizers)")
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
    ta.add_argument("--choices", type=at_least(2, "the answer and a distractor"), default=4,
                    help="choices per cloze item (default 4)")
    ta.add_argument("--seed", type=int, default=0)
    ta.add_argument("--max-docs", type=positive_int, help="use only the first N documents")
    ta.add_argument("--model", help="the model folder (or Hub id) the tasks will score: every cloze item fits its "
                    "context length, counted with its tokenizer")
    ta.add_argument("--max-tokens", type=at_least(4, "a context and a continuation"),
                    help="context length the items must fit (default: --model's; without --model counted as UTF-8 "
                    "bytes + 1, an upper bound)")
    ta.add_argument("--overwrite", action="store_true", help="replace tasks of the same name in --output")
    ta.add_argument("--no-progress", action="store_true", help="no progress bar")
    ta.add_argument("--list", action="store_true", help="list the offline tasks shipped with expertize")
    ta.set_defaults(func=_tasks)


def _metric_help() -> str:
    from .publishing.metrics_schema import metric_help  # a light import: --help stays fast

    return metric_help()


def _add_plot_sweep(sub) -> None:
    ps = sub.add_parser(
        "plot-sweep",
        help="plot a metric against K (or active parameters) per method over model folders",
        description="One line per method (layer kind) through the folders' points, the base model as a dashed line "
        "(--no-base: none). Folders evaluated on different budgets (eval tokens, lm-eval --limit) are plotted as "
        f"separate evaluations, each with its own marker and base line. METRIC: {_metric_help()}.",
    )
    ps.add_argument("model_dirs", nargs="+", help="folders written by `expertize upcycle`")
    ps.add_argument("--metric", required=True)
    ps.add_argument("--x", default="k", choices=["k", "active_parameters"], help="x axis (default k)")
    ps.add_argument("--no-base", action="store_true", help="leave the base model's dashed line out")
    ps.add_argument("--output", default="sweep.png",
                    help="PNG path; missing folders are created (the points go to the same name .json)")
    ps.set_defaults(func=_plot_sweep)


def _add_push(sub) -> None:
    pu = sub.add_parser(
        "push",
        help="upload a model folder to the Hugging Face Hub",
        description="Create the model repo if needed and upload the folder in one commit (never push_to_hub, "
        "which would replace the model card). Skipped: checkpoint/, hidden and temporary files, __pycache__, and "
        "lm-eval's per-document samples_*.jsonl (unless --include-samples), and anything that is not part of the "
        "model: reports at the top level (inspect --output MODEL_DIR, specialize --json MODEL_DIR/spec.json) or in "
        "subfolders other than plots/ and lm_eval/ (unless --include-reports). --dry-run lists what would go up.",
    )
    pu.add_argument("model_dir")
    pu.add_argument("--repo-id", help="USER/NAME or ORG/NAME (required, except with --dry-run)")
    pu.add_argument("--dry-run", action="store_true",
                    help="list the files that would be uploaded and what is left out; offline, no token needed")
    pu.add_argument("--private", action="store_true", help="create the repo private")
    pu.add_argument("--revision", help="push to this branch (created from main when missing)")
    pu.add_argument("--token", help="Hub token with write access (default: `hf auth login` / HF_TOKEN)")
    pu.add_argument("--include-samples", action="store_true", help="also upload lm-eval's samples_*.jsonl")
    pu.add_argument("--include-reports", action="store_true",
                    help="also upload what is not part of the model (reports at the top level, subfolders other than "
                    "plots/ and lm_eval/)")
    pu.set_defaults(func=_push)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertize", description="Turn the dense MLPs of a pretrained LM into sparse experts."
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Subcommand)
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
    add_inspect(sub)
    _add_specialize(sub)
    _add_capture(sub)
    add_export(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    import errno

    from .checks import disk_full, no_space_message

    args = build_parser().parse_args(argv)
    try:
        with house_warnings():
            return args.func(args)
    except ExpertizeError as err:
        # Input refused up front exits 2 (nothing was written); a run that started and failed says what it kept.
        print(f"expertize {args.command}: error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", 2)
    except (FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"expertize {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if not (disk_full(err) or isinstance(err, PermissionError) or err.errno == errno.EROFS):
            raise  # anything else is a bug in expertize: keep its traceback
        # The up-front checks passed, so the disk filled (or a permission changed) while the command ran.
        where = os.path.dirname(err.filename) if err.filename else "the output folder"
        then = "rerun to resume" if args.command == "upcycle" else "run the command again"
        message = no_space_message(where, then=then) if disk_full(err) else f"{err}; fix the permissions and {then}"
        print(f"expertize {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        resume = " Run the same command again to resume from the last checkpoint." if args.command == "upcycle" else ""
        print(f"expertize {args.command}: interrupted.{resume}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
