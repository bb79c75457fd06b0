"""`expertize specialize`: Monet's 2x assignment rule, ablation and its random control on a tiny model whose units'
domains are known by construction; probe selection and F1 against brute force; determinism; the document split;
CLI errors."""

import json
import math

import pytest
import torch

from expertize.conversion.cli import main
from expertize.conversion.specialization import (
    Estimate, SpecializationSettings, SuffixRunner, assign_units, binary_f1, condition_ce, content_mask,
    document_weights, in_eval, masking_rows, mean_ce, pack_with_documents, plan_masking, probe_domains,
    random_live_units, select_units, significant, specialize, specificity, split_corpora, split_documents,
    weighted_f1,
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
    plan = plan_masking(rates, live, ratio=2.0, seed=0)
    runner, docs = SuffixRunner(model, 0), torch.arange(6)[:, None].expand(6, 16)
    ce = [condition_ce(runner, layer, s, docs, plan.conditions()) for s in held.values()]
    for c, n in zip(ce, held):  # the per-document sums add up to the full forward's mean CE
        assert float(c.base.sum() / c.tokens.sum()) == pytest.approx(base[n], rel=1e-12)
    rows = masking_rows(list(held), plan, ce, [document_weights(c.documents, 200, 0) for c in ce])
    assert [(r.domain, r.units) for r in rows] == [("low", 1), ("high", 1)]
    for r in rows:
        assert r.delta_target.value > 0.05 and r.delta_target.low > 0.05
        assert r.delta_others.value == pytest.approx(0.0, abs=1e-12)
        assert r.specificity.value == float("inf")
        # the control is one of the two live units, seeded: here the domain's own unit, so the figure is n.s.
        assert r.random_specificity.value == float("inf") and not r.significant


def test_specialize_end_to_end_finds_the_domains_and_is_deterministic():
    model = domain_model()
    settings = SpecializationSettings(probe_ks=(1, 2), probe_top=4, steer_scale=2.0)
    fit, held = domain_text(2), domain_text(3)
    report = specialize(model, fit, held, special_ids=[1, 2], settings=settings)
    assert [r.units for r in report.masking] == [1, 1] and report.live_units == 2
    summary = report.summary()
    assert summary["specificity"] == float("inf") and summary["dead_fraction"] == pytest.approx(4 / 6)
    assert {d: report.probing.value("best_1d", d) for d in fit} == {"low": 1.0, "high": 1.0}  # exact separation
    assert report.probing.selected["low"][0] == 0 and report.probing.selected["high"][0] == 1
    assert [r.unit for r in report.steering] == [0, 1]
    assert all(r.drop_target.value > r.drop_others.value for r in report.steering)  # toward the domain helps it more
    assert report.documents == {"low": 6, "high": 6}  # without document ids every context is its own document
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

        assert result.value("best_1d", name) == pytest.approx(max(f1([u]) for u in order))
        assert result.value("k2", name) == pytest.approx(f1(order[:2]))

    # Bootstrap replicates weight each test context by its draw count: F1 with sample weights, replicate by replicate.
    weights = document_weights(10, 50, seed=3)  # every test context its own document
    candidates = torch.zeros(12, dtype=torch.bool)
    candidates[[0, 1, 2]] = True  # the random control draws from these only
    result = probe_domains(x[train], label[train], x[test], label[test], ["a", "b"], ks=(1, 2), top=3,
                           test_weights=weights, candidates=candidates)
    yte = (label[test] == 1).numpy()
    xtr, xte = x[train][:, order[:2]], x[test][:, order[:2]]
    mean, std = xtr.mean(0), xtr.std(0)
    probe = LogisticRegression(C=1.0, class_weight="balanced", max_iter=1000, random_state=0)
    predicted = probe.fit(((xtr - mean) / std).numpy(), (label[train] == 1).numpy()).predict(((xte - mean) / std).numpy())
    for r in (0, 1, 17, 50):
        want = f1_score(yte, predicted, sample_weight=weights[r].numpy(), zero_division=0.0)
        assert float(result.f1["k2"]["b"][r]) == pytest.approx(want)
    assert result.estimate("k2", "b").low <= result.value("k2", "b") <= result.estimate("k2", "b").high
    for name in ("a", "b"):  # the control's units are drawn among the candidates
        assert sorted(result.random_selected[name]) == [0, 1, 2]


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
    assert {d: v["value"] for d, v in report["probing"]["f1"]["best_1d"].items()} == {"low": 1.0, "high": 1.0}
    assert report["masking"][0]["delta_target"]["ci"][0] > 0 and report["documents"]["low"] == 5  # 13-token documents
    # At most 6 words (+ EOS) per document: 60 eval tokens span 9 documents; 50 replicates; and full forwards give
    # exactly the suffix's numbers.
    for extra in ([], ["--full-forward"]):
        assert main(argv + ["--document-tokens", "6", "--bootstrap", "50", *extra]) == 0
        again = json.loads(out.read_text())
        assert again["documents"] == {"low": 9, "high": 9}
        assert again["masking"][0]["delta_target"]["replicates"] == 50
        if extra:
            assert again["masking"] == first["masking"] and again["steering"] == first["steering"]
        first = again


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    model_dir = tmp_path / "model"
    save_model(domain_model().float(), model_dir, tiny_tokenizer())
    corpus = tmp_path / "a.txt"
    corpus.write_text("some text here\nmore text\n", encoding="utf-8")
    capsys.readouterr()  # saving's progress bar
    cases = [
        ([str(model_dir), "--corpus", f"a={corpus}"], "at least two domain corpora"),
        ([str(model_dir), "--corpus", f"a={corpus}", "--corpus", f"b={tmp_path / 'none.txt'}"], "no such file"),
        ([str(model_dir), "--corpus", f"a={corpus}", "--corpus", f"b={tmp_path}"],
         f"--corpus b: {str(tmp_path)!r} is a directory, not a file (it holds a.txt"),
        ([str(tmp_path), "--corpus", f"a={corpus}", "--corpus", f"b={corpus}"], "config.json"),
        ([str(model_dir), "--corpus", f"a={corpus}", "--corpus", f"b={corpus}", "--eval-fraction", "1.5"],
         "between 0 and 1"),
    ]
    for argv, message in cases:
        assert main(["specialize", *argv, "--context-length", "16"]) == 2  # the model has 64 positions
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


def test_packing_keeps_each_tokens_document():
    from expertize.conversion.data.text import pack_sequences
    from expertize.conversion.recipe.data import DataConfig

    tok = tiny_tokenizer()
    gen = torch.Generator().manual_seed(4)
    docs = [" ".join(f"w{int(w)}" for w in torch.randint(0, 90, (int(n),), generator=gen))
            for n in torch.randint(3, 30, (40,), generator=gen)]
    ids, owner = pack_with_documents("d", docs, tok, tokens=200, context_length=16)
    cfg = DataConfig(source="hub", name="in-memory", paths=[], context_length=16)
    assert torch.equal(ids, torch.stack(list(pack_sequences(iter(docs), tok, cfg, "eval"))[: ids.shape[0]]))
    assert ids.shape == owner.shape == (13, 16) and (owner[:, 0] == -1).all() and (ids[:, 0] == 1).all()  # BOS
    flat_ids, flat_owner = ids[:, 1:].reshape(-1), owner[:, 1:].reshape(-1)
    for d in range(int(flat_owner.max())):  # every document wholly seen: its words, then EOS
        want = tok(docs[d], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert flat_ids[flat_owner == d].tolist() == want
    # At most 4 tokens (and the EOS) per document: the same budget spreads over more documents.
    capped_ids, capped = pack_with_documents("d", docs, tok, tokens=200, context_length=16, document_tokens=4)
    assert int(capped.max()) > 2 * int(owner.max())
    assert all(int((capped == d).sum()) <= 5 for d in range(int(capped.max())))
    with pytest.raises(Exception, match="at least 1"):
        pack_with_documents("d", docs, tok, tokens=200, context_length=16, document_tokens=0)


def test_intervals_resample_documents_and_flag_what_the_control_explains():
    from expertize.conversion.specialization.bootstrap import mean_change

    w = document_weights(7, 400, seed=1)
    assert w.shape == (401, 7) and (w[0] == 1).all() and (w.sum(1) == 7).all()
    assert torch.equal(w, document_weights(7, 400, seed=1)) and not torch.equal(w, document_weights(7, 400, seed=2))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 20, (7,), generator=gen).double()  # predicted tokens per document
    base, ablated = torch.rand(7, generator=gen, dtype=torch.float64) * tokens, torch.rand(7, generator=gen) * tokens
    change = mean_change(ablated.double(), base, tokens, w)  # (401,)
    for r in (0, 5, 399):  # brute force: the drawn documents, each as often as drawn, pooled over their tokens
        drawn = [d for d in range(7) for _ in range(int(w[r, d]))]
        want = sum(float(ablated[d] - base[d]) for d in drawn) / sum(float(tokens[d]) for d in drawn)
        assert float(change[r]) == pytest.approx(want)
    e = Estimate.of(change)
    ordered = change[1:].sort().values
    assert (e.value, e.low, e.high) == (float(change[0]), float(ordered[10]), float(ordered[389]))
    assert e.low <= e.value <= e.high
    assert significant(Estimate(0.5, 0.4, 0.6, 100), Estimate(0.1, 0.0, 0.2, 100))
    assert not significant(Estimate(0.5, 0.05, 0.9, 100), Estimate(0.1, 0.0, 0.2, 100))  # "n.s."
    assert weighted_f1(torch.tensor([[1, 1, 0, 0, 1]]).bool(), torch.tensor([1, 0, 0, 1, 1]).bool(),
                       torch.ones(1, 5, dtype=torch.float64)).item() == pytest.approx(
        binary_f1(torch.tensor([1, 1, 0, 0, 1]), torch.tensor([1, 0, 0, 1, 1])))


def test_report_prints_intervals_and_not_significant():
    model = domain_model()
    settings = SpecializationSettings(probe_ks=(1,), probe_top=2, bootstrap=200)
    report = specialize(model, domain_text(2), domain_text(3), special_ids=[1, 2], settings=settings)
    text = report.format()
    assert "[95% interval" in text and "n.s." in text  # the masking control is the domain's own unit (2 live units)
    assert "fewer than 10 eval documents" in text  # 6 contexts per domain, each its own document
    row = report.summary()
    assert row["mask_delta_target_ci"][0] <= row["mask_delta_target"] <= row["mask_delta_target_ci"][1]
    assert row["specificity_significant"] is False and row["steering_effect_significant"] in (True, False)
    same = domain_text(2)["low"]  # two "domains" of the same text: no unit is assigned, masking is undefined
    report = specialize(model, {"a": same, "b": same}, {"a": same, "b": same}, [1, 2], settings=settings)
    assert report.masking == [] and math.isnan(report.summary()["specificity"])
    assert "masking (Monet's rule)" in report.format() and report.to_json()["summary"]["specificity"] is None


def test_a_specificity_without_a_value_says_why():
    """The quickstart's headline was `specificity n/a [-321.97, n/a] n.s. (random inf)`: a ratio over ΔCE(others) <= 0
    has no value; the summary now says so with the two ΔCEs it would divide."""
    from expertize.conversion.specialization.report import _specificity_summary

    e = lambda value, low=math.nan, high=math.nan: Estimate(value, low, high, 1000)  # noqa: E731
    figures = {"specificity": e(math.nan, -321.97), "random_specificity": e(math.inf, 0.3, math.inf),
               "mask_delta_target": e(-0.0002), "mask_delta_others": e(-0.0001),
               "random_mask_delta_target": e(0.0003), "random_mask_delta_others": e(-0.0001)}
    assert _specificity_summary(figures) == (
        "specificity undefined (ΔCE target -0.0002, others -0.0001: masking made no text worse) (random unbounded "
        "(ΔCE target +0.0003, others -0.0001: only the domains' own text got worse))")
    figures.update(specificity=e(4.0, 3.0, 5.0), random_specificity=e(1.1, 0.5, 1.5))
    assert _specificity_summary(figures) == "specificity 4.00 [3.00, 5.00] (random 1.10)"
    figures.update(random_specificity=e(3.5, 0.5, 6.0))
    assert _specificity_summary(figures) == "specificity 4.00 [3.00, 5.00] n.s. (random 3.50)"


def test_explicit_held_out_files(tmp_path, capsys):
    tok = tiny_tokenizer()
    low = [" ".join(f"w{(7 * i + j) % 45}" for j in range(10)) for i in range(30)]
    high = [" ".join(f"w{45 + (5 * i + j) % 45}" for j in range(10)) for i in range(30)]
    paths = {}
    for name, docs in (("low", low), ("high", high), ("low_eval", low[:5] + ["w1 w2 w3 w4 w5 w6 w7 w8"] * 3)):
        paths[name] = tmp_path / f"{name}.txt"
        paths[name].write_text("\n".join(docs), encoding="utf-8")
    corpora = {"low": str(paths["low"]), "high": str(paths["high"])}
    fit, held, documents = split_corpora(corpora, tok, 600, 600, 16, eval_corpora={"low": str(paths["low_eval"])})
    # low: the eval file is all eval, its corpus all fit minus the 5 documents that also appear in the eval file
    assert int(documents["low"].max()) + 1 == 8 and held["low"].shape[0] == (5 * 11 + 3 * 9) // 15
    assert fit["low"].shape[0] == (25 * 11) // 15
    hash_fit, hash_held, _ = split_corpora(corpora, tok, 600, 600, 16)  # high: the hash split, as without the file
    assert torch.equal(held["high"], hash_held["high"]) and torch.equal(fit["high"], hash_fit["high"])
    with pytest.raises(Exception, match="not among the --corpus domains"):
        split_corpora(corpora, tok, 600, 600, 16, eval_corpora={"mid": str(paths["low_eval"])})

    model_dir = tmp_path / "model"
    save_model(domain_model().float(), model_dir, tok)
    capsys.readouterr()
    argv = ["specialize", str(model_dir), "--corpus", f"low={paths['low']}", "--corpus", f"high={paths['high']}",
            "--eval-corpus", f"low={paths['low_eval']}", "--context-length", "16", "--tokens", "96",
            "--eval-tokens", "80", "--probe-k", "1", "--probe-top", "2", "--no-progress"]
    assert main(argv) == 0
    assert "eval documents low 8, high" in capsys.readouterr().out
    assert main(argv + ["--eval-corpus", f"mid={paths['low_eval']}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--eval-corpus names 'mid'" in err
