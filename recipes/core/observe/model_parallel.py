"""Observers of the recipes that split the model itself: tensor_parallel, hybrid_parallel,
context_parallel (the sequence) and expert_parallel (the experts)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Shard

from recipes.core.observe.base import Observer
from recipes.core.result import param_checksum
from recipes.core.state import all_ranks
from recipes.toy import MODEL_PRESETS, Block, TransformerLM

__all__ = [
    "ContextParallelObserver",
    "ExpertParallelObserver",
    "HybridObserver",
    "TensorParallelObserver",
]


class TensorParallelObserver(Observer):
    """recipes/tensor_parallel.py: the split, measured on the model it trains (into ``extras``).

    ``tp_size``: the ranks its parameters are split over; ``sequence_parallel``: the final norm
    runs on sequence shards (its input is a Shard(1) DTensor), and ``residual_seq_len_per_rank``
    is the sequence length of the residual stream the first block receives (1/N of it with
    sequence parallel); ``loss_parallel``: the logits come out as a DTensor split over the
    vocabulary; ``compiled``: the blocks run torch.compile'd code; ``param_bytes_per_rank``,
    ``param_bytes_unsplit`` (the whole model's), their fraction and ``optimizer_bytes_per_rank``:
    this rank's, after the first step.
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self._tp_hooks: list[Any] = []

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        params = list(model.parameters())
        blocks = [m for m in model.modules() if isinstance(m, Block)]
        meshes = {p.device_mesh.size() for p in params if isinstance(p, DTensor)}
        self.extras.update(
            {
                "tp_size": meshes.pop() if len(meshes) == 1 else None,
                "param_bytes_unsplit": sum(p.numel() * p.element_size() for p in params),  # global
                "compiled": all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in blocks),
            }
        )
        # Registered after apply_tp's own hooks: these see the inputs as the split made them.
        self._tp_hooks = [
            blocks[0].register_forward_pre_hook(self._record_residual),
            model.norm.register_forward_pre_hook(self._record_norm_input),
            model.register_forward_hook(self._record_logits),
        ]

    def measure(self, step: int) -> None:
        if step == 0:
            self.close_tp_hooks()  # the first forward showed all there is to see
        super().measure(step)
        if step == 0:  # memory_per_rank: measured by the step above
            mine = self.memory_per_rank[self.rank]
            self.extras.update(
                {
                    "param_bytes_per_rank": mine["param_bytes"],
                    "param_fraction_per_rank": mine["param_bytes"]
                    / self.extras["param_bytes_unsplit"],
                    "optimizer_bytes_per_rank": mine["optimizer_bytes"],
                }
            )

    def close_tp_hooks(self) -> None:
        for hook in self._tp_hooks:
            hook.remove()
        self._tp_hooks = []

    def close(self) -> None:
        self.close_tp_hooks()
        super().close()

    def _record_residual(self, module: nn.Module, args: Any) -> None:
        residual = args[0].to_local() if isinstance(args[0], DTensor) else args[0]
        self.extras["residual_seq_len_per_rank"] = residual.shape[1]

    def _record_norm_input(self, module: nn.Module, args: Any) -> None:
        self.extras["sequence_parallel"] = isinstance(args[0], DTensor) and args[0].placements == (
            Shard(1),
        )

    def _record_logits(self, module: nn.Module, args: Any, output: Any) -> None:
        self.extras["loss_parallel"] = isinstance(output, DTensor) and any(
            isinstance(p, Shard) and p.dim in (-1, output.ndim - 1) for p in output.placements
        )


class HybridObserver(Observer):
    """recipes/hybrid_parallel.py: the split, measured on the model (or pipeline stage) it trains
    (into ``extras``).

    ``param_bytes_per_rank`` (this rank's, after the first step), ``param_bytes_unsplit`` (the
    whole model's) and their fraction; ``sequence_parallel``: a LayerNorm ran on sequence shards
    (its input a Shard(1) DTensor). With a pipeline (``cfg.pp`` > 1) each rank holds one stage:
    the final state is every stage's, gathered from the ranks that hold them, in model order
    (pp is the outermost mesh dim, so rank order is stage order).
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.pipelined = cfg.pp > 1
        with torch.device("meta"):  # the sizes only
            whole = TransformerLM(MODEL_PRESETS[cfg.model])
        self.extras.update(
            {
                "sequence_parallel": False,
                "param_bytes_unsplit": sum(
                    p.numel() * p.element_size() for p in whole.parameters()
                ),
            }
        )
        self._norm_hooks: list[Any] = []

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        # Registered after TP's own input hooks: these see the inputs as the split made them.
        self._norm_hooks = [
            m.register_forward_pre_hook(self._record_norm_input)
            for m in model.modules()
            if isinstance(m, nn.LayerNorm)
        ]

    def _record_norm_input(self, module: nn.Module, args: Any) -> None:
        if isinstance(args[0], DTensor) and any(
            isinstance(p, Shard) and p.dim == 1 for p in args[0].placements
        ):
            self.extras["sequence_parallel"] = True

    def measure(self, step: int) -> None:
        if step == 0:
            self.close_norm_hooks()  # the first step's forwards showed all there is to see
        super().measure(step)
        if step == 0:  # memory_per_rank: measured by the step above
            held = self.memory_per_rank[self.rank]["param_bytes"]
            self.extras.update(
                {
                    "param_bytes_per_rank": held,
                    "param_fraction_per_rank": held / self.extras["param_bytes_unsplit"],
                }
            )

    def gather_final_state(self) -> None:
        if not self.pipelined:
            return super().gather_final_state()
        # Each stage's full state (TP x FSDP all-gathered inside it), then every rank's: a
        # collective of the world. Not cpu_offload: rank 0 does not hold every stage.
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        local = {
            name: t.detach().cpu().clone()
            for name, t in get_model_state_dict(self._model, options=options).items()
        }
        state: dict[str, torch.Tensor] = {}
        for piece in all_ranks(local):  # a stage's dp x tp ranks hold the same state
            for name, tensor in piece.items():
                state.setdefault(name, tensor)
        self.param_checksum = param_checksum(state.values())
        if self.keep_final_state and self.rank == 0:
            self.final_state = state

    def close_norm_hooks(self) -> None:
        for hook in self._norm_hooks:
            hook.remove()
        self._norm_hooks = []

    def close(self) -> None:
        self.close_norm_hooks()
        super().close()


class ContextParallelObserver(Observer):
    """recipes/context_parallel.py: the split, measured on the model's input (into ``extras``).

    ``positions_per_rank``: how many positions of each sequence this rank's model received;
    ``score_entries_per_rank``: the query-key scores each rank computes per head under a causal
    mask, from the positions every rank's model received (its work: equal under load balancing);
    ``cp_size``: the ranks the sequence is split over (the world); ``impl`` and ``load_balance``:
    as configured.
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.extras.update(impl=cfg.impl, load_balance=cfg.load_balance)
        self._positions: torch.Tensor | None = None
        self._pre_hook: Any = None

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        self._pre_hook = model.register_forward_pre_hook(self._record_positions, with_kwargs=True)

    def _record_positions(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        positions = kwargs.get("positions")
        if positions is None:  # the model's default: 0..seq-1 of what it received
            positions = torch.arange(args[0].shape[1])
        self._positions = positions.reshape(-1, positions.shape[-1])[0].detach().cpu()

    def measure(self, step: int) -> None:
        if step == self.steps - 1:  # a collective: every rank's positions, in rank order
            layout = all_ranks(self._positions)
            self.extras.update(
                cp_size=self.world_size,
                positions_per_rank=len(self._positions),
                score_entries_per_rank=[
                    sum(int((queries[:, None] >= keys[None, :]).sum()) for keys in layout)
                    for queries in layout
                ],
            )
        super().measure(step)

    def close(self) -> None:
        if self._pre_hook is not None:
            self._pre_hook.remove()
            self._pre_hook = None
        super().close()


class ExpertParallelObserver(Observer):
    """recipes/expert_parallel.py: the placement, read off the model's MoE layers (into
    ``extras``), and the full state with every rank's experts gathered.

    ``ep_size`` (the ranks the experts are spread over), ``experts_per_rank``, ``top_k`` and
    ``capacity_factor`` (None: no capacity, nothing dropped). The final state and its checksum
    hold every expert: each rank's slices of ``w_in``/``w_out`` all-gathered over the EP group
    (a collective), the replicated parameters as they are. ``model_config``: the FLOPs a token
    costs, for tokens/s and MFU: top_k expert MLPs the size of the dense one (router left out).
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        dense = MODEL_PRESETS[cfg.model]
        self.model_config = dataclasses.replace(dense, mlp_ratio=dense.mlp_ratio * cfg.top_k)
        self._moes: list[nn.Module] = []

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().model_ready(model, optimizer)
        self._moes = [
            m for m in model.modules() if hasattr(m, "ep_group") and hasattr(m, "num_experts")
        ]
        moe = self._moes[0]
        self.extras.update(
            ep_size=dist.get_world_size(moe.ep_group) if moe.ep_group is not None else 1,
            experts_per_rank=moe.w_in.shape[0],
            top_k=moe.top_k,
            capacity_factor=moe.capacity_factor if moe.capacity_factor < float("inf") else None,
        )

    def gather_final_state(self) -> None:
        sliced = {id(p): moe.ep_group for moe in self._moes for p in (moe.w_in, moe.w_out)}
        state = {}
        for name, p in self._model.named_parameters():
            group = sliced.get(id(p))
            if group is not None:  # this rank's experts: every rank's, in rank order
                parts = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, p.detach().contiguous(), group=group)
                p = torch.cat(parts)
            state[name] = p.detach().cpu().clone()
        self.param_checksum = param_checksum(state.values())
        if self.keep_final_state:
            self.final_state = state

    def close(self) -> None:
        self._moes = []
        super().close()
