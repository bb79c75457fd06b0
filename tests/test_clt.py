"""Cross-layer transcoders (modeling/jumprelu_transcoders.py): what a placed CLT's layers read from each other inside a model, the
refusals when run out of order, the Hub bundle (remote code, generation), and the circuit-tracer layout of its
export. The per-layer contract of a lone CLT layer is the kind battery's (tests/kinds.py); circuit-tracer's own
loader on a trained CLT is tests/test_circuit_tracer_e2e.py."""

import re

import pytest
import torch
from safetensors.torch import load_file

from expertize.conversion.cli import main as cli_main
from expertize.conversion.surgery.splice import splice
from expertize.modeling import CrossLayerError, build_sparse_layer, link_cross_layer, spec_from_dict
from tests.conftest import check_remote_roundtrip, tiny_base_model
from tests.export_helpers import model_folder

D = 32  # tiny_base_model's d_model


def clt_layers(layer_ids=(0, 1), seed: int = 0, width: int = 48) -> dict:
    """Placed CLT layers over `layer_ids` with random weights (std 0.3) and thresholds around 0.2."""
    spec = spec_from_dict({"kind": "clt", "d_in": D, "d_out": D, "num_latents": width, "k": 4})
    torch.manual_seed(seed)
    layers = {i: build_sparse_layer(spec.at_layer(i, list(layer_ids))) for i in layer_ids}
    with torch.no_grad():
        for layer in layers.values():
            for name, param in layer.named_parameters():
                param.normal_(std=0.3)
            layer.threshold_exponent.fill_(torch.log(torch.tensor(0.2)).item() / 10)
    return layers


def activations(layer, x: torch.Tensor) -> torch.Tensor:
    pre = torch.nn.functional.linear(x, layer.W_enc, layer.b_enc)  # (T, L)
    return pre * (pre > layer.threshold)


def mlp_io(model, input_ids) -> dict:
    seen = {}
    handles = [layer.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(
        i, (args[0].detach().reshape(-1, D).clone(), out.detach().reshape(-1, D).clone())))
        for i, layer in model.sparse_layers().items()]
    with torch.no_grad():
        model(input_ids)
    for handle in handles:
        handle.remove()
    return seen


def test_every_layer_adds_what_each_earlier_layer_writes_into_it():
    """y_m = b_dec,m + Σ_{s ≤ m} W_dec,s→mᵀ a_s inside a model, with a_s from layer s's own input of the same pass."""
    model = splice(tiny_base_model("llama"), clt_layers()).eval()
    ids = torch.randint(4, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    seen = mlp_io(model, ids)
    layers = model.sparse_layers()
    with torch.no_grad():
        for m, layer in layers.items():
            expected = layer.b_dec + sum(activations(layers[s], seen[s][0]) @ layer.W_dec[p]
                                         for p, s in enumerate(layer.spec.sources))
            torch.testing.assert_close(seen[m][1], expected, rtol=1e-5, atol=1e-5)
        # what layer 0's latents write into layer 1 is part of layer 1's output
        assert layers[1].spec.sources == [0, 1] and (activations(layers[0], seen[0][0]) != 0).any()


def test_decoder_from_is_each_sources_write_by_model_layer_index():
    """`decoder_from(s)`, the exporters' view: the decoder of source layer s (a model layer index, not a row number),
    so a CLT placed at layers 2 and 4 gives layer 4's W_dec rows by source; a layer that is no source is refused."""
    layers = clt_layers((2, 4))
    assert layers[4].spec.sources == [2, 4]
    assert torch.equal(layers[4].decoder_from(2), layers[4].W_dec[0].detach())
    assert torch.equal(layers[4].decoder_from(4), layers[4].W_dec[1].detach())
    assert torch.equal(layers[2].decoder_from(2), layers[2].W_dec[0].detach())
    with pytest.raises(ValueError, match=r"reads sources \[2\], not layer 4"):
        layers[2].decoder_from(4)


def test_ablating_a_latent_removes_it_from_every_later_layer():
    model = splice(tiny_base_model("llama"), clt_layers()).eval()
    ids = torch.randint(4, 99, (1, 6), generator=torch.Generator().manual_seed(1))
    seen = mlp_io(model, ids)
    layers = model.sparse_layers()
    acts = activations(layers[0], seen[0][0])  # (T, L)
    unit = int(acts[0].abs().argmax())
    assert acts[0, unit] != 0
    with layers[0].intervene(ablate=[unit]), torch.no_grad():
        # layer 1 alone on the same inputs is refused: it reads layer 0's code of the same pass
        with pytest.raises(CrossLayerError, match=r"reads the codes of layer\(s\) \[0\] from the same pass"):
            layers[1](seen[1][0])
        layers[0](seen[0][0])  # the pass, in order: layer 0 posts its (ablated) code, layer 1 reads it
        ablated = layers[1](seen[1][0])
    expected = seen[1][1] - acts[:, unit, None] * layers[1].W_dec[0, unit]  # (T, O)
    torch.testing.assert_close(ablated, expected, rtol=1e-5, atol=1e-5)


def test_out_of_order_and_unlinked_layers_are_refused():
    layers = clt_layers((0, 1, 2))
    x = torch.randn(5, D)
    with pytest.raises(CrossLayerError, match=r"not linked to its sources \[0, 1\]"):
        layers[2](x)
    link_cross_layer(layers)
    layers[0](x)
    with pytest.raises(CrossLayerError, match=r"layer\(s\) \[1\] from the same pass"):
        layers[2](x)
    layers[0](x), layers[1](x)
    with pytest.raises(CrossLayerError, match=r"got 3 tokens, but layer 0 posted 5 in this pass"):
        layers[2](x[:3])
    with pytest.raises(CrossLayerError, match=r"reads layer\(s\) \[0\], which are not CLT layers of this model"):
        link_cross_layer({1: clt_layers()[1]})


@pytest.mark.slow  # 5-25 s (subprocesses or a whole upcycle): in CI's opt-in run, off the fast suite's 8 minutes
def test_a_placed_clt_round_trips_through_remote_code_and_generates(tmp_path):
    model = splice(tiny_base_model("llama"), clt_layers()).eval()
    report, _, _ = check_remote_roundtrip(model, tmp_path, "model.layers")
    assert report["sparse"] == ["CltLayer", "CltLayer"]


def test_the_export_writes_circuit_tracers_clt_layout(tmp_path):
    """W_enc_{i}: layer i's encoder, bias and thresholds; W_dec_{i} (L, n - i, d): [:, j - i] what layer i's latents
    write into layer j (circuit-tracer 0.5.0 `load_clt`); with attribute.py and a tokenizer transformers 4.57 reads."""
    folder = model_folder(tmp_path, clt_layers())
    assert cli_main(["export", str(folder), "--to", "circuit-tracer", str(tmp_path / "ct")]) == 0
    layers = clt_layers()  # the same seeded weights as the folder's
    for i in (0, 1):
        enc, dec = load_file(tmp_path / "ct" / f"W_enc_{i}.safetensors"), load_file(tmp_path / "ct" / f"W_dec_{i}.safetensors")
        assert set(enc) == {f"W_enc_{i}", f"b_enc_{i}", f"b_dec_{i}", f"threshold_{i}"} and set(dec) == {f"W_dec_{i}"}
        torch.testing.assert_close(enc[f"threshold_{i}"], layers[i].threshold.detach())
        assert dec[f"W_dec_{i}"].shape == (48, 2 - i, D)
        for j in range(i, 2):
            torch.testing.assert_close(dec[f"W_dec_{i}"][:, j - i], layers[j].W_dec.detach()[i])
    assert (tmp_path / "ct" / "attribute.py").is_file() and (tmp_path / "ct" / "tokenizer" / "tokenizer.json").is_file()


def test_the_export_refusals_name_the_fix(tmp_path, capsys):
    folder = model_folder(tmp_path, clt_layers())
    partial = model_folder(tmp_path, {0: clt_layers((0,))[0]}, name="partial")
    for args, expected in (
        ([str(folder), "--to", "sparsify"], r"is a cross-layer transcoder, which sparsify cannot hold .* export it "
                                            r"--to circuit-tracer, saelens \(per layer\) or delphi"),
        ([str(partial), "--to", "circuit-tracer"], r"circuit-tracer's cross-layer transcoder covers every decoder "
                                                   r"layer 0\.\.1, but \S+ CLT leaves out layer\(s\) \[1\]"),
    ):
        capsys.readouterr()
        code = cli_main(["export", *args, str(tmp_path / "out")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert re.search(expected, err), err
        assert not (tmp_path / "out").exists()


def test_specialize_measures_a_clt_layer_with_full_forwards():
    """`specialize`'s cheap path replays blocks L… only, which cannot serve a layer reading earlier layers' codes of the
    same pass: on a CLT it measures every condition with full forwards (it raised CrossLayerError before)."""
    from expertize.conversion.specialization import SpecializationSettings, specialize

    model = splice(tiny_base_model("llama"), clt_layers()).eval()
    gen = torch.Generator().manual_seed(0)
    text = lambda: {"low": torch.randint(4, 50, (4, 12), generator=gen), "high": torch.randint(50, 99, (4, 12), generator=gen)}  # noqa: E731
    report = specialize(model, text(), text(), special_ids=[1, 2], layer=1,
                        settings=SpecializationSettings(probe_ks=(1,), probe_top=2, bootstrap=20))
    assert report.layer == 1 and [r.domain for r in report.masking] == ["low", "high"]
