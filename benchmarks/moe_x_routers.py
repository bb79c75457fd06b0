"""MoE-X router benchmark (issue 4): sparsity-aware vs Switch router, ReLU vs GELU experts, at equal active units.

Three variants of one MoE layer, each split-upcycled from the dense MLP of tiny-gpt2-shakespeare (layer.init: split,
M = 8 experts of d_expert = H/8 hidden units, K = 2, so K·D = H/4 hidden units are active per token in all three;
gate_scaling k_softmax, expert biases from the MLP), then healed end to end with the same budget and settings
(KL(base ‖ healed), rest of the model frozen, AdamW, warm-up + cosine, no layer-wise distillation):

    moe_x        MoE-X: parameter-free sparsity router (−erf(μ_h/(√2σ_h)), sigma_mode std), ReLU experts
    switch_relu  Switch router (linear W_router x, random init), ReLU experts
    switch_gelu  Switch router, GELU experts (the base MLP's gelu_new: layer.activation auto keeps it for split)

All three use the paper's load-balance loss (λ = 0.001, top-1 counting), the same data order and seeds.

Columns of the main table (from each run's metrics.json, held-out documents = the last 10% by document hash):
    ΔCE init   CE(spliced at initialization) − CE(base), before any training: the cost of K < M (and of the
               GELU -> ReLU switch for the ReLU variants)   [metrics init.delta]
    CE healed  held-out next-token CE of the healed model    [ce.spliced];  ΔCE = CE healed − CE base   [ce.delta]
    L0         mean number of nonzero entries of the scaled code concat_j(ω_j zʲ) per token (at most K·D); GELU is
               nonzero almost everywhere, so its L0 is ≈ K·D by construction   [layers.<i>.l0]
    FVU        of the healed layer vs the dense MLP on the base model's held-out MLP inputs   [layers.<i>.fvu]
    r(score)   Pearson r over all (token, expert) pairs between the sparsity estimator s_j = −erf(μ_h/(√2σ_h)) and
               the actual per-expert L0 = #{h : (W_encʲ x + b_encʲ)_h > 0}, on the healed model's MLP inputs at that
               layer (held-out text). Computed for every expert, selected or not, and for every variant from its
               own expert weights (the switch variants do not route with it). For GELU experts "active" is also
               pre-activation > 0. The paper (MoE-X, §4.3.2) reports r < −0.95 for its router.
    r(logits)  the same r for the Switch router's own logits (what it routes with) vs actual L0.

The diagnostics table adds: r within token (both variables centred per token before pooling: only the ranking of
experts for one token matters for routing); r over (sequence, expert) pairs of per-sequence means (the paper's
"over 5,000 sentences" may mean such an aggregate); r of the paper's score at initialization (split init, before
healing, on the base model's MLP inputs);
r of the bias-aware score (μ_h += mean b_enc, σ_h² += var b_enc; the paper's experts have no bias); the mean actual
pre-activation L0 of the K selected experts vs the mean over all M experts vs the K sparsest experts (oracle); the
fraction of selected experts that are among the oracle's K; the largest share of assignments one expert gets.

Runs go to <out>/<budget>/<variant>/; a finished run (metrics.json, same recipe) is reused, an unfinished one resumes.
The tables are printed and written to <out>/moe_x_routers.md and .json.

Run:  EXPERTIZE_DATA=/path/to/shared/data python benchmarks/moe_x_routers.py
      python benchmarks/moe_x_routers.py --data /path/to/shared/data --budgets 65536 --layers all --lr 1e-3

Default: layer 2, healing budgets 131,072 and 262,144 tokens, lr 3e-3 (of 1e-3 / 3e-3 / 1e-2 probed on Switch-ReLU
and MoE-X at 32,768 tokens, 3e-3 healed both best), one torch thread; 6 runs plus the analysis take a few minutes on
2 CPU cores shared with other jobs.
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from _runs import run_upcycle, text_data

MODEL_DIR = "models/tiny-gpt2-shakespeare"
CORPUS = "corpora/tinyshakespeare.txt"
VARIANTS = {
    # name: (label, router, layer.activation)
    "moe_x": ("MoE-X: sparsity router, ReLU", "sparsity", "relu"),
    "switch_relu": ("Switch router, ReLU", "switch", "relu"),
    "switch_gelu": ("Switch router, GELU (base gelu_new)", "switch", "auto"),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", default=os.environ.get("EXPERTIZE_DATA"),
                   help="shared data folder holding models/ and corpora/ (default: $EXPERTIZE_DATA)")
    p.add_argument("--out", default="runs/moe_x_routers", help="output folder (default runs/moe_x_routers)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--layers", default="2",
                   help="comma-separated decoder layers replaced together, or 'all' (default 2, the middle of 4)")
    p.add_argument("--num-experts", type=int, default=8, help="M (default 8); d_expert = ceil(H / M)")
    p.add_argument("--k", type=int, default=2, help="K active experts per token (default 2)")
    p.add_argument("--budgets", default="131072,262144",
                   help="comma-separated healing budgets in tokens, each run for every variant (default 131,072 and "
                        "262,144 = 128 and 256 steps of 8 x 128 tokens; the train split has about 343,000 tokens)")
    p.add_argument("--batch-sequences", type=int, default=8, help="sequences per healing step (default 8)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW lr of healing, all variants (default 3e-3)")
    p.add_argument("--warmup-steps", type=int, default=16, help="linear warm-up steps of healing (default 16)")
    p.add_argument("--load-balance-coef", type=float, default=1e-3, help="λ of the balance loss (default 1e-3)")
    p.add_argument("--clustering", default="random", choices=("random", "balanced_kmeans"),
                   help="split init: how neurons are grouped into experts (default random)")
    p.add_argument("--bias-aware-router", action="store_true",
                   help="route MoE-X with the bias-aware score (ours) instead of the paper's bias-free one")
    p.add_argument("--context-length", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--eval-tokens", type=int, default=32_768, help="held-out evaluation tokens (default 32,768)")
    p.add_argument("--seed", type=int, default=0, help="data, init, router and shuffle seed (default 0)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: on a shared, oversubscribed CPU, OpenMP's waits make 2 "
                        "threads several times slower for these small ops; 0 keeps torch's default)")
    return p.parse_args()


def build_tree(args: argparse.Namespace, variant: str, layers, budget: int, out_dir: Path) -> dict:
    """The recipe of one run; only the router and the activation differ between variants."""
    _, router, activation = VARIANTS[variant]
    data = Path(args.data)
    options = {"router": router, "load_balance_coef": args.load_balance_coef}
    if router == "sparsity" and args.bias_aware_router:
        options["bias_aware_router"] = True
    return {
        "base_model": str(data / MODEL_DIR),
        "dtype": "float32",
        "layers": layers,
        "layer": {
            "kind": "moe_x",
            "num_experts": args.num_experts,
            "k": args.k,
            "init": "split",
            "init_clustering": args.clustering,
            "activation": activation,
            "options": options,
        },
        "data": text_data(data / CORPUS, "blank_line", args.context_length, budget, args.eval_tokens, args.seed),
        "train": {"distill": False, "seed": args.seed, "device": "cpu", "precision": "fp32"},
        "heal": {
            "tokens": budget,
            "batch_sequences": args.batch_sequences,
            "objective": "kl",
            "lr": args.lr,
            "warmup_steps": args.warmup_steps,
            "schedule": "cosine",
            "min_lr_ratio": 0.1,
            "rest": "frozen",
            "aux_loss_coef": 1.0,
            "log_every": 16,
            "checkpoint_every": 0,
        },
        "eval": {"batch_sequences": 16, "generation_prompts": 0, "histogram": False},
        "output_dir": str(out_dir),
    }


# ----------------------------------------------------------------------------------------------------------------
# Router analysis: estimated vs actual per-expert L0


def paper_scores(layer, x: torch.Tensor, bias_aware: bool = False) -> torch.Tensor:
    """s = −erf(μ_h / (√2 σ_h)) (MoE-X Eq. 7, σ_h the std) from `layer`'s expert encoders, whatever its router:
    x (T, I) -> (T, M), float64. bias_aware adds b_enc's mean to μ_h and its variance to σ_h²."""
    from expertize.modeling.moe_x import ROUTER_EPS

    W = layer.W_enc.detach().double()  # (M, D, I)
    xd = x.double()
    mu = W.mean(dim=1)  # (M, I)
    var = W.var(dim=1, unbiased=False)  # (M, I)
    mu_h = xd @ mu.T  # (T, M)
    var_h = xd.square() @ var.T
    if bias_aware:
        b = layer.b_enc.detach().double()  # (M, D)
        mu_h = mu_h + b.mean(dim=1)
        var_h = var_h + b.var(dim=1, unbiased=False)
    return -torch.erf(mu_h / (math.sqrt(2.0) * (var_h + ROUTER_EPS).sqrt()))


def actual_l0(layer, x: torch.Tensor) -> torch.Tensor:
    """Active hidden units of every expert: #{h : (W_encʲ x + b_encʲ)_h > 0}, x (T, I) -> (T, M) float64."""
    W = layer.W_enc.detach()  # (M, D, I)
    pre = torch.einsum("ti,jhi->tjh", x, W)  # (T, M, D)
    if layer.b_enc is not None:
        pre = pre + layer.b_enc.detach()
    return (pre > 0).sum(dim=-1).double()


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    den = a.norm() * b.norm()
    return float((a @ b) / den) if den > 0 else float("nan")


def within_token_r(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson r of (T, M) tables after centring each token's row: only the per-token ranking of experts counts."""
    return pearson(a - a.mean(dim=1, keepdim=True), b - b.mean(dim=1, keepdim=True))


@torch.no_grad()
def analyze_layer(layer, x: torch.Tensor, seq_len: int) -> dict:
    """Estimated vs actual L0 for one MoE-X layer on MLP inputs x (T, I), T = sequences x seq_len in order."""
    K = layer.spec.k
    l0 = actual_l0(layer, x)  # (T, M)
    score = paper_scores(layer, x)  # (T, M)
    score_bias = paper_scores(layer, x, bias_aware=layer.b_enc is not None)
    own = layer.router_scores(x).double()  # what the layer routes with
    if layer.spec.router == "sparsity":
        expected = score_bias if layer.spec.bias_aware_router else score
        err = float((own - expected).abs().max())
        if err > 1e-4:
            raise RuntimeError(f"hand-computed sparsity scores differ from MoeXLayer.router_scores by {err:.2e}")
    selected = own.topk(K, dim=-1).indices  # (T, K)
    oracle = l0.topk(K, dim=-1, largest=False).indices  # K sparsest experts (ties: any)
    sel_l0 = l0.gather(1, selected)  # (T, K)
    oracle_l0 = l0.gather(1, oracle)
    # overlap: selected experts whose actual L0 is at most the K-th smallest (tie-aware membership in an oracle set)
    kth = oracle_l0.max(dim=1, keepdim=True).values
    overlap = float((sel_l0 <= kth).double().mean())
    load = torch.bincount(selected.flatten(), minlength=layer.spec.num_experts).double() / selected.numel()
    return {
        "tokens": x.shape[0],
        "r_score": pearson(score, l0),
        "r_score_within_token": within_token_r(score, l0),
        "r_score_bias_aware": pearson(score_bias, l0),
        # (sequence, expert) means: one reading of the paper's "over 5,000 sentences" (its unit is not stated)
        "r_score_per_sequence": pearson(score.view(-1, seq_len, score.shape[1]).mean(dim=1),
                                        l0.view(-1, seq_len, l0.shape[1]).mean(dim=1)),
        "r_router": pearson(own, l0),
        "r_router_within_token": within_token_r(own, l0),
        "l0_preact_selected": float(sel_l0.mean()),
        "l0_preact_all": float(l0.mean()),
        "l0_preact_oracle": float(oracle_l0.mean()),
        "l0_estimated_all": float((layer.spec.d_expert * (1 - score) / 2).mean()),  # D·Φ(μ_h/σ_h), Eq. 6
        "oracle_overlap": overlap,
        "max_load": float(load.max()),
        "load": load.tolist(),
    }


@torch.no_grad()
def capture_inputs(model, layer_ids: list[int], sequences: torch.Tensor, batch: int = 16) -> dict[int, torch.Tensor]:
    """MLP inputs (T, I) at `layer_ids` of `model` on `sequences` (S, L)."""
    from expertize.conversion.data.mlp_pairs import MlpCapture

    capture = MlpCapture(model, layer_ids)
    parts: dict[int, list[torch.Tensor]] = {i: [] for i in layer_ids}
    for start in range(0, sequences.shape[0], batch):
        for i, (x, _) in capture(sequences[start : start + batch]).items():
            parts[i].append(x.float())
    return {i: torch.cat(p) for i, p in parts.items()}


def init_layers(tree: dict, base, layer_ids: list[int]) -> dict:
    """The variant's layers at initialization: the same spec and split partition (seed + layer) as `upcycle`, so the
    same W_enc, b_enc, W_dec; the switch router's random W_router may differ from upcycle's (only the score, which
    reads W_enc and b_enc, is reported at init)."""
    from expertize.conversion.data.mlp_pairs import decoder_blocks
    from expertize.conversion.surgery.dense_init import init_moe_from_dense
    from expertize.conversion.recipe import recipe_from_dict, resolve_layer_spec
    from expertize.modeling import FAMILIES, build_sparse_layer

    recipe = recipe_from_dict(tree)
    shape = FAMILIES["gpt2"][0].mlp_shape(base.config)
    spec = resolve_layer_spec(recipe.layer, shape)
    torch.manual_seed(recipe.train.seed)
    blocks = decoder_blocks(base)
    layers = {}
    for i in layer_ids:
        layer = build_sparse_layer(spec)
        init_moe_from_dense(layer, blocks[i].mlp, "split", family=base.config.model_type,
                            clustering=recipe.layer.init_clustering, noise_std=None, seed=recipe.train.seed + i,
                            allow_activation_change=True)
        layers[i] = layer.eval()
    return layers


# ----------------------------------------------------------------------------------------------------------------
# Report


def _f(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, fmt)


def format_tables(rows: list[dict], header: str) -> str:
    cols = ["budget", "variant", "layer", "active units", "ΔCE init", "CE healed", "ΔCE healed", "L0 (scaled code)",
            "FVU", "r(score, L0)", "r(switch logits, L0)", "run s"]
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        a = r["analysis"]
        cells = [f"{r['budget']:,}", r["label"], str(r["layer"]), f"{r['active_units']} of {r['units']}",
                 _f(r["delta_ce_init"], "+.4f"), _f(r["ce_spliced"], ".4f"), _f(r["delta_ce"], "+.4f"),
                 _f(r["l0"], ".1f"), _f(r["fvu"], ".4f"), _f(a["r_score"], "+.3f"),
                 _f(a["r_router"], "+.3f") if r["router"] == "switch" else "(= score)",
                 "reused" if r["seconds"] is None else f"{r['seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    cols = ["budget", "variant", "layer", "r(score) within token", "r(logits) within token", "r(score) seq. means",
            "r(score) at init", "r(bias-aware score)", "pre-act L0: selected", "all experts", "K sparsest",
            "est. L0 (Eq. 6)",
            "selected ∈ K sparsest", "max expert load"]
    lines += ["", "Router diagnostics (held-out tokens, per-expert L0 = pre-activation > 0 count, all variants):", "",
              "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        a, i = r["analysis"], r["init_analysis"]
        cells = [f"{r['budget']:,}", r["label"], str(r["layer"]), _f(a["r_score_within_token"], "+.3f"),
                 _f(a["r_router_within_token"], "+.3f") if r["router"] == "switch" else "(= score)",
                 _f(a["r_score_per_sequence"], "+.3f"), _f(i["r_score"], "+.3f"), _f(a["r_score_bias_aware"], "+.3f"),
                 _f(a["l0_preact_selected"], ".1f"),
                 _f(a["l0_preact_all"], ".1f"), _f(a["l0_preact_oracle"], ".1f"), _f(a["l0_estimated_all"], ".1f"),
                 _f(a["oracle_overlap"], ".3f"), _f(a["max_load"], ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    if not args.data:
        print("error: give --data or set EXPERTIZE_DATA to the shared data folder (models/, corpora/)",
              file=sys.stderr)
        return 2
    if not (Path(args.data) / MODEL_DIR / "config.json").is_file():
        print(f"error: {Path(args.data) / MODEL_DIR} is not a model folder; check --data / EXPERTIZE_DATA",
              file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from expertize.conversion.data.text import load_eval_sequences
    from expertize.conversion.recipe.data import DataConfig
    from expertize.conversion.surgery.splice import load_base_model, load_expertize_model

    hf_logging.disable_progress_bar()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        print(f"error: unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    base = load_base_model(str(Path(args.data) / MODEL_DIR), dtype=torch.float32).eval()
    n_layers = base.config.num_hidden_layers
    layers = "all" if args.layers.strip() == "all" else [int(i) for i in args.layers.split(",") if i.strip()]
    layer_ids = list(range(n_layers)) if layers == "all" else sorted(layers)
    H = base.config.n_inner or 4 * base.config.n_embd
    d_expert = math.ceil(H / args.num_experts)
    steps = [b // (args.batch_sequences * args.context_length) for b in budgets]
    budget_text = ", ".join(f"{b:,} tokens ({s} steps x {args.batch_sequences} x {args.context_length})"
                            for b, s in zip(budgets, steps))
    header = (
        f"MoE-X routers on tiny-gpt2-shakespeare (d_model {base.config.n_embd}, MLP width H = {H}, gelu_new), layers "
        f"{layer_ids}: split-upcycled (init_clustering {args.clustering}, seed {args.seed}), M = {args.num_experts} "
        f"experts x D = {d_expert}, K = {args.k} (active hidden units K·D = {args.k * d_expert} = H/"
        f"{H / (args.k * d_expert):g}), gate_scaling k_softmax, expert biases, load balance λ = "
        f"{args.load_balance_coef:g} (top-1 count); MoE-X score sigma_mode std"
        f"{', bias-aware' if args.bias_aware_router else ', bias-free (paper)'}. Healing only (no distillation): "
        f"budgets {budget_text}; "
        f"KL(base ‖ healed), rest frozen, AdamW lr {args.lr:g}, warm-up {args.warmup_steps}, cosine to 0.1 lr, grad "
        f"clip 1.0; seed {args.seed} (data order, switch-router init, split partition); eval on {args.eval_tokens:,} "
        f"held-out tokens (10% of paragraphs); torch threads {torch.get_num_threads()}"
    )
    print(header, flush=True)

    tokenizer = AutoTokenizer.from_pretrained(str(Path(args.data) / MODEL_DIR))
    out_root = Path(args.out)
    rows, all_warnings, base_ces = [], {}, set()
    eval_cache: dict[tuple, torch.Tensor] = {}
    start_all = time.perf_counter()
    for budget in budgets:
        for variant in variants:
            out_dir = out_root / f"heal{budget}" / variant
            tree = build_tree(args, variant, layers, budget, out_dir)
            metrics, seconds, caught = run_upcycle(tree, "benchmarks/moe_x_routers.py")
            if caught:
                all_warnings[str(out_dir)] = caught
            t0 = time.perf_counter()
            # held-out sequences exactly as upcycle evaluates them
            data_cfg = DataConfig(**tree["data"])
            key = tuple(sorted((k, str(v)) for k, v in tree["data"].items() if k != "train_tokens"))
            if key not in eval_cache:
                eval_cache[key] = load_eval_sequences(data_cfg, tokenizer)
            sequences = eval_cache[key]
            healed = load_expertize_model(out_dir).eval()
            sparse = healed.sparse_layers()
            xs = capture_inputs(healed, layer_ids, sequences)
            analyses = {i: analyze_layer(sparse[i], xs[i], sequences.shape[1]) for i in layer_ids}
            init = init_layers(tree, base, layer_ids)
            x_base = capture_inputs(base, layer_ids, sequences)
            init_analyses = {i: analyze_layer(init[i], x_base[i], sequences.shape[1]) for i in layer_ids}
            analysis_seconds = time.perf_counter() - t0
            ce, label = metrics["ce"], VARIANTS[variant][0]
            base_ces.add(round(ce["base"], 10))
            for i in layer_ids:
                m, spec = metrics["layers"][str(i)], sparse[i].spec
                row = {
                    "budget": budget, "variant": variant, "label": label, "router": spec.router,
                    "activation": spec.activation, "layer": i, "units": spec.num_experts * spec.d_expert,
                    "active_units": spec.k * spec.d_expert, "delta_ce_init": metrics["init"]["delta"],
                    "ce_init": metrics["init"]["spliced"], "ce_base": ce["base"], "ce_spliced": ce["spliced"],
                    "delta_ce": ce["delta"], "kl": ce["kl_base_spliced"], "l0": m["l0"], "fvu": m["fvu"],
                    "nmse_paper": m["nmse_paper"], "dead_fraction": m["dead_fraction"],
                    "heal": metrics.get("heal"), "seconds": seconds, "analysis_seconds": analysis_seconds,
                    "analysis": analyses[i], "init_analysis": init_analyses[i], "run_dir": str(out_dir),
                }
                rows.append(row)
                a = analyses[i]
                print(f"  heal {budget:,} {variant:<11} L{i}: ΔCE init {row['delta_ce_init']:+.4f} -> healed "
                      f"{row['delta_ce']:+.4f}, L0 {row['l0']:.1f}, FVU {row['fvu']:.4f}, r(score) "
                      f"{a['r_score']:+.3f}, r(router) {a['r_router']:+.3f} "
                      f"[{'reused' if seconds is None else f'{seconds:.0f}s'} + analysis {analysis_seconds:.0f}s]",
                      flush=True)
            for message in caught:
                print(f"    warning: {message}", flush=True)
    wall = time.perf_counter() - start_all
    text = format_tables(rows, header)
    base_line = ", ".join(f"{c:.4f}" for c in sorted(base_ces))
    print()
    print(text)
    print(f"\nbase CE (dense model, same held-out tokens): {base_line}")
    print(f"wall time {wall:.0f}s (runs reused from earlier invocations count 0)")
    out_root.mkdir(parents=True, exist_ok=True)
    (out_root / "moe_x_routers.md").write_text(f"{text}\n\nbase CE: {base_line}\n", encoding="utf-8")
    (out_root / "moe_x_routers.json").write_text(
        json.dumps({"header": header, "args": vars(args), "rows": rows, "warnings": all_warnings,
                    "wall_seconds": wall}, indent=2),
        encoding="utf-8",
    )
    print(f"wrote {out_root / 'moe_x_routers.md'} and {out_root / 'moe_x_routers.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
