"""The GPU check of issue 32: the MxD paper recipe's pipeline and the layer fwd+bwd table, each row printed against
its target, on one GPU with no network, in at most 8 minutes.

    python benchmarks/gpu_check.py                        one CUDA GPU (an H100 / H200); exit 1 if a target fails
    python benchmarks/gpu_check.py --device cpu --smoke   the same code at toy sizes, a few seconds (the test suite
                                                          runs it, so the check cannot rot); targets not judged

What it builds, offline: a GPT-2 124M with random weights (transformers' GPT2Config defaults: 12 layers, d 768, MLP
3,072) saved with a GPT-2 tokenizer found on the machine (--tokenizer DIR, else $EXPERTIZE_DATA/tokenizers/gpt2,
else the Hugging Face cache's `gpt2`; else the shipped tiny-gpt2-shakespeare tokenizer, vocabulary 2,048, with a note:
its (t) is not GPT-2's), and text: the shipped tinyshakespeare.txt written out as many times as the budget needs
(its paragraphs are the documents), or --text FILE.... The recipe is recipes/paper/mxd-gpt2-l8-mxd.yaml (layer 8,
MxD K = 32 at the 32x budget, context 128) with that model and text.

Pipeline stages (benchmarks/pipeline_throughput.py's functions: the pipeline's own code, timed with the GPU
synchronized), --tokens tokens each (default 2,097,152, the issue's):

    (t) tokenize + pack    the train split read, tokenized (the fast tokenizer's batch encoding) and packed; and
    (t) from token cache   the same ids read back from data.token_cache (what a second run pays)
    (c) capture forward    the base model to layer 8 (train.capture_precision, capture_batch_sequences: auto, TF32)
    (b) layer math         forward, loss, backward, fused AdamW and the step's bookkeeping on captured batches
    (a) pipeline           `expertize upcycle`'s distillation stage (data, capture, shuffle, training, logging)

in two settings: fp32 (the paper's: 4,096 tokens per step, fp32 capture and layers; TF32 on, the default) and bf16
(16,384 tokens per step, bf16 layers and bf16 capture). (b) and (c) run before and after (a); the faster pass is
kept. Extra rows, no target: (c) at the paper's fixed 32 sequences per forward (what `auto` gains), and (b) with
train.compile (compiled in untimed warm-up steps).

Layer table: one fwd+bwd (sum of the output, as benchmarks/mxd_speed.py) at T = 16,384 tokens, fp32 and bf16
autocast, median of --repeats: every kind at the 32x budget (benchmarks/all_kinds.py's settings), the dense GPT-2
MLP, and MxD as the paper's code computes it (dense (T, N) coefficients, benchmarks/mxd_speed.py).

Targets (issue 32; judged on CUDA only):
    (a) bf16 >= 700,000 tokens/s; (a) fp32 >= 350,000 tokens/s
    (c) >= 2 x (a) and (t) >= 2 x (a), each setting
    (a) <= 1.1 x ((b) + (c)), each setting
    MxD fwd+bwd bf16 at T = 16,384: the paper code's time / MxD's >= 3
"""

import argparse
import dataclasses
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from _timing import Seconds, round_robin_times, synchronize, timed
from all_kinds import KIND_SETTINGS, KINDS
from mxd_speed import gpt2_mlp, mxd_reference
from pipeline_throughput import capture, layer_math, pipeline

from expertize.conversion import upcycle as up
from expertize.conversion.data.text import iter_sequences
from expertize.conversion.data.token_cache import train_sequences
from expertize.conversion.preflight import plan_run
from expertize.conversion.recipe import load_recipe
from expertize.conversion.recipe.layer_config import LayerConfig
from expertize.conversion.recipe.layer_spec import resolve_layer_spec
from expertize.conversion.device import make_accelerator
from expertize.modeling import MlpShape, build_sparse_layer

ROOT = Path(__file__).resolve().parent.parent
PAPER_RECIPE = ROOT / "recipes" / "paper" / "mxd-gpt2-l8-mxd.yaml"
ASSETS = ROOT / "expertize" / "assets"
SETTINGS = {  # name: recipe overrides over the paper recipe
    "fp32": [],
    "bf16": ["train.precision=bf16", "train.capture_precision=bf16", "train.tokens_per_step=16384"],
}
PIPELINE_TARGET = {"fp32": 350_000, "bf16": 700_000}
STAGE_RATIO = 2.0  # (c), (t) >= 2 x (a)
OVERHEAD = 1.1  # (a) <= 1.1 x ((b) + (c))
MXD_VS_PAPER = 3.0
SMOKE = dict(layer=1, tokens=8192, table_tokens=256, steps_per=(512, 1024), d_model=64, heads=4, n_layer=2)


@dataclass
class Row:
    section: str
    label: str
    value: str
    target: str = ""
    passed: bool | None = None  # None: no target, or not judged (off CUDA)

    def line(self, judged: bool) -> str:
        verdict = "" if self.passed is None else ("PASS" if self.passed else "FAIL") if judged else "n/a"
        return f"{self.section:<10} {self.label:<44} {self.value:>22}  {self.target:<28} {verdict}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--smoke", action="store_true", help="toy sizes (a 2-layer d 64 GPT-2, 8,192 tokens, T 256)")
    p.add_argument("--tokens", type=int, default=None, help="tokens of every pipeline stage (default 2,097,152)")
    p.add_argument("--table-tokens", type=int, default=None, help="T of the layer table (default 16,384)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds of the layer table (median; default 5)")
    p.add_argument("--tokenizer", help="a GPT-2 tokenizer folder (default: found on the machine, see above)")
    p.add_argument("--text", nargs="+", help="text files to read instead of the shipped tinyshakespeare.txt")
    p.add_argument("--kinds", default=",".join(KINDS), help="kinds of the layer table (default: all)")
    p.add_argument("--no-compile", action="store_true", help="skip the train.compile row")
    return p.parse_args(argv)


# -- what the check builds ---------------------------------------------------------------------------------------------


def find_tokenizer(folder: str | None, smoke: bool):
    """(tokenizer, where it came from): --tokenizer, $EXPERTIZE_DATA/tokenizers/gpt2, the HF cache's gpt2, else the
    shipped one (always in --smoke, so the test does not depend on the machine)."""
    from transformers import AutoTokenizer, GPT2TokenizerFast

    candidates = [] if smoke else [folder, os.environ.get("EXPERTIZE_DATA") and
                                   str(Path(os.environ["EXPERTIZE_DATA"]) / "tokenizers" / "gpt2")]
    for path in filter(None, candidates):
        path = Path(path)
        if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(path), str(path)
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return GPT2TokenizerFast(vocab_file=str(path / "vocab.json"), merges_file=str(path / "merges.txt")), str(path)
    if not smoke:
        try:
            return AutoTokenizer.from_pretrained("gpt2", local_files_only=True), "gpt2 (Hugging Face cache)"
        except OSError:
            pass
    shipped = ASSETS / "tiny-gpt2-shakespeare"
    note = "" if smoke else " (NOTE: not GPT-2's vocabulary; (t) is not GPT-2's tokenizing speed)"
    return AutoTokenizer.from_pretrained(shipped), f"shipped tiny-gpt2-shakespeare, vocabulary 2,048{note}"


def build_base(folder: Path, tokenizer, smoke: bool) -> Path:
    """A GPT-2 with random weights (124M, or the smoke size) and `tokenizer`, saved to `folder`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    eos = tokenizer.eos_token_id
    sizes = {} if not smoke else dict(n_layer=SMOKE["n_layer"], n_embd=SMOKE["d_model"], n_head=SMOKE["heads"],
                                      n_positions=128)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos, **sizes))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_text(path: Path, sources: list[str], tokenizer, tokens: int) -> Path:
    """The source texts written out as many times as `tokens` train tokens need (with the 5 % held out and the
    packing's dropped tails, 1.25x), paragraphs as documents."""
    text = "\n\n".join(Path(s).read_text(encoding="utf-8") for s in sources)
    per_copy = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    copies = max(1, math.ceil(1.25 * tokens / per_copy))
    path.write_text("\n\n".join([text] * copies), encoding="utf-8")
    return path


def recipe_for(setting: str, base: Path, text: Path, tokens: int, out: Path, device: str, smoke: bool, extra=()):
    overrides = [
        f"base_model={base}", f"output_dir={out}", f"train.device={device}", "data.source=text",
        f"data.paths=[{text}]", "data.document_separator=blank_line", f"data.train_tokens={tokens}",
        f"data.eval_tokens={1024 if smoke else 8192}", "train.warmup_steps=auto", "train.checkpoint_every=0", *SETTINGS[setting], *extra,
    ]
    if smoke:
        per_step = SMOKE["steps_per"][setting == "bf16"]
        # the recipe's d_hidden is GPT-2's MLP width (the paper's H = W): the toy model's is 4 x d_model
        overrides += [f"layers=[{SMOKE['layer']}]", f"train.tokens_per_step={per_step}", "eval.batch_sequences=8",
                      f"layer.d_hidden={4 * SMOKE['d_model']}"]
    return load_recipe(str(PAPER_RECIPE), overrides)


# -- the pipeline stages -----------------------------------------------------------------------------------------------


def pipeline_rows(setting: str, args, base: Path, text: Path, tmp: Path) -> list[Row]:
    tokens = args.tokens
    recipe = recipe_for(setting, base, text, tokens, tmp / f"{setting}-a", args.device, args.smoke)
    plan = plan_run(recipe)
    device = plan.device
    accelerator = make_accelerator(device)
    model = up.load_base(plan, device)
    data = recipe.data
    steps = plan.distill_steps
    t_live, sequences = timed(device, lambda: list(iter_sequences(data, plan.tokenizer, split="train")))
    cached = dataclasses.replace(data, token_cache=str(tmp / "token-cache"))
    for _ in train_sequences(cached, plan.tokenizer)(0):  # writes the cache
        pass
    t_cached, _ = timed(device, lambda: list(train_sequences(cached, plan.tokenizer)(0)))
    captures, maths = [], []

    def references(label: str) -> None:
        seconds, pool = capture(model, plan, sequences, device)
        captures.append(seconds)
        maths.append(layer_math(plan, pool, steps, accelerator, tmp / f"{setting}-math-{label}"))

    references("before")
    one = pipeline(recipe, progress=False)
    references("after")
    t_c = Seconds(min(c.wall for c in captures), min(c.cpu for c in captures))
    t_b = Seconds(min(m.wall for m in maths), min(m.cpu for m in maths))
    t_a = one["seconds"]
    rate = {name: tokens / t.wall for name, t in (("t", t_live), ("tc", t_cached), ("c", t_c), ("b", t_b),
                                                  ("a", t_a))}
    rows = [
        Row(setting, "(t) tokenize + pack", f"{rate['t']:,.0f} tok/s", f">= {STAGE_RATIO:g} x (a)",
            rate["t"] >= STAGE_RATIO * rate["a"]),
        Row(setting, "(t) from token cache", f"{rate['tc']:,.0f} tok/s"),
        Row(setting, f"(c) capture forward ({plan_batch(plan, model, device)} seq/forward)",
            f"{rate['c']:,.0f} tok/s", f">= {STAGE_RATIO:g} x (a)", rate["c"] >= STAGE_RATIO * rate["a"]),
        Row(setting, "(b) layer math", f"{rate['b']:,.0f} tok/s"),
        Row(setting, "(a) pipeline", f"{rate['a']:,.0f} tok/s", f">= {PIPELINE_TARGET[setting]:,} tok/s",
            rate["a"] >= PIPELINE_TARGET[setting]),
        Row(setting, "(a) / ((b) + (c))", f"{t_a.wall / (t_b.wall + t_c.wall):.2f}x", f"<= {OVERHEAD:g}x",
            t_a.wall <= OVERHEAD * (t_b.wall + t_c.wall)),
    ]
    fixed = recipe_for(setting, base, text, tokens, tmp / f"{setting}-fixed", args.device, args.smoke,
                       extra=["train.capture_batch_sequences=32"])
    t_fixed, _ = capture(model, plan_run(fixed), sequences, device)
    rows.append(Row(setting, "(c) at 32 seq/forward (the paper's)", f"{tokens / t_fixed.wall:,.0f} tok/s"))
    if not args.no_compile:
        compiled = plan_run(recipe_for(setting, base, text, tokens, tmp / f"{setting}-compiled", args.device,
                                       args.smoke, extra=["train.compile=true"]))
        _, pool = capture(model, compiled, sequences[: math.ceil(64 * recipe.train.tokens_per_step
                                                                 / data.context_length)], device)
        t_compiled = layer_math(compiled, pool, steps, accelerator, tmp / f"{setting}-compiled-math", warmup=3)
        rows.append(Row(setting, "(b) layer math, train.compile", f"{tokens / t_compiled.wall:,.0f} tok/s"))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def plan_batch(plan, model, device) -> int:
    stream = up.activation_batches(plan.recipe, model, plan.tokenizer, plan.layer_ids, plan.distill_steps, device)
    return stream.capture_batch_sequences


# -- the layer table ---------------------------------------------------------------------------------------------------


def fwd_bwd(module: torch.nn.Module, fn, x: torch.Tensor, precision: str):
    def run() -> None:
        for p in module.parameters():
            p.grad = None
        x.grad = None
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = fn(x)
        out.float().sum().backward()
        synchronize(x.device)

    return run


def layer_rows(args, d_model: int, d_hidden: int, device: torch.device) -> list[Row]:
    """fwd+bwd ms of every kind at the 32x budget, the dense MLP and the paper code's MxD, fp32 and bf16."""
    T = args.table_tokens
    shape = MlpShape(d_model, d_hidden, "gelu_new", False)
    rows = []
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        x = torch.randn(T, d_model, device=device, requires_grad=True)  # (T, d)
        modules = {"dense MLP": (gpt2_mlp(d_model, d_model, d_hidden).to(device), None)}
        for kind in args.kinds.split(","):
            settings = {k: v for k, v in KIND_SETTINGS[kind].items()}
            spec = resolve_layer_spec(LayerConfig(kind=kind, match_transcoder=32, **settings), shape)
            layer = build_sparse_layer(spec).to(device).train()
            with torch.no_grad():  # a fresh layer's zero decoders would leave parts of the graph without gradients
                for p in layer.parameters():
                    p.normal_(0, d_model**-0.5)
            modules[kind] = (layer, None)
        mxd = modules.get("mxd", (None,))[0]
        calls = {name: fwd_bwd(m, m, x, precision) for name, (m, _) in modules.items()}
        if mxd is not None:
            calls["mxd (paper code)"] = fwd_bwd(mxd, lambda v: mxd_reference(mxd, v), x, precision)
        times = {}
        for name, call in calls.items():  # one at a time: a too-large row (OOM) is reported, the others go on
            try:
                times[name] = statistics.median(round_robin_times({name: call}, 1, args.repeats)[name]) * 1e3
            except torch.OutOfMemoryError:
                times[name] = math.nan
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dense = times["dense MLP"]
        for name, ms in times.items():
            rows.append(Row(f"layer {precision}", f"{name} fwd+bwd, T={T:,}", f"{ms:.2f} ms ({ms / dense:.1f}x MLP)"))
        if mxd is not None:
            ratio = times["mxd (paper code)"] / times["mxd"]
            target = precision == "bf16"
            rows.append(Row(f"layer {precision}", "mxd speed-up over the paper code", f"{ratio:.2f}x",
                            f">= {MXD_VS_PAPER:g}x" if target else "", ratio >= MXD_VS_PAPER if target else None))
    return rows


# -- main --------------------------------------------------------------------------------------------------------------


def run_check(args) -> tuple[list[Row], str]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here (torch.cuda.is_available() is False); use --device cpu --smoke")
    args.tokens = args.tokens or (SMOKE["tokens"] if args.smoke else 2_097_152)
    args.table_tokens = args.table_tokens or (SMOKE["table_tokens"] if args.smoke else 16_384)
    tokenizer, source = find_tokenizer(args.tokenizer, args.smoke)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = build_base(tmp / "gpt2-random", tokenizer, args.smoke)
        text = write_text(tmp / "text.txt", args.text or [str(ASSETS / "tinyshakespeare.txt")], tokenizer,
                          args.tokens)
        for setting in SETTINGS:
            rows += pipeline_rows(setting, args, base, text, tmp)
    d_model, d_hidden = (SMOKE["d_model"], 4 * SMOKE["d_model"]) if args.smoke else (768, 3072)
    rows += layer_rows(args, d_model, d_hidden, device)
    return rows, source


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    rows, source = run_check(args)
    device = torch.device(args.device)
    judged = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if judged else "CPU"
    print(f"\nGPU check (issue 32) on {name}, torch {torch.__version__}; tokenizer: {source}; "
          f"{args.tokens:,} tokens per stage; layer table T = {args.table_tokens:,}; "
          f"{time.perf_counter() - start:.0f} s")
    if not judged:
        print("targets are for one H100 / H200 and are not judged here (n/a)")
    for row in rows:
        print(row.line(judged))
    failed = [row for row in rows if row.passed is False]
    if judged:
        print(f"\n{len(failed)} of {sum(row.passed is not None for row in rows)} targets failed" if failed
              else "\nevery target passed")
    return 1 if judged and failed else 0


if __name__ == "__main__":
    sys.exit(main())
