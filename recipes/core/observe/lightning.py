"""The harness's view of recipes/lightning_trainer.py: an ``Observer`` that is a Lightning
Callback, added to the recipe's Trainer through ``train(cfg, observer=...)``.

The Trainer owns the loop, so the observer learns from Lightning's hooks what a hand-written loop
tells it: ``on_train_start`` is ``model_ready`` (the strategy has wrapped the model and built the
optimizer), the end of each optimizer step's last micro-batch is ``step_end``. At the last step,
while the process group exists, it gathers the full weights to rank 0 whatever wraps them (DDP,
FSDP units, DTensor TP shards) and measures ``param_fraction_per_rank``: the parameter elements
rank 0 holds over the whole model's (1 under DDP, 1/N under FULL_SHARD).

Under ``ddp_spawn`` Lightning pickles the Trainer, this observer with it, into the processes it
starts: rank 0's copy writes what it measured (the final state too) to a file named in the parent,
and the parent's copy reads it in ``close``, which ``prove`` calls once ``train`` returned.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from recipes.core.observe.base import Observer
from recipes.core.state import full_state_on_rank0

__all__ = ["LightningObserver"]

_TRAVELS = (
    "durations",
    "param_checksum",
    "output_dtype",
    "extras",
    "rank",
    "world_size",
    "backend",
    "device",
    "final_state",
)


class LightningObserver(Observer, L.Callback):
    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        Observer.__init__(self, cfg.steps, keep_final_state=keep_final_state)
        self.extras["strategy"] = cfg.strategy
        self._trainer: L.Trainer | None = None
        self._in_child = False
        self._spawn_file = None
        if cfg.strategy == "ddp_spawn":
            handle, self._spawn_file = tempfile.mkstemp(prefix="lightning-observer-", suffix=".pt")
            os.close(handle)
            os.remove(self._spawn_file)  # rank 0 of the spawned processes creates it

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_in_child": True}  # only ever pickled to go to a child

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._trainer = trainer
        self.extras["lightning_precision"] = str(trainer.precision)
        self.model_ready(pl_module.model, trainer.optimizers[0])

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:  # an optimizer step ended
            loss = trainer.callback_metrics.get("train_loss", torch.tensor(float("nan")))
            self.step_end(trainer.global_step - 1, float(loss))

    def measure(self, step: int) -> None:
        if step != self.steps - 1:
            return
        module = self._trainer.lightning_module
        held = sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters()
        )
        # every rank takes part in the gather (a collective); rank 0 gets the state
        state, self.param_checksum = full_state_on_rank0(self._trainer.strategy.model)
        state = {name.removeprefix("model."): t for name, t in state.items()}
        if self.rank == 0:
            self.extras["param_fraction_per_rank"] = held / max(
                sum(t.numel() for t in state.values()), 1
            )
            if self.keep_final_state:
                self.final_state = state
        self.close()
        self._model = self._optimizer = self._trainer = None
        if self._in_child and self.rank == 0 and self._spawn_file:
            torch.save({key: getattr(self, key) for key in _TRAVELS}, self._spawn_file)

    def close(self) -> None:
        super().close()
        if not self._in_child and self._spawn_file and os.path.exists(self._spawn_file):
            self.__dict__.update(torch.load(self._spawn_file, weights_only=False))
            os.remove(self._spawn_file)
