"""AuxK (conversion/training/auxk.py and each kind's `auxk_reconstruction`).

What is asserted, per kind that has AuxK (tests/kinds.py's AUXK_KINDS, read from the layer classes: transcoder,
skip transcoder, MxD, routed neurons; each in the configurations below), in float64:
- the loss equals a hand computation (explicit loops over tokens and units) on a tiny case with a known dead mask,
  with more and with fewer dead units than k_aux, and the gradients equal those of that hand computation;
- the gradients reach only the dead units' own rows (the paper's behaviour: only dead latents' encoder / decoder
  rows). Shared parameters (MxD's dense path, the skip path, output biases, routed neurons' router projection and
  shared neurons) get none: their grads stay None or exactly 0;
- no dead unit: loss exactly 0 and every gradient 0; a token with zero error adds 0 (no NaN).
The tracker marks exactly the units that did not fire (non-zero weight) within the window, and resumes exactly.
That the other kinds refuse AuxK with the fix is tests/test_kind_contract.py's battery.
"""

import math

import pytest
import torch
from torch.nn import functional as F

from expertize.conversion.training.auxk import (
    DeadUnitTracker,
    auto_k_aux,
    auxk_loss,
    dead_window_tokens,
    fired_units,
    supports_auxk,
)
from expertize.modeling import build_sparse_layer
from tests.kinds import AUXK_KINDS, randomized

I, O, H, N, K, T = 6, 5, 7, 11, 3, 9
DEAD = torch.tensor([1, 0, 0, 1, 0, 1, 0, 0, 1, 0, 0], dtype=torch.bool)  # 4 of N = 11 dead

SPECS = {
    "transcoder": dict(kind="transcoder", num_latents=N, k=K),
    "skip_transcoder": dict(kind="skip_transcoder", num_latents=N, k=K),
    "mxd_mlp": dict(kind="mxd", d_hidden=H, num_experts=N, k=K, encoder="mlp", activation="relu"),
    "mxd_glu": dict(kind="mxd", d_hidden=H, num_experts=N, k=K, encoder="glu", activation="silu"),
    "routed_low_rank": dict(kind="routed_neurons", num_experts=N, k=K, num_shared=2, router_rank=4),
    "routed_full_rank": dict(kind="routed_neurons", num_experts=N, k=K, num_shared=0, router_rank=0),
}

# Parameters whose row n belongs to unit n (dim 0); every other parameter is shared and must get no AuxK gradient.
UNIT_ROWS = {
    "transcoder": {"W_enc", "b_enc", "W_dec"},
    "mxd": {"W_gate", "b_gate", "W_experts"},
    "routed_neurons": {"W_gate", "b_gate", "W_enc", "b_enc", "W_dec"},
}


def test_every_kind_with_auxk_has_a_hand_computation():
    """A kind whose layer declares AuxK is checked here: it needs a configuration above and a hand computation."""
    assert {spec["kind"] for spec in SPECS.values()} == set(AUXK_KINDS)
    assert {_family(_layer(name)) for name in SPECS} == set(UNIT_ROWS)


def _layer(name: str, seed: int = 0):
    """float64, random everywhere (the init zeroes D, W_dec)."""
    return randomized(build_sparse_layer({"d_in": I, "d_out": O, **SPECS[name]}), seed).train()


def _predicted(name: str):
    """(layer, x, y, the layer's prediction ŷ of y, computed without gradients)."""
    layer = _layer(name)
    x, y = _data()
    with torch.no_grad():
        return layer, x, y, layer(x)


def _data(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, I, generator=gen, dtype=torch.float64), torch.randn(T, O, generator=gen, dtype=torch.float64)


def _family(layer) -> str:
    return {"skip_transcoder": "transcoder"}.get(layer.spec.kind, layer.spec.kind)


# -- hand computations: loops over tokens and units, dense math -------------------------------------------------------


def _dead_by_score(scores: torch.Tensor, dead: torch.Tensor, k_aux: int) -> list[int]:
    """The k_aux dead units with the highest scores (all of them when fewer are dead)."""
    ids = sorted((n for n in range(len(scores)) if dead[n]), key=lambda n: -float(scores[n]))
    return ids[:k_aux]


def _hand_e_hat(layer, x: torch.Tensor, dead: torch.Tensor, k_aux: int) -> torch.Tensor:
    family, rows = _family(layer), []
    for t in range(x.shape[0]):
        xt, out = x[t], torch.zeros(O, dtype=x.dtype)
        if family == "transcoder":
            pre = torch.stack([layer.W_enc[n] @ xt + layer.b_enc[n] for n in range(N)])
            for n in _dead_by_score(pre.detach(), dead, k_aux):
                out = out + torch.relu(pre[n]) * layer.W_dec[n]
        elif family == "mxd":
            pre = torch.stack([layer.W_gate[n] @ xt + layer.b_gate[n] for n in range(N)])
            mix = torch.zeros(O, dtype=x.dtype)
            for n in _dead_by_score(pre.detach(), dead, k_aux):
                mix = mix + torch.relu(pre[n]) * layer.W_experts[n]
            with torch.no_grad():  # Dᵀz is detached (the dense path is not AuxK's)
                z = layer.act(layer.W_enc @ xt + layer.b_enc)
                if layer.W_glu is not None:
                    z = z * (layer.W_glu @ xt + layer.b_glu)
                modulation = torch.stack([sum(z[h] * layer.W_dec[h, o] for h in range(H)) for o in range(O)])
            out = mix * modulation
        else:  # routed neurons: gate = softmax over the K selected (detached) and the k_aux dead scores
            with torch.no_grad():
                xr = layer.W_gate_proj @ xt if layer.W_gate_proj is not None else xt
            score = torch.stack([layer.W_gate[n] @ xr + layer.b_gate[n] for n in range(N)])
            live = sorted(score.detach().tolist(), reverse=True)[:K]
            chosen = _dead_by_score(score.detach(), dead, k_aux)
            denominator = sum(math.exp(s) for s in live) + sum(torch.exp(score[n]) for n in chosen)
            for n in chosen:
                gate = torch.exp(score[n]) / denominator
                h = F.gelu(layer.W_enc[n] @ xt + layer.b_enc[n])
                out = out + gate * h * layer.W_dec[n]
        rows.append(out)
    return torch.stack(rows)


def _hand_loss(layer, x, y, dead, k_aux) -> torch.Tensor:
    with torch.no_grad():
        e = y - layer(x)
    e_hat = _hand_e_hat(layer, x, dead, k_aux)
    terms = [((e[t] - e_hat[t]) ** 2).sum() / (e[t] ** 2).sum() for t in range(x.shape[0])]
    return sum(terms) / len(terms)


def _grads(layer, loss_fn):
    layer.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in layer.named_parameters()}


# -- the loss --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k_aux", [2, 6])  # fewer and more than the 4 dead units
@pytest.mark.parametrize("name", list(SPECS))
def test_auxk_loss_and_gradients_equal_hand_computation(name, k_aux):
    layer = _layer(name)
    x, y = _data()
    assert supports_auxk(layer)

    def ours():
        with torch.no_grad():
            y_hat = layer(x)
        return auxk_loss(layer, x, y, y_hat, DEAD, k_aux)

    loss, grads = _grads(layer, ours)
    hand, hand_grads = _grads(layer, lambda: _hand_loss(layer, x, y, DEAD, k_aux))
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, hand, rtol=1e-10, atol=1e-12)
    assert 0 < float(loss) < 10
    for pname, grad in hand_grads.items():
        if grad is None:
            assert grads[pname] is None or not grads[pname].any(), pname
        else:
            torch.testing.assert_close(grads[pname], grad, rtol=1e-9, atol=1e-12, msg=f"grad of {pname}")


@pytest.mark.parametrize("name", list(SPECS))
def test_gradients_reach_only_dead_units(name):
    layer, x, y, y_hat = _predicted(name)
    layer.zero_grad(set_to_none=True)
    auxk_loss(layer, x, y, y_hat, DEAD, k_aux=2).backward()
    unit_rows = UNIT_ROWS[_family(layer)]
    for pname, p in layer.named_parameters():
        if pname in unit_rows:
            assert p.grad is not None and p.grad[DEAD].abs().sum() > 0, f"{pname}: dead rows got no gradient"
            assert not p.grad[~DEAD].any(), f"{pname}: a live unit's row got an AuxK gradient"
        else:
            assert p.grad is None or not p.grad.any(), f"shared parameter {pname} got an AuxK gradient"


@pytest.mark.parametrize("name", list(SPECS))
def test_no_dead_unit_gives_zero_loss_and_no_gradient(name):
    layer, x, y, y_hat = _predicted(name)
    loss, grads = _grads(layer, lambda: auxk_loss(layer, x, y, y_hat, torch.zeros(N, dtype=torch.bool), k_aux=4))
    assert float(loss) == 0.0
    assert all(g is None or not g.any() for g in grads.values())


@pytest.mark.parametrize("name", ["transcoder", "mxd_mlp", "routed_low_rank"])
def test_zero_error_tokens_are_nan_free(name):
    layer, x, y, y_hat = _predicted(name)
    y = y.clone()
    y[0] = y_hat[0]  # token 0 reconstructed exactly: ||e_0|| = 0 adds 0, not NaN
    loss, grads = _grads(layer, lambda: auxk_loss(layer, x, y, y_hat, DEAD, k_aux=2))
    hand_rest = _hand_loss(layer, x[1:], y[1:], DEAD, 2).detach() * (T - 1) / T
    torch.testing.assert_close(loss, hand_rest, rtol=1e-10, atol=1e-12)
    assert all(g is None or torch.isfinite(g).all() for g in grads.values())
    # Every error exactly 0: loss 0.
    assert float(auxk_loss(layer, x, y_hat, y_hat, DEAD, k_aux=2).detach()) == 0.0


def test_token_mask_excludes_tokens_and_leading_dims_work():
    layer, x, y, y_hat = _predicted("mxd_mlp")
    keep = torch.ones(T, dtype=torch.bool)
    keep[0] = False
    spiked = y.clone()
    spiked[0] += 1e6  # an outlier on an excluded position changes nothing
    masked = auxk_loss(layer, x, spiked, y_hat, DEAD, 2, token_mask=keep)
    torch.testing.assert_close(masked, auxk_loss(layer, x[1:], y[1:], y_hat[1:], DEAD, 2))
    # (B, S, I) inputs: the same loss as flattened tokens.
    batched = auxk_loss(layer, x.view(3, 3, I), y.view(3, 3, O), y_hat.view(3, 3, O), DEAD, 2)
    torch.testing.assert_close(batched, auxk_loss(layer, x, y, y_hat, DEAD, 2))


# -- the tracker -----------------------------------------------------------------------------------------------------


def _code(fired_per_token: list[list[int]], zero: list[int] = ()):
    """(T, K) code in which each token lists its units; units in `zero` are selected with weight 0 (not fired)."""
    index = torch.tensor(fired_per_token)
    weights = torch.ones(index.shape, dtype=torch.float32)
    weights[torch.isin(index, torch.tensor(list(zero), dtype=torch.long))] = 0.0
    return index, weights


def test_tracker_marks_exactly_the_units_silent_for_a_window():
    tracker = DeadUnitTracker(num_units=6, window_tokens=4)
    # Each step has 2 tokens; the window is 2 steps.
    steps = [
        _code([[0, 1], [0, 2]]),  # tokens 0-2: 0, 1, 2 fire
        _code([[3, 0], [3, 5]], zero=[5]),  # tokens 2-4: 3 and 0 fire; 5 selected with weight 0
        _code([[1, 3], [1, 3]]),  # tokens 4-6: 1, 3 fire
        _code([[4, 3], [4, 3]]),  # tokens 6-8: 3, 4 fire
    ]
    # A unit is dead when tokens_seen - (token count at the end of the step it last fired) >= 4.
    expected_dead = [
        [],  # 2 tokens seen: nothing can be dead yet
        [4, 5],  # 4 tokens: 4 and 5 never fired (5's weight-0 selection does not count)
        [2, 4, 5],  # 6 tokens: 2 last fired at 2
        [0, 2, 5],  # 8 tokens: 0 last fired at 4, 2 at 2; 1 fired at 6 and 4 at 8 are alive
    ]
    assert not tracker.may_have_dead
    for (index, weights), dead in zip(steps, expected_dead):
        tracker.update(index, weights != 0)
        assert torch.nonzero(tracker.dead_mask()).flatten().tolist() == dead
    assert tracker.tokens_seen == 8 and tracker.may_have_dead
    assert tracker.tokens_since_fired().tolist() == [4, 2, 6, 0, 0, 8]


def test_tracker_state_resumes_exactly():
    gen = torch.Generator().manual_seed(0)
    codes = [(torch.randint(0, 20, (5, 3), generator=gen), torch.rand(5, 3, generator=gen).round()) for _ in range(12)]
    full = DeadUnitTracker(20, window_tokens=15)
    for index, weights in codes:
        full.update(index, weights != 0)
    first = DeadUnitTracker(20, window_tokens=15)
    for index, weights in codes[:5]:
        first.update(index, weights != 0)
    state = first.state_dict()
    resumed = DeadUnitTracker(20, window_tokens=999)  # the saved window wins
    resumed.load_state_dict(state)
    for index, weights in codes[5:]:
        resumed.update(index, weights != 0)
    assert resumed.tokens_seen == full.tokens_seen == 60
    assert torch.equal(resumed.last_fired, full.last_fired)
    assert torch.equal(resumed.dead_mask(), full.dead_mask())
    with pytest.raises(ValueError, match="has 20 units, this layer has 7"):
        DeadUnitTracker(7, 15).load_state_dict(state)


def test_fired_units_and_update_fired_for_data_parallel():
    index, weights = _code([[2, 0], [2, 3]], zero=[3])
    assert fired_units(index, weights != 0, 5).tolist() == [True, False, True, False, False]
    with pytest.raises(TypeError, match="bool mask"):  # the rule is the layer's, never re-derived from weights
        fired_units(index, weights, 5)
    tracker = DeadUnitTracker(5, window_tokens=3)
    tracker.update_fired(torch.tensor([True, False, False, False, True]), num_tokens=4)  # global tokens
    assert tracker.dead_mask().tolist() == [False, True, True, True, False]


def test_window_rule_and_auto_k_aux():
    assert dead_window_tokens(1_000_000_000, 4096) == 10_002_432  # the paper's 10M, in whole steps
    assert dead_window_tokens(2_000_000, 4096) == 53_248  # 1/40 of the budget (50,000), in whole steps
    assert dead_window_tokens(100, 4096) == 4096  # at least one step
    assert auto_k_aux(4096) == 512 and auto_k_aux(576) == 288 and auto_k_aux(1) == 1
