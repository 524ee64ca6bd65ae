"""Observers of the recipes that make, load or save a model's state: meta_init (the initial
weights), sharded_checkpoint (a resumed run) and hf_checkpoint (a Hugging Face model)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from recipes.core.memory import model_state_bytes
from recipes.core.observe.base import Observer
from recipes.core.state import all_ranks, full_state_on_rank0
from recipes.toy import ModelConfig

__all__ = ["CheckpointObserver", "HFCheckpointObserver", "MetaInitObserver"]


class MetaInitObserver(Observer):
    """recipes/meta_init.py: the model it built, read when it is ready (``model_ready``), before
    its one forward: fully_shard's root keeps its parameters unsharded after a forward, so every
    figure is read before it. Into ``extras``: ``param_bytes_per_rank`` (each rank's shards) and
    ``full_model_bytes`` (the whole model, unsharded); the checksum and (if asked) the full state
    gathered to rank 0 are the initial weights. One "step": the initial model's forward, with no
    optimizer (``model_ready(model, None)``).
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(1, keep_final_state=keep_final_state)

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        super().model_ready(model, optimizer)
        held = model_state_bytes(model, optimizer)
        self.memory_per_rank = all_ranks(held)
        self.extras.update(
            full_model_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
            param_bytes_per_rank=[m["param_bytes"] for m in self.memory_per_rank],
        )
        state, self.param_checksum = full_state_on_rank0(model)  # a collective: every rank
        if self.keep_final_state and self.rank == 0:
            self.final_state = state
        self._restart_clock()  # the step's time is the forward's, not this reading's

    def measure(self, step: int) -> None:
        self.close()  # all of it was read before the forward
        self._model = self._optimizer = None


class CheckpointObserver(Observer):
    """recipes/sharded_checkpoint.py: the final state gathered whole to rank 0 for each of its
    strategies (classic FSDP's flat parameters too, which ``Observer`` would read as they are), its
    checksum over that state, and ``strategy`` in ``extras``. The recipe calls ``model_ready`` after
    it loaded a checkpoint, so the loaded state is measured there too: a resumed run with no step
    left to train (the same command again) has it as its final state; a last step replaces it."""

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.extras["strategy"] = cfg.strategy

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        self.gather_final_state()

    def gather_final_state(self) -> None:
        state, self.param_checksum = full_state_on_rank0(self._model)  # every rank: a collective
        if self.keep_final_state and self.rank == 0:
            self.final_state = state


class HFCheckpointObserver(Observer):
    """recipes/hf_checkpoint.py: a fully_shard run of a Hugging Face model. Into ``extras``:
    ``param_bytes_per_rank`` (each rank's shards, read when the model is ready, before any
    forward). The checksum sums ``model.parameters()`` (GPT-2's tied embedding once) shard by
    shard; a run of 0 steps (a load, then the export) has the loaded weights as its final state.
    tokens/s counts the recipe's sequences; the FLOPs formula is the cookbook model's: left out.
    """

    counts_model_flops = False

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.model_config = ModelConfig(
            vocab_size=128, seq_len=16, dim=64, n_layers=2, n_heads=4
        )  # only seq_len counts: tokens per sequence

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        self.extras["param_bytes_per_rank"] = all_ranks(
            sum(p.to_local().nbytes for p in model.parameters())
        )
        if self.steps == 0:
            self.gather_final_state()
        self._restart_clock()

    def gather_final_state(self) -> None:
        local = sum(p.to_local().double().sum().item() for p in self._model.parameters())
        checksum = torch.tensor([local], dtype=torch.float64, device=self.device)
        dist.all_reduce(checksum)  # every rank: the sum over all shards
        self.param_checksum = float(checksum.item())
        if self.keep_final_state:
            state, _ = full_state_on_rank0(self._model)
            if self.rank == 0:
                self.final_state = state
