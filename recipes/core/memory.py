"""Per-rank memory accounting: how many bytes of parameters, gradients and optimizer state THIS rank
holds.

``model_state_bytes(model, optimizer)`` counts tensors, not allocator statistics, so it gives the
same answer on CPU and GPU and needs no CUDA: the sharding recipes use it to assert "1/N of DDP's
bytes".

What is counted, exactly:

- A tensor is counted by the bytes of its storage (``untyped_storage().nbytes()``), once per
  storage: views into one flat buffer (classic FSDP's ``use_orig_params=True`` parameters,
  fully_shard's gradients, which are views into one reduce-scatter output per group) count that
  buffer once, and the padding FSDP adds so that a flat buffer divides by N is counted, because the
  rank holds it. A storage that FSDP has freed (resized to 0 bytes) counts 0.
- DTensors (fully_shard parameters, gradients and optimizer state) count their local tensor
  (``to_local()``): the shard this rank holds, not the global size.
- ``param_bytes``: every parameter of ``model.parameters()``; for classic
  ``FullyShardedDataParallel`` also each flat parameter's local shard and, while it is allocated,
  its unsharded (all-gathered) copy; for ``fully_shard`` also each parameter's unsharded copy while
  it is allocated. So a strategy that keeps unsharded parameters at the measuring point (e.g.
  SHARD_GRAD_OP between forward and backward) shows it.
- ``grad_bytes``: every ``.grad`` that is not None (None counts 0); for classic FSDP also the flat
  parameter's saved gradient shard and its CPU-offloaded gradient; for ``fully_shard`` also the
  unsharded gradients it accumulates while gradient sync is off
  (``set_requires_gradient_sync(False)``), which live on internal unsharded parameters that
  ``model.parameters()`` does not show, and the sharded gradients HSDP holds back while its
  all-reduce is off (``set_requires_all_reduce(False)``).
- ``optimizer_bytes``: every tensor in ``optimizer.state`` (including AdamW's scalar ``step``); for
  ``ZeroRedundancyOptimizer`` its local optimizer's state (``optimizer.optim.state``), which holds
  only this rank's partition (the wrapper's own ``.state`` stays empty until a ``load_state_dict``).

Not counted: activations, DDP's gradient buckets, FSDP's communication staging buffers, a
consolidated optimizer state dict. Offloaded tensors are counted wherever they live (host memory
included). Measure right after ``optimizer.step()`` and before ``zero_grad()``: gradients are still
present. The classic-FSDP and fully_shard internals read here are private attributes (``_handle``,
``_local_shard``, ``_fsdp_param_groups``...); each is read with ``getattr`` and a default, so a
torch that renames one undercounts that item instead of failing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "model_state_bytes",
    "tensor_storage_bytes",
    "measure_last_forward",
    "SavedTensorBytes",
]


def tensor_storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct, allocated storages behind ``tensors`` (None and freed storages count
    0)."""
    from torch.distributed.tensor import DTensor

    seen: set[tuple[str, int]] = set()
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            continue
        key = (str(storage.device), storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += nbytes
    return total


def _fsdp_internals(
    model: nn.Module,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Parameter and gradient tensors that FSDP holds outside ``model.parameters()``."""
    params: list[torch.Tensor | None] = []
    grads: list[torch.Tensor | None] = []
    from torch.distributed.fsdp import FullyShardedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without fully_shard
        FSDPModule = ()  # type: ignore[assignment]
    for module in model.modules():
        if isinstance(module, FullyShardedDataParallel):
            handle = getattr(module, "_handle", None)
            if handle is None:
                continue
            flat = handle.flat_param
            params += [
                getattr(flat, "_local_shard", None),
                _tensor_or_none(getattr(flat, "_full_param_padded", None)),
            ]
            grads += [
                flat.grad,
                getattr(flat, "_saved_grad_shard", None),
                getattr(flat, "_cpu_grad", None),
            ]
        elif FSDPModule and isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # older torch: a single optional group
                groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
            for group in groups:
                # HSDP with set_requires_all_reduce(False): the reduce-scattered (sharded)
                # gradients wait here for the all-reduce, not in .grad
                grads.append(getattr(group, "_partial_reduce_output", None))
                for fsdp_param in group.fsdp_params:
                    # exists after the 1st all-gather
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    params.append(unsharded)
                    grads += [
                        None if unsharded is None else unsharded.grad,
                        getattr(fsdp_param, "unsharded_accumulated_grad", None),
                    ]
    return params, grads


def _tensor_or_none(value: object) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


def _optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    states = [optimizer.state]
    # ZeroRedundancyOptimizer: the local partition's optimizer
    local = getattr(optimizer, "optim", None)
    if isinstance(local, torch.optim.Optimizer):
        states.append(local.state)
    tensors = []
    for state in states:
        for per_param in state.values():
            tensors += [value for value in per_param.values() if isinstance(value, torch.Tensor)]
    return tensors


# --8<-- [start:model_state_bytes]
def model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """``{"param_bytes", "grad_bytes", "optimizer_bytes"}`` this rank holds (see the module
    docstring).

    Works for plain modules, DDP, classic FSDP (``use_orig_params`` True or False), ``fully_shard``
    (DTensor parameters) and ``ZeroRedundancyOptimizer``. Call it after ``optimizer.step()``, before
    ``zero_grad()``.
    """
    params: list[torch.Tensor | None] = list(model.parameters())
    grads: list[torch.Tensor | None] = [p.grad for p in model.parameters()]
    fsdp_params, fsdp_grads = _fsdp_internals(model)
    return {
        "param_bytes": tensor_storage_bytes(params + fsdp_params),
        "grad_bytes": tensor_storage_bytes(grads + fsdp_grads),
        "optimizer_bytes": tensor_storage_bytes(_optimizer_tensors(optimizer)),
    }


# --8<-- [end:model_state_bytes]


def measure_last_forward(model: nn.Module, *, steps: int, extras: dict[str, Any]) -> list[Any]:
    """Measure the run's last forward from a hook, so that the training loop carries none of it:
    ``extras["param_bytes_after_forward"]`` is the parameter bytes this rank holds just after it
    (with SHARD_GRAD_OP, or no reshard after forward: the unsharded parameters kept for backward).

    The loop must call ``model`` once per step. Returns the hook's handle (``handle.remove()``
    takes it off).
    """
    calls = 0

    def after(module: nn.Module, args: Any, output: Any) -> None:
        nonlocal calls
        if calls == steps - 1:
            extras["param_bytes_after_forward"] = model_state_bytes(module)["param_bytes"]
        calls += 1

    return [model.register_forward_hook(after)]


class SavedTensorBytes(TorchDispatchMode):
    """Bytes a forward pass (and its loss) leaves alive for backward, counted once per storage.

    Enter it just before the forward (``CheckpointingObserver`` in recipes/core/observe/training.py
    does, from a forward pre-hook on the model) and leave it after backward. Whatever keeps a tensor
    for backward - autograd's saved tensors, checkpoint's copy of a region's input, the cache where
    selective checkpointing keeps what its policy saves - keeps its storage alive after the forward.
    So the mode notes a weak reference to the storage of every tensor an op produces (it sees every
    op, inside checkpointed regions too) and, at backward's first op (before any node has run and
    freed what it saved), counts those still alive: ``total``. Pitfall: ``saved_tensors_hooks``
    alone misses selective checkpointing's cache (it holds no saved tensors) and would report
    op_selective as small as per_block. Parameters and views of them are excluded (they exist
    anyway), and so is the batch (made before the forward). Autocast's cache of low-precision
    weights is freed when autocast exits, before backward: not counted. ``note_input(key, tensor)``:
    a tensor to count apart too (a checkpointed region's input); ``input_bytes[key]``: the bytes of
    those still alive at the count."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._made: list = []
        self._inputs: dict[Any, list] = {}
        self.total: int | None = None  # set at backward's first op
        self.input_bytes: dict[Any, int] = {}

    @staticmethod
    def _note(tensors, notes: list) -> None:
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                notes.append((StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))

    def _alive_bytes(self, notes: list) -> int:
        # A freed storage's address can be reused by a later one: only a live reference names it.
        alive = {pointer: nbytes for ref, pointer, nbytes in notes if not ref.expired()}
        return sum(nbytes for pointer, nbytes in alive.items() if pointer not in self._params)

    def note_input(self, key: Any, tensor: torch.Tensor) -> None:
        if self.total is None:
            self._note((tensor,), self._inputs.setdefault(key, []))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # -1 outside backward: the first op with a graph task is backward's first
        if self.total is None and torch._C._current_graph_task_id() != -1:
            self.total = self._alive_bytes(self._made)
            self.input_bytes = {
                key: self._alive_bytes(notes) for key, notes in self._inputs.items()
            }
            self._made, self._inputs = [], {}
        out = func(*args, **(kwargs or {}))
        if self.total is None:
            self._note(out if isinstance(out, (tuple, list)) else (out,), self._made)
        return out
