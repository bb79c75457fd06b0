"""Do the experts specialize? Every kind on one table: faithfulness beside domain masking, sparse probing, steering,
every figure with its confidence interval, the headline rows repeated over seeds.

One MLP of a real multi-domain model (SmolLM2-135M-Instruct, made by benchmarks/data/get_smollm2.py) is replaced by
each kind. Per seed, all kinds are variants of ONE recipe (`variants:`, one per kind, each a complete model folder
RUNS/seed<S>/runs/KIND; benchmarks/_runs.run_variants) trained from ONE activation cache (`expertize capture`,
docs/capture.md: the base model runs once per seed; a rerun with --runs-dir, more kinds or another --lr
reuses the cache), with the same tokens in the same order and the same optimizer settings. Each variant's `layer:`
section names its kind (sizes as benchmarks/all_kinds.py: every kind parameter-matched to a TopK transcoder with
F·d_in latents, F = --match-transcoder; per-kind settings all_kinds.KIND_SETTINGS). Data: named domain corpora
(DIR/{code,docs,wiki,literature,stories}.jsonl, made by benchmarks/data/domain_corpora.py).

Seeds (--seeds, default 0,1,2): each seed is a different document split (seeded hash), a different training order
and initialization (data.seed = train.seed = the seed) and different random controls. The summary table gives each
headline figure as mean ± standard deviation over the seeds, with how many seeds found it significant.

Split (conversion/specialization/splits.py): every document goes to the fit or the eval side by a seeded hash of its
text (--eval-fraction of them to eval). The sparse layer is trained on fit documents only (interleaved round-robin
across domains); units are assigned, steering units chosen and probes trained on fit documents; every masking ΔCE,
probe F1 and steering effect is measured on eval documents, each document contributing at most --document-tokens
tokens (default: one context), so the eval budget spans many documents. (The ΔCE / FVU columns are the upcycle run's
own held-out part of the fit documents, never trained on.)

Intervals: 95 % bootstrap over eval documents (conversion/specialization/bootstrap.py, --bootstrap replicates); a
figure whose interval holds its random control's value is marked "n.s.". Masking and steering run on the blocks from
the sparse layer up only (conversion/specialization/suffix.py: bit for bit the full forward's CE); the benchmark times
one masking condition both ways on the first kind and prints the speed-up.

Columns: ΔCE and FVU of the run (metrics.json), dead % on the fit text of the specialization pass; masking
specificity = mean ΔCE(domain) / mean ΔCE(other domains) when each domain's Monet-assigned units are ablated (ratio of
means over the domains that have units), beside the same for as many random live units; best 1-D probe F1 and
k-sparse probe F1 at k=1 and k=8 (mean over domains; random live units as the control; dense MLP neurons as the
baseline row); steering effect = CE drop on the steered unit's domain minus the mean drop on the others (nats),
beside a random live unit's.

Run:  python benchmarks/specialization.py --domains DIR --model SMOLLM2_DIR [--quick | --full-cpu]
          [--lr KIND=LR,...] [--seeds 0,1,2] [--png specialization.png] [--out table.md] [--runs-dir RUNS]
      python benchmarks/specialization.py --domains DIR --model SMOLLM2_DIR --train-only [--kinds ...] [--lr ...]
          (the runs' readings only — ΔCE, KL, FVU, code share, L0, dead — without the specialization passes)
      python benchmarks/specialization.py --from-rows RUNS/rows.json [--out table.md] [--png plot.png]
          (re-tabulate a finished run: the tables, the claims' reading and the plot, without a model)

After the tables comes each seed paper's claim read out with its verdict (benchmarks/specialization_claims.py:
95 % t-intervals over the seeds, paired by seed for differences between kinds).

Cost model: with D domains, F fit and E eval tokens per domain, one kind's specialization pass is one full forward
over D·F fit tokens (unit statistics and pooled codes together) and one over D·E eval tokens (base CE, pooled codes,
the prefix record), then 4·D conditions (D masking + D controls, D steering + D controls) over the D·E eval tokens on
the suffix only (blocks L…end: on SmolLM2 layer 15 of 30, about half a forward); plus the dense baseline's D·(F + E)
once per seed, and per seed one capture of --train-tokens and each variant's held-out evaluation.

--quick (a smoke-scale run, < 10 minutes on 2 idle cores): layer 15, 3 domains (code, wiki, stories), 2 kinds (mxd,
transcoder), 3 seeds, context 32, the 8x transcoder budget, 4,096 training tokens (16 steps of 256), 256 fit and 256
eval tokens per domain (at most 32 tokens per document: 8 eval documents per domain), 20 units tried as 1-D probes,
200 bootstrap replicates. Its numbers show the pipeline runs, not what the seeds claim.

--full-cpu: layer 15, all 5 domains, all 7 kinds of DEFAULT_KINDS, 3 seeds, context 32, the 8x transcoder budget,
32,768 training tokens (128 steps of 256; 512 held-out tokens for ΔCE / FVU), 512 fit and 128 eval tokens per domain,
100 units tried as 1-D probes. The defaults (262,144 training tokens, 8,192 fit / 2,048 eval tokens per domain,
context 128) ran 4 kinds x 3 seeds on SmolLM2 in 84 min on 2 CPU cores, 56 of them in the specialization passes
(docs/results/specialization.md); --device cuda runs them on a GPU.
"""

import argparse
import hashlib
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _runs import run_variants
from all_kinds import KIND_SETTINGS
from specialization_claims import beyond_control, claims, format_value, seed_interval

DEFAULT_KINDS = ("mxd", "transcoder", "skip_transcoder", "moe_x", "monet_vd", "routed_neurons", "mumoe_cp")
QUICK = dict(layer=15, domain_names="code,wiki,stories", kinds="mxd,transcoder", context_length=32,
             train_tokens=4096, tokens_per_step=256, fit_tokens=256, eval_tokens=256, upcycle_eval_tokens=256,
             probe_top=20, bootstrap=200)
FULL_CPU = dict(layer=15, domain_names="code,docs,literature,stories,wiki", kinds=",".join(DEFAULT_KINDS),
                context_length=32, train_tokens=32_768, tokens_per_step=256, fit_tokens=512, eval_tokens=128,
                upcycle_eval_tokens=512, probe_top=100)
# (summary key, its random control's key or None, column title, format) of the headline figures.
HEADLINE = (
    ("delta_ce", None, "ΔCE", "+.4f"), ("fvu", None, "FVU", ".4f"), ("code_share", None, "code share", ".2f"),
    ("dead_pct", None, "dead %", ".1f"),
    ("specificity", "random_specificity", "masking specificity", ".2f"),
    ("mask_delta_target", "random_mask_delta_target", "masking ΔCE target", "+.4f"),
    ("mask_delta_others", None, "masking ΔCE others", "+.4f"),
    ("probe_best_1d", "random_probe_best_1d", "best 1-D F1", ".3f"),
    ("probe_f1_k1", "random_probe_f1_k1", "F1 k=1", ".3f"), ("probe_f1_k8", "random_probe_f1_k8", "F1 k=8", ".3f"),
    ("steering_effect", "random_steering_effect", "steering effect, nats", "+.4f"),
    ("steering_drop_others", None, "steering CE drop on others (−fluency cost), nats", "+.4f"),
)

_STEERING_DASHES = "".join(" | –" for key, *_ in HEADLINE if key.startswith("steering")) + " |"
"""The dense row's empty steering cells (the dense neurons are probed, not steered)."""
_DENSE_LEAD = "".join(f" {'0' if key in ('delta_ce', 'fvu') else '–'} |" for key, *_ in HEADLINE
                      if not key.startswith(("probe", "steering")))
"""The dense row's cells before its probes: it is the base (ΔCE and FVU 0) and has no code, dead units or masking."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--domains", help="folder of NAME.jsonl domain corpora ({'text': ...} per line); required "
                                     "unless --from-rows")
    p.add_argument("--model", help="the dense base model folder (e.g. SmolLM2-135M-Instruct); required unless "
                                   "--from-rows")
    p.add_argument("--from-rows", default=None, metavar="RUNS/rows.json",
                   help="re-tabulate, re-plot and read the claims of a finished run (its --runs-dir's rows.json) "
                        "without training or measuring anything")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the smoke-scale settings of the module docstring")
    mode.add_argument("--full-cpu", action="store_true", help="the CPU-budget table of the module docstring")
    p.add_argument("--layer-option", dest="layer_options", action="append", type=parse_layer_option, default=[],
                   metavar="KIND.KEY=VALUE", help="a `layer:` key of one kind's variant, e.g. mxd.d_hidden=1536 "
                                                  "(repeatable; VALUE read as YAML)")
    p.add_argument("--train-only", action="store_true",
                   help="train every kind and read its run (ΔCE, KL, FVU, code share, L0, dead %%) without the "
                        "specialization passes: the table's first columns in a third of the time")
    p.add_argument("--domain-names", default=None, help="comma-separated corpora of --domains (default: all)")
    p.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help="comma-separated kinds")
    p.add_argument("--layer", type=int, default=None, help="decoder layer to replace (default: the middle one)")
    p.add_argument("--match-transcoder", type=float, default=8.0, help="parameter budget (default 8x transcoder)")
    p.add_argument("--train-tokens", type=int, default=262_144, help="training tokens per kind (default 262,144)")
    p.add_argument("--upcycle-eval-tokens", type=int, default=8192, help="the run's held-out tokens (default 8192)")
    p.add_argument("--fit-tokens", type=int, default=8192, help="fit tokens per domain (default 8192)")
    p.add_argument("--eval-tokens", type=int, default=2048, help="eval tokens per domain (default 2048)")
    p.add_argument("--eval-fraction", type=float, default=0.3, help="documents held out for evaluation (0.3)")
    p.add_argument("--document-tokens", type=int, default=None,
                   help="at most this many tokens per document on both sides (default: the context length)")
    p.add_argument("--context-length", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--lr", type=parse_lrs, default=parse_lrs("1e-2"),
                   help="AdamW lr: one for every kind (default 1e-2) or per kind, KIND=LR,... (each kind at its best "
                        "lr from a sweep; a kind not named takes the bare value if one is given, else 1e-2)")
    p.add_argument("--tokens-per-step", type=int, default=1024, help="tokens per optimizer step (default 1024)")
    p.add_argument("--probe-top", type=int, default=100, help="units tried as 1-D probes (default 100)")
    p.add_argument("--steer-scale", type=float, default=4.0, help="λ / the unit's mean activation (default 4)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds: split, data order, init, controls")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates over documents (default 1000)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (default 8)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--runs-dir", default=None, help="keep runs and caches here (default: a temporary folder)")
    p.add_argument("--png", default="specialization.png", help="where to write the plot (default specialization.png)")
    p.add_argument("--out", default=None, help="also write the Markdown tables here")
    args = p.parse_args()
    if args.quick or args.full_cpu:  # the mode's values are defaults: options given explicitly still win
        p.set_defaults(**(QUICK if args.quick else FULL_CPU))
        args = p.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.document_tokens = args.document_tokens or args.context_length
    options: dict[str, dict] = {}
    for kind, key, value in args.layer_options:
        options.setdefault(kind, {})[key] = value
    args.layer_options = options
    return args


def parse_layer_option(text: str) -> tuple[str, str, object]:
    """"KIND.KEY=VALUE" -> (KIND, KEY, VALUE parsed as YAML)."""
    import yaml

    name, sep, value = text.partition("=")
    kind, dot, key = name.partition(".")
    if not (sep and dot and kind and key):
        raise argparse.ArgumentTypeError(f"--layer-option: {text!r} is not KIND.KEY=VALUE (e.g. mxd.d_hidden=1536)")
    return kind, key, yaml.safe_load(value)


def parse_lrs(text: str) -> dict[str, float]:
    """'1e-2' -> {'*': 0.01}; 'mxd=1e-3,transcoder=3e-3' -> per kind ('*' is the fallback)."""
    out = {"*": 1e-2}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, value = part.rpartition("=")
        try:
            out[name or "*"] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--lr: {part!r} is not LR or KIND=LR") from None
    return out


def lr_of(args, kind: str) -> float:
    return args.lr.get(kind, args.lr["*"])


def lr_text(args, kinds: list[str]) -> str:
    lrs = {kind: lr_of(args, kind) for kind in kinds}
    if len(set(lrs.values())) == 1:
        return f"lr {next(iter(lrs.values())):g}"
    return "lr " + ", ".join(f"{kind} {lr:g}" for kind, lr in lrs.items())


def interleave(docs: dict[str, list[str]]) -> list[dict]:
    """Round-robin over the domains' documents: {"text", "domain"} records."""
    out = []
    for group in itertools.zip_longest(*docs.values()):
        out += [{"text": t, "domain": name} for name, t in zip(docs, group) if t is not None]
    return out


def build_tree(args, base: str, kinds: list[str], corpus: Path, out_dir: Path, seed: int) -> dict:
    """One recipe, one variant per kind (output_dir/KIND), all trained on the same activation stream."""
    layer = lambda kind: {"kind": kind, "match_transcoder": args.match_transcoder, **KIND_SETTINGS[kind],  # noqa: E731
                          **args.layer_options.get(kind, {})}
    return {
        "base_model": base, "dtype": "float32", "layers": [args.layer],
        "layer": layer(kinds[0]),
        "variants": [{"name": kind, "layer": layer(kind), "train": {"lr": lr_of(args, kind)}} for kind in kinds],
        "data": {"source": "jsonl", "paths": [str(corpus)], "context_length": args.context_length,
                 "train_tokens": args.train_tokens, "eval_tokens": args.upcycle_eval_tokens, "eval_fraction": 0.1,
                 "shuffle_documents": True, "seed": seed},
        "train": {"lr": lr_of(args, kinds[0]), "warmup_steps": min(50, max(1, args.train_tokens // args.tokens_per_step // 10)),
                  "schedule": "cosine", "min_lr_ratio": 0.1, "tokens_per_step": args.tokens_per_step,
                  "loss": "nmse", "precision": "fp32", "grad_clip": 1.0, "checkpoint_every": 0, "log_every": 50,
                  "seed": seed, "device": args.device},
        "eval": {"batch_sequences": 8, "generation_prompts": 0, "histogram": False},
        "output_dir": str(out_dir),
    }


def capture_once(tree: dict, folder: Path) -> Path:
    """The recipe's activation cache (`expertize capture`), written once and reused by every later run."""
    from expertize.conversion.capture import capture_activations
    from expertize.conversion.recipe import recipe_from_dict

    if not (folder / "cache.json").is_file():
        capture_activations(recipe_from_dict(tree, source=__file__), folder)
    return folder


def train_kinds(tree: dict, kinds: list[str], out_dir: Path) -> tuple[dict, dict, float | None]:
    """Train every kind as a variant of one recipe; returns ({kind: metrics} of the published ones, {kind: failure
    message} of the others, seconds or None when all were already finished). A variant that diverges is not
    published (upcycle raises RunFailed after publishing the others): it becomes a failure row, the rest go on."""
    from expertize.conversion.errors import RunFailed
    from expertize.conversion.publishing.run_folder import METRICS

    try:
        metrics, seconds = run_variants(tree, __file__)
        return metrics, {}, seconds
    except RunFailed as error:
        message = str(error).splitlines()[0][:300]
        done = {k: json.loads((out_dir / k / METRICS).read_text(encoding="utf-8")) for k in kinds
                if (out_dir / k / METRICS).is_file()}
        return done, {k: f"not published: {message}" for k in kinds if k not in done}, None


def speedup(model, layer_index: int, held: dict, documents: dict, batch_size: int) -> str:
    """One masking condition (ablating 8 units) over every domain's eval text: full forward vs suffix."""
    from expertize.conversion.specialization import Condition, SuffixRunner, condition_ce

    layer = model.sparse_layers()[layer_index]
    runner, condition = SuffixRunner(model, layer_index), [Condition(ablate=tuple(range(8)))]

    def seconds(conditions, **options):
        start = time.perf_counter()
        sums = [condition_ce(runner, layer, held[n], documents[n], conditions, batch_size, check=False,
                             **options).conditions for n in held]
        return time.perf_counter() - start, sums

    base, _ = seconds([])
    suffix, a = seconds(condition)
    full, b = seconds(condition, full_forward=True)
    same = all(torch.equal(x, y) for x, y in zip(a, b))
    per_suffix, per_full = max(suffix - base, 1e-9), max(full - base, 1e-9)
    return (f"one masking condition over the eval text: full forward {per_full:.2f}s, suffix (layer {layer_index} of "
            f"{len(runner.blocks)}) {per_suffix:.2f}s: {per_full / per_suffix:.2f}x; prefix record {base:.2f}s per "
            f"evaluation; identical CE: {same}")


def run_seed(args, seed: int, names: list[str], kinds: list[str], root: Path, tokenizer, base) -> dict:
    """Split, capture, train and measure every kind at one seed; returns its rows, dense baseline and failures."""
    from expertize.conversion.specialization import (
        SpecializationSettings, content_mask, pack_documents, pack_with_documents, pooled_dense, probe_domains,
        read_documents, specialize, split_documents,
    )
    from expertize.conversion.specialization.bootstrap import domain_weights
    from expertize.conversion.specialization.report import _labelled
    from expertize.conversion.surgery.families import decoder_blocks
    from expertize.conversion.surgery.splice import load_expertize_model

    folder = root / f"seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    fit_docs, eval_docs = {}, {}
    for n in names:
        fit_docs[n], eval_docs[n] = split_documents(read_documents(n, str(Path(args.domains) / f"{n}.jsonl")),
                                                    seed, args.eval_fraction)
    corpus = folder / "fit_documents.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in interleave(fit_docs)), encoding="utf-8")
    cap = args.document_tokens
    fit = {n: pack_documents(n, d, tokenizer, args.fit_tokens, args.context_length, cap) for n, d in fit_docs.items()}
    held, documents = {}, {}
    for n, d in eval_docs.items():
        held[n], documents[n] = pack_with_documents(n, d, tokenizer, args.eval_tokens, args.context_length, cap)
    out = {"seed": seed, "rows": [], "failures": [], "timing": {}}
    t0 = time.perf_counter()
    tree = build_tree(args, args.model, kinds, corpus, folder / "runs", seed)
    text_id = hashlib.sha256(corpus.read_bytes()).hexdigest()[:10]  # the fit documents decide the stream
    cache = capture_once(tree, root / f"cache-{text_id}-seed{seed}-L{args.layer}-ctx{args.context_length}-"
                                      f"{args.train_tokens}")
    tree["data"]["activation_cache"] = str(cache)
    capture_seconds = time.perf_counter() - t0
    trained, untrained, train_seconds = train_kinds(tree, kinds, folder / "runs")
    out["timing"]["capture and train"] = time.perf_counter() - t0 if train_seconds is not None else None
    out["timing"]["capture"] = capture_seconds
    out["failures"] += [f"seed {seed}, {kind}: {message}" for kind, message in untrained.items()]
    if args.train_only:
        out["rows"] = [{**run_reading(trained[kind], args.layer), "kind": kind} for kind in kinds if kind in trained]
        return out
    special = [i for i in tokenizer.all_special_ids if i is not None]
    settings = SpecializationSettings(seed=seed, probe_top=args.probe_top, steer_scale=args.steer_scale,
                                      batch_size=args.batch_size, bootstrap=args.bootstrap)
    spec_seconds = 0.0
    for kind in kinds:
        if kind not in trained:
            continue
        t0 = time.perf_counter()
        try:
            model = load_expertize_model(folder / "runs" / kind).to(args.device).eval()
            report = specialize(model, fit, held, special, settings, layer=args.layer, held_documents=documents)
        except Exception as error:  # report it (e.g. every unit dead at a tiny budget), go on with the others
            out["failures"].append(f"seed {seed}, {kind}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            print(f"  {out['failures'][-1]}", flush=True)
            continue
        spec_seconds += time.perf_counter() - t0
        metrics = trained[kind]
        summary = report.summary()
        row = {**run_reading(metrics, args.layer), "kind": kind, "dead_pct": 100 * summary["dead_fraction"], **summary}
        out["rows"].append(row)
        (folder / f"{kind}_specialization.json").write_text(json.dumps(report.to_json(), indent=1))
        print(f"  seed {seed}, {kind} [{time.perf_counter() - t0:.0f}s]\n" + report.format(), flush=True)
        if "speedup" not in out:
            out["speedup"] = speedup(model, args.layer, held, documents, args.batch_size)
            print("  " + out["speedup"], flush=True)
        del model
    out["timing"]["specialization"] = spec_seconds
    # The dense baseline of the probes: the base MLP's hidden neurons at the same layer, the same test weights.
    (xf, yf), (xh, yh) = _labelled(fit), _labelled(held)
    test_weights = domain_weights([documents[n] for n in names], args.bootstrap, seed)[1]
    mlp = decoder_blocks(base)[args.layer].mlp
    dense = probe_domains(pooled_dense(base, mlp, xf, content_mask(xf, special)), yf,
                          pooled_dense(base, mlp, xh, content_mask(xh, special)), yh, names,
                          ks=settings.probe_ks, top=settings.probe_top, seed=seed, test_weights=test_weights)
    out["dense"] = {"probe_best_1d": _interval(dense.mean_best_1d), "probe_f1_k1": _interval(dense.mean_k(1)),
                    "probe_f1_k8": _interval(dense.mean_k(8))}
    return out


def run_reading(metrics: dict, layer: int) -> dict:
    """The upcycle run's own reading of one kind (metrics.json): ΔCE, KL, FVU, code share, L0, dead % (on its
    held-out part of the fit documents)."""
    m = metrics["layers"][str(layer)]
    return {"delta_ce": metrics["ce"]["delta"], "kl": metrics["ce"]["kl_base_spliced"], "fvu": m["fvu"],
            "code_share": m.get("code_share"), "l0": m["l0"], "dead_pct": 100 * m["dead_fraction"]}


RUN_COLUMNS = (("delta_ce", "ΔCE", "+.4f"), ("kl", "KL", ".4f"), ("fvu", "FVU", ".4f"),
               ("code_share", "code share", ".2f"), ("l0", "L0", ".1f"), ("dead_pct", "dead %", ".1f"))


def run_table(results: list[dict], kinds: list[str]) -> list[str]:
    """--train-only: each kind's run reading, mean [95 % t-interval] over the seeds."""
    lines = ["| kind (seeds) | " + " | ".join(title for _, title, _ in RUN_COLUMNS) + " |",
             "|---|" + "---:|" * len(RUN_COLUMNS)]
    for kind in kinds:
        rows = [r for res in results for r in res["rows"] if r["kind"] == kind]
        if rows:
            cells = []
            for key, _, fmt in RUN_COLUMNS:
                mean, low, high = seed_interval([r.get(key) for r in rows])
                cells.append(f"{format_value(mean, fmt)} [{format_value(low, fmt)}, {format_value(high, fmt)}]")
            lines.append(f"| {kind} ({len(rows)}/{len(results)}) | " + " | ".join(cells) + " |")
    return lines


def _interval(estimate) -> dict:
    return {"value": estimate.value, "ci": [estimate.low, estimate.high]}


def seed_table(result: dict) -> list[str]:
    """One seed's rows: every figure with its interval; n.s. where it holds the random control's value."""
    cols = [title for _, _, title, _ in HEADLINE]
    lines = [f"seed {result['seed']}:", "", "| kind | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for r in result["rows"]:
        cells = []
        for key, control, _, fmt in HEADLINE:
            ci = r.get(f"{key}_ci")
            cell = format_value(r.get(key), fmt) + (f" [{format_value(ci[0], fmt)}, {format_value(ci[1], fmt)}]" if ci else "")
            if control is not None:
                cell += ("" if r.get(f"{key}_significant") else " n.s.") + f" ({format_value(r[control], fmt)})"
            cells.append(cell)
        lines.append(f"| {r['kind']} | " + " | ".join(cells) + " |")
    d = result["dense"]
    dense = {k: f"{format_value(v['value'], '.3f')} [{format_value(v['ci'][0], '.3f')}, {format_value(v['ci'][1], '.3f')}]" for k, v in d.items()}
    lines.append(f"| dense MLP neurons |{_DENSE_LEAD} " + " | ".join(dense.values()) + _STEERING_DASHES)
    return lines


def summary_table(results: list[dict], kinds: list[str]) -> tuple[list[str], list[dict]]:
    """Mean ± standard deviation over the seeds of each headline figure, with the seeds where it was significant."""
    n = len(results)
    cols = [title for _, _, title, _ in HEADLINE]
    lines = [f"| kind (seeds) | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    means = []
    for kind in kinds:
        rows = [r for res in results for r in res["rows"] if r["kind"] == kind]
        if not rows:
            continue
        cells, mean_row = [], {"kind": kind}
        for key, control, _, fmt in HEADLINE:
            cell, mean_row[key], mean_row[f"{key}_sd"] = _spread([r.get(key) for r in rows], fmt)
            if control is not None:
                above, below = beyond_control(rows, key, control)
                control_cell, mean_row[control], _ = _spread([r[control] for r in rows], fmt)
                cell += (f" ({control_cell}; above {above}/{len(rows)}"
                         + (f", below {below}/{len(rows)}" if below else "") + ")")
            cells.append(cell)
        lines.append(f"| {kind} ({len(rows)}/{n}) | " + " | ".join(cells) + " |")
        means.append(mean_row)
    dense = [res["dense"] for res in results]
    cells = [_spread([d[k]["value"] for d in dense], ".3f")[0] for k in ("probe_best_1d", "probe_f1_k1",
                                                                         "probe_f1_k8")]
    lines.append(f"| dense MLP neurons ({n}/{n}) |{_DENSE_LEAD} " + " | ".join(cells) + _STEERING_DASHES)
    return lines, means


def _spread(values: list[float], fmt: str) -> tuple[str, float, float]:
    """"mean ± sd" over the finite values (n/a when none; an infinite value makes the mean inf)."""
    finite = [v for v in values if v is not None and not math.isnan(v)]
    if not finite:
        return "n/a", math.nan, math.nan
    if any(math.isinf(v) for v in finite):
        return "inf (" + ", ".join(format_value(v, fmt) for v in finite) + ")", math.inf, math.nan
    mean = statistics.fmean(finite)
    sd = statistics.stdev(finite) if len(finite) > 1 else math.nan
    return f"{format_value(mean, fmt)} ± {format_value(sd, fmt.lstrip('+'))}", mean, sd


def main() -> int:
    args = parse_args()
    if args.from_rows:
        return report_rows(args)
    if not args.domains or not args.model:
        print("error: --domains and --model are required (or --from-rows RUNS/rows.json to re-tabulate a finished "
              "run)", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from expertize.conversion.surgery.splice import load_base_model
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    names = (args.domain_names.split(",") if args.domain_names
             else sorted(p.stem for p in Path(args.domains).glob("*.jsonl")))
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KIND_SETTINGS]
    missing = [n for n in names if not (Path(args.domains) / f"{n}.jsonl").is_file()]
    if bad or len(names) < 2 or missing or not args.seeds:
        print(f"error: --domains {args.domains} must hold >= 2 NAME.jsonl corpora (missing: {missing or 'none'}; "
              f"found {len(names) - len(missing)}), --kinds must come from {list(KIND_SETTINGS)} (unknown: "
              f"{bad or 'none'}) and --seeds must name at least one seed; write the corpora with "
              "benchmarks/data/domain_corpora.py DIR", file=sys.stderr)
        return 2
    root = Path(args.runs_dir) if args.runs_dir else Path(tempfile.mkdtemp(prefix="expertize-specialize-"))
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    base = load_base_model(args.model, dtype=torch.float32).to(args.device).eval()
    if args.layer is None:
        args.layer = base.config.num_hidden_layers // 2
    header = (f"{Path(args.model).name}, layer {args.layer}, {args.match_transcoder:g}x transcoder budget, "
              f"{args.train_tokens:,} training tokens per kind (context {args.context_length}, {args.tokens_per_step} "
              f"tokens per step, {lr_text(args, kinds)}, NMSE, trained from one activation cache per seed"
              f"{''.join(f', {k} {o}' for k, o in args.layer_options.items())}), domains "
              f"{', '.join(names)}: {args.fit_tokens:,} fit / {args.eval_tokens:,} eval tokens per domain from "
              f"disjoint documents (seeded hash, {args.eval_fraction:g} held out; at most {args.document_tokens} "
              f"tokens per document), seeds {', '.join(map(str, args.seeds))}, 95% intervals from {args.bootstrap} "
              f"bootstrap replicates over eval documents, device {args.device}")
    print(header, flush=True)
    results = []
    try:
        for seed in args.seeds:
            results.append(run_seed(args, seed, names, kinds, root, tokenizer, base))
    finally:
        if not args.runs_dir:
            shutil.rmtree(root, ignore_errors=True)
    timing = {k: sum(res["timing"].get(k) or 0 for res in results) for k in ("capture", "capture and train",
                                                                         "specialization")}
    wall = (f"wall time {time.perf_counter() - start:.0f}s: capture {timing['capture']:.0f}s, capture and "
            f"training {timing['capture and train']:.0f}s"
            + ("" if args.train_only else f", specialization {timing['specialization']:.0f}s")
            + f" ({len(kinds)} kinds x {len(results)} seeds)")
    if args.runs_dir:  # the rows, to re-plot or re-tabulate without rerunning (--from-rows)
        rows = {"header": header, "kinds": kinds, "layer": args.layer, "model": Path(args.model).name,
                "train_tokens": args.train_tokens, "wall": wall, "seeds": results}
        (root / "rows.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    write_report(args, header, results, kinds, wall, f"{Path(args.model).name} layer {args.layer}, "
                                                     f"{args.train_tokens:,} training tokens, {len(results)} seeds")
    return 0


def report_rows(args) -> int:
    """--from-rows: the tables, the claims and the plot of a finished run, from its rows.json alone."""
    path = Path(args.from_rows)
    if not path.is_file():
        print(f"error: --from-rows {path}: no such file (benchmarks/specialization.py --runs-dir RUNS writes "
              "RUNS/rows.json)", file=sys.stderr)
        return 2
    data = json.loads(path.read_text(encoding="utf-8"))
    results = data["seeds"]
    kinds = data.get("kinds") or list(dict.fromkeys(r["kind"] for res in results for r in res["rows"]))
    layer = data.get("layer", results[0]["rows"][0]["layer"] if results and results[0]["rows"] else "?")
    title = f"{data.get('model', data['header'].split(',')[0])} layer {layer}, " + (
        f"{data['train_tokens']:,} training tokens, " if "train_tokens" in data else "") + f"{len(results)} seeds"
    write_report(args, data["header"], results, kinds, data.get("wall"), title)
    return 0


def write_report(args, header: str, results: list[dict], kinds: list[str], wall: str | None, title: str) -> None:
    """Print (and --out) the summary, each seed's table and the claims' reading; write the plot (--png). A
    --train-only run has its runs' readings only: one table, no claims, no plot."""
    if not any("dense" in res for res in results):
        table = "\n".join([header, "", *run_table(results, kinds), *([wall] if wall else [])])
        print("\n" + table)
        if args.out:
            Path(args.out).write_text(table + "\n", encoding="utf-8")
        return
    summary, means = summary_table(results, kinds)
    tables = [header, "", f"Mean ± standard deviation over {len(results)} seeds; in parentheses the random "
              "control's mean and in how many seeds the figure's interval lay wholly above (below) the control's "
              "value:", "",
              *summary, ""]
    for res in results:
        tables += [*seed_table(res), ""]
    speed = next((res["speedup"] for res in results if "speedup" in res), None)
    if speed:
        tables.append(f"Cheap interventions: {speed}.")
    tables += [f"failed: {f}" for res in results for f in res["failures"]]
    if wall:
        tables.append(wall)
    tables += ["", *claims(results)]
    table = "\n".join(tables)
    print("\n" + table)
    if args.out:
        Path(args.out).write_text(table + "\n", encoding="utf-8")
    plot(means, args.png, title)
    print(f"wrote {args.png}")


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """Masking specificity (filled marker, mean over seeds with its standard deviation as an error bar) and its
    random-live-units control (x, same colour) against ΔCE, one colour per kind. The y axis is symmetric-log: at small
    budgets a ratio of two near-zero ΔCEs can be in the hundreds, of either sign. An infinite specificity is drawn at
    the top edge as a triangle; a kind with no assigned unit (undefined specificity) is named in the legend."""
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
            sd = r.get(f"{key}_sd", math.nan)
            ax.errorbar(r["delta_ce"], value, yerr=None if not math.isfinite(sd) else sd, fmt=marker, color=color,
                        label=label, ms=6, capsize=2)
        ax.plot([r["delta_ce"]] * 2, shown, color=color, lw=0.6, alpha=0.5)
    ax.scatter([], [], marker="x", color="grey", label="random live units (control)")
    ax.axhline(1.0, color="grey", lw=0.5, ls="--")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("ΔCE of the spliced model (nats, lower = more faithful; mean over seeds)")
    ax.set_ylabel("masking specificity ΔCE(domain) / ΔCE(others), symlog")
    if title:
        ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
