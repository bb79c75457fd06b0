"""Check that saved expertize models load through `trust_remote_code` under another Python / transformers install.

The parent process (this interpreter; it needs `expertize` and transformers 5) builds one tiny random model per family
in `expertize.modeling.FAMILIES`, with an MxD layer at decoder layer 0 and a (skip) transcoder at layer 1, saves each
with `save_pretrained` and stores reference outputs next to it. It then runs this same file with `--child` under the
interpreter given by `--python` (e.g. a venv with transformers 4.57), offline and with a fresh `HF_MODULES_CACHE`.
The child imports only torch and transformers and, for every family:

* loads the folder with `AutoModelForCausalLM` and `AutoModel` (`trust_remote_code=True`, `output_loading_info=True`);
* checks that both classes come from the copied Hub files (`transformers_modules.*`), not from an installed library;
* checks the loading info: no missing or mismatched keys; no unexpected keys (bar the LM head, for the base model),
  unless the native headless class of that version cannot load the native causal-LM checkpoint either (the control:
  a native model of the same config; transformers 4.57's Gemma3TextModel, whose base_model_prefix is empty);
* compares logits and the base model's last hidden state with the saved references (`--atol`, default 1e-5);
* runs greedy `generate()` for 5 new tokens and compares them with the parent's.

Rotary models use non-default RoPE settings (rope_theta 100, linear scaling for Llama and Gemma-3's global layers,
GPT-NeoX rotary fraction 0.5) unless `--default-rope`, so that a config field the other version does not read shows
up as a mismatch instead of passing because the defaults happen to agree.

Usage (from the repository root):

    /work/venv/bin/python scripts/check_transformers4.py --python /work/venv457/bin/python
    /work/venv/bin/python scripts/check_transformers4.py            # control: the same interpreter
    /work/venv/bin/python scripts/check_transformers4.py --python ... --kinds moe_x monet_vd   # other layer kinds

Prints one line per family (OK / FAIL and why) and a summary; exits 1 if any family fails.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

SEED = 0
VOCAB_SIZE = 99
INPUT_SHAPE = (2, 7)
NEW_TOKENS = 5
REFERENCE_FILE = "reference.pt"
MANIFEST_FILE = "manifest.json"
RESULTS_FILE = "results.json"

# -- parent: build, save, reference outputs ---------------------------------------------------------------------------


def rope_parameters(family: str) -> dict | None:
    """Non-default RoPE settings (transformers-5 `rope_parameters`): a small base, linear scaling for Llama, a partial
    rotary fraction for GPT-NeoX; Gemma-3 keeps one dict per attention type (its local and global bases). None for
    GPT-2 (no RoPE)."""
    if family == "gpt2":
        return None
    rope = {"rope_type": "default", "rope_theta": 100.0}
    if family == "llama":
        rope.update(rope_type="linear", factor=2.0)
    if family == "gpt_neox":
        rope["partial_rotary_factor"] = 0.5
    if family == "gemma3_text":
        full = {"rope_type": "linear", "factor": 2.0, "rope_theta": 300.0}
        return {"sliding_attention": rope, "full_attention": full}
    return rope


def tiny_base_config(family: str, default_rope: bool):
    """A tiny native config from the family table of the tests (tests/families.py: sizes as in transformers' own
    causal-LM tests, the family's spelling of them), fp32, small token ids."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests/ is importable
    from tests.families import ROWS, Sizes

    sizes = Sizes(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    fields = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "mistral":
        fields["sliding_window"] = None
    rope = None if default_rope else rope_parameters(family)
    if rope is not None:
        fields["rope_parameters"] = rope
    return ROWS[family].config(sizes, **fields)


KIND_CHOICES = (
    "mxd", "transcoder", "skip_transcoder", "moe_x", "mumoe_cp", "mumoe_tr", "monet_hd", "monet_vd", "routed_neurons",
)


def tiny_spec(kind: str, shape):
    """A small spec of `kind` for the tiny MLP `shape` (d_model 32, hidden 37)."""
    from expertize.modeling import spec_from_dict

    d = shape.d_model
    fields = {
        "mxd": dict(d_hidden=shape.d_hidden, num_experts=16, k=4, encoder="glu" if shape.glu else "mlp",
                    activation=shape.activation),
        "transcoder": dict(num_latents=64, k=8),
        "skip_transcoder": dict(num_latents=64, k=8),
        "moe_x": dict(d_expert=8, num_experts=4, k=2, expert_glu=shape.glu, expert_bias=not shape.glu),
        "mumoe_cp": dict(d_hidden=shape.d_hidden, num_experts=8, rank=16, encoder="glu" if shape.glu else "mlp"),
        "mumoe_tr": dict(d_hidden=shape.d_hidden, num_experts=8, rank=8, encoder="glu" if shape.glu else "mlp"),
        "monet_hd": dict(d_hidden=32, num_experts=16, k=2, num_heads=2),
        "monet_vd": dict(d_hidden=32, num_experts=16, k=2, num_heads=2),
        "routed_neurons": dict(num_experts=32, k=4, router_rank=8),
    }[kind]
    return spec_from_dict({"kind": kind, "d_in": d, "d_out": d, **fields})


def expertize_config(family: str, default_rope: bool, kinds: tuple[str, str] | None = None):
    """The family's expertize config: the tiny base config plus sparse layers at layers 0 and 1 (default: MxD and a
    (skip) transcoder; `kinds` picks others)."""
    from expertize.modeling import FAMILIES

    config_cls = FAMILIES[family][0]
    base = tiny_base_config(family, default_rope).to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        base.pop(key, None)
    shape = config_cls(**base).mlp_shape()
    if kinds is None:
        # The transcoder kind alternates over the families' order, so that both are covered.
        kinds = ("mxd", "skip_transcoder" if list(FAMILIES).index(family) % 2 else "transcoder")
    specs = {i: tiny_spec(kind, shape).to_dict() for i, kind in enumerate(kinds)}
    return config_cls(sparse_layers=specs, **base)


def randomize_decoders(model, generator) -> None:
    """Give every sparse parameter random non-zero values (several kinds start with a zero decoder, skip
    transcoders with W_skip = 0), so that the sparse layers change the logits and a load that drops them cannot
    pass."""
    import torch

    layers = model.sparse_layers()
    assert sorted(layers) == [0, 1], f"expected sparse layers at 0 and 1, got {sorted(layers)}"
    with torch.no_grad():
        for layer in layers.values():
            for param in layer.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
            probe = torch.randn(3, layer.spec.d_in, generator=generator)
            assert layer(probe).abs().max() > 0, f"{type(layer).__name__} outputs zeros"


def save_family(family: str, root: Path, default_rope: bool, kinds: tuple[str, str] | None = None) -> dict:
    """Build, save and run one family's model; returns its manifest entry."""
    import torch
    from expertize.modeling import FAMILIES

    generator = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    config = expertize_config(family, default_rope, kinds)
    _, base_cls, causal_cls = FAMILIES[family]
    model = causal_cls(config).eval()
    randomize_decoders(model, generator)

    # A unique leaf name per family: transformers_modules/<leaf>/ is where the child's copy of the code lands.
    model_dir = root / f"expertize_check_{family}"
    model.save_pretrained(model_dir)
    # The control: the native causal LM of the same config, saved the same way (the child loads its headless model
    # to see whether the other version can load a causal-LM checkpoint into the family's base model at all).
    native_dir = root / f"native_{family}"
    native_config = tiny_base_config(family, default_rope)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(native_config).save_pretrained(native_dir)

    input_ids = torch.randint(3, VOCAB_SIZE, INPUT_SHAPE, generator=generator)
    attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        generated = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
        )
    torch.save(
        {"input_ids": input_ids, "logits": logits, "last_hidden_state": hidden, "generated": generated},
        root / f"{family}_{REFERENCE_FILE}",
    )
    prefix = model.base_model_prefix + "."
    head_keys = sorted(k for k in model.state_dict() if not k.startswith(prefix))
    return {
        "family": family,
        "dir": str(model_dir),
        "native_dir": str(native_dir),
        "reference": str(root / f"{family}_{REFERENCE_FILE}"),
        "causal_class": causal_cls.__name__,
        "base_class": base_cls.__name__,
        "head_keys": head_keys,
    }


def child_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(root / "hf_home"),
        HF_MODULES_CACHE=str(root / "modules_cache"),
        PYTHONNOUSERSITE="1",
        PYTHONDONTWRITEBYTECODE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def run_child(python: str, root: Path, timeout: float, verbose: bool) -> tuple[dict | None, str]:
    """Run the checks under `python`; returns (results or None, the child's combined output)."""
    cmd = [python, str(Path(__file__).resolve()), "--child", str(root / MANIFEST_FILE)]
    try:
        proc = subprocess.run(
            cmd, cwd=root, env=child_env(root), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        return None, f"child timed out after {timeout:.0f}s\n{exc.stdout or ''}{exc.stderr or ''}"
    output = proc.stdout + proc.stderr
    if verbose:
        print(output, file=sys.stderr)
    results_path = root / RESULTS_FILE
    if not results_path.exists():
        return None, f"child exited {proc.returncode} without results\n{output}"
    return json.loads(results_path.read_text()), output


# -- child: imports only torch, transformers and the standard library -------------------------------------------------


def _max_abs_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def check_loading_info(info: dict, allowed_unexpected: set[str]) -> list[str]:
    problems = []
    for key in ("missing_keys", "mismatched_keys", "error_msgs"):
        if info.get(key):
            problems.append(f"{key}={sorted(map(str, info[key]))}")
    unexpected = set(info.get("unexpected_keys") or ()) - allowed_unexpected
    if unexpected:
        problems.append(f"unexpected_keys={sorted(unexpected)}")
    return problems


def check_family(case: dict, atol: float) -> dict:
    """Load one saved family both ways and compare with the references; returns {"ok", "problems", "details"}."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    ref = torch.load(case["reference"], weights_only=True)
    problems: list[str] = []
    details: dict = {}

    causal, info = AutoModelForCausalLM.from_pretrained(case["dir"], trust_remote_code=True, output_loading_info=True)
    causal.eval()
    cls = type(causal)
    if not cls.__module__.startswith("transformers_modules") or cls.__name__ != case["causal_class"]:
        problems.append(f"AutoModelForCausalLM gave {cls.__module__}.{cls.__name__}")
    problems += [f"causal LM {p}" for p in check_loading_info(info, set())]
    mask = torch.ones_like(ref["input_ids"])
    with torch.no_grad():
        logits = causal(input_ids=ref["input_ids"], attention_mask=mask).logits
    details["logits_diff"] = diff = _max_abs_diff(logits, ref["logits"])
    if logits.shape != ref["logits"].shape or not diff <= atol:
        problems.append(f"logits differ: max|Δ|={diff:.3g} > atol={atol:g}")
    with torch.no_grad():
        generated = causal.generate(
            input_ids=ref["input_ids"],
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
        )
    new_tokens = generated.shape[1] - ref["input_ids"].shape[1]
    if new_tokens != NEW_TOKENS:
        problems.append(f"generate() made {new_tokens} new tokens, not {NEW_TOKENS}")
    elif not torch.equal(generated, ref["generated"]):
        problems.append(
            f"greedy generate() differs: {generated[:, -NEW_TOKENS:].tolist()} vs "
            f"{ref['generated'][:, -NEW_TOKENS:].tolist()}"
        )

    _, native_info = AutoModel.from_pretrained(case["native_dir"], output_loading_info=True)
    if native_info.get("missing_keys"):  # the native headless class cannot load a causal-LM checkpoint here either
        details["base_model"] = (f"not checked: the native AutoModel misses {len(native_info['missing_keys'])} keys "
                                 "of the native causal-LM checkpoint under this transformers version too")
        return {"ok": not problems, "problems": problems, "details": details}
    base, info = AutoModel.from_pretrained(case["dir"], trust_remote_code=True, output_loading_info=True)
    base.eval()
    cls = type(base)
    if not cls.__module__.startswith("transformers_modules") or cls.__name__ != case["base_class"]:
        problems.append(f"AutoModel gave {cls.__module__}.{cls.__name__}")
    problems += [f"base model {p}" for p in check_loading_info(info, set(case["head_keys"]))]
    with torch.no_grad():
        hidden = base(input_ids=ref["input_ids"], attention_mask=mask).last_hidden_state
    details["hidden_diff"] = diff = _max_abs_diff(hidden, ref["last_hidden_state"])
    if hidden.shape != ref["last_hidden_state"].shape or not diff <= atol:
        problems.append(f"base model last_hidden_state differs: max|Δ|={diff:.3g} > atol={atol:g}")
    return {"ok": not problems, "problems": problems, "details": details}


def child_main(manifest_path: Path) -> int:
    manifest = json.loads(manifest_path.read_text())
    results: dict = {"families": {}}
    try:
        import torch
        import transformers

        results["versions"] = {"transformers": transformers.__version__, "torch": torch.__version__}
    except Exception:
        results["error"] = traceback.format_exc()
    else:
        for case in manifest["cases"]:
            try:
                results["families"][case["family"]] = check_family(case, manifest["atol"])
            except Exception as exc:
                tb = traceback.format_exc()
                print(tb, file=sys.stderr)
                results["families"][case["family"]] = {
                    "ok": False,
                    "problems": [f"{type(exc).__name__}: {exc}"],
                    "traceback": tb,
                }
        leaked = sorted(m for m in sys.modules if m == "expertize" or m.startswith(("expertize.", "modeling")))
        if leaked:
            results["error"] = f"the child imported project modules, so the check proves nothing: {leaked}"
    (manifest_path.parent / RESULTS_FILE).write_text(json.dumps(results, indent=2))
    return 0


# -- driver -----------------------------------------------------------------------------------------------------------


def report(families: list[str], results: dict | None, child_output: str, python: str, show_tracebacks: bool) -> int:
    """Print one line per family and a summary; returns the number of failures."""
    if results is None:
        for family in families:
            print(f"{family:<10} FAIL  child process gave no results")
        print(child_output[-4000:])
        print(f"SUMMARY: 0/{len(families)} OK under {python}")
        return len(families)
    versions = results.get("versions", {})
    failures = 0
    for family in families:
        result = results["families"].get(family, {"ok": False, "problems": ["not checked"]})
        if result["ok"]:
            d = result["details"]
            hidden = f"max|Δhidden|={d['hidden_diff']:.2g}" if "hidden_diff" in d else f"base model {d['base_model']}"
            print(f"{family:<10} OK    max|Δlogits|={d['logits_diff']:.2g}  {hidden}")
        else:
            failures += 1
            print(f"{family:<10} FAIL  " + "; ".join(result["problems"]))
            if show_tracebacks and "traceback" in result:
                print("    " + result["traceback"].rstrip().replace("\n", "\n    "))
    if "error" in results:
        failures = max(failures, 1)
        print(f"ERROR: {results['error']}")
    version_text = ", ".join(f"{k} {v}" for k, v in versions.items()) or "versions unknown"
    print(f"SUMMARY: {len(families) - failures}/{len(families)} OK under {python} ({version_text})")
    return failures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter to load the saved models with (default: this one, a transformers-5 control run)",
    )
    parser.add_argument("--families", nargs="+", help="families to check (default: all of expertize FAMILIES)")
    parser.add_argument(
        "--kinds", nargs=2, choices=KIND_CHOICES, metavar="KIND",
        help="sparse layer kinds at layers 0 and 1 (default: mxd and a (skip) transcoder)",
    )
    parser.add_argument("--atol", type=float, default=1e-5, help="tolerance on logits and hidden states")
    parser.add_argument("--default-rope", action="store_true", help="keep the default RoPE settings")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder and print its path")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed for the child process")
    parser.add_argument("--tracebacks", action="store_true", help="print the child's tracebacks for failures")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the child's output")
    parser.add_argument("--child", type=Path, metavar="MANIFEST", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args.child)

    import transformers
    from expertize.modeling import FAMILIES

    transformers.utils.logging.disable_progress_bar()
    families = args.families or list(FAMILIES)
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"unknown families {unknown}; choose from {sorted(FAMILIES)}")
    root = Path(tempfile.mkdtemp(prefix="expertize_tf4_"))
    try:
        print(f"saving {len(families)} tiny models with transformers {transformers.__version__} in {root}")
        cases = [save_family(family, root, args.default_rope, tuple(args.kinds) if args.kinds else None)
                 for family in families]
        (root / MANIFEST_FILE).write_text(json.dumps({"atol": args.atol, "cases": cases}, indent=2))
        print(f"loading them with {args.python} (HF_HUB_OFFLINE=1, fresh HF_MODULES_CACHE)")
        results, output = run_child(args.python, root, args.timeout, args.verbose)
        failures = report(families, results, output, args.python, args.tracebacks)
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
