"""What a real model loses on lm-eval with its MLPs replaced (issue 48): the base and, per kind, the base with the
MLPs of several layers replaced at once by that kind, scored by lm-evaluation-harness side by side on held-out text
of several domains.

Protocol:
- The sparse layers are those benchmarks/real_model.py trained (one per layer, each on that layer's own captured
  inputs and outputs, kept with --keep-weights): for each kind, the layers of one budget and seed are spliced into
  the base together (`expertize.splice`; the rest of the model is the base's, bit for bit) and saved as one folder.
- Tasks: per domain of the corpus, `expertize tasks` (perplexity + 4-way cloze) over the real-model runs' own
  held-out split (the recipe's document hash: no training run read them), its documents cut at line ends into
  pieces of at most --chars characters, the first --docs pieces per domain, the base's tokenizer fitting every
  cloze item.
- Scores: lm-eval's bits per byte (the perplexity task) and cloze accuracy, base and model, with each difference's
  95 % paired bootstrap interval over documents / items (the same documents resampled for both: 2,000 draws,
  seeded). An interval that holds 0 is a difference the tasks cannot tell from none.
- Beside them, each replaced layer's held-out KL and code share from its real_model.py run.

Run (after benchmarks/real_model.py ... --keep-weights has trained the layers at BUDGET and SEED):
    python benchmarks/real_model_lm_eval.py --model SMOLLM2_DIR --corpus DOMAINS_DIR --runs-dir RUNS \
        --layers 5,15,25 --budget 1048576 --seed 0 --kinds transcoder,mxd,moe_x --out-dir OUT \
        --lock /tmp/expertize-cpu.lock --out table.md
Finished pieces (a composed folder, the task files, a kind's lm-eval output) are reused, so it resumes.
"""

import argparse
import json
import math
import os
import random
import sys
from pathlib import Path

from real_model import cores

BOOTSTRAP = 2_000


def run_folder(args, layer: int, kind: str) -> Path:
    return Path(args.runs_dir) / f"l{layer}-b{args.budget}-s{args.seed}" / kind


def compose(args, kind: str) -> Path:
    """The base with every --layers MLP replaced by its trained `kind` layer, saved once."""
    from expertize.conversion.surgery.splice import load_expertize_model, save_model, splice
    from transformers import AutoTokenizer

    out = Path(args.out_dir) / "models" / kind
    if (out / "config.json").exists():
        return out
    layers = {}
    for layer in args.layers:
        folder = run_folder(args, layer, kind)
        if not (folder / "model.safetensors").exists():
            raise SystemExit(f"error: {folder} has no model.safetensors; train it with benchmarks/real_model.py "
                             f"--budgets {args.budget} --seeds {args.seed} --keep-weights")
        layers[layer] = load_expertize_model(folder).sparse_layers()[layer]
    save_model(splice(args.model, layers), out, tokenizer=AutoTokenizer.from_pretrained(args.model))
    return out


def pieces(text: str, chars: int) -> list[str]:
    """`text` in consecutive pieces of at most `chars` characters, each ended at a line break (else a space) where
    one falls inside it: a long held-out document gives several task documents."""
    out = []
    while text.strip():
        if len(text) <= chars:
            out.append(text.strip())
            break
        head = text[:chars]
        end = head.rfind("\n")
        end = end if end > 0 else head.rfind(" ")
        end = end if end > 0 else chars
        if head[:end].strip():
            out.append(head[:end].strip())
        text = text[end:]
    return out


def held_out_tasks(args) -> tuple[Path, list[str]]:
    """Per domain: the runs' held-out documents as an `expertize tasks` folder; returns it and the domains."""
    from expertize.conversion.data.text import split_documents
    from expertize.conversion.harness.offline_tasks import model_token_limit, write_tasks_from_text
    from expertize.conversion.recipe import load_recipe

    folder = Path(args.out_dir) / "tasks"
    domain_of = {}
    for path in sorted(Path(args.corpus).glob("*.jsonl")):
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                domain_of.setdefault(json.loads(line)["text"], path.stem)
    domains = sorted(set(domain_of.values()))
    if all((folder / f"held_{d}_ppl.yaml").exists() for d in domains):
        return folder, domains
    recipe = load_recipe(run_folder(args, args.layers[0], args.kinds[0]) / "recipe.resolved.yaml")
    picked: dict[str, list[str]] = {d: [] for d in domains}
    for doc in split_documents(recipe.data).eval():
        domain = domain_of.get(doc)
        if domain is not None:
            picked[domain] += pieces(doc, args.chars)[: args.docs - len(picked[domain])]
        if all(len(docs) >= args.docs for docs in picked.values()):
            break
    count, limit = model_token_limit(args.model)
    folder.mkdir(parents=True, exist_ok=True)
    for domain, docs in picked.items():
        if not docs:
            raise SystemExit(f"error: no held-out document of domain {domain!r}; raise the corpus or eval_fraction")
        source = folder / f"held_{domain}.jsonl"
        source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
        write_tasks_from_text(source, folder, f"held_{domain}", count_tokens=count, max_tokens=limit, overwrite=True)
    return folder, domains


def evaluate(args, kind: str, model_dir: Path, tasks_dir: Path, tasks: list[str], with_base: bool) -> Path:
    """lm-eval on the composed folder (and the base, once): the harness's files under out-dir/lm_eval/kind."""
    from expertize.conversion.harness.folder_eval import evaluate_model_folder
    from expertize.conversion.harness.runner import HarnessSettings

    out = Path(args.out_dir) / "lm_eval" / kind
    if (out / "comparison.json").exists():
        return out
    settings = HarnessSettings(tasks=tasks, include_paths=[str(tasks_dir)], batch_size=args.batch_size, seed=0)
    with cores(args.lock):
        evaluate_model_folder(model_dir, settings, base=args.model if with_base else None, output_dir=out,
                              update_card=False)
    return out


def samples(folder: Path, task: str) -> dict[int, dict]:
    """doc_id -> the harness's per-document record of `task` under `folder` (its model/ or base/)."""
    (path,) = sorted(folder.glob(f"samples_{task}_*.jsonl"))
    with open(path, encoding="utf-8") as lines:
        return {record["doc_id"]: record for record in map(json.loads, lines)}


def bits_per_byte(records: list[dict]) -> float:
    loglik = sum(r["bits_per_byte"][0] for r in records)
    return -loglik / sum(r["bits_per_byte"][1] for r in records) / math.log(2)


def accuracy(records: list[dict]) -> float:
    return sum(r["acc"] for r in records) / len(records)


def paired(base: dict[int, dict], model: dict[int, dict], score) -> tuple[float, float, float, float, int]:
    """(base score, model score, 95 % bootstrap interval of model − base) over the documents both scored."""
    ids = sorted(set(base) & set(model))
    rng = random.Random(0)
    draws = []
    for _ in range(BOOTSTRAP):
        pick = [ids[rng.randrange(len(ids))] for _ in ids]
        draws.append(score([model[i] for i in pick]) - score([base[i] for i in pick]))
    draws.sort()
    low, high = draws[int(0.025 * BOOTSTRAP)], draws[int(0.975 * BOOTSTRAP) - 1]
    return score([base[i] for i in ids]), score([model[i] for i in ids]), low, high, len(ids)


def layer_metrics(args, kind: str) -> str:
    """'L5 KL 0.012 share 0.61, ...' from each replaced layer's run."""
    parts = []
    for layer in args.layers:
        metrics = json.loads((run_folder(args, layer, kind) / "metrics.json").read_text(encoding="utf-8"))
        (m,) = metrics["layers"].values()
        share = m.get("code_share")
        parts.append(f"L{layer} KL {metrics['ce']['kl_base_spliced']:.4f}"
                     + ("" if share is None else f" share {share:.2f}"))
    return "; ".join(parts)


def table(args, domains: list[str]) -> str:
    base_dir = Path(args.out_dir) / "lm_eval" / args.kinds[0] / "base"
    rows = ["| kind | domain | docs | base bits/byte | model bits/byte | Δ bits/byte [95 %] | items | base acc "
            "| model acc | Δ acc [95 %] |", "|---|---|---|---|---|---|---|---|---|---|"]
    for kind in args.kinds:
        model_dir = Path(args.out_dir) / "lm_eval" / kind / "model"
        for domain in domains:
            ppl = paired(samples(base_dir, f"held_{domain}_ppl"), samples(model_dir, f"held_{domain}_ppl"),
                         bits_per_byte)
            cloze = paired(samples(base_dir, f"held_{domain}_cloze"), samples(model_dir, f"held_{domain}_cloze"),
                           accuracy)
            rows.append(f"| {kind} | {domain} | {ppl[4]} | {ppl[0]:.4f} | {ppl[1]:.4f} | {ppl[1] - ppl[0]:+.4f} "
                        f"[{ppl[2]:+.4f}, {ppl[3]:+.4f}] | {cloze[4]} | {cloze[0]:.3f} | {cloze[1]:.3f} | "
                        f"{cloze[1] - cloze[0]:+.3f} [{cloze[2]:+.3f}, {cloze[3]:+.3f}] |")
    layers = "\n".join(f"- {kind}: {layer_metrics(args, kind)}" for kind in args.kinds)
    head = "\n".join(rows)
    return (f"{head}\n\nEach replaced layer's held-out KL (alone, from its run) and code share:\n{layers}"
            f"\n\nbudget: model {args.model}; layers {args.layers} replaced together; {args.budget:,} training tokens "
            f"per layer, seed {args.seed}; {args.docs} held-out pieces of <= {args.chars:,} characters per "
            f"domain; cloze 4-way; {BOOTSTRAP:,} paired bootstrap draws\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.environ.get("SMOLLM2"), help="the base model folder")
    parser.add_argument("--corpus", default=os.environ.get("DOMAINS"), help="a folder of <domain>.jsonl files")
    parser.add_argument("--runs-dir", required=True, help="benchmarks/real_model.py's --runs-dir")
    parser.add_argument("--layers", default="5,15,25")
    parser.add_argument("--budget", type=int, default=1_048_576)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default="transcoder,mxd,moe_x", help="variant names of the real_model.py runs")
    parser.add_argument("--docs", type=int, default=40, help="held-out pieces per domain")
    parser.add_argument("--chars", type=int, default=3_000, help="characters per piece of a held-out document")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--lock", help="an exclusive flock held while a model is evaluated")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    if not args.model or not Path(args.model).is_dir() or not args.corpus or not Path(args.corpus).is_dir():
        print("error: --model (a model folder) and --corpus (a folder of <domain>.jsonl) are required",
              file=sys.stderr)
        return 2
    args.layers = [int(x) for x in args.layers.split(",")]
    args.kinds = args.kinds.split(",")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tasks_dir, domains = held_out_tasks(args)
    tasks = [f"held_{d}_{t}" for d in domains for t in ("ppl", "cloze")]
    for position, kind in enumerate(args.kinds):
        with cores(args.lock):
            model_dir = compose(args, kind)
        evaluate(args, kind, model_dir, tasks_dir, tasks, with_base=position == 0)
        print(f"  {kind}: evaluated", flush=True)
    text = table(args, domains)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
