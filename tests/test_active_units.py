"""One definition of an active unit (`SparseLayer.active_entries`), counted the same by every reader of the code.

MoE-X split from a GELU MLP keeps the GELU, so a large share of its code's entries are negative: the output depends
on them, and every count (the evaluation's L0 and dead units, the training log's L0, inspection's and specialization's
firing statistics, the per-prompt view, the card) must count them alike.
"""

import torch

from expertize.conversion.evaluation.evaluate import evaluate_sparse_layers
from expertize.conversion.inspection import InspectionSettings, collect_stats, prompt_view
from expertize.conversion.publishing.card import CardInputs, render_model_card
from expertize.conversion.recipe import EvalConfig, TrainConfig
from expertize.conversion.surgery.dense_init import layer_from_dense
from expertize.conversion.surgery.families import decoder_blocks
from expertize.conversion.surgery.splice import splice
from expertize.conversion.device import make_accelerator
from expertize.conversion.training.distill import Trainer
from expertize.conversion.training.log import read_log
from tests.conftest import tiny_base_model

LAYER = 1


def _split_moe_x():
    """A tiny GPT-2 (GELU MLPs) and a MoE-X split from its layer-1 MLP: 4 experts, K = 2, the MLP's GELU kept."""
    torch.manual_seed(0)
    base = tiny_base_model("gpt2").eval()
    layer = layer_from_dense("moe_x", decoder_blocks(base)[LAYER].mlp, "split", 4, k=2, family="gpt2").eval()
    return base, layer


def _mlp_inputs(base, input_ids: torch.Tensor) -> torch.Tensor:
    """The layer's MLP inputs on `input_ids`, (B·L, d), from a hook on the base's MLP."""
    seen = []
    handle = decoder_blocks(base)[LAYER].mlp.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    with torch.no_grad():
        base(input_ids=input_ids)
    handle.remove()
    return seen[0].reshape(-1, seen[0].shape[-1])


class _OneStep:
    """A distillation stream of one step: the given (x, y) pairs."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.local_tokens = x.shape[0]
        self.data = [{LAYER: (x, y)}]

    def batches(self, start_step: int = 0):
        yield from self.data[start_step:]


def test_a_gelu_moe_x_code_is_counted_alike_by_every_reader(tmp_path):
    base, layer = _split_moe_x()
    input_ids = torch.randint(0, base.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    x = _mlp_inputs(base, input_ids)  # (64, d)
    tokens = x.shape[0]
    with torch.no_grad():
        code = layer.encode(x)
    weights = code.top_k_weights  # (T, K·D)
    # The case at hand: a GELU code, many negative entries; "> 0" and "!= 0" disagree by a wide margin.
    assert (weights < 0).float().mean() > 0.3
    truth = (weights != 0).sum().item() / tokens  # every entry the output depends on
    assert truth > 1.5 * (weights > 0).sum().item() / tokens
    truth_dead = int((torch.bincount(code.top_k_index[weights != 0], minlength=layer.num_units) == 0).sum())

    # The evaluation (metrics.json's L0 and dead units), over every position.
    metrics = evaluate_sparse_layers(
        base, {LAYER: layer}, input_ids, EvalConfig(batch_sequences=4, generation_prompts=0, histogram=False),
        progress=False,
    )
    recorded = metrics["layers"][str(LAYER)]
    assert recorded["l0"] == truth and recorded["dead_units"] == truth_dead

    # Inspection's statistics (which `expertize specialize` reads too: its live units are counts > 0).
    model = splice(base, {LAYER: layer})
    stats = collect_stats(model, {"text": input_ids}, InspectionSettings(tokens=0, context_length=16, top_n=2),
                          token_text=str)
    counts = stats.layers[LAYER].counts  # (U,)
    assert counts.sum().item() / tokens == truth
    assert int((counts == 0).sum()) == truth_dead
    # Its maximum activation is the largest value seen, negative for a unit that fired only below 0.
    peaks = stats.layers[LAYER].contexts.values[:, 0]  # (U,) -inf for dead units
    negative_only = (counts > 0) & (peaks < 0)
    assert torch.equal(stats.layers[LAYER].max_activation[negative_only], peaks[negative_only])

    # The per-prompt view lists as firing what the code has as active (its top 5 by value, here all nonzero).
    view = prompt_view(model, input_ids[:1], token_text=str, top=5)
    assert all(len(row) == 5 for row in view.units[LAYER])

    # The training log: one distillation step (the logged code is the forward before the step) on the same inputs.
    with torch.no_grad():
        y = decoder_blocks(base)[LAYER].mlp(x)
    cfg = TrainConfig(lr=1e-3, warmup_steps=0, tokens_per_step=tokens, checkpoint_every=0, log_every=1,
                      device="cpu", balance="none")
    Trainer({LAYER: layer}, _OneStep(x, y), cfg, total_steps=1, accelerator=make_accelerator(torch.device("cpu")),
            run_dir=tmp_path, progress=False, init_output_bias=False).fit()
    (record,) = read_log(tmp_path / "train_log.jsonl")
    assert record["l0"] == truth

    # The card names what the code indexes: hidden units (of 4 experts), not "experts".
    card = str(render_model_card(tmp_path, CardInputs(base_model="gpt2", layers={LAYER: layer.spec.to_dict()},
                                                      recipe_summary=None, metrics=metrics)))
    num_units = layer.num_units
    assert f"/ {num_units} hidden units" in card and "mean number of active hidden units per token" in card
    assert "K = 2 of 4 experts active per token" in card  # routing is over experts
    assert "experts that never fired" not in card

