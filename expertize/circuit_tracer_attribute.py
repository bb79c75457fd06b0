#!/usr/bin/env python
"""An attribution graph from this circuit-tracer export, offline, with the registry's circuit-tracer (0.5.0).

`expertize export MODEL --to circuit-tracer OUT` copies this file to OUT/attribute.py. In an environment with
circuit-tracer (`pip install circuit-tracer==0.5.0`: it pins transformers <= 4.57) and without expertize:

    python OUT/attribute.py --prompt "Once upon a time" --out graphs/ [--base BASE_DIR] [--check REF.safetensors]

It loads the transcoders of OUT (a per-layer set, layer_{i}.safetensors, or a cross-layer transcoder,
W_enc_{i} / W_dec_{i}.safetensors) with circuit-tracer's own loaders from the local folder, the base model from its
local folder (config.yaml's model_name unless --base), builds the ReplacementModel, runs `attribute` and writes the
graph files (`graph.pt`, and `graph.json` + `graph-metadata.json` for circuit-tracer's viewer).

Why not circuit-tracer's documented one-liner, `ReplacementModel.from_pretrained_and_transcoders(model_name, ...)`:
its TransformerLens backend accepts official Hub names only. Routes taken here:
- Llama-likes through the nnsight backend when the installed nnsight is one circuit-tracer 0.5.0 can import
  (0.6.x; the registry resolves 0.8.x, whose API it cannot), else through TransformerLens;
- every family through TransformerLens built from the local folder (`get_pretrained_model_config` and
  `get_pretrained_state_dict` accept one): the same graph as the nnsight route on a Llama, and the only route for
  GPT-2 (circuit-tracer's nnsight mapping has no GPT-2).
A base saved by transformers 5 is not readable by 4.57 as it is: OUT/base_fixed/ is a copy with symlinked weights,
a tokenizer_config.json 4.57 reads (OUT/tokenizer/, written by the export) and a config.json with rope_theta (4.57
ignores rope_parameters and would use 10000) and GPT-2's n_ctx (TransformerLens reads it).

--check REF.safetensors compares circuit-tracer's loaded transcoders with reference outputs: x_{i} (T, d) the MLP
inputs at layer i, y_{i} (T, d) what the expertize layer outputs there; exit 2 above --tol (1e-5).

--scores SCORES.json adds circuit-tracer's own graph scores (`compute_graph_scores`: the replacement score, the share
of the tokens' influence on the logits that reaches them through features rather than error nodes, and the
completeness score, the influence-weighted share of every node's inputs that are not errors) of each prompt's graph;
with --prompts FILE (one prompt per line) in place of --prompt it scores every line and writes no graph files:

    python OUT/attribute.py --prompts prompts.txt --scores scores.json --out graphs/ --max-feature-nodes 8192

Imports only circuit_tracer, torch, transformers, transformer_lens, safetensors and yaml (never expertize).
"""

import argparse
import glob
import json
import os
import re
import sys
import time

import torch
import yaml
from safetensors.torch import load_file

DEVICE = torch.device("cpu")
DTYPE = torch.float32
DEFAULT_IN_HOOK = "mlp.hook_in"    # MLP input after ln2 / post_attention_layernorm
DEFAULT_OUT_HOOK = "mlp.hook_out"  # MLP output


# ----------------------------------------------------------------------------- base model
_DROP_TOK_KEYS = {"backend", "is_local", "local_files_only"}


def fix_tokenizer_config(tc: dict) -> dict:
    """transformers-5 tokenizer_config.json -> one transformers 4.57 can read.

    * tokenizer_class 'TokenizersBackend' (GPT-2) doesn't exist in 4.57, and 'LlamaTokenizer'
      maps to LlamaTokenizerFast, which re-derives pre-tokenizer/post-processor from its own
      legacy logic.  'PreTrainedTokenizerFast' uses tokenizer.json exactly as saved.
    * extra_special_tokens saved as a LIST makes 4.57 crash
      (AttributeError: 'list' object has no attribute 'keys'); 4.57 expects a dict.
      List entries become additional_special_tokens (minus bos/eos/unk/pad).
    """
    tc = {k: v for k, v in tc.items() if k not in _DROP_TOK_KEYS}
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    est = tc.pop("extra_special_tokens", None)
    if isinstance(est, dict):
        tc["extra_special_tokens"] = est
    elif isinstance(est, list):
        named = {tc.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        extra = [t for t in est if (t if isinstance(t, str) else t.get("content")) not in named]
        if extra:
            tc["additional_special_tokens"] = list(tc.get("additional_special_tokens", [])) + extra
    return tc


def fix_model_config(cfg: dict) -> dict:
    """transformers-5 'rope_parameters' -> 4.57 'rope_theta' / 'rope_scaling'.
    (4.57 ignores rope_parameters and would silently fall back to rope_theta=10000.)"""
    cfg = dict(cfg)
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        if "rope_theta" in rp and "rope_theta" not in cfg:
            cfg["rope_theta"] = rp["rope_theta"]
        rtype = rp.get("rope_type", "default")
        if rtype != "default" and not cfg.get("rope_scaling"):
            cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    if cfg.get("model_type") == "gpt2" and "n_ctx" not in cfg:
        # transformer_lens convert_hf_model_config reads hf_config.n_ctx for GPT-2; Hub gpt2
        # configs carry it, transformers-5 saves don't -> AttributeError without this.
        cfg["n_ctx"] = cfg.get("n_positions", 1024)
    return cfg


def prepare_base(base: str, dst: str, tokenizer: str | None = None) -> str:
    """Shadow copy of `base` readable by transformers 4.57 (symlinked weights; the tokenizer files of `tokenizer`,
    a folder, where given)."""
    base = os.path.abspath(base)
    os.makedirs(dst, exist_ok=True)
    if not os.path.exists(os.path.join(base, "tokenizer.json")):
        raise SystemExit(f"{base} has no tokenizer.json: cannot build a fast tokenizer offline")
    for name in os.listdir(base):
        src, tgt = os.path.join(base, name), os.path.join(dst, name)
        if name in ("tokenizer_config.json", "config.json") or (tokenizer and os.path.exists(os.path.join(tokenizer, name))):
            continue
        if os.path.lexists(tgt):
            os.remove(tgt)
        os.symlink(src, tgt)
    tc_path = os.path.join(base, "tokenizer_config.json")
    tc = json.load(open(tc_path)) if os.path.exists(tc_path) else {}
    if tokenizer is not None:  # the export's own copy, already readable by transformers 4.x
        for name in os.listdir(tokenizer):
            if os.path.lexists(os.path.join(dst, name)):
                os.remove(os.path.join(dst, name))
            os.symlink(os.path.join(tokenizer, name), os.path.join(dst, name))
        tc = json.load(open(os.path.join(tokenizer, "tokenizer_config.json")))
    json.dump(fix_tokenizer_config(tc), open(os.path.join(dst, "tokenizer_config.json"), "w"), indent=2)
    json.dump(fix_model_config(json.load(open(os.path.join(base, "config.json")))),
              open(os.path.join(dst, "config.json"), "w"), indent=2)
    return dst


def load_tl_replacement_model(fixed_dir: str, transcoders):
    """TransformerLens route without the Hub: HookedTransformer.from_pretrained rejects local
    paths (get_official_model_name raises), but transformer_lens 3.x loading helpers
    get_pretrained_model_config / get_pretrained_state_dict accept a local folder."""
    from transformer_lens import loading_from_pretrained as loading
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from circuit_tracer.replacement_model.replacement_model_transformerlens import (
        TransformerLensReplacementModel,
    )

    hf_model = AutoModelForCausalLM.from_pretrained(fixed_dir, torch_dtype=DTYPE)
    hc = hf_model.config
    if hc.model_type == "gpt2" and hc.n_inner not in (None, 4 * hc.n_embd):
        # transformer_lens sets d_mlp = 4 * n_embd for GPT-2 and ignores n_inner
        raise SystemExit(f"GPT-2 n_inner={hc.n_inner} != 4*n_embd: transformer_lens would build a wrong d_mlp")
    tok = AutoTokenizer.from_pretrained(fixed_dir)
    cfg = loading.get_pretrained_model_config(
        fixed_dir, hf_cfg=hf_model.config.to_dict(), fold_ln=False, device=str(DEVICE), dtype=DTYPE
    )
    sd = loading.get_pretrained_state_dict(fixed_dir, cfg, hf_model, dtype=DTYPE)
    model = TransformerLensReplacementModel(cfg, tok, move_to_device=False)
    # same processing flags circuit-tracer uses in from_pretrained_and_transcoders
    model.load_and_process_state_dict(
        sd, fold_ln=False, center_writing_weights=False, center_unembed=False,
        fold_value_biases=True, refactor_factored_attn_matrices=False,
    )
    model.move_model_modules_to_device()
    model._configure_replacement_model(transcoders)
    return model, hf_model


def load_base(fixed_dir: str, transcoders, backend: str):
    from circuit_tracer import ReplacementModel
    from circuit_tracer.utils.tl_nnsight_mapping import get_supported_architectures

    arch = json.load(open(os.path.join(fixed_dir, "config.json")))["architectures"][0]
    nn_err = None
    try:
        import nnsight  # noqa: F401  (whether it imports at all)

        from circuit_tracer.replacement_model import replacement_model_nnsight  # noqa: F401
    except Exception as e:  # noqa: BLE001
        nn_err = f"{type(e).__name__}: {e}"
    nn_ver = getattr(sys.modules.get("nnsight"), "__version__", "?")
    if backend == "auto":
        if arch not in get_supported_architectures():
            backend = "transformerlens"
            print(f"[base] nnsight mapping has no {arch} (supported: {get_supported_architectures()})")
        elif nn_err is not None:
            backend = "transformerlens"
            print(f"[base] nnsight backend unusable with nnsight {nn_ver}: {nn_err}")
        else:
            backend = "nnsight"
    print(f"[base] architecture={arch} backend={backend} nnsight={nn_ver}")
    if backend == "nnsight":
        model = ReplacementModel.from_pretrained_and_transcoders(
            fixed_dir, transcoders, backend="nnsight", device=DEVICE, dtype=DTYPE
        )
        return model, None, backend
    model, hf_model = load_tl_replacement_model(fixed_dir, transcoders)
    return model, hf_model, backend


# ----------------------------------------------------------------------------- transcoders
def _layer_idx(path, pat):
    m = re.fullmatch(pat, os.path.basename(path))
    return int(m.group(1)) if m else None


def load_local_transcoders(tc_dir: str, in_hook=None, out_hook=None, lazy_decoder=True):
    from circuit_tracer.transcoder.cross_layer_transcoder import load_clt
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set

    tc_dir = os.path.abspath(tc_dir)
    cfg_path = os.path.join(tc_dir, "config.yaml")
    cfg = yaml.safe_load(open(cfg_path)) if os.path.exists(cfg_path) else {}
    enc = sorted(glob.glob(os.path.join(tc_dir, "W_enc_*.safetensors")))
    lay = sorted(glob.glob(os.path.join(tc_dir, "layer_*.safetensors")))
    kind = cfg.get("model_kind") or ("cross_layer_transcoder" if enc else "transcoder_set" if lay else None)
    in_hook = in_hook or cfg.get("feature_input_hook") or DEFAULT_IN_HOOK
    out_hook = out_hook or cfg.get("feature_output_hook") or DEFAULT_OUT_HOOK
    scan = cfg.get("scan") or f"local:{os.path.basename(tc_dir)}"

    if kind == "cross_layer_transcoder":
        idx = sorted(_layer_idx(p, r"W_enc_(\d+)\.safetensors") for p in enc)
        assert idx == list(range(len(idx))), f"W_enc_i files must be 0..n-1, got {idx}"
        for i in idx:
            assert os.path.exists(os.path.join(tc_dir, f"W_dec_{i}.safetensors")), f"missing W_dec_{i}"
        # load_clt's dtype default is bfloat16 -> pass float32 explicitly.
        tcs = load_clt(tc_dir, feature_input_hook=in_hook, feature_output_hook=out_hook, scan=scan,
                       device=DEVICE, dtype=DTYPE, lazy_decoder=lazy_decoder, lazy_encoder=False)
    elif kind == "transcoder_set":
        if cfg.get("transcoders"):
            # resolve_transcoder_paths would take these relative to the *CWD*; we use the folder
            paths = {i: p if os.path.isabs(p) else os.path.join(tc_dir, p)
                     for i, p in enumerate(cfg["transcoders"])}
        else:
            idx = sorted(_layer_idx(p, r"layer_(\d+)\.safetensors") for p in lay)
            assert idx == list(range(len(idx))), f"layer_i files must be 0..n-1, got {idx}"
            paths = {i: os.path.join(tc_dir, f"layer_{i}.safetensors") for i in idx}
        tcs = load_transcoder_set(paths, scan=scan, feature_input_hook=in_hook, feature_output_hook=out_hook,
                                  device=DEVICE, dtype=DTYPE, lazy_encoder=False, lazy_decoder=lazy_decoder)
    else:
        raise SystemExit(f"cannot tell transcoder layout of {tc_dir}")
    return tcs, kind


def check_transcoders(tcs, kind, ref_path, tol=1e-5):
    """Compare circuit-tracer's transcoder outputs with y_i in REF (x_i = MLP inputs)."""
    ref = load_file(ref_path)
    n = tcs.n_layers
    xs = [ref[f"x_{i}"].to(DEVICE, DTYPE) for i in range(n)]
    errs = []
    with torch.no_grad():
        if kind == "transcoder_set":
            outs = [tcs[i](xs[i]) for i in range(n)]  # SingleLayerTranscoder.forward = decode(encode(x), x)
            method = "transcoders[i](x_i)"
        else:
            X = torch.stack(xs)  # (n_layers, T, d)
            out = tcs(X)         # CrossLayerTranscoder.forward: encode -> sparse -> decode (+skip)
            method = "clt(stack(x))[i]"
            if out.shape != X.shape:
                # forward() sizes its output by the last position with an active feature
                print(f"[check] clt.forward returned {tuple(out.shape)} != {tuple(X.shape)};"
                      " using per-layer encode_layer/_get_decoder_vectors instead")
                out = torch.stack([
                    tcs.b_dec[i] + sum(tcs.encode_layer(xs[j], j) @ tcs._get_decoder_vectors(j)[:, i - j, :]
                                       for j in range(i + 1)) for i in range(n)])
                method = "sum_j encode_layer(x_j,j) @ W_dec_j[:, i-j]"
            outs = [out[i] for i in range(n)]
    for i in range(n):
        e = (outs[i] - ref[f"y_{i}"].to(DEVICE, DTYPE)).abs().max().item()
        errs.append(e)
    mx = max(errs)
    print(f"[check] method={method} per-layer max|err|={['%.2e' % e for e in errs]} max={mx:.3e} tol={tol:g}")
    return mx <= tol, mx


def tokenize_with_bos(tok, prompt):
    """Same result as circuit-tracer's ensure_tokenized (prompt without special tokens, one
    special token prepended), but safe when that token's id is 0: ensure_tokenized picks it
    with next(filter(None, [bos, pad, eos, *special])), which drops id 0 and raises
    StopIteration (e.g. GPT-2 <|endoftext|> = 0 in tiny-gpt2-shakespeare).  A tensor that
    already starts with a special id is passed through unchanged by ensure_tokenized."""
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids.squeeze(0)
    if len(ids) and int(ids[0]) in tok.all_special_ids:
        return ids.to(DEVICE)
    cands = [tok.bos_token_id, tok.pad_token_id, tok.eos_token_id, *tok.all_special_ids]
    bos = next((c for c in cands if c is not None), None)
    if bos is None:
        raise SystemExit("tokenizer has no special token to prepend")
    return torch.cat([torch.tensor([bos]), ids]).to(DEVICE)


def tl_vs_hf_logits(model, hf_model, ids):
    with torch.no_grad():
        a = model(ids[None])
        b = hf_model(ids[None]).logits
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------- graph scores
def read_prompts(path: str) -> list[str]:
    """One prompt per non-empty line of `path` (a prompt is a line: its own newlines are not kept)."""
    with open(path, encoding="utf-8") as lines:
        return [line.rstrip("\n") for line in lines if line.strip()]


def graph_scores(graph, prompt: str, seconds: float) -> dict:
    """circuit-tracer's own scores of one attribution graph, with what they were computed over."""
    from circuit_tracer.graph import compute_graph_scores

    replacement, completeness = compute_graph_scores(graph)
    return {"prompt": prompt, "tokens": len(graph.input_tokens), "replacement": replacement,
            "completeness": completeness, "active_features": int(graph.active_features.shape[0]),
            "selected_features": int(graph.selected_features.shape[0]), "seconds": round(seconds, 2)}


def score_prompt(model, prompt: str, a) -> dict:
    """Attribute one prompt and score its graph (no graph files)."""
    from circuit_tracer import attribute

    start = time.time()
    ids = tokenize_with_bos(model.tokenizer, prompt)
    graph = attribute(ids, model, max_n_logits=a.max_n_logits, batch_size=a.batch_size,
                      max_feature_nodes=a.max_feature_nodes, verbose=False)
    scored = graph_scores(graph, prompt, time.time() - start)
    print(f"[scores] replacement={scored['replacement']:.4f} completeness={scored['completeness']:.4f} "
          f"tokens={scored['tokens']} active={scored['active_features']} selected={scored['selected_features']} "
          f"{scored['seconds']:.1f}s", flush=True)
    return scored


def write_scores(a, kind: str, scored: list[dict], backend: str) -> None:
    """SCORES.json: every prompt's scores and their means (a selected-feature cap below the active count leaves
    the unselected features' influence out of both scores: the file records the cap)."""
    def mean(key: str) -> float:
        return sum(s[key] for s in scored) / len(scored)

    out = {"kind": kind, "backend": backend, "max_feature_nodes": a.max_feature_nodes,
           "max_n_logits": a.max_n_logits, "replacement_mean": mean("replacement"),
           "completeness_mean": mean("completeness"), "prompts": scored}
    os.makedirs(os.path.dirname(os.path.abspath(a.scores)) or ".", exist_ok=True)
    with open(a.scores, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(f"[scores] {len(scored)} prompts: replacement mean={out['replacement_mean']:.4f} "
          f"completeness mean={out['completeness_mean']:.4f} -> {a.scores}")


# ----------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--base", help="the base model's folder (default: config.yaml's model_name)")
    ap.add_argument("--transcoders", default=here, help="the export folder (default: this script's)")
    prompts = ap.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", help="draw this prompt's graph (graph.pt, graph.json)")
    prompts.add_argument("--prompts", help="a text file, one prompt per line: score each (needs --scores)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--scores", default=None, help="write each prompt's compute_graph_scores here (JSON)")
    ap.add_argument("--check", default=None, help="REF.safetensors with x_i / y_i")
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--backend", choices=["auto", "nnsight", "transformerlens"], default="auto")
    ap.add_argument("--input-hook", default=None, help="override config.yaml feature_input_hook")
    ap.add_argument("--output-hook", default=None, help="override config.yaml feature_output_hook")
    ap.add_argument("--max-n-logits", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-feature-nodes", type=int, default=256)
    ap.add_argument("--node-threshold", type=float, default=0.8)
    ap.add_argument("--edge-threshold", type=float, default=0.98)
    ap.add_argument("--slug", default="graph")
    a = ap.parse_args()
    if a.prompts and not a.scores:
        ap.error("--prompts scores every line and draws no graph: give --scores SCORES.json (or one --prompt)")
    texts = [a.prompt] if a.prompt else read_prompts(a.prompts)
    if not texts:
        ap.error(f"--prompts {a.prompts}: no prompt in it (one prompt per line)")
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[name] = "1"  # everything is local: a Hub lookup is a bug, never a download
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    t0 = time.time()
    a.out = os.path.abspath(a.out)  # circuit-tracer's create_graph_files needs a folder it can name the parent of
    os.makedirs(a.out, exist_ok=True)
    if a.base is None:
        a.base = yaml.safe_load(open(os.path.join(a.transcoders, "config.yaml")))["model_name"]
    tcs, kind = load_local_transcoders(a.transcoders, a.input_hook, a.output_hook)
    print(f"[tc] kind={kind} type={type(tcs).__name__} n_layers={tcs.n_layers} d_transcoder={tcs.d_transcoder} "
          f"in={tcs.feature_input_hook} out={tcs.feature_output_hook} skip={tcs.skip_connection} "
          f"act={type(tcs.activation_function).__name__ if kind != 'transcoder_set' else type(tcs[0].activation_function).__name__}")

    rc = 0
    if a.check:
        ok, _ = check_transcoders(tcs, kind, a.check, a.tol)
        rc = 0 if ok else 2

    tokenizer = os.path.join(a.transcoders, "tokenizer")
    fixed = prepare_base(a.base, os.path.join(os.path.abspath(a.out), "base_fixed"),
                         tokenizer if os.path.isdir(tokenizer) else None)
    t1 = time.time()
    model, hf_model, backend = load_base(fixed, tcs, a.backend)
    t2 = time.time()
    n_model_layers = model.cfg.n_layers
    if n_model_layers != tcs.n_layers:
        raise SystemExit(f"transcoders cover {tcs.n_layers} layers but model has {n_model_layers}")

    from circuit_tracer import attribute
    from circuit_tracer.utils.create_graph_files import create_graph_files

    if a.prompts:
        scored = [score_prompt(model, text, a) for text in texts]
        write_scores(a, kind, scored, backend)
        t3 = t4 = time.time()
    else:
        ids = tokenize_with_bos(model.tokenizer, a.prompt)
        print(f"[prompt] ids={ids.tolist()}")
        if hf_model is not None:
            print(f"[base] TransformerLens vs HF logits max|diff|={tl_vs_hf_logits(model, hf_model, ids):.3e}")
        graph = attribute(ids, model, max_n_logits=a.max_n_logits, batch_size=a.batch_size,
                          max_feature_nodes=a.max_feature_nodes, verbose=False)
        t3 = time.time()
        if a.scores:
            write_scores(a, kind, [graph_scores(graph, a.prompt, t3 - t2)], backend)
        graph.to_pt(os.path.join(a.out, f"{a.slug}.pt"))
        create_graph_files(graph, slug=a.slug, output_path=a.out, scan=graph.scan,
                           node_threshold=a.node_threshold, edge_threshold=a.edge_threshold)
        t4 = time.time()
        nodes = json.load(open(os.path.join(a.out, f"{a.slug}.json")))
        print(f"[graph] active_features={graph.active_features.shape[0]} selected={graph.selected_features.shape[0]} "
              f"adjacency={tuple(graph.adjacency_matrix.shape)} logits={graph.logit_token_ids.tolist() if hasattr(graph, 'logit_token_ids') else '?'} "
              f"json nodes={len(nodes['nodes'])} links={len(nodes['links'])}")
        print(f"[files] {sorted(os.listdir(a.out))}")
    print(f"[time] load_tc+check={t1 - t0:.1f}s load_base={t2 - t1:.1f}s attribute={t3 - t2:.1f}s "
          f"graph_files={t4 - t3:.1f}s total={t4 - t0:.1f}s backend={backend}")
    if rc:
        print(f"[check] FAILED (> {a.tol:g})")
    sys.exit(rc)


if __name__ == "__main__":
    main()
