"""`expertize inspect`'s statistics engine against brute force over the whole corpus, on tiny models with hand-set
weights: frequencies, per-corpus rates, mean / max activations, top contexts with their windows, direct vocabulary
effects and routing loads."""

import pytest
import torch

from expertize.conversion.inspection import InspectionSettings, collect_stats
from expertize.conversion.inspection.effects import final_norm
from expertize.conversion.surgery.splice import splice
from expertize.modeling import build_sparse_layer
from tests.conftest import D_MODEL, FAMILY_NAMES, VOCAB, tiny_base_model
from tests.families import ROWS
from tests.kinds import KINDS, tiny_spec

D = D_MODEL


def hand_set(spec, seed: int):
    """A sparse layer whose every weight is drawn from a seeded N(0, 0.5): non-zero decoders, spread-out codes."""
    layer = build_sparse_layer(spec)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return layer.eval()


def tiny_model(kind: str, family: str = "gpt2"):
    """A float64 tiny model with the kind at layer 1 and a transcoder at layer 0 (two layers inspected at once)."""
    layers = {0: hand_set(tiny_spec("transcoder"), 1), 1: hand_set(tiny_spec(kind, activation="gelu_new"), 2)}
    return splice(tiny_base_model(family), layers).double().eval()


def corpora(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "low": torch.randint(4, VOCAB // 2, (7, 16), generator=gen),  # (S, T): two corpora over different words
        "high": torch.randint(VOCAB // 2, VOCAB, (5, 16), generator=gen),
    }


def brute_force_codes(model, sequences: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per layer the dense (all tokens, U) matrix of listed activations (`activation_hook`: the code, or routed
    neurons' |g·h|), from one forward per sequence."""
    layers = model.sparse_layers()
    dense = {i: [] for i in layers}
    for seqs in sequences.values():
        for seq in seqs:
            codes = {}
            handles = [l.activation_hook.register_forward_hook(lambda m, a, o, i=i: codes.__setitem__(i, o))
                       for i, l in layers.items()]
            with torch.no_grad():
                model(input_ids=seq[None])
            for h in handles:
                h.remove()
            for i, code in codes.items():
                K = code.top_k_index.shape[-1]
                rows = torch.zeros(seq.numel(), layers[i].num_units, dtype=torch.float64)
                rows.scatter_add_(1, code.top_k_index.reshape(-1, K), code.top_k_weights.reshape(-1, K).double())
                dense[i].append(rows)
    return {i: torch.cat(rows) for i, rows in dense.items()}  # (S_total · T, U)


def is_peak(column: torch.Tensor, row: int, T: int, radius: int) -> bool:
    """Whether flat token `row` is the highest of `column` within `radius` tokens of its sequence on either side, ties
    going to the earlier token: one context per stretch of text."""
    s, p = divmod(row, T)
    for q in range(max(0, p - radius), min(T, p + radius + 1)):
        other = float(column[s * T + q])
        if q != p and (other > float(column[row]) or (other == float(column[row]) and q < p)):
            return False
    return True


def layer_inputs(model, layer, sequences) -> torch.Tensor:
    """(all tokens, I): what `layer` reads over the corpora, in the pass's token order."""
    inputs = []
    handle = layer.register_forward_pre_hook(lambda m, a: inputs.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        for seqs in sequences.values():
            model(input_ids=seqs)
    handle.remove()
    return torch.cat(inputs)


def run(model, sequences, **settings):
    settings = InspectionSettings(**{"top_n": 4, "left": 3, "right": 2, "batch_size": 3, **settings})
    return collect_stats(model, sequences, settings, token_text=lambda t: f"t{t}", model_name="tiny")


@pytest.mark.parametrize("kind", KINDS)
def test_statistics_equal_brute_force(kind):
    model = tiny_model(kind)
    sequences = corpora()
    stats = run(model, sequences)
    dense = brute_force_codes(model, sequences)
    all_ids = torch.cat(list(sequences.values()))  # (S, T)
    S, T = all_ids.shape
    domain_of_seq = torch.tensor([0] * 7 + [1] * 5)
    for layer, acts in dense.items():
        ls = stats.layers[layer]
        fired = acts > 0  # (S·T, U)
        per_domain = torch.stack([fired[(domain_of_seq == d).repeat_interleave(T)].sum(0) for d in (0, 1)])
        assert torch.equal(ls.fire_counts, per_domain)
        torch.testing.assert_close(stats.frequency(layer), fired.double().mean(0))
        torch.testing.assert_close(stats.domain_rates(layer), per_domain.double() / torch.tensor([[7 * T], [5 * T]]))
        mean = (acts * fired).sum(0) / fired.sum(0).clamp_min(1)
        torch.testing.assert_close(ls.mean_activation.double(), mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ls.max_activation.double(), (acts * fired).amax(0), rtol=1e-5, atol=1e-6)
        report = stats.to_json(layer)
        for unit in range(ls.num_units):
            column = acts[:, unit]
            rows = torch.tensor([r for r in fired[:, unit].nonzero().squeeze(-1).tolist()
                                 if is_peak(column, r, T, radius=3 + 2)], dtype=torch.long)
            order = torch.sort(column[rows], descending=True, stable=True).indices[:4]
            expected = rows[order]  # flat token rows of the top 4, earlier token first on ties
            got = report["units"][unit]["top_contexts"]
            assert [c["sequence"] * T + c["position"] for c in got] == expected.tolist(), (layer, unit)
            for c, row in zip(got, expected.tolist()):
                s, p = divmod(row, T)
                lo, hi = max(0, p - 3), min(T, p + 3)
                assert c["tokens"] == [f"t{t}" for t in all_ids[s, lo:hi].tolist()]
                assert c["peak"] == p - lo
                window = acts[s * T + lo : s * T + hi, unit].tolist()
                assert c["activations"] == pytest.approx(window, rel=1e-4, abs=1e-6)
                assert c["max"] == pytest.approx(float(column[row]), rel=1e-5)
                assert c["domain"] == ("low" if s < 7 else "high")
            if not rows.numel():
                assert report["units"][unit]["frequency"] == 0 and not got


def test_top_contexts_do_not_depend_on_the_batch_size():
    model = tiny_model("mxd")
    one = run(model, corpora(), batch_size=1)
    many = run(model, corpora(), batch_size=12)
    for layer in one.layers:
        a, b = one.layers[layer].contexts, many.layers[layer].contexts
        assert torch.equal(a.where, b.where)
        torch.testing.assert_close(a.acts, b.acts, rtol=1e-5, atol=1e-6)
        assert torch.equal(a.tokens, b.tokens)


def _vocab_logits(model, direction: torch.Tensor) -> torch.Tensor:
    """W_U · N(d) with N the linear part of a LayerNorm or plain RMSNorm final norm (centre for LayerNorm, scale by the
    weight), for the tests on one such family (GPT-2); every family's own norm: `_native_norm_logits`."""
    norm = final_norm(model)
    d = direction.double()
    if isinstance(norm, torch.nn.LayerNorm):
        d = d - d.mean()
    return model.get_output_embeddings().weight.double() @ (norm.weight.double() * d)  # (V,)


def _native_norm_logits(model, family: str, direction: torch.Tensor) -> torch.Tensor:
    """The oracle without any convention: W_U · (N(d) - N(0)) through the family's own final norm module. N(d) - N(0)
    is the norm's linear part applied to d, divided by the norm's per-token scale σ(d) > 0: the same ranking, and
    values that differ by the one factor σ(d)."""
    norm = model.get_submodule(ROWS[family].final_norm)
    d = direction.double()[None]
    with torch.no_grad():
        return model.get_output_embeddings().weight.double() @ (norm(d) - norm(torch.zeros_like(d)))[0].double()


@pytest.mark.parametrize("family", FAMILY_NAMES)  # LayerNorm, RMSNorm, and Gemma's RMSNorm that scales by 1 + w
def test_transcoder_direct_effect_is_its_decoder_row_through_norm_and_unembedding(family):
    model = tiny_model("transcoder", family)
    norm = model.get_submodule(ROWS[family].final_norm)
    with torch.no_grad():  # a final norm away from its init (ones; Gemma: zeros), so that its convention matters
        gen = torch.Generator().manual_seed(9)
        norm.weight.copy_(torch.randn(norm.weight.shape, generator=gen, dtype=torch.float64))
    stats = run(model, corpora(), vocab_top=5)
    layer = model.sparse_layers()[1]
    ids, values = stats.layers[1].promoted
    for unit in (0, 7, layer.num_units - 1):
        logits = _native_norm_logits(model, family, layer.W_dec[unit])
        assert ids[unit, 0].tolist() == logits.topk(5).indices.tolist()
        assert ids[unit, 1].tolist() == (-logits).topk(5).indices.tolist()
        ratio = values[unit, 0].double() / logits.topk(5).values  # σ(d), the same for every token
        torch.testing.assert_close(ratio, ratio[:1].expand(5), rtol=1e-4, atol=0)
        assert ratio[0] > 0


def test_mxd_direct_effect_averages_the_expert_contribution_over_its_firing_tokens():
    model = tiny_model("mxd")
    sequences = corpora()
    stats = run(model, sequences, vocab_top=3)
    layer = model.sparse_layers()[1]
    x = layer_inputs(model, layer, sequences)  # (all tokens, I)
    with torch.no_grad():
        code = layer.encode(x)
        dz = layer.hidden(x) @ layer.W_dec  # Dᵀz: (tokens, O)
    checked = 0
    for unit in range(layer.num_units):
        firing = (code.top_k_index == unit).logical_and(code.top_k_weights > 0).any(-1)
        if not firing.any():
            assert stats.to_json(1)["units"][unit]["promoted_tokens"] == []
            continue
        direction = layer.W_experts[unit] * dz[firing].mean(0)  # c_n ⊙ mean Dᵀz
        logits = _vocab_logits(model, direction)
        assert stats.layers[1].promoted[0][unit, 0].tolist() == logits.topk(3).indices.tolist()
        checked += 1
    assert checked > 10


def test_routing_load_and_entropy_of_moe_x():
    model = tiny_model("moe_x")
    sequences = corpora()
    stats = run(model, sequences)
    layer = model.sparse_layers()[1]
    logits = []
    with torch.no_grad():
        for seqs in sequences.values():
            x = []
            h = layer.register_forward_pre_hook(lambda m, a: x.append(a[0].reshape(-1, D)))
            model(input_ids=seqs)
            h.remove()
            logits.append(layer.router_scores(x[0]))
    scores = torch.cat(logits)  # (tokens, M)
    top = scores.topk(layer.spec.k, dim=-1).indices
    load = torch.bincount(top.reshape(-1), minlength=layer.spec.num_experts).double() / top.numel()
    p = scores.double().softmax(-1)
    routing = stats.layers[1].routing
    assert routing["experts"] == layer.spec.num_experts
    assert routing["load"] == pytest.approx(load.tolist())
    assert routing["router_entropy"] == pytest.approx(float(-(p * p.log()).sum(-1).mean()))
    assert stats.layers[0].routing is None  # transcoders have no router
    assert not layer.record_router_outputs and layer.router_logits is None  # the pass leaves the layer as it was
