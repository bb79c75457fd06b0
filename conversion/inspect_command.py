"""`expertize inspect MODEL_DIR (--corpus NAME=PATH ... --output DIR | --prompt TEXT)`: the subcommand's flags and its
run (the CLI module only registers it; nothing here imports transformers before the command runs)."""

import argparse
import sys

from .checks import non_negative_int, positive_int
from .cli_flags import corpus_pass_flags, reading_of, say, setting_flag, settings_from, token_progress

__all__ = ["add_inspect", "inspection_settings"]


def _inspect(args: argparse.Namespace) -> int:
    from .checks import check_output_location, resolve_device
    from .surgery.families import model_positions
    from .inspection import (
        InspectionError, format_prompt_view, inspect_folder, load_for_inspection, parse_corpora, prompt_ids,
        prompt_view, report_bytes, token_texts,
    )
    from .inspection.output import ReportFolder, model_identity

    device = resolve_device(args.device, "--device")
    reading = reading_of(args, args.model_dir)  # as the folder's run read its text, unless the flags say otherwise
    if args.prompt is not None:
        model, tokenizer = load_for_inspection(args.model_dir, device)
        ids = prompt_ids(tokenizer, args.prompt, max_positions=model_positions(model.config), log=say,
                         bos=reading.prompt_bos(tokenizer))
        print(format_prompt_view(prompt_view(model, ids, token_texts(tokenizer), top=args.per_token)))
        return 0
    if not args.corpus or not args.output:
        raise InspectionError("give --corpus NAME=PATH (repeatable) and --output DIR, or --prompt TEXT")
    settings = inspection_settings(args)
    corpora = parse_corpora(args.corpus)
    check_output_location(args.output, what="--output", need_bytes=report_bytes(args.model_dir, settings))
    delphi = None
    if args.export == "delphi":
        from .export.delphi import delphi_target

        delphi = delphi_target(args.model_dir, args.base_model)  # refused before the pass, not after it
    # The folder is claimed before the pass (another model's report, a second inspect of it: refused up front).
    with ReportFolder(args.output, model_identity(args.model_dir), overwrite=args.overwrite).claimed() as folder:
        stats = inspect_folder(
            args.model_dir, corpora, settings, device=device,
            progress=None if args.no_progress else token_progress("inspect"), reading=reading,
        )
        if not args.no_progress:
            print(file=sys.stderr)
        written = folder.publish(_report_writer(stats, delphi))
    recorded = _recorded_reading(args.model_dir)
    for layer, ls in sorted(stats.layers.items()):
        dead = int((ls.counts == 0).sum())
        print(f"layer {layer} ({ls.kind}): {ls.num_units:,} units, {dead:,} dead over {stats.tokens:,} tokens"
              + recorded["layers"].get(str(layer), ""))
    if recorded["verdict"]:
        print(recorded["verdict"])
    say(f"wrote {', '.join(str(p) for p in written)}")
    return 0


def _report_writer(stats, delphi: dict | None):
    """The report's files, and with `delphi` ({"model_name", "model_type"} of the base) a delphi latent cache in
    delphi_cache/ (conversion/export/delphi.py) from the same pass."""
    from pathlib import Path

    from .export.delphi import export_delphi

    report = stats.files_writer()
    if delphi is None:
        return report
    return lambda output_dir: report(output_dir) + export_delphi(stats, Path(output_dir) / "delphi_cache", **delphi)


def _recorded_reading(model_dir) -> dict:
    """What the folder's metrics.json says of its code (issue 35: a unit report is read beside how much of the layer
    the units carry): {"layers": {index: "; the code carries 5 % of ... (poor)"}, "verdict": the recorded verdict's
    line or None}. Empty for a folder without metrics (a model saved from Python)."""
    from .evaluation.reading import Verdict, code_share_phrase
    from .publishing.metrics_schema import load_metrics

    metrics = load_metrics(model_dir)
    layers = {i: f"; {code_share_phrase(m.code_share)} (metrics.json, held-out text of its run)"
              for i, m in metrics.layers.items() if m.code_share is not None}
    verdict = Verdict.from_dict(metrics.verdict).line() if metrics.verdict else None
    return {"layers": layers, "verdict": verdict}


def inspection_settings(args: argparse.Namespace):
    """The `InspectionSettings` of parsed `inspect` flags."""
    from .inspection import InspectionSettings

    layers = tuple(args.layers) if args.layers else None
    return settings_from(args, InspectionSettings, layers=layers, collect_locations=args.export == "delphi")


def add_inspect(sub) -> None:
    ins = sub.add_parser(
        "inspect",
        help="what every sparse unit responds to: JSON per layer and an offline HTML explorer, or a prompt's units",
        description="One pass of MODEL_DIR over the named corpora, every sparse layer at once: per unit its firing "
        "frequency (overall and per corpus), mean and max activation, top activating contexts and the tokens it "
        "promotes / suppresses; router kinds add load per expert and router entropy. Writes DIR/layer_<i>.json and "
        "DIR/index.html (self-contained, opens from disk). With --prompt: the units firing on each token.",
    )
    ins.later = _inspect_flags
    ins.set_defaults(func=_inspect)


def _inspect_flags(ins) -> None:
    """The `inspect` flags; those of `InspectionSettings`' fields take its defaults (and docstrings)."""
    from .inspection import InspectionSettings as S

    ins.add_argument("model_dir", help="an expertize model folder (written by `expertize upcycle` or save_model)")
    corpus_pass_flags(ins, S, corpus_help="a named corpus (.txt: one document per line or blank-line blocks; .jsonl: "
                      "a \"text\" field); repeat for per-domain firing rates, e.g. --corpus code=code.txt "
                      "--corpus wiki=wiki.jsonl")
    ins.add_argument("--output", help="folder for layer_<i>.json and index.html")
    ins.add_argument("--prompt", help="print the units firing on each token of this text instead")
    ins.add_argument("--per-token", type=positive_int, default=5,
                     help="--prompt: units shown per token and layer (default 5)")
    setting_flag(ins, S, "top_n", type=positive_int)
    setting_flag(ins, S, "left", type=non_negative_int)
    setting_flag(ins, S, "right", type=non_negative_int, help="context tokens after the peak")
    setting_flag(ins, S, "vocab_top", type=positive_int)
    ins.add_argument("--export", choices=["delphi"], help="also write a delphi latent cache to DIR/delphi_cache")
    ins.add_argument("--base-model", help="--export delphi: the base model's Hub id or folder, the cache's "
                     "model_name (default: the one the folder records)")
    ins.add_argument("--overwrite", action="store_true",
                     help="replace the report of another model in --output (a report of the same model is always "
                     "replaced; a folder that is not a report is never written into)")
    ins.add_argument("--no-progress", action="store_true", help="no progress line")
