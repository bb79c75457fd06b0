"""`expertize export MODEL_DIR --to sparsify|circuit-tracer|saelens|delphi OUTPUT`: the subcommand's flags and its
run (the CLI module only registers it)."""

import argparse
import sys

from .cli_flags import corpus_pass_flags, reading_of, settings_from, token_progress

__all__ = ["add_export", "run_export"]

TARGETS = ("sparsify", "circuit-tracer", "saelens", "delphi")


def run_export(args: argparse.Namespace) -> int:
    from .checks import resolve_device
    from .export.coders import export_coders
    from .export.expressible import ExportError

    if args.to != "delphi":
        flags = (("--corpus", args.corpus), ("--layers", args.layers), ("--add-bos", args.add_bos),
                 ("--document-marker", args.document_marker), ("--document-separator", args.document_separator))
        given = [flag for flag, value in flags if value]
        if given:
            verb = "applies" if len(given) == 1 else "apply"  # "--corpus applies", "--corpus and --layers apply"
            raise ExportError(f"{' and '.join(given)} only {verb} to --to delphi (a {args.to} export holds every layer's "
                              "weights, read from the folder without any text)")
        if args.circuit_tracer_topk and args.to != "circuit-tracer":
            raise ExportError("--circuit-tracer-topk only applies to --to circuit-tracer")
        out = export_coders(args.model_dir, args.to, args.output, base_model=args.base_model,
                            circuit_tracer_topk=args.circuit_tracer_topk)
        print(f"expertize: wrote {args.to} export of {args.model_dir} to {out}")
        return 0
    from .inspection import InspectionSettings, parse_corpora
    from .export.delphi import delphi_cache_from_folder

    if not args.corpus:
        raise ExportError("--to delphi reads the folder's activations over text: give --corpus NAME=PATH (repeatable)")
    device = resolve_device(args.device, "--device")
    layers = tuple(args.layers) if args.layers else None
    settings = settings_from(args, InspectionSettings, layers=layers, collect_locations=True)
    written = delphi_cache_from_folder(
        args.model_dir, args.output, parse_corpora(args.corpus), settings, base_model=args.base_model,
        device=device, progress=None if args.no_progress else token_progress("export"),
        reading=reading_of(args, args.model_dir),
    )
    if not args.no_progress:
        print(file=sys.stderr)
    print(f"expertize: wrote a delphi latent cache of {len(written)} hookpoint(s) to {args.output}")
    return 0


def add_export(sub) -> None:
    ex = sub.add_parser(
        "export",
        help="a folder's sparse layers for sparsify, circuit-tracer, SAELens or delphi (docs/export.md)",
        description="Write MODEL_DIR's sparse layers in another tool's own layout, named for the base model the "
        "tool loads: sparsify (one cfg.json + sae.safetensors per hookpoint), circuit-tracer (one JumpReLU "
        "coder per layer, every layer) and SAELens (one cfg.json + sae_weights.safetensors per layer) hold the "
        "layers themselves and refuse a layer they cannot hold exactly; delphi "
        "holds every activation over --corpus text (any kind).",
    )
    ex.later = _export_flags
    ex.set_defaults(func=run_export)


def _export_flags(ex) -> None:
    from .inspection import InspectionSettings as S

    ex.add_argument("model_dir", help="an expertize model folder (written by `expertize upcycle` or save_model)")
    ex.add_argument("--to", required=True, choices=TARGETS, help="the target tool")
    ex.add_argument("output", help="the export's folder (must not exist, or be empty)")
    ex.add_argument("--base-model", help="the base model's Hub id or folder that the tool loads (default: the one "
                    "the folder records)")
    ex.add_argument("--circuit-tracer-topk", action="store_true",
                    help="write TopK layers for circuit-tracer installed from its repository (TopK since its PR "
                    "#94); the registry's circuit-tracer 0.5.0 would read them as ReLU, so they are refused without "
                    "this flag")
    delphi = ex.add_argument_group("--to delphi (the activations over text)")
    corpus_pass_flags(delphi, S, corpus_help="a named corpus (.txt, or .jsonl with a \"text\" field); repeatable")
    delphi.add_argument("--no-progress", action="store_true", help="no progress line")
