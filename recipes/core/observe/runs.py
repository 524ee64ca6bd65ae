"""Observers of the recipes whose run is not one training loop in this process: ddp_spawn
starts its own processes, lightning_fabric resumes from a checkpoint, hang_diagnosis hangs on
purpose, and collectives trains nothing (a probe measures it)."""

from __future__ import annotations

import multiprocessing
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from recipes.core.observe.base import Observer
from recipes.core.result import RecipeResult, param_checksum, peak_memory_bytes

__all__ = ["HangObserver", "ResumableObserver", "SpawnedObserver", "probe_collectives"]


class SpawnedObserver(Observer):
    """An Observer that can travel into the processes a recipe starts itself (ddp_spawn hands it
    to ``mp.spawn``, which pickles a copy into every child).

    Rank 0's copy sends what it measured at the last step back through a queue made here (from
    the "spawn" context: it travels with the copy), and the caller's own copy takes it in
    ``close``, which ``prove`` calls once the recipe's function has returned. Where the recipe's
    per-rank function runs in the caller's world instead (tests), it is a plain Observer. The
    final state does not travel: the parent reads the queue only after the children exit, and a
    message larger than the pipe's buffer would block rank 0 forever.
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self._queue = multiprocessing.get_context("spawn").SimpleQueue()
        self._in_child = False

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_in_child": True}  # only ever pickled to go to a child

    def measure(self, step: int) -> None:
        super().measure(step)
        if self._in_child and step == self.steps - 1 and self.rank == 0:
            self._queue.put({key: getattr(self, key) for key in _TRAVELS})

    def close(self) -> None:
        super().close()
        if not self._in_child and not self._queue.empty():
            self.__dict__.update(self._queue.get())


_TRAVELS = (
    "durations",
    "memory_per_rank",
    "param_checksum",
    "output_dtype",
    "extras",
    "rank",
    "world_size",
    "backend",
    "device",
)


class ResumableObserver(Observer):
    """recipes/lightning_fabric.py: ``start_step`` in ``extras``, the first step the run trained
    (past 0 where it resumed from a checkpoint; the recipe returns the losses of the steps it
    trained)."""

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)

    def step_end(self, step: int, loss: float) -> None:
        self.extras.setdefault("start_step", step)
        super().step_end(step, loss)


class HangObserver(Observer):
    """recipes/hang_diagnosis.py: ``mode`` and ``trace_dir`` in ``extras``. A run that hangs on
    purpose stops before its last step: its checksum is then read where it stopped (in ``close``,
    once the recipe returned), so that the world that hung still gives a result."""

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.extras.update(mode=cfg.mode, trace_dir=cfg.trace_dir)

    def close(self) -> None:
        if self.param_checksum is None and self._model is not None:  # the hang ended the loop
            self.param_checksum = param_checksum(self._model.parameters())
            self._model = self._optimizer = None
        super().close()


def probe_collectives(run_fn: Callable[..., Any], cfg: Any) -> RecipeResult:
    """recipes/collectives.py trains nothing: measured by wrapping, for the run, each op of its
    ``OPS`` table and its ``Ctx.check`` (the recipe has no observer line).

    ``extras["ops"]``: what ``run`` returned (op -> "ok", "fallback: why" or "skipped: why");
    ``extras["op_ms"]``: each op's wall time on this rank (CUDA synchronised);
    ``param_checksum``: the sum of every tensor this rank received and checked (the portable
    fallbacks must give the native ops' sum); ``seconds_per_step``: the whole pass.
    """
    module = sys.modules[run_fn.__module__]
    ops, check = dict(module.OPS), module.Ctx.check
    received: list[torch.Tensor] = []
    op_ms: dict[str, float] = {}
    seen: dict[str, Any] = {}

    def timed(name: str, op: Callable[[Any], str]) -> Callable[[Any], str]:
        def run_op(ctx: Any) -> str:
            seen.update(world_size=ctx.world_size, backend=ctx.backend, device=ctx.device)
            sync = torch.cuda.synchronize if ctx.device.type == "cuda" else lambda *_: None
            sync(ctx.device)
            start = time.perf_counter()
            note = op(ctx)
            sync(ctx.device)
            op_ms[name] = round((time.perf_counter() - start) * 1e3, 3)
            return note

        return run_op

    def recording_check(ctx: Any, actual: Any, expected: Any) -> None:
        if isinstance(expected, torch.Tensor):
            received.append(actual)
        check(ctx, actual, expected)

    module.OPS.update({name: timed(name, op) for name, op in ops.items()})
    module.Ctx.check = recording_check
    try:
        report = run_fn(cfg)
    finally:
        module.OPS.update(ops)
        module.Ctx.check = check
    device = seen["device"]
    return RecipeResult(
        recipe="collectives",
        world_size=seen["world_size"],
        backend=seen["backend"],
        device=str(device),
        losses=[],
        param_checksum=param_checksum(received),
        seconds_per_step=sum(op_ms.values()) / 1e3,
        peak_memory_bytes=peak_memory_bytes(device),
        extras={"ops": report, "op_ms": op_ms},
    )
