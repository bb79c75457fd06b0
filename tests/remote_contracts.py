"""Run in a fresh interpreter that cannot import expertize (tests/test_native_contracts.py): saved folders loaded
through remote code, checked against the contracts transformers and its clients rely on, with the native classes
of the same family as the reference. Prints one JSON line: {check: result} per folder.

argv[1]: a JSON file {"families": {family: {"folder": DIR, "base": DIR, "native": the native causal-LM class name,
"lora": [LoRA target modules]}}, "kinds": {kind: DIR}} (tests/test_native_contracts.py writes it from the family
table, tests/families.py).
"""

import inspect
import json
import sys
import tempfile

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

PAD = 3


def load(folder, **kwargs):
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs)
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    return model.eval()


def prompts(vocab):
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(4, vocab, (n,), generator=gen) for n in (2, 6, 3, 5)]


def left_pad(rows):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


def greedy(model, ids, mask, n=5):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=PAD)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def signature(native_class, model):
    ours = list(inspect.signature(model.forward).parameters)
    native = [p for p in inspect.signature(native_class.forward).parameters if p != "self"]
    assert [p for p in ours if p != "output_router_logits"] == native, (ours, native)
    assert "output_router_logits" in ours
    return "native + output_router_logits"


def hidden_states(family, model, base_dir):
    """Returned in a process that never built the base class first; equal to the native model's before layer 1."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager").eval()
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    ids = prompts(model.config.vocab_size)[1][None]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, output_attentions=True)
        ref = base(ids, output_hidden_states=True, output_attentions=True)
    n = model.config.num_hidden_layers
    assert out.hidden_states is not None and len(out.hidden_states) == n + 1, out.hidden_states
    assert out.attentions is not None and len(out.attentions) == n, out.attentions
    for i in (0, 1):  # the embeddings and decoder layer 0's output: layer 0 is native in both models
        torch.testing.assert_close(out.hidden_states[i], ref.hidden_states[i])
    for i in range(n):  # attention weights depend only on what enters each layer's attention
        if i <= 1:
            torch.testing.assert_close(out.attentions[i], ref.attentions[i])
    gen = model.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True,
                         output_hidden_states=True, output_attentions=True, pad_token_id=PAD)
    assert gen.hidden_states is not None and gen.attentions is not None
    model.set_attn_implementation(previous)
    return "returned, equal to native"


def batched_generation(family, model):
    rows = prompts(model.config.vocab_size)
    ids, mask = left_pad(rows)
    batched = greedy(model, ids, mask)[:, ids.shape[1]:]
    alone = [greedy(model, r[None], torch.ones_like(r[None]))[0, len(r):] for r in rows]
    # A prompt alone stops at EOS; in the batch its row goes on as padding until every row is done (random weights
    # may say EOS early: the tiny Phi-3's do for one prompt).
    width = batched.shape[1]
    same = sum(batched[i].tolist() == a.tolist() + [PAD] * (width - len(a)) for i, a in enumerate(alone))
    assert same == len(rows), f"{same} of {len(rows)} prompts agree"
    return f"{same}/{len(rows)} agree"


def trainer_step(family, folder):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = load(folder)
    vocab = model.config.vocab_size
    rows = [torch.randint(4, vocab, (8,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
    data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * 8] * 4, "labels": rows, "text": ["x"] * 4})
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(out, max_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True,
                                 save_strategy="no")  # remove_unused_columns=True: the default
        before = [p.detach().clone() for p in model.parameters()]
        result = Trainer(model=model, args=args, train_dataset=data).train()
    moved = sum(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert moved > 0 and result.training_loss == result.training_loss, (moved, result)
    return f"1 step, loss {result.training_loss:.3f}"


def inference_mode(model):
    ids = prompts(model.config.vocab_size)[1][None]
    reference = logits(model, ids)
    with torch.inference_mode():
        out = model(ids).logits.float()
        gen = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    torch.testing.assert_close(out, reference)
    return gen.shape[1] == ids.shape[1] + 3


def support_matrix(native_class, lora_targets, folder, model):
    """The support matrix of docs/native.md, cell by cell, on a folder loaded through remote code."""
    cells = {}
    ids = prompts(model.config.vocab_size)[3][None]
    reference = logits(model, ids)

    bf16 = load(folder, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    torch.testing.assert_close(logits(bf16, ids), reference, rtol=0.1, atol=0.1)
    cells["dtype=bfloat16"] = "ok"

    for name, kwargs in {"device_map=auto": {"device_map": "auto"}, "low_cpu_mem_usage": {"low_cpu_mem_usage": True},
                         "attn_implementation=eager": {"attn_implementation": "eager"},
                         "attn_implementation=sdpa": {"attn_implementation": "sdpa"}}.items():
        if kwargs.get("attn_implementation") == "sdpa" and not native_class._supports_sdpa:
            try:  # Gemma 2's soft-capped attention: refused as the native class refuses it
                load(folder, **kwargs)
            except ValueError as err:
                assert "scaled_dot_product_attention" in str(err), err
                cells[name] = "refused, as by the native class"
                continue
            raise AssertionError("sdpa loaded although the native class does not support it")
        torch.testing.assert_close(logits(load(folder, **kwargs), ids), reference, rtol=1e-5, atol=1e-5)
        cells[name] = "ok"

    with tempfile.TemporaryDirectory() as shards:
        model.save_pretrained(shards, max_shard_size="20KB")
        n = len([f for f in __import__("os").listdir(shards) if f.endswith(".safetensors")])
        assert n > 1, n
        torch.testing.assert_close(logits(load(shards), ids), reference)
        cells["sharded save (max_shard_size) + reload"] = f"{n} shards"

    grads = []
    for checkpointing in (False, True):
        m = load(folder)
        m.train()
        if checkpointing:
            m.gradient_checkpointing_enable()
            assert m.is_gradient_checkpointing
        torch.manual_seed(0)
        m(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)
    cells["gradient checkpointing"] = "same gradients"

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    pipe = transformers.pipeline("text-generation", model=folder, tokenizer=tokenizer, trust_remote_code=True)
    text = "w1 w2 w3"
    out = pipe(text, max_new_tokens=4, do_sample=False, return_full_text=False)[0]["generated_text"]
    enc = tokenizer(text, return_tensors="pt")
    direct = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    assert out == tokenizer.decode(direct[0, enc["input_ids"].shape[1]:], skip_special_tokens=True), out
    cells['pipeline("text-generation")'] = "same text as generate"

    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(load(folder), LoraConfig(r=2, target_modules=lora_targets, init_lora_weights=False))
    peft_model(ids, labels=ids).loss.backward()
    merged = peft_model.merge_and_unload()
    torch.testing.assert_close(logits(merged, ids), logits(peft_model, ids), rtol=1e-4, atol=1e-4)
    assert type(merged).__module__.startswith("transformers_modules")
    cells["PEFT LoRA (train, merge)"] = "ok"

    resized = load(folder)
    resized.resize_token_embeddings(model.config.vocab_size + 8)
    assert resized(ids).logits.shape[-1] == model.config.vocab_size + 8
    cells["resize_token_embeddings"] = "ok"
    return cells


def check(fn, *args):
    """fn's result, or "FAIL: ..." (every check runs, so one report shows all that fail)."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - reported, and the test fails on it
        return f"FAIL: {type(err).__name__}: {str(err)[:300]}"


def main() -> None:
    plan = json.load(open(sys.argv[1]))
    report = {}
    for family, dirs in plan["families"].items():
        model = load(dirs["folder"])  # the causal LM first: the case that used to lose hidden states
        native_class = getattr(transformers, dirs["native"])
        report[family] = {
            "signature": check(signature, native_class, model),
            "hidden_states": check(hidden_states, family, model, dirs["base"]),
            "batched_generation": check(batched_generation, family, model),
            "trainer": check(trainer_step, family, dirs["folder"]),
            "support": check(support_matrix, native_class, dirs["lora"], dirs["folder"], model),
        }
    report["inference_mode"] = {kind: check(inference_mode, load(folder)) for kind, folder in plan["kinds"].items()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
