"""Activation offloading: what backward needs waits in CPU memory, not on the GPU.

    torchrun --standalone --nproc_per_node=2 -m recipes.activation_offload     # auto: cpu on a GPU
    torchrun --standalone --nproc_per_node=2 -m recipes.activation_offload --checkpoint per_block
    torchrun --standalone --nproc_per_node=2 -m recipes.activation_offload --offload streamed

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/options.py (the command line, from the config).

Autograd keeps the tensors backward needs on the GPU from the forward until backward reaches
them. Here each one goes to host memory as the forward saves it, and comes back when backward asks
for it, at the price of two copies over PCIe per saved tensor and no recompute. The loop is DDP's,
with the forward inside the offload context:

- ``--offload cpu``: torch's ``save_on_cpu(pin_memory=True)``: pinned host buffers, copies on the
  compute stream. Every saved tensor goes, the weights a linear layer saves included (they stay
  on the GPU anyway: copying them saves nothing).
- ``--offload streamed``: ``offload_hooks``, a ``saved_tensors_hooks`` pair written out here: it
  keeps the parameters where they are and copies the rest on a side CUDA stream, so that the
  forward's copies overlap its compute. Backward waits for each copy back (no prefetch).
- ``--offload auto`` (the default): ``cpu`` on a GPU; on a CPU device there is nothing to offload
  from, so ``none``, and the first line says so. ``cpu`` or ``streamed`` there: refused.

``--checkpoint per_block`` composes: a checkpointed block keeps only its input, which is
offloaded like any saved tensor (the recomputation in backward runs under checkpoint's own hooks).
``--checkpoint op_selective`` keeps the matmuls' outputs in selective checkpointing's cache, which
no ``saved_tensors_hooks`` sees: they stay on the GPU. A copy there and back is exact: the
gradients are unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, resolve_precision, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset

# op_selective keeps the outputs of these ops (every nn.Linear here: mm, or addmm with a bias)
MATMULS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]


@dataclass
class OffloadConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    offload: str = option(
        "auto",
        "where saved activations wait for backward: auto (cpu on a GPU, none on CPU) | none | "
        "cpu: torch's save_on_cpu | streamed: offload_hooks, parameters kept, side-stream copies",
        choices=["auto", "none", "cpu", "streamed"],
    )
    checkpoint: str = option(
        "none",
        "none | per_block: each block keeps only its input | op_selective: each block keeps its "
        "matmuls' outputs (on the GPU) and recomputes the rest",
        choices=["none", "per_block", "op_selective"],
    )
    steps: int = option(6, "optimizer steps", at_least=1)
    global_batch_size: int = option(12, "sequences per step, summed over all ranks", at_least=1)
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    seed: int = option(0, "model init and data order, the same on every rank", at_least=0)
    precision: str = option(
        "auto",
        "auto: bf16 autocast on a GPU, fp32 on CPU; fp32: exact (TF32 off)",
        choices=["auto", "fp32", "bf16"],
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        if self.offload in ("cpu", "streamed") and (
            self.backend == "gloo" or not torch.cuda.is_available()
        ):
            raise ValueError(no_device_to_offload_from(self.offload))


def no_device_to_offload_from(offload: str) -> str:
    return (
        f"offload {offload} moves activations from a GPU to host memory, and this run is on CPU, "
        "where they are already; use offload none (or auto), or run with a GPU per rank"
    )


# --8<-- [start:checkpoint]
def checkpoint_blocks(blocks: Iterable[nn.Module], *, keep: list | None = None) -> None:
    """Each block's ``forward`` under a non-reentrant ``checkpoint``, in place (no wrapper: the
    parameter names stay). ``keep``: the ops whose outputs selective checkpointing keeps for
    backward (in a cache of its own, where the device holds them); None: a block keeps only its
    input. Call it before DDP wraps the model."""
    blocks = list(blocks)
    if not blocks:
        raise ValueError("checkpoint_blocks got no block; pass your model's blocks, e.g. layers")
    options: dict = {"use_reentrant": False}  # reentrant needs static_graph=True under DDP
    if keep is not None:  # a fresh cache on every forward: context_fn is called each time
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, keep)
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, **options)


# --8<-- [end:checkpoint]


# --8<-- [start:hooks]
def offload_hooks(model: nn.Module, *, stream: torch.cuda.Stream | None = None):
    """A (pack, unpack) pair for ``torch.autograd.graph.saved_tensors_hooks``: each tensor the
    forward saves for backward is copied to host memory, and back when backward needs it.

    A tensor on a parameter's storage (a linear layer saves its weight) is kept as it is: it stays
    on the device anyway. ``stream``: a side CUDA stream for the copies of CUDA tensors (None:
    synchronous copies, the only kind a CPU tensor gets). Create it before the forward; the hooks
    hold the model's parameter addresses, so make them after the model is on its device.
    """
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor: torch.Tensor):
        if tensor.untyped_storage().data_ptr() in parameters:
            return tensor.detach()  # detach: a pack hook must not return its argument itself
        host = torch.empty(
            tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=tensor.is_cuda
        )  # pinned: the copy from the GPU runs without the CPU waiting for it
        if stream is None or not tensor.is_cuda:
            host.copy_(tensor)
            return tensor.device, host
        # the side stream starts once the compute stream has written the tensor ...
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        # ... and the allocator must not hand its memory to the next op before the copy read it
        tensor.record_stream(stream)
        return tensor.device, host

    def unpack(packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):  # a parameter, kept where it was
            return packed
        device, host = packed
        if stream is None or device.type != "cuda":
            return host.to(device)
        with torch.cuda.stream(stream):  # after the pack's copy to the host: the stream's order
            tensor = host.to(device, non_blocking=True)
        # Pitfall: the compute stream must wait for the copy before backward reads the tensor,
        # and the tensor (allocated on the side stream) must not be reused before it is done with
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(stream)
        tensor.record_stream(compute)
        return tensor

    return pack, unpack


# --8<-- [end:hooks]


# --8<-- [start:train]
def train(cfg: OffloadConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns the global batch's loss of each step (every rank)."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)  # torchrun's, or a world of 1
    try:
        device, rank, world_size = world.device, world.rank, world.world_size
        if cfg.global_batch_size % world_size:
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide across {world_size} "
                f"ranks; use a multiple of {world_size}"
            )
        on_cuda = device.type == "cuda"
        offload = cfg.offload if cfg.offload != "auto" else ("cpu" if on_cuda else "none")
        if offload != "none" and not on_cuda:  # backend auto found fewer GPUs than ranks
            raise ValueError(no_device_to_offload_from(offload))
        precision = resolve_precision(cfg.precision, device)  # bf16 on a GPU, TF32 off for fp32
        bf16 = precision == "bf16"

        # --8<-- [start:loop]
        # Pitfall: the same seed on every rank, or the replicas start different (DDP broadcasts
        # rank 0's weights at construction, but a model built differently still diverges)
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        if cfg.checkpoint != "none":  # before DDP wraps the model
            keep = MATMULS if cfg.checkpoint == "op_selective" else None
            checkpoint_blocks(model.layers.values(), keep=keep)
        model = DDP(model, device_ids=[device.index] if on_cuda else None)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if on_cuda else None
        )  # one kernel on CUDA
        if observer:
            observer.model_ready(model, optimizer)
        if offload == "cpu":  # torch's own: every saved tensor to pinned host memory
            offloading = torch.autograd.graph.save_on_cpu(pin_memory=True)
        elif offload == "streamed":  # the pair above: parameters stay, copies on a side stream
            pack, unpack = offload_hooks(model, stream=torch.cuda.Stream(device))
            offloading = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        else:
            offloading = contextlib.nullcontext()
        if rank == 0:
            print(
                f"offload {offload}, checkpoint {cfg.checkpoint} ({precision}) on "
                f"{world_size} rank(s) of {device.type}"
                + ("" if on_cuda or cfg.offload != "auto" else ": no GPU to offload from"),
                flush=True,
            )

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # Each rank reads a disjoint 1/world_size of every epoch, as in DDP
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        loader = DataLoader(
            dataset,
            batch_size=cfg.global_batch_size // world_size,
            sampler=sampler,
            drop_last=True,
            pin_memory=on_cuda,
        )

        losses, step, epoch = [], 0, 0
        while step < cfg.steps:
            sampler.set_epoch(epoch)
            for inputs, targets in loader:
                if step == cfg.steps:
                    break
                inputs = inputs.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                # what the forward saves for backward goes to host memory as it is saved
                with offloading, torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = lm_loss(model(inputs), targets)
                loss.backward()  # each saved tensor comes back to the GPU when backward needs it
                optimizer.step()
                global_loss = loss.detach().float().clone()
                dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
                losses.append(global_loss.item())
                if rank == 0:
                    print(f"step {step} loss {losses[-1]:.4f}", flush=True)
                if observer:
                    observer.step_end(step, losses[-1])
                step += 1
            epoch += 1
        # --8<-- [end:loop]
        return losses
    finally:
        cleanup_distributed()


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(OffloadConfig, prog="python -m recipes.activation_offload", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), OffloadConfig, argv)
    with exit_on_bad_input():  # a batch that does not divide: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
