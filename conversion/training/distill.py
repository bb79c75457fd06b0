"""Distillation: train the sparse layers of every target layer concurrently to reproduce the frozen MLPs.

The base model only produces activations (see `data/activations.py`); each sparse layer learns `y ≈ layer(x)` with
the recipe's loss. One AdamW over all layers (their losses are independent, so summing them trains each on its own).
Data parallelism goes through 🤗 Accelerate: `accelerate launch -m expertize upcycle ...` runs the same code. The
loop itself (optimizer, schedule, hooks, checkpoints, logs) is `engine.Engine`.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from expertize.modeling import SparseLayer

from ..data.activations import ActivationBatches
from ..evaluation.metrics import LOSSES
from ..recipe import TrainConfig
from .engine import Engine, OptimConfig, run_paths

DEAD_WINDOW_TOKENS = 1_000_000
"""A unit counts as dead during training if it has not fired in this many tokens (MxD paper App. C.1 uses ~4M)."""



class SparseStack(nn.Module):
    """All target layers as one module, so that DDP can wrap them: dict of inputs -> dict of outputs."""

    def __init__(self, layers: dict[int, SparseLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): layer for i, layer in sorted(layers.items())})

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: self.layers[name](x) for name, x in inputs.items()}


@dataclass
class TrainState:
    step: int
    mean_outputs: dict[int, torch.Tensor]


class Trainer(Engine):
    """One distillation run: batches of captured (x, y) per layer -> the recipe's loss + routed layers' aux."""

    name = "distil"
    section = "train"
    ran_out_fix = "lower data.train_tokens or add text"

    def __init__(
        self,
        layers: dict[int, SparseLayer],
        batches: ActivationBatches,
        cfg: TrainConfig,
        *,
        total_steps: int,
        accelerator,
        run_dir: Path | None = None,
        checkpoint_path: Path | None = None,
        log_path: Path | None = None,
        progress: bool = True,
        init_output_bias: bool = True,
        log=None,
    ) -> None:
        """`checkpoint_path` / `log_path` default to `run_dir/checkpoint/state.pt` and `run_dir/train_log.jsonl`."""
        checkpoint_path, log_path = run_paths(run_dir, checkpoint_path, log_path, "train")
        self.layers, self.activations, self.cfg = layers, batches, cfg
        self.init_output_bias = init_output_bias  # False keeps b_dec (e.g. copied from the dense MLP)
        self.stack = SparseStack(layers).to(accelerator.device)
        super().__init__(
            self.stack,
            self.stack.parameters(),
            OptimConfig.from_config(cfg),
            total_steps=total_steps,
            tokens_per_step=cfg.tokens_per_step,
            checkpoint_path=checkpoint_path,
            log_path=log_path,
            hook_layers=layers.values(),
            accelerator=accelerator,
            progress=progress,
            log=log,
        )
        self.log_path = self.train_log.path
        self.loss_fn = LOSSES[cfg.loss]
        self.window_steps = max(1, DEAD_WINDOW_TOKENS // cfg.tokens_per_step)
        self.last_fired = {i: torch.full((layer.num_units,), -1, dtype=torch.long) for i, layer in layers.items()}
        self.mean_outputs: dict[int, torch.Tensor] = {}
        self._codes: dict[int, torch.Tensor] = {}
        self._hooks = [layer.code_hook.register_forward_hook(self._record_code(i)) for i, layer in layers.items()]

    @property
    def state(self) -> TrainState:
        return TrainState(step=self.step, mean_outputs=self.mean_outputs)

    def _record_code(self, index: int):
        def hook(module, args, code) -> None:
            self._codes[index] = code.top_k_index.detach()[code.top_k_weights.detach() > 0]

        return hook

    # -- engine task ------------------------------------------------------------------------------------------------

    def batches(self, start_step: int):
        return self.activations.batches(start_step=start_step)

    def start(self, batches, resumed: bool):
        self.model.train()
        if resumed:
            return batches
        first = next(batches)
        self._init_output_bias(first)
        return _prepend(first, batches)

    @torch.no_grad()
    def _init_output_bias(self, batch) -> None:
        """The paper's init: b_dec = mean MLP output (on the first batch's tokens, averaged over ranks). The mean is
        kept for the evaluation's mean ablation either way."""
        for i, (_, y) in batch.items():
            mean = self.accelerator.reduce(y.float().mean(0), reduction="mean")
            if self.init_output_bias:
                self.layers[i].b_dec.copy_(mean.to(self.layers[i].b_dec.dtype))
            self.mean_outputs[i] = mean.cpu()

    def compute_loss(self, batch):
        with self.autocast:
            outputs = self.model({str(i): x for i, (x, _) in batch.items()})
        losses = {i: self.loss_fn(outputs[str(i)].float(), y.float()) for i, (_, y) in batch.items()}
        # Routed layers' own auxiliary losses (load balance, ...), already weighted by their specs.
        aux = [layer.aux_loss for layer in self.layers.values() if layer.aux_loss is not None]
        return sum(losses.values()) + sum(aux), losses

    def record(self, losses: dict[int, torch.Tensor]) -> dict:
        step, per_layer = self.step, {}
        for i, loss in losses.items():
            fired = self._codes[i].cpu()
            self.last_fired[i][fired] = step
            n_tokens = self.activations.local_tokens
            dead = int(((self.last_fired[i] < 0) | (step - self.last_fired[i] >= self.window_steps)).sum())
            per_layer[str(i)] = {"loss": loss.item(), "l0": fired.numel() / n_tokens, "dead": dead}
        return {
            "loss": sum(v["loss"] for v in per_layer.values()) / len(per_layer),
            "l0": sum(v["l0"] for v in per_layer.values()) / len(per_layer),
            "dead": sum(v["dead"] for v in per_layer.values()),
            "layers": per_layer,
        }

    def postfix(self, record: dict) -> dict:
        return {"loss": f"{record['loss']:.4g}", "l0": f"{record['l0']:.1f}", "dead": record["dead"]}

    def model_state(self) -> dict:
        return self.accelerator.unwrap_model(self.model).state_dict()

    def load_model_state(self, state: dict) -> None:
        self.accelerator.unwrap_model(self.model).load_state_dict(state)

    def extra_state(self) -> dict:
        return {"mean_outputs": self.mean_outputs, "last_fired": self.last_fired}

    def load_extra_state(self, state: dict) -> None:
        self.mean_outputs, self.last_fired = state["mean_outputs"], state["last_fired"]

    # -- public -----------------------------------------------------------------------------------------------------

    def fit(self) -> dict[int, SparseLayer]:
        """Train to `total_steps` (resuming from the checkpoint if there is one); the layers, in eval mode."""
        try:
            self.run()
        finally:
            for handle in self._hooks:
                handle.remove()
            self._hooks = []
            self.model.eval()
        return self.layers


def _prepend(first, rest):
    yield first
    yield from rest
