"""Several engines on one batch stream: the training loop, for one engine or for a recipe's variants.

`train_together(engines)` hands the batch of step s to every engine whose next step is s; each engine does its own
step (`Engine.train_step`: loss, backward, hooks, clipping, AdamW, schedule, log, checkpoint), so an engine sees
exactly what it would see alone. The batches come from the first engine's `batches` (the engines share the stream).
"""

from tqdm.auto import tqdm

from ..errors import RunFailed
from .engine import Engine
from .errors import RunInterrupted, TrainingDiverged


def train_together(engines: list[Engine]) -> dict[Engine, TrainingDiverged]:
    """Train `engines` on one batch stream: the batch of step s (from the first engine's `batches`) goes to every
    engine whose next step is s, so each engine sees exactly the batches it would see alone. Variants of a recipe
    (`variants:`) train this way on one activation capture; `train_together([engine])` is the one-engine case.

    Engines resumed from different steps (a run killed between two engines' checkpoints) are fine: the stream starts
    at the earliest step and an engine waits until it reaches its own. With several engines each one draws from its
    own torch RNG (`own_rng`), as it would alone, and one that diverges stops alone: its `TrainingDiverged` is
    returned by engine (its last good checkpoint kept) while the others go on. With one engine the error is
    raised. Ctrl-C saves every engine that is between two steps and raises one `RunInterrupted`.
    """
    alone, lead = len(engines) == 1, engines[0]
    if len({engine.total_steps for engine in engines}) > 1:
        raise ValueError("engines trained together must have the same total_steps (they share one batch stream)")
    opened: list[Engine] = []
    failed: dict[Engine, TrainingDiverged] = {}
    local_main = lead.accelerator is None or lead.accelerator.is_local_main_process
    bar = None
    try:
        for engine in engines:
            with engine.own_rng(not alone):
                engine.open()
            opened.append(engine)
        active = [engine for engine in engines if not engine.done]
        step = min((engine.step for engine in active), default=lead.total_steps)
        desc = lead.name if alone else f"{type(lead).name} ({len(engines)} variants)"
        bar = tqdm(total=lead.total_steps, initial=step, desc=desc, disable=not (lead.progress and local_main))
        batches = lead.batches(step) if active else iter(())
        while active:
            batch = next(batches, None)
            if batch is None:
                first = active[0]
                raise RunFailed(
                    f"the training data ran out after {step} of {first.total_steps} {first.name} steps; "
                    f"{first.ran_out_fix}"
                )
            records = []
            for engine in list(active):
                if engine.step != step:  # resumed further than the stream: waits for its own step
                    continue
                try:
                    with engine.own_rng(not alone):
                        record = engine.train_step(batch)
                except TrainingDiverged as diverged:
                    if alone:
                        raise
                    failed[engine] = diverged
                    active.remove(engine)
                    engine.say(f"{diverged}; the other variants go on")
                    continue
                if record is not None:
                    records.append((engine, record))
                if engine.done:
                    active.remove(engine)
            step += 1
            bar.update(1)
            if records:
                bar.set_postfix(**_postfix(records))
    except KeyboardInterrupt as interrupt:
        if isinstance(interrupt, RunInterrupted):
            raise
        raise _interrupted_together(opened, alone) from interrupt
    finally:
        if bar is not None:
            bar.close()
        for engine in opened:
            engine.close()
    return failed


def _postfix(records: list[tuple[Engine, dict]]) -> dict:
    if len(records) == 1:
        engine, record = records[0]
        return engine.postfix(record)
    losses = [record["loss"] for _, record in records]
    return {"loss": f"{min(losses):.4g}..{max(losses):.4g}"}


def _interrupted_together(engines: list[Engine], alone: bool) -> RunInterrupted:
    """Each engine saves its state if it is between two steps (with its own RNG); one message for all."""
    messages = []
    for engine in engines:
        with engine.own_rng(not alone):
            messages.append(str(engine.interrupted()))
    if alone:
        return RunInterrupted(messages[0])
    return RunInterrupted(f"training of {len(engines)} variants interrupted:\n  " + "\n  ".join(messages))
