"""The observer of recipes/finetune.py: what freezing saves, measured on the model it trains,
against full fine-tuning of the same model built with the recipe's own public functions."""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from recipes import finetune
from recipes.core.memory import model_state_bytes
from recipes.core.observe.base import Observer
from recipes.core.result import param_checksum
from recipes.core.state import all_ranks, full_state_on_rank0
from recipes.toy import MODEL_PRESETS

__all__ = ["FinetuneObserver"]


class FinetuneObserver(Observer):
    """recipes/finetune.py: what freezing saves, measured on the model it trains (into ``extras``).

    When the model is ready: ``trainable_params``, ``total_params`` (tied weights once),
    ``trainable_fraction``, ``trainable_names``, and, unless the mode is full, full fine-tuning's
    bytes of the same model and strategy (``full_finetune_memory_per_rank``): built with the
    recipe's own ``adapt``/``wrap``, one step, read, freed. Under DDP a comm hook counts the
    gradient bytes all-reduced (``reduced_bytes_per_step``). After the last step, before the
    recipe's next ``zero_grad``: ``memory_per_rank`` (this run's), ``bytes_saved_per_rank``,
    ``frozen_grads_none_per_rank``, the optimizer's tensors and state tensors. The final state
    holds the model's parameter names (GPT-2's tied ``lm_head.weight`` once), its checksum the
    recipe's earlier one. No FLOPs count: 6 x parameters counts weight gradients that frozen
    weights never compute.
    """

    counts_model_flops = False

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.cfg = cfg
        self.model_config = MODEL_PRESETS[cfg.model] if cfg.arch == "cookbook" else finetune.HF_DATA
        self.extras.update(mode=cfg.mode, strategy=cfg.strategy, arch=cfg.arch)
        self._full_bytes: dict[str, int] | None = None
        self._reduced: dict[str, int] | None = None

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        base = getattr(model, "module", model)  # DDP's wrapped module
        params = list(base.parameters())
        trainable = sum(p.numel() for p in params if p.requires_grad)
        total = sum(p.numel() for p in params)
        self.extras.update(
            trainable_params=trainable,
            total_params=total,
            trainable_fraction=trainable / total,
            trainable_names=[n for n, p in base.named_parameters() if p.requires_grad],
        )
        if self.cfg.mode != "full":  # before the clock starts: not the run's time
            self._full_bytes = self._full_finetune_bytes(base)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self._reduced = {"bytes": 0}
            model.register_comm_hook(None, self._count_and_allreduce)
        super().model_ready(model, optimizer)

    def _count_and_allreduce(self, state, bucket):  # DDP checks the annotations: none
        self._reduced["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(None, bucket)  # what DDP does without a hook: the average

    def _full_finetune_bytes(self, trained: nn.Module) -> dict[str, int]:
        """Every parameter trainable, the same wrapper and precision: the bytes after one step."""
        # mode full drops the LoRA options too: the config refuses them outside mode lora
        cfg = dataclasses.replace(self.cfg, mode="full", lora_targets="")
        first = next(trained.parameters())
        device = first.device
        precision = finetune.resolve_precision(cfg.precision, device)
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        model, _ = finetune.adapt(cfg, "full")
        wrapped = finetune.wrap(
            model,
            cfg.strategy,
            mesh=getattr(first, "device_mesh", None),
            device=device,
            low=low,
            block_types=finetune.ready_made_targets(cfg.arch).block_types,
        )
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if device.type == "cuda" else None
        )
        per_rank = cfg.global_batch_size // (dist.get_world_size() if dist.is_initialized() else 1)
        tokens = (
            finetune.make_dataset(self.model_config, cfg.global_batch_size, seed=cfg.seed)
            .tokens[:per_rank]
            .to(device)
        )
        autocast = low is not None and cfg.strategy == "ddp"
        with torch.autocast(device.type, dtype=low or torch.float32, enabled=autocast):
            loss = finetune.lm_loss(finetune.logits_of(wrapped(tokens[:, :-1])), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        held = model_state_bytes(model, optimizer)
        del model, wrapped, optimizer, loss
        gc.collect()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        return held

    def measure(self, step: int) -> None:
        if step == self.steps - 1:  # after the optimizer step, before the next zero_grad
            base = getattr(self._model, "module", self._model)
            own = model_state_bytes(self._model, self._optimizer)
            full = self._full_bytes or own
            self.extras.update(
                full_finetune_memory_per_rank=all_ranks(full),
                bytes_saved_per_rank=all_ranks(sum(full.values()) - sum(own.values())),
                frozen_grads_none_per_rank=all_ranks(
                    all(p.grad is None for p in base.parameters() if not p.requires_grad)
                ),
                optimizer_tensors=sum(len(g["params"]) for g in self._optimizer.param_groups),
                optimizer_state_tensors=len(self._optimizer.state),
                reduced_bytes_per_step=(
                    self._reduced["bytes"] / self.steps if self._reduced else None
                ),
            )
            super().measure(step)
            self.memory_per_rank = all_ranks(own)  # after the last step, as full's was read
        else:
            super().measure(step)

    def gather_final_state(self) -> None:
        names = [n for n, _ in getattr(self._model, "module", self._model).named_parameters()]
        state, _ = full_state_on_rank0(self._model)  # every rank: a collective; rank 0 has it
        state = {name: state[name] for name in names} if state else {}
        self.param_checksum = param_checksum(state.values())
        if self.keep_final_state and self.rank == 0:
            self.final_state = state
