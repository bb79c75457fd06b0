"""The one training engine of expertize: distillation (`distill.py`) and healing (`heal.py`) subclass `Engine` and
supply only their batches, their loss and what they save beyond the weights.

The engine owns AdamW (fused where the device has the kernel: `compute.make_adamw`), the learning-rate schedule,
gradient clipping, bf16 autocast, the sparse layers' `before_optimizer_step` / `after_optimizer_step` hooks,
non-finite detection, atomic checkpoint / exact resume (weights, optimizer, schedule, RNG, step; the data position is
a function of the step), the JSONL log and the progress bar, and the experiment trackers (`tracking.py`,
`train.log_with`). One step is

    loss = compute_loss(batch) -> backward -> layer.before_optimizer_step() -> clip -> AdamW step -> schedule step
    -> zero grads -> layer.after_optimizer_step() -> track (device-side bookkeeping) -> step += 1
    -> at log steps only: record (the one host synchronization of a step) / log -> checkpoint when due

The loop over steps is `together.train_together` (one engine, or a recipe's variants on one batch stream).
A non-finite loss or weight stops the run with `TrainingDiverged` before anything non-finite is logged or saved
(the last good checkpoint stays); Ctrl-C becomes `RunInterrupted`, after saving the state when it arrived between
two steps.
"""

import contextlib
import dataclasses
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checks import NoSpaceLeft, disk_full, no_space_message
from .compute import make_adamw
from .errors import RunInterrupted, TrainingDiverged
from .log import JsonlLog
from .tracking import Tracking, tracking_dir


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """What the engine needs to know about optimization, whichever recipe section it comes from."""

    lr: float
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float | None = None
    precision: str = "fp32"
    log_every: int = 50
    checkpoint_every: int = 0

    @classmethod
    def from_config(cls, cfg: Any, **overrides: Any) -> "OptimConfig":
        """The fields of `cfg` (a TrainConfig, a HealConfig, ...) that share a name with ours, then `overrides`
        (e.g. healing's precision, which comes from `train.precision`)."""
        values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls) if hasattr(cfg, f.name)}
        values.update(overrides)
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        return cls(**values)


def lr_lambda(cfg: Any, total_steps: int) -> Callable[[int], float]:
    """Linear warmup, then constant / cosine / linear decay to `min_lr_ratio`. `cfg`: anything with
    `warmup_steps`, `schedule` and `min_lr_ratio` (OptimConfig, TrainConfig, HealConfig)."""
    warmup, schedule, floor = cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
        return floor + (1 - floor) * decay

    return factor


def remove_hooks(handles) -> list:
    """Remove forward-hook handles (the code hooks a task reads the sparse codes through); returns []."""
    for handle in handles:
        handle.remove()
    return []


def run_paths(
    run_dir: Path | None, checkpoint_path: Path | None, log_path: Path | None, stage: str
) -> tuple[Path, Path]:
    """(checkpoint, log): the given paths, else the run folder's for `stage` ("train" or "heal"): the names belong
    to `publishing.run_folder.RunFolder`, the one place that knows them."""
    from ..publishing.run_folder import RunFolder

    if (checkpoint_path is None or log_path is None) and run_dir is None:
        raise TypeError("pass run_dir, or both checkpoint_path and log_path")
    folder = RunFolder(run_dir) if run_dir is not None else None
    return (
        Path(checkpoint_path or getattr(folder, f"{stage}_state")),
        Path(log_path or getattr(folder, f"{stage}_log")),
    )


class Engine:
    """The loop; subclasses implement the methods under "task" below.

    `section` names the recipe section of the optimizer fields in advice ("train", "heal"); `name` labels the bar
    and messages. With an `accelerator` (distillation), backward, clipping and checkpoint writing go through it
    (data parallel; only the main process writes); without one, `device` is used on a single process.
    """

    name = "train"
    section = "train"
    ran_out_fix = "lower the token budget or add text"

    def __init__(
        self,
        model: nn.Module,
        params: Iterable,
        optim: OptimConfig,
        *,
        total_steps: int,
        tokens_per_step: int,
        checkpoint_path: Path,
        log_path: Path,
        hook_layers: Iterable[nn.Module] = (),
        accelerator=None,
        device: torch.device | None = None,
        progress: bool = True,
        log: Callable[[str], None] | None = None,
        log_with: str = "none",
        tracking_path: Path | None = None,
        name: str | None = None,
        section: str | None = None,
    ) -> None:
        """`log_with`: Accelerate tracker name or "none"; its files go to `tracking_path` (default: `tracking/`
        beside the JSONL log), in a run named after the stage (`name`). `name` / `section` override the class's
        (e.g. a variant's trainer: "distil[mxd-k8]", "variants[mxd-k8].train")."""
        if name is not None:
            self.name = name
        if section is not None:
            self.section = section
        self.optim, self.total_steps, self.tokens_per_step = optim, total_steps, tokens_per_step
        self.checkpoint_path, self.train_log = Path(checkpoint_path), JsonlLog(log_path)
        self.hook_layers = list(hook_layers)  # SparseLayers: before/after_optimizer_step
        self.accelerator, self.progress, self.log = accelerator, progress, log
        self.device = accelerator.device if accelerator is not None else torch.device(device or "cpu")
        # fused where the device has the kernel (CUDA, CPU): one kernel per step, not a loop over parameters;
        # `params`: parameters, or {"params", "lr_scale"} groups (compute.make_adamw)
        self.optimizer = make_adamw(
            params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay, device=self.device
        )
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, total_steps))
        if accelerator is not None:
            model, self.optimizer = accelerator.prepare(model, self.optimizer)
        self.model = model
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=optim.precision == "bf16")
        self.step = 0
        self.saved_step: int | None = None  # step of the checkpoint on disk (None: none written or loaded)
        self._between_steps = False  # True while the state is a consistent end-of-step state (safe to save)
        self._loss_finite = torch.ones((), dtype=torch.bool, device=self.device)  # AND over steps, no host sync
        self._rng = rng_state()  # this engine's RNG when trained together with others (`own_rng`)
        self._started, self._first_step = time.perf_counter(), 0
        self.tracking = Tracking(
            log_with, type(self).name, Path(tracking_path or tracking_dir(log_path)), is_main_process=self.is_main_process
        )

    # -- task: what distillation / healing supply ----------------------------------------------------------------

    def batches(self, start_step: int) -> Iterator[Any]:
        """The batches of steps `start_step`, `start_step + 1`, ... (a function of the step, for exact resume)."""
        raise NotImplementedError

    def begin(self, resumed: bool) -> None:
        """Before the first step (set train/eval modes, say what the run does)."""

    def first_batch(self, batch: Any) -> None:
        """Called with the batch of step 0 before it is trained on, on a fresh run only (e.g. initialize from it)."""

    def compute_loss(self, batch: Any) -> tuple[torch.Tensor, Any]:
        """(scalar loss to minimize, what `track` / `record` need); run the model under `self.autocast`."""
        raise NotImplementedError

    def track(self, parts: Any) -> None:
        """Every step, after the optimizer step: device-side bookkeeping (e.g. which units fired). Must not move
        values to the host: the engine synchronizes with the device only at log steps."""

    def record(self, parts: Any) -> dict:
        """The log fields of the step just taken (a log step), starting with "loss" (host floats)."""
        raise NotImplementedError

    def postfix(self, record: dict) -> dict:
        return {"loss": f"{record['loss']:.4g}"}

    def model_state(self) -> dict:
        raise NotImplementedError

    def load_model_state(self, state: dict) -> None:
        raise NotImplementedError

    def extra_state(self) -> dict:
        """Task state saved with the checkpoint beyond weights (e.g. dead-unit bookkeeping)."""
        return {}

    def load_extra_state(self, state: dict) -> None:
        pass

    # -- processes --------------------------------------------------------------------------------------------------

    @property
    def is_main_process(self) -> bool:
        return self.accelerator is None or self.accelerator.is_main_process

    @property
    def num_processes(self) -> int:
        return 1 if self.accelerator is None else self.accelerator.num_processes

    # -- checkpoints ------------------------------------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        """Atomically write everything needed to continue exactly; refuses (TrainingDiverged) non-finite state."""
        self._require_finite()
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()
        if self.is_main_process:
            self._write_checkpoint()
        self.saved_step = self.step

    def _write_checkpoint(self) -> None:
        self.checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "step": self.step,
            "model": self.model_state(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": _cuda_rng(),
            "extra": self.extra_state(),
        }
        tmp = self.checkpoint_path.with_name(self.checkpoint_path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())  # a full disk can surface only here
        except (OSError, RuntimeError) as e:
            tmp.unlink(missing_ok=True)
            # torch's zip writer turns a full disk into "RuntimeError: [enforce fail ...] unexpected pos": recognized
            # by the space it leaves, which is less than the checkpoint needs.
            if not (disk_full(e) or shutil.disk_usage(tmp.parent).free < _state_bytes(state)):
                raise
            kept = (
                f"the checkpoint of step {self.saved_step} ({self.checkpoint_path}) is kept"
                if self.saved_step is not None
                else "no checkpoint was written yet (a rerun starts this stage over)"
            )
            raise NoSpaceLeft(
                f"{self.name}: writing the checkpoint of step {self.step} failed: "
                f"{no_space_message(self.checkpoint_path.parent, _state_bytes(state), 'rerun to resume')}; {kept}"
            ) from None
        os.replace(tmp, self.checkpoint_path)  # the previous checkpoint stays whole until this line

    def load_checkpoint(self) -> bool:
        """Restore the checkpoint if there is one (and drop log records written after it); False when none."""
        if not self.checkpoint_path.is_file():
            return False
        state = torch.load(self.checkpoint_path, map_location="cpu", weights_only=False)  # our own file
        self.load_model_state(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.load_extra_state(state["extra"])
        self.step = self.saved_step = state["step"]
        if self.is_main_process:
            self.train_log.truncate(self.step)
        return True

    # -- the loop ---------------------------------------------------------------------------------------------------

    def open(self) -> bool:
        """Start the trackers, restore the checkpoint if there is one and say so; True when resumed."""
        self.tracking.start()  # a missing tracker package fails before any work
        resumed = self.load_checkpoint()
        if resumed:
            self.say(f"resuming {self.name} from step {self.step} of {self.total_steps} ({self.checkpoint_path})")
        if self.optim.warmup_steps > self.total_steps:
            self.say(
                f"warning: {self.section}.warmup_steps={self.optim.warmup_steps} is more than the {self.total_steps} "
                f"steps of {self.name}, so the learning rate never reaches {self.section}.lr; lower warmup_steps"
            )
        self.begin(resumed)
        self._between_steps = True
        self._started, self._first_step = time.perf_counter(), self.step
        return resumed

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    def train_step(self, batch: Any) -> dict | None:
        """One optimizer step on `batch`, then log / checkpoint if due; the record at a log step, else None."""
        self._between_steps = False
        if self.step == 0:
            self.first_batch(batch)
        loss, parts = self.compute_loss(batch)
        self._backward(loss)
        self._optimizer_step()
        self._loss_finite &= torch.isfinite(loss.detach())
        self.track(parts)
        self.step += 1
        record = None
        if self.step % self.optim.log_every == 0 or self.step == self.total_steps:
            # The only host synchronization of a step: at log steps (a NaN anywhere since the last one is caught
            # here, through the device-side AND of the losses' finiteness).
            if not bool(self._loss_finite):
                self._diverged("the loss")
            record = {
                "step": self.step,
                "tokens": self.step * self.tokens_per_step,
                "lr": self.scheduler.get_last_lr()[0],
                **self.record(parts),
                "seconds": round(time.perf_counter() - self._started, 3),  # since this process started the loop
            }
            if not math.isfinite(record["loss"]):
                self._diverged("the loss")
            if self.is_main_process:
                self.train_log.append(record)
                # Throughput: tokens per second of this process's loop so far (not in the JSONL log, whose records
                # are the same for a resumed and an uninterrupted run).
                seconds = time.perf_counter() - self._started
                rate = (self.step - self._first_step) * self.tokens_per_step / max(seconds, 1e-9)
                self.tracking.log({**record, "tokens_per_second": rate}, step=self.step)
        if self.optim.checkpoint_every and self.step % self.optim.checkpoint_every == 0:
            self.save_checkpoint()
        # Weights, optimizer, RNG, task bookkeeping and log all describe the end of this step now.
        self._between_steps = True
        if self.done:
            self._require_finite()
        return record

    def close(self) -> None:
        self.tracking.finish()
        self._between_steps = False

    @contextlib.contextmanager
    def own_rng(self, enabled: bool = True) -> Iterator[None]:
        """Run the block with this engine's own torch RNG state (CPU and CUDA), then keep the state it leaves: how
        engines trained together draw exactly the random numbers they would draw alone (e.g. MxD's random K)."""
        if not enabled:
            yield
            return
        set_rng_state(self._rng)
        try:
            yield
        finally:
            self._rng = rng_state()

    def _backward(self, loss: torch.Tensor) -> None:
        if self.accelerator is not None:
            self.accelerator.backward(loss)
        else:
            loss.backward()

    def _optimizer_step(self) -> None:
        for layer in self.hook_layers:
            layer.before_optimizer_step()
        if self.optim.grad_clip:
            if self.accelerator is not None:
                self.accelerator.clip_grad_norm_(self.params, self.optim.grad_clip)
            else:
                torch.nn.utils.clip_grad_norm_(self.params, self.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        for layer in self.hook_layers:
            layer.after_optimizer_step()

    # -- failures ---------------------------------------------------------------------------------------------------

    def _require_finite(self) -> None:
        """Raise TrainingDiverged if a loss so far or a trainable weight is non-finite (one host sync)."""
        if not bool(self._loss_finite):
            self._diverged("the loss")
        weights_finite = torch.stack([torch.isfinite(p.detach()).all() for p in self.params]).all()
        if not bool(weights_finite):
            self._diverged("the weights")

    def _diverged(self, what: str) -> None:
        lr = self.scheduler.get_last_lr()[0]
        kept = (
            f"the checkpoint of step {self.saved_step} ({self.checkpoint_path}) is kept"
            if self.saved_step is not None
            else "no checkpoint was written"
        )
        clip, section = self.optim.grad_clip, self.section
        clip_advice = f" or {section}.grad_clip (now {clip:g})" if clip else f", set {section}.grad_clip (e.g. 1.0)"
        raise TrainingDiverged(
            f"{self.name} diverged: {what} became non-finite (NaN or inf) by step {self.step} of {self.total_steps}, "
            f"at learning rate {lr:.3g} ({section}.lr={self.optim.lr:g}); {kept}, and nothing non-finite was saved. "
            f"Lower {section}.lr{clip_advice}, then start over with `expertize upcycle RECIPE --restart`"
        )

    def interrupted(self) -> RunInterrupted:
        """Save the state if the interrupt came between two steps (single process only: other ranks may be inside
        a collective), then say where the run stands."""
        saved_now = False
        if self._between_steps and self.num_processes == 1 and self.step > 0 and self.step != self.saved_step:
            try:
                self._require_finite()
                self._write_checkpoint()
                self.saved_step, saved_now = self.step, True
            except (TrainingDiverged, NoSpaceLeft, KeyboardInterrupt):
                pass  # keep the last good checkpoint; a second Ctrl-C means "stop now"
        where = f"{self.name} interrupted at step {self.step} of {self.total_steps}"
        if saved_now:
            return RunInterrupted(
                f"{where}; saved a checkpoint of step {self.step} ({self.checkpoint_path}). Run the same command "
                "again to resume from it"
            )
        if self.saved_step is not None:
            return RunInterrupted(
                f"{where}; the last checkpoint is of step {self.saved_step} ({self.checkpoint_path}). Run the same "
                "command again to resume from it"
            )
        return RunInterrupted(
            f"{where}; no checkpoint was written yet. Run the same command again to resume (it starts this stage over)"
        )

    def say(self, message: str) -> None:
        if self.log is not None and self.is_main_process:
            self.log(message)


# -- RNG state --------------------------------------------------------------------------------------------------------


def _state_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) checkpoint state: what its file needs, give or take the pickle."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    return 0


def rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """torch's global RNG state, CPU and CUDA (for `set_rng_state`)."""
    return torch.get_rng_state(), _cuda_rng()


def set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def _cuda_rng() -> list[torch.Tensor] | None:
    return torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
