"""`--no-progress`: silence the libraries' own progress bars and log chatter, not just expertize's bars.

    with quiet_library_progress(args.no_progress):
        ...   # transformers, huggingface_hub, datasets: no bars, errors only; lm-eval: no bars, errors only

transformers, huggingface_hub and datasets have switches for their bars (set here, restored on exit). lm-eval passes
`disable=False` to tqdm explicitly, which no switch or TQDM_DISABLE overrides, so the harness runner wraps its runs
in `quiet_lm_eval()`: while `quiet_library_progress` is active, tqdm in lm-eval's modules is replaced by a silent one.
"""

import contextlib
import importlib
import logging
import sys
from collections.abc import Callable, Iterator

__all__ = ["library_progress_is_quiet", "quiet_library_progress", "quiet_lm_eval", "stage_bar"]

_quiet_depth = 0
_LOGGERS = ("transformers", "datasets", "huggingface_hub", "lm_eval", "lm-eval", "accelerate")


def library_progress_is_quiet() -> bool:
    return _quiet_depth > 0


@contextlib.contextmanager
def quiet_library_progress(enabled: bool = True) -> Iterator[None]:
    """Turn off the progress bars of transformers, huggingface_hub, datasets and lm-eval and keep only their
    errors in the log, for the duration of the block; `enabled=False` changes nothing."""
    global _quiet_depth
    if not enabled:
        yield
        return
    restore: list = []
    with contextlib.ExitStack() as stack:
        try:
            from transformers.utils import logging as hf_logging

            bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
            hf_logging.disable_progress_bar()
            hf_logging.set_verbosity_error()
            restore.append(lambda: (hf_logging.enable_progress_bar() if bars else None,
                                    hf_logging.set_verbosity(verbosity)))
        except ImportError:
            pass
        try:
            import huggingface_hub.utils as hub_utils

            hub_disabled = hub_utils.are_progress_bars_disabled()
            hub_utils.disable_progress_bars()
            restore.append(lambda: None if hub_disabled else hub_utils.enable_progress_bars())
        except ImportError:
            pass
        try:
            import datasets

            datasets_bars = datasets.is_progress_bar_enabled()
            datasets.disable_progress_bars()
            restore.append(lambda: datasets.enable_progress_bars() if datasets_bars else None)
        except ImportError:
            pass
        for name in _LOGGERS:
            logger = logging.getLogger(name)
            level = logger.level
            logger.setLevel(max(level, logging.ERROR))
            restore.append(lambda logger=logger, level=level: logger.setLevel(level))
        stack.callback(lambda: [undo() for undo in reversed(restore)])
        _quiet_depth += 1
        stack.callback(_leave)
        yield


def _leave() -> None:
    global _quiet_depth
    _quiet_depth -= 1


def _silent_tqdm(tqdm_class):
    class SilentTqdm(tqdm_class):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return SilentTqdm


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """Inside `quiet_library_progress`: lm-eval's modules get a tqdm that never draws (restored on exit).
    Outside it: nothing changes."""
    if not library_progress_is_quiet():
        yield
        return
    patched = []
    for name in ("lm_eval.models.huggingface", "lm_eval.api.model", "lm_eval.api.task", "lm_eval.api.metrics",
                 "lm_eval.evaluator", "lm_eval.models.utils"):
        try:
            module = sys.modules.get(name) or importlib.import_module(name)
        except ImportError:
            continue
        original = getattr(module, "tqdm", None)
        if isinstance(original, type):
            module.tqdm = _silent_tqdm(original)
            patched.append((module, original))
    try:
        yield
    finally:
        for module, original in patched:
            module.tqdm = original


@contextlib.contextmanager
def stage_bar(desc: str, stages: int, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """A progress bar over the `stages` stages of a long command (`expertize specialize`), drawn like upcycle's
    step bars: the yielded `start(name)` marks the previous stage done and names the one starting. Nothing is drawn
    before the first stage starts, so a refusal before the work stays one line."""
    from tqdm.auto import tqdm

    bar = None

    def start(name: str) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=stages, desc=desc, unit="stage", disable=not enabled)
        else:
            bar.update(1)
        bar.set_postfix_str(name)

    try:
        yield start
        if bar is not None:
            bar.update(bar.total - bar.n)
    finally:
        if bar is not None:
            bar.close()
