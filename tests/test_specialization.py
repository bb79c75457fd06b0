"""`expertize specialize`: Monet's 2x assignment rule, ablation and its random control on a tiny model whose units'
domains are known by construction; probe selection and F1 against brute force; determinism; the document split;
CLI errors."""

import json

import pytest
import torch

from expertize.conversion.cli import main
from expertize.conversion.specialization import (
    SpecializationSettings, assign_units, binary_f1, content_mask, domain_masking, in_eval, mean_ce, probe_domains,
    random_live_units, select_units, specialize, specificity, split_documents,
)
from expertize.conversion.surgery.splice import save_model, splice
from expertize.modeling import TranscoderSpec, build_sparse_layer
from tests.conftest import D_MODEL, VOCAB, tiny_base_model, tiny_tokenizer

LOW, HIGH = range(4, VOCAB // 2), range(VOCAB // 2, VOCAB)


def domain_model():
    """A tiny GPT-2 (float64) whose layer-0 MLP is a transcoder with two hand-set latents: latent 0 fires exactly on
    "low" tokens and writes the LM-head direction of low tokens (so it helps predict low text), latent 1 the same for
    "high" tokens; latents 2-5 are dead. Layer 0's attention output and the position embeddings are zeroed, so the
    MLP input of a token depends on the token alone and the domains are exact. The LM head is untied and reads other
    directions (e2, e3) than the embeddings (e0, e1), so without the latents the next token is not predictable."""
    base = tiny_base_model("gpt2").double()
    gen = torch.Generator().manual_seed(0)
    e0, e1, e2, e3 = torch.eye(D_MODEL, dtype=torch.float64)[:4]
    base.config.tie_word_embeddings = False
    base.lm_head.weight = torch.nn.Parameter(torch.zeros(VOCAB, D_MODEL, dtype=torch.float64))
    with torch.no_grad():
        wte = base.transformer.wte.weight  # (V, d)
        wte.copy_(0.1 * torch.randn(wte.shape, generator=gen, dtype=torch.float64))
        wte[list(LOW)] += 3 * e0
        wte[list(HIGH)] += 3 * e1
        head = base.lm_head.weight  # (V, d)
        head.copy_(0.1 * torch.randn(head.shape, generator=gen, dtype=torch.float64))
        head[list(LOW)] += e2
        head[list(HIGH)] += e3
        base.transformer.wpe.weight.zero_()
        base.transformer.h[0].attn.c_proj.weight.zero_()
        base.transformer.h[0].attn.c_proj.bias.zero_()
    layer = build_sparse_layer(TranscoderSpec(d_in=D_MODEL, d_out=D_MODEL, num_latents=6, k=2)).double()
    with torch.no_grad():
        layer.W_enc.zero_(), layer.b_enc.fill_(-1.0), layer.b_dec.zero_(), layer.W_dec.zero_()
        layer.W_enc[0], layer.W_enc[1] = e0 - e1, e1 - e0
        layer.b_enc[:2] = 0.0
        layer.W_dec[0], layer.W_dec[1] = 5 * e2, 5 * e3
    return splice(base, {0: layer}).double().eval()


def domain_text(seed: int, n: int = 6, T: int = 16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"low": torch.randint(LOW.start, LOW.stop, (n, T), generator=gen),
            "high": torch.randint(HIGH.start, HIGH.stop, (n, T), generator=gen)}


def test_assignment_rule_is_monets_2x():
    rates = torch.tensor([[0.4, 0.4, 0.2, 0.0, 0.1, 0.30],
                          [0.2, 0.21, 0.0, 0.0, 0.1, 0.10],
                          [0.1, 0.0, 0.0, 0.0, 0.1, 0.15]])  # (D=3, U=6)
    # unit 0: 0.4 >= 2 x 0.2 -> domain 0; unit 1: 0.4 < 2 x 0.21 -> none; unit 2: 0.2 vs 0 -> domain 0;
    # unit 3: never fires -> none; unit 4: tie -> none; unit 5: 0.30 >= 2 x 0.15 -> domain 0
    assert [u.tolist() for u in assign_units(rates, 2.0)] == [[0, 2, 5], [], []]
    assert [u.tolist() for u in assign_units(rates, 1.5)] == [[0, 1, 2, 5], [], []]  # 0.4 >= 1.5 x 0.21
    assert [u.tolist() for u in assign_units(rates, 3.0)] == [[2], [], []]  # only the unit silent elsewhere
    assert [u.tolist() for u in assign_units(rates.flip(0), 2.0)] == [[], [], [0, 2, 5]]
    with pytest.raises(ValueError, match=">= 1"):
        assign_units(rates, 0.5)


def test_random_control_is_seeded_and_live():
    live = torch.tensor([True, False, True, True, False, True, True])
    a, b = random_live_units(live, 3, seed=5), random_live_units(live, 3, seed=5)
    assert a.tolist() == b.tolist() and len(set(a.tolist())) == 3 and live[a].all()
    assert random_live_units(live, 99, seed=1).tolist() == [0, 2, 3, 5, 6]
    assert specificity(0.2, 0.1) == pytest.approx(2.0) and specificity(0.1, 0.0) == float("inf")


def test_ablating_a_domain_unit_raises_ce_on_its_domain_only():
    model = domain_model()
    layer = model.sparse_layers()[0]
    held = domain_text(1)
    base = {n: mean_ce(model, s) for n, s in held.items()}
    for unit, own, other in ((0, "low", "high"), (1, "high", "low")):
        ablated = {n: mean_ce(model, s, layer=layer, ablate=[unit]) for n, s in held.items()}
        assert ablated[own] > base[own] + 0.05
        assert ablated[other] == pytest.approx(base[other], abs=1e-12)  # never fires there: ablation is a no-op
    assert not layer._ablated  # the intervention is undone

    rates = torch.tensor([[1.0, 0.0, 0, 0, 0, 0], [0.0, 1.0, 0, 0, 0, 0]], dtype=torch.float64)
    live = torch.tensor([True, True, False, False, False, False])
    rows = domain_masking(model, layer, rates, live, held, ratio=2.0, seed=0)
    assert [(r.domain, r.units) for r in rows] == [("low", 1), ("high", 1)]
    for r in rows:
        assert r.delta_target > 0.05 and r.delta_others == pytest.approx(0.0, abs=1e-12)
        assert r.specificity == float("inf")
        assert r.random_delta_target >= 0 or r.random_delta_others >= 0  # one of the two live units, seeded


def test_specialize_end_to_end_finds_the_domains_and_is_deterministic():
    model = domain_model()
    settings = SpecializationSettings(probe_ks=(1, 2), probe_top=4, steer_scale=2.0)
    fit, held = domain_text(2), domain_text(3)
    report = specialize(model, fit, held, special_ids=[1, 2], settings=settings)
    assert [r.units for r in report.masking] == [1, 1] and report.live_units == 2
    summary = report.summary()
    assert summary["specificity"] == float("inf") and summary["dead_fraction"] == pytest.approx(4 / 6)
    assert report.probing.best_1d == {"low": 1.0, "high": 1.0}  # latent 0 / 1 separate the domains exactly
    assert report.probing.selected["low"][0] == 0 and report.probing.selected["high"][0] == 1
    assert [r.unit for r in report.steering] == [0, 1]
    assert all(r.drop_target > r.drop_others for r in report.steering)  # steering toward the domain helps it more
    again = specialize(domain_model(), fit, held, special_ids=[1, 2], settings=settings)
    assert json.dumps(again.to_json(), sort_keys=True) == json.dumps(report.to_json(), sort_keys=True)
    assert "specificity" in report.format()


def test_probe_selection_and_f1_match_brute_force():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(40, 12, generator=gen, dtype=torch.float64)
    label = torch.arange(40) % 2
    x[label == 1, 7] += 0.8  # feature 7 separates the classes (up to noise)
    x[label == 1, 3] += 0.3
    pos = label == 1
    diffs = [float(sum(x[i, f] for i in range(40) if pos[i]) / int(pos.sum())
                   - sum(x[i, f] for i in range(40) if not pos[i]) / int((~pos).sum())) for f in range(12)]
    brute = sorted(range(12), key=lambda f: -diffs[f])
    assert select_units(x, pos, 12).tolist() == brute and brute[:2] == [7, 3]

    for predicted, truth in [([1, 1, 0, 0, 1], [1, 0, 0, 1, 1]), ([0, 0], [0, 0]), ([1, 0, 1], [1, 0, 1])]:
        p, t = torch.tensor(predicted), torch.tensor(truth)
        tp = sum(a and b for a, b in zip(predicted, truth))
        fp = sum(a and not b for a, b in zip(predicted, truth))
        fn = sum(b and not a for a, b in zip(predicted, truth))
        assert binary_f1(p, t) == pytest.approx(2 * tp / (2 * tp + fp + fn) if tp else 0.0)

    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import f1_score

    train, test = slice(0, 30), slice(30, 40)
    result = probe_domains(x[train], label[train], x[test], label[test], ["a", "b"], ks=(1, 2), top=3)
    for d, name in enumerate(["a", "b"]):
        ytr, yte = (label[train] == d).numpy(), (label[test] == d).numpy()
        order = select_units(x[train], label[train] == d, 3).tolist()
        assert result.selected[name] == order

        def f1(cols):
            xtr, xte = x[train][:, cols], x[test][:, cols]
            mean, std = xtr.mean(0), xtr.std(0)
            probe = LogisticRegression(C=1.0, class_weight="balanced", max_iter=1000, random_state=0)
            probe.fit(((xtr - mean) / std).numpy(), ytr)
            return f1_score(yte, probe.predict(((xte - mean) / std).numpy()), zero_division=0.0)

        assert result.best_1d[name] == pytest.approx(max(f1([u]) for u in order))
        assert result.k_sparse[2][name] == pytest.approx(f1(order[:2]))


def test_document_split_is_seeded_by_text_and_disjoint():
    docs = [f"document number {i}" for i in range(400)]
    fit, held = split_documents(docs, seed=3, eval_fraction=0.25)
    assert not set(fit) & set(held) and len(fit) + len(held) == 400 and 60 < len(held) < 140
    assert split_documents(list(reversed(docs)), 3, 0.25)[1] == list(reversed(held))  # by text, not by position
    assert split_documents(docs, 4, 0.25)[1] != held
    assert all(in_eval(d, 3, 0.25) for d in held)
    ids = torch.tensor([[1, 5, 6, 2, 7]])
    assert content_mask(ids, [1, 2]).tolist() == [[False, True, True, False, True]]


def test_cli_runs_end_to_end_and_writes_strict_json(tmp_path, capsys):
    model_dir = tmp_path / "model"
    save_model(domain_model().float(), model_dir, tiny_tokenizer())
    gen = torch.Generator().manual_seed(0)
    paths = []
    for name, words in (("low", range(0, 45)), ("high", range(45, 95))):  # word w_i is token id i + 4
        lines = [" ".join(f"w{words[int(i)]}" for i in torch.randint(0, len(words), (12,), generator=gen))
                 for _ in range(80)]
        paths.append(tmp_path / f"{name}.txt")
        paths[-1].write_text("\n".join(lines), encoding="utf-8")
    out = tmp_path / "spec.json"
    argv = ["specialize", str(model_dir), "--corpus", f"low={paths[0]}", "--corpus", f"high={paths[1]}",
            "--context-length", "16", "--tokens", "96", "--eval-tokens", "64", "--probe-k", "1,2", "--probe-top", "4",
            "--json", str(out)]
    assert main(argv) == 0
    assert "masking (Monet's rule)" in capsys.readouterr().out
    report = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert [r["units"] for r in report["masking"]] == [1, 1]
    assert report["summary"]["specificity"] is None  # +inf: the other domain's CE does not move at all
    assert report["probing"]["best_1d"] == {"low": 1.0, "high": 1.0}


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    model_dir = tmp_path / "model"
    save_model(domain_model().float(), model_dir, tiny_tokenizer())
    corpus = tmp_path / "a.txt"
    corpus.write_text("some text here\nmore text\n", encoding="utf-8")
    capsys.readouterr()  # saving's progress bar
    cases = [
        ([str(model_dir), "--corpus", f"a={corpus}"], "at least two domain corpora"),
        ([str(model_dir), "--corpus", f"a={corpus}", "--corpus", f"b={tmp_path / 'none.txt'}"], "no such file"),
        ([str(tmp_path), "--corpus", f"a={corpus}", "--corpus", f"b={corpus}"], "config.json"),
        ([str(model_dir), "--corpus", f"a={corpus}", "--corpus", f"b={corpus}", "--eval-fraction", "1.5"],
         "between 0 and 1"),
    ]
    for argv, message in cases:
        assert main(["specialize", *argv, "--context-length", "16"]) == 2  # the model has 64 positions
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
