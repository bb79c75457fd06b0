"""Distillation: train the sparse layers of every target layer concurrently to reproduce the frozen MLPs.

The base model only produces activations (see `activations.py`); each sparse layer learns `y ≈ layer(x)` with the
recipe's loss. One AdamW over all layers (their losses are independent, so summing them trains each on its own).
Data parallelism goes through 🤗 Accelerate: `accelerate launch -m expertize upcycle ...` runs the same code.
"""

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from expertize.modeling import SparseLayer

from ..data.activations import ActivationBatches
from ..evaluation.metrics import LOSSES
from ..recipe.schema import TrainConfig

DEAD_WINDOW_TOKENS = 1_000_000
"""A unit counts as dead during training if it has not fired in this many tokens (MxD paper App. C.1 uses ~4M)."""


class SparseStack(nn.Module):
    """All target layers as one module, so that DDP can wrap them: dict of inputs -> dict of outputs."""

    def __init__(self, layers: dict[int, SparseLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): layer for i, layer in sorted(layers.items())})

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: self.layers[name](x) for name, x in inputs.items()}


def lr_lambda(cfg: TrainConfig, total_steps: int):
    """Linear warmup, then constant / cosine / linear decay to `min_lr_ratio`."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    return factor


@dataclass
class TrainState:
    step: int
    mean_outputs: dict[int, torch.Tensor]


class Trainer:
    """Owns the optimizer, schedule, checkpoints and logs of one distillation run."""

    def __init__(
        self,
        layers: dict[int, SparseLayer],
        batches: ActivationBatches,
        cfg: TrainConfig,
        *,
        total_steps: int,
        run_dir: Path,
        accelerator,
        progress: bool = True,
        init_output_bias: bool = True,
    ) -> None:
        self.layers, self.batches, self.cfg, self.total_steps = layers, batches, cfg, total_steps
        self.init_output_bias = init_output_bias  # False keeps b_dec (e.g. copied from the dense MLP)
        self.run_dir, self.accelerator, self.progress = run_dir, accelerator, progress
        self.checkpoint_dir = run_dir / "checkpoint"
        self.log_path = run_dir / "train_log.jsonl"
        self.stack = SparseStack(layers).to(accelerator.device)
        self.optimizer = torch.optim.AdamW(
            self.stack.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, total_steps))
        self.model, self.optimizer = accelerator.prepare(self.stack, self.optimizer)
        self.loss_fn = LOSSES[cfg.loss]
        self.window_steps = max(1, DEAD_WINDOW_TOKENS // cfg.tokens_per_step)
        self.last_fired = {i: torch.full((layer.num_units,), -1, dtype=torch.long) for i, layer in layers.items()}
        self.state = TrainState(step=0, mean_outputs={})
        self._codes: dict[int, torch.Tensor] = {}
        self._hooks = [layer.code_hook.register_forward_hook(self._record_code(i)) for i, layer in layers.items()]

    def _record_code(self, index: int):
        def hook(module, args, code) -> None:
            self._codes[index] = code.top_k_index.detach()[code.top_k_weights.detach() > 0]

        return hook

    # -- checkpoints ------------------------------------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        """Atomically write everything needed to continue exactly: weights, optimizer, schedule, RNG, position."""
        self.accelerator.wait_for_everyone()
        if not self.accelerator.is_main_process:
            return
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "step": self.state.step,
            "layers": self.accelerator.unwrap_model(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "mean_outputs": self.state.mean_outputs,
            "last_fired": self.last_fired,
        }
        tmp = self.checkpoint_dir / "state.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.checkpoint_dir / "state.pt")

    def load_checkpoint(self) -> bool:
        path = self.checkpoint_dir / "state.pt"
        if not path.is_file():
            return False
        state = torch.load(path, map_location="cpu", weights_only=False)  # our own file
        self.accelerator.unwrap_model(self.model).load_state_dict(state["layers"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.state = TrainState(step=state["step"], mean_outputs=state["mean_outputs"])
        self.last_fired = state["last_fired"]
        self._truncate_log(self.state.step)
        return True

    def _truncate_log(self, step: int) -> None:
        if self.accelerator.is_main_process:
            truncate_log(self.log_path, step)

    # -- training ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _init_output_bias(self, batch) -> None:
        """The paper's init: b_dec = mean MLP output (on the first batch's tokens, averaged over ranks). The mean is
        kept for the evaluation's mean ablation either way."""
        for i, (_, y) in batch.items():
            mean = self.accelerator.reduce(y.float().mean(0), reduction="mean")
            if self.init_output_bias:
                self.layers[i].b_dec.copy_(mean.to(self.layers[i].b_dec.dtype))
            self.state.mean_outputs[i] = mean.cpu()

    def fit(self) -> dict[int, SparseLayer]:
        from tqdm.auto import tqdm

        resumed = self.load_checkpoint()
        batches = self.batches.batches(start_step=self.state.step)
        bar = tqdm(
            total=self.total_steps,
            initial=self.state.step,
            desc="distil",
            disable=not (self.progress and self.accelerator.is_local_main_process),
        )
        if not resumed:
            first = next(batches)
            self._init_output_bias(first)
            batches = _prepend(first, batches)
        autocast = torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16")
        self.model.train()
        started = time.perf_counter()
        while self.state.step < self.total_steps:
            batch = next(batches)
            with autocast:
                outputs = self.model({str(i): x for i, (x, _) in batch.items()})
            losses = {i: self.loss_fn(outputs[str(i)].float(), y.float()) for i, (_, y) in batch.items()}
            # Routed layers' own auxiliary losses (load balance, ...), already weighted by their specs.
            aux = [layer.aux_loss for layer in self.layers.values() if layer.aux_loss is not None]
            self.accelerator.backward(sum(losses.values()) + sum(aux))
            self._step()
            self.state.step += 1
            record = self._record(losses)
            record["seconds"] = round(time.perf_counter() - started, 3)  # since this process started fitting
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4g}", l0=f"{record['l0']:.1f}", dead=record["dead"])
            if self.state.step % self.cfg.log_every == 0 or self.state.step == self.total_steps:
                self._log(record)
            if self.cfg.checkpoint_every and self.state.step % self.cfg.checkpoint_every == 0:
                self.save_checkpoint()
        bar.close()
        for handle in self._hooks:
            handle.remove()
        self.model.eval()
        return self.layers

    def _step(self) -> None:
        for layer in self.layers.values():
            layer.before_optimizer_step()
        if self.cfg.grad_clip:
            self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        for layer in self.layers.values():
            layer.after_optimizer_step()

    def _record(self, losses: dict[int, torch.Tensor]) -> dict:
        step, per_layer = self.state.step, {}
        for i, loss in losses.items():
            fired = self._codes[i].cpu()
            self.last_fired[i][fired] = step
            n_tokens = self.batches.local_tokens
            dead = int(((self.last_fired[i] < 0) | (step - self.last_fired[i] >= self.window_steps)).sum())
            per_layer[str(i)] = {"loss": loss.item(), "l0": fired.numel() / n_tokens, "dead": dead}
        return {
            "step": step,
            "tokens": step * self.cfg.tokens_per_step,
            "lr": self.scheduler.get_last_lr()[0],
            "loss": sum(v["loss"] for v in per_layer.values()) / len(per_layer),
            "l0": sum(v["l0"] for v in per_layer.values()) / len(per_layer),
            "dead": sum(v["dead"] for v in per_layer.values()),
            "layers": per_layer,
        }

    def _log(self, record: dict) -> None:
        if self.accelerator.is_main_process:
            with self.log_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def truncate_log(path: Path, step: int) -> None:
    """Drop JSONL log lines written after `step` (the checkpoint's), so a resumed run's log equals an
    uninterrupted one's."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


def _prepend(first, rest):
    yield first
    yield from rest
