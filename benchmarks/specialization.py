"""Do the experts specialize? Every kind on one table: faithfulness beside domain masking, sparse probing, steering.

One MLP of a real multi-domain model (SmolLM2-135M-Instruct, made by shared/tools/get_smollm2.py) is replaced by
each kind. All kinds are variants of ONE recipe (`variants:`, one per kind, each a complete model folder
RUNS/runs/KIND; benchmarks/_runs.run_variants): they train on one activation capture of the base model, the
expensive part on CPU, with the same tokens in the same order and the same optimizer settings (a variant's weights
are those of training it alone). Each variant's `layer:` section names its kind (sizes as benchmarks/all_kinds.py:
every kind parameter-matched to a TopK transcoder with F·d_in latents, F = --match-transcoder; the per-kind settings
are all_kinds.KIND_SETTINGS). Data: named domain corpora (DIR/{code,docs,wiki,literature,stories}.jsonl, made by
shared/tools/domain_corpora.py).

Split (conversion/specialization/splits.py): every document goes to the fit or the eval side by a seeded hash of its
text (--eval-fraction of them to eval). The sparse layer is trained on fit documents only (interleaved round-robin
across domains, so each domain contributes documents in turn); units are assigned, steering units chosen and probes
trained on fit documents; every masking ΔCE, probe F1 and steering effect is measured on eval documents. (The FVU / ΔCE
columns are the upcycle run's own held-out part of the fit documents, never trained on.)

Columns: ΔCE and FVU of the run (metrics.json), dead % on the fit text of the specialization pass; masking
specificity = mean ΔCE(domain) / mean ΔCE(other domains) when each domain's Monet-assigned units are ablated (ratio of
means over the domains that have units), beside the same for as many random live units; best 1-D probe F1 and
k-sparse probe F1 at k=1 and k=8 (mean over domains; dense MLP neurons as the baseline row); steering effect = CE drop
on the steered unit's domain minus the mean drop on the others (nats), beside a random live unit's. μMoE: a unit
(expert) "fires" where its entmax gate is > 0, so its frequency-based assignment is weaker than for TopK codes.

A PNG (--png) plots masking specificity against ΔCE per kind, each beside its random-live-units control.

Run:  python benchmarks/specialization.py --domains DIR --model SMOLLM2_DIR [--quick | --full-cpu]
          [--png docs/specialization.png] [--out docs/specialization.md] [--runs-dir RUNS]

Cost model (why the CPU budgets are so small): every masking / steering measurement is a full forward of SmolLM2 over
every domain's eval text (a model truncated to fewer layers was tried and is useless, its CE is ~20 nats). With D
domains, F fit and E eval tokens per domain, one kind's specialization pass forwards 2·D·F tokens (unit statistics,
pooled codes) + D·E (base CE) + 2·D²·E (masking: each domain's units and the random control, on every domain) +
2·D²·E (steering, likewise) + D·E (pooled codes), i.e. 10·F + 110·E tokens at D = 5, plus the dense baseline's
D·(F + E) once. Training costs one capture of --train-tokens plus each variant's held-out evaluation. Measured on 2
shared CPU cores under `nice -n 15` (load 5-7): SmolLM2 forwards ~35-50 tokens/s (a 512x576x1536 matmul at
~20 GFLOP/s); --quick (2 kinds, 3 domains, context 64, 256 fit / 128 eval tokens) took 9m36s: training 106s (one
capture of 8,192 tokens, 2 variants), specialization ~200 s per kind.

--quick (a smoke-scale run, < 10 minutes): layer 15, 3 domains (code, wiki, stories), 2 kinds (mxd, transcoder),
context 32, the 8x transcoder budget, 8,192 training tokens (32 steps of 256), 256 fit and 64 eval tokens per domain
(8 and 2 contexts), 20 units tried as 1-D probes. Its numbers show the pipeline runs, not what the seeds claim.

--full-cpu (the full table, ~45-60 minutes on 2 shared cores under `nice -n 15`): layer 15, all 5 domains, all 7
kinds of DEFAULT_KINDS, context 32, the 8x transcoder budget, 32,768 training tokens (128 steps of 256; 512 held-out
tokens for ΔCE / FVU), 512 fit and 64 eval tokens per domain (16 and 2 contexts), 100 units tried as 1-D probes:
~12,000 forwarded tokens per kind. It is the largest budget the cost model fits in an hour there, and still tiny:
the layers are far from converged and every masking / steering ΔCE is measured on 62 predicted tokens per domain,
probe F1 on 2 held-out contexts per domain. A GPU runs the defaults (262,144 training tokens, 8,192 fit / 2,048
eval tokens per domain, context 128) with --device cuda.
"""

import argparse
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from _runs import run_variants
from all_kinds import KIND_SETTINGS

DEFAULT_KINDS = ("mxd", "transcoder", "skip_transcoder", "moe_x", "monet_vd", "routed_neurons", "mumoe_cp")
QUICK = dict(layer=15, domain_names="code,wiki,stories", kinds="mxd,transcoder", context_length=32,
             train_tokens=8192, tokens_per_step=256, fit_tokens=256, eval_tokens=64, upcycle_eval_tokens=256,
             probe_top=20)
# The largest budget of the full table (7 kinds, 5 domains, layer 15) that 2 shared CPU cores finish in ~45-60 min
# under `nice -n 15` (module docstring: the cost model and the measurement it was extrapolated from).
FULL_CPU = dict(layer=15, domain_names="code,docs,literature,stories,wiki", kinds=",".join(DEFAULT_KINDS),
                context_length=32, train_tokens=32_768, tokens_per_step=256, fit_tokens=512, eval_tokens=64,
                upcycle_eval_tokens=512, probe_top=100)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--domains", required=True, help="folder of NAME.jsonl domain corpora ({'text': ...} per line)")
    p.add_argument("--model", required=True, help="the dense base model folder (e.g. SmolLM2-135M-Instruct)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the smoke-scale settings of the module docstring")
    mode.add_argument("--full-cpu", action="store_true",
                      help="the full table at the CPU budget of the module docstring (~45-60 min on 2 shared cores)")
    p.add_argument("--domain-names", default=None, help="comma-separated corpora of --domains (default: all)")
    p.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help="comma-separated kinds")
    p.add_argument("--layer", type=int, default=None, help="decoder layer to replace (default: the middle one)")
    p.add_argument("--match-transcoder", type=float, default=8.0, help="parameter budget (default 8x transcoder)")
    p.add_argument("--train-tokens", type=int, default=262_144, help="training tokens per kind (default 262,144)")
    p.add_argument("--upcycle-eval-tokens", type=int, default=8192, help="the run's held-out tokens (default 8192)")
    p.add_argument("--fit-tokens", type=int, default=8192, help="fit tokens per domain (default 8192)")
    p.add_argument("--eval-tokens", type=int, default=2048, help="eval tokens per domain (default 2048)")
    p.add_argument("--eval-fraction", type=float, default=0.3, help="documents held out for evaluation (0.3)")
    p.add_argument("--context-length", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW lr shared by all kinds (default 1e-2)")
    p.add_argument("--tokens-per-step", type=int, default=1024, help="tokens per optimizer step (default 1024)")
    p.add_argument("--probe-top", type=int, default=100, help="units tried as 1-D probes (default 100)")
    p.add_argument("--steer-scale", type=float, default=4.0, help="λ / the unit's mean activation (default 4)")
    p.add_argument("--seed", type=int, default=0, help="split, data, init and control seed (default 0)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--runs-dir", default=None, help="keep runs here (default: a temporary folder, removed)")
    p.add_argument("--png", default="specialization.png", help="where to write the plot (default specialization.png)")
    p.add_argument("--out", default=None, help="also write the Markdown table here")
    args = p.parse_args()
    if args.quick or args.full_cpu:  # the mode's values are defaults: options given explicitly still win
        p.set_defaults(**(QUICK if args.quick else FULL_CPU))
        args = p.parse_args()
    return args


def interleave(docs: dict[str, list[str]]) -> list[dict]:
    """Round-robin over the domains' documents: {"text", "domain"} records."""
    out = []
    for group in itertools.zip_longest(*docs.values()):
        out += [{"text": t, "domain": name} for name, t in zip(docs, group) if t is not None]
    return out


def build_tree(args, base: str, kinds: list[str], corpus: Path, out_dir: Path) -> dict:
    """One recipe, one variant per kind (output_dir/KIND): every kind trains on the same single activation capture
    of the base model (the expensive part on CPU), with the same tokens in the same order and the same optimizer."""
    layer = lambda kind: {"kind": kind, "match_transcoder": args.match_transcoder, **KIND_SETTINGS[kind]}  # noqa: E731
    return {
        "base_model": base, "dtype": "float32", "layers": [args.layer],
        "layer": layer(kinds[0]),
        "variants": [{"name": kind, "layer": layer(kind)} for kind in kinds],
        "data": {"source": "jsonl", "paths": [str(corpus)], "context_length": args.context_length,
                 "train_tokens": args.train_tokens, "eval_tokens": args.upcycle_eval_tokens, "eval_fraction": 0.1,
                 "shuffle_documents": True, "seed": args.seed},
        "train": {"lr": args.lr, "warmup_steps": min(50, max(1, args.train_tokens // args.tokens_per_step // 10)),
                  "schedule": "cosine", "min_lr_ratio": 0.1, "tokens_per_step": args.tokens_per_step,
                  "loss": "nmse", "precision": "fp32", "grad_clip": 1.0, "checkpoint_every": 0, "log_every": 50,
                  "seed": args.seed, "device": args.device},
        "eval": {"batch_sequences": 8, "generation_prompts": 0, "histogram": False},
        "output_dir": str(out_dir),
    }


def train_kinds(args, base: str, kinds: list[str], corpus: Path, out_dir: Path) -> tuple[dict, dict, float | None]:
    """Train every kind as a variant of one recipe; returns ({kind: metrics} of the published ones, {kind: failure
    message} of the others, seconds or None when all were already finished). A variant that diverges is not
    published (upcycle raises RunFailed after publishing the others): it becomes a failure row, the rest go on."""
    from expertize.conversion.errors import RunFailed
    from expertize.conversion.publishing.run_folder import METRICS

    try:
        metrics, seconds = run_variants(build_tree(args, base, kinds, corpus, out_dir), __file__)
        return metrics, {}, seconds
    except RunFailed as error:
        message = str(error).splitlines()[0][:300]
        done = {k: json.loads((out_dir / k / METRICS).read_text(encoding="utf-8")) for k in kinds
                if (out_dir / k / METRICS).is_file()}
        return done, {k: f"not published: {message}" for k in kinds if k not in done}, None


def _f(value, fmt):
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def main() -> int:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from expertize.conversion.specialization import (
        SpecializationSettings, pack_documents, read_documents, specialize, split_documents,
    )
    from expertize.conversion.surgery.splice import load_base_model, load_expertize_model
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    names = (args.domain_names.split(",") if args.domain_names
             else sorted(p.stem for p in Path(args.domains).glob("*.jsonl")))
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KIND_SETTINGS]
    missing = [n for n in names if not (Path(args.domains) / f"{n}.jsonl").is_file()]
    if bad or len(names) < 2 or missing:
        print(f"error: --domains {args.domains} must hold >= 2 NAME.jsonl corpora (missing: {missing or 'none'}; "
              f"found {len(names) - len(missing)}) and --kinds must come from {list(KIND_SETTINGS)} (unknown: "
              f"{bad or 'none'}); write the corpora with shared/tools/domain_corpora.py DIR", file=sys.stderr)
        return 2
    root = Path(args.runs_dir) if args.runs_dir else Path(tempfile.mkdtemp(prefix="expertize-specialize-"))
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        base_dir = args.model
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
        base = load_base_model(base_dir, dtype=torch.float32).to(args.device).eval()
        if args.layer is None:
            args.layer = base.config.num_hidden_layers // 2
        fit_docs, eval_docs = {}, {}
        for n in names:
            fit_docs[n], eval_docs[n] = split_documents(read_documents(n, str(Path(args.domains) / f"{n}.jsonl")),
                                                        args.seed, args.eval_fraction)
        corpus = root / "fit_documents.jsonl"
        corpus.write_text("".join(json.dumps(r) + "\n" for r in interleave(fit_docs)), encoding="utf-8")
        fit = {n: pack_documents(n, d, tokenizer, args.fit_tokens, args.context_length) for n, d in fit_docs.items()}
        held = {n: pack_documents(n, d, tokenizer, args.eval_tokens, args.context_length)
                for n, d in eval_docs.items()}
        special = [i for i in tokenizer.all_special_ids if i is not None]
        settings = SpecializationSettings(seed=args.seed, probe_top=args.probe_top, steer_scale=args.steer_scale)
        header = (f"{Path(args.model).name}, layer "
                  f"{args.layer}, {args.match_transcoder:g}x transcoder budget, {args.train_tokens:,} training tokens "
                  f"per kind (context {args.context_length}, {args.tokens_per_step} tokens per step, lr {args.lr:g}, NMSE), domains {', '.join(names)}: "
                  f"{args.fit_tokens:,} fit / {args.eval_tokens:,} eval tokens per domain from disjoint documents "
                  f"(seeded hash, {args.eval_fraction:g} held out), seed {args.seed}, device {args.device}")
        print(header, flush=True)
        rows, failures, spec_seconds = [], [], 0.0
        t0 = time.perf_counter()
        trained, untrained, train_seconds = train_kinds(args, base_dir, kinds, corpus, root / "runs")
        train_seconds = time.perf_counter() - t0 if train_seconds is not None else None
        failures += [f"{kind}: {message}" for kind, message in untrained.items()]
        print(f"trained {len(trained)} of {len(kinds)} kinds on one activation capture"
              + (f" [{train_seconds:.0f}s]" if train_seconds is not None else " (reused)"), flush=True)
        for kind in kinds:
            if kind not in trained:
                continue
            t0 = time.perf_counter()
            try:
                model = load_expertize_model(root / "runs" / kind).to(args.device).eval()
                report = specialize(model, fit, held, special, settings, layer=args.layer, base_model=None)
            except Exception as error:  # report it (e.g. every unit dead at a tiny budget), go on with the others
                failures.append(f"{kind}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
                print(f"  {kind}: FAILED: {failures[-1]}", flush=True)
                continue
            metrics = trained[kind]
            m = metrics["layers"][str(args.layer)]
            row = {"kind": kind, "delta_ce": metrics["ce"]["delta"], "fvu": m["fvu"], **report.summary()}
            rows.append(row)
            (root / f"{kind}_specialization.json").write_text(json.dumps(report.to_json(), indent=1))
            print(f"  {kind} [{time.perf_counter() - t0:.0f}s]\n" + report.format(), flush=True)
            spec_seconds += time.perf_counter() - t0
            del model
        # The dense baseline of the probes: the base MLP's hidden neurons at the same layer (same contexts).
        from expertize.conversion.specialization import content_mask, pooled_dense, probe_domains
        from expertize.conversion.specialization.report import _labelled
        from expertize.conversion.surgery.families import decoder_blocks

        (xf, yf), (xh, yh) = _labelled(fit), _labelled(held)
        mlp = decoder_blocks(base)[args.layer].mlp
        dense = probe_domains(pooled_dense(base, mlp, xf, content_mask(xf, special)), yf,
                              pooled_dense(base, mlp, xh, content_mask(xh, special)), yh, names,
                              ks=settings.probe_ks, top=settings.probe_top, seed=args.seed)
    finally:
        if not args.runs_dir:
            shutil.rmtree(root, ignore_errors=True)
    cols = ["kind", "ΔCE", "FVU", "dead %", "masking specificity (random)",
            "masking ΔCE target / others", "units masked", "best 1-D F1",
            "F1 k=1", "F1 k=8", "steering effect (random), nats"]
    lines = ["| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['delta_ce']:+.4f} | {r['fvu']:.4f} | {100 * r['dead_fraction']:.1f} | "
                     f"{_f(r['specificity'], '.2f')} ({_f(r['random_specificity'], '.2f')}) | "
                     f"{_f(r['mask_delta_target'], '+.4f')} / {_f(r['mask_delta_others'], '+.4f')} | "
                     f"{r['masked_units']} | "
                     f"{r['probe_best_1d']:.3f} | {r['probe_f1_k1']:.3f} | {r['probe_f1_k8']:.3f} | "
                     f"{r['steering_effect']:+.4f} ({r['random_steering_effect']:+.4f}) |")
    lines.append(f"| dense MLP neurons | 0 | 0 | – | – | – | – | {dense.mean_best_1d:.3f} | {dense.mean_k(1):.3f} | "
                 f"{dense.mean_k(8):.3f} | – |")
    lines += [f"| {f} | failed |" for f in failures]
    timing = (f"wall time {time.perf_counter() - start:.0f}s: training "
              + (f"{train_seconds:.0f}s" if train_seconds is not None else "reused")
              + f" ({len(kinds)} kinds as variants of one recipe, one activation capture), specialization "
              f"{spec_seconds:.0f}s")
    table = "\n".join([header, "", *lines, "", timing])
    print("\n" + table)
    if args.out:
        Path(args.out).write_text(table + "\n", encoding="utf-8")
    if args.runs_dir:  # the rows, to re-plot or re-tabulate without rerunning
        (root / "rows.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1), encoding="utf-8")
    plot(rows, args.png, f"{Path(args.model).name} layer {args.layer}, {args.train_tokens:,} training tokens")
    print(f"wrote {args.png}")
    return 0


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """Masking specificity (filled marker) and its random-live-units control (x, same colour) against ΔCE, one colour
    per kind. The y axis is symmetric-log: at small budgets a ratio of two near-zero ΔCEs can be in the hundreds, of
    either sign. An infinite specificity (the other domains did not get worse) is drawn at the top edge as a
    triangle; a kind with no assigned unit (undefined specificity) is named in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [v for r in rows for v in (r["specificity"], r["random_specificity"]) if math.isfinite(v)]
    top = max([1.0, *finite]) * 2
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    for i, r in enumerate(rows):
        color = f"C{i % 10}"
        shown = []
        for key, marker in (("specificity", "o"), ("random_specificity", "x")):
            value = r[key]
            if math.isinf(value):
                value, marker = (top, "^") if value > 0 else (float("nan"), marker)
            shown.append(value)
            label = None if key != "specificity" else (r["kind"] if math.isfinite(value) else
                                                       f"{r['kind']} (no assigned units)")
            ax.scatter(r["delta_ce"], value, marker=marker, color=color, label=label, s=40)
        ax.plot([r["delta_ce"]] * 2, shown, color=color, lw=0.6, alpha=0.5)
    ax.scatter([], [], marker="x", color="grey", label="random live units (control)")
    ax.axhline(1.0, color="grey", lw=0.5, ls="--")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("ΔCE of the spliced model (nats, lower = more faithful)")
    ax.set_ylabel("masking specificity ΔCE(domain) / ΔCE(others), symlog")
    if title:
        ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
