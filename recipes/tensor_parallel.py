r"""Tensor parallelism with DTensor: every layer's weights split across ranks, the same model.

    torchrun --standalone --nproc_per_node=2 -m recipes.tensor_parallel
    torchrun --standalone --nproc_per_node=4 -m recipes.tensor_parallel --sequence-parallel \
        --loss-parallel
    python -m recipes.tensor_parallel                   # a world of 1: tensor-parallel degree 1

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/parallelize.py (``ReplicateParallel``, ``check_tp_fits``),
recipes/options.py (the command line, from the config).

The whole world is one tensor-parallel group (a 1-D DeviceMesh named "tp"); for tensor parallel
inside each of several data-parallel replicas see recipes.hybrid_parallel. ``tp_plan`` below is
the Megatron-LM split, written with ``torch.distributed.tensor.parallel`` as torchtitan's
``parallelize.py`` does, and ``train`` hands it to ``parallelize_module`` (recipes/parallelize.py's
``apply_tp`` with ``transformer_lm_plan`` does the same, with checks, for the recipes that compose;
tests/test_tensor_parallel.py asserts they agree):

- attention: ``wq``/``wk``/``wv`` column-wise (each rank computes n_heads / N whole heads; the
  model's attention infers its local head count from the projection's output size), ``wo``
  row-wise (its all-reduce sums the heads' contributions);
- MLP: ``w_in`` column-wise, ``w_out`` row-wise: one all-reduce per MLP, none between the two
  matmuls;
- embeddings row-wise (vocabulary rows split), the output head column-wise (vocabulary columns
  split);
- ``--sequence-parallel``: the norms and residual stream are split along the sequence instead of
  replicated (the all-reduces become reduce-scatter + all-gather; activations take 1/N of the
  memory);
- ``--loss-parallel``: the logits stay split over the vocabulary and cross-entropy is computed on
  the shards (``loss_parallel()``), so the full [batch, seq, vocab] logits never exist on one rank.

Every tensor-parallel rank must see the SAME batch (it computes a part of every sample, not a part
of the batch). The losses and weights equal single-process training (tests/test_tensor_parallel.py,
worlds of 2 and 4); forward outputs and full gradients equal the unsplit model's. Runs on gloo/CPU
and NCCL. It prints one line per step from rank 0: the step and the loss of the whole batch, which
every rank computed.

Speed: TP alone has no mixed-precision policy of its own, so ``--precision auto`` (bf16 on a GPU) is
autocast around the forward, as torchtitan does; AdamW is fused. Every op on a DTensor pays for
sharding propagation on the host, so on a GPU this recipe compiles each block by default
(``--eager`` turns it off): the compiled blocks trace the DTensor ops once; the replicated parts
outside them (embeddings, norm, output head) still pay DTensor's host cost (results/bench/).
fp16 loss scaling is recipes/amp.py's lesson.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.parallelize import ReplicateParallel, check_tp_fits
from recipes.toy import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset


@dataclass
class TPConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    global_batch_size: int = option(
        12,
        "sequences per optimizer step; every tensor-parallel rank computes a part of each",
        at_least=1,
    )
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    # the same seed -> the same weights and data order on every rank, on any world size
    seed: int = option(0, "model init and data order", at_least=0)
    precision: str = option(
        "auto",
        "auto: bf16 autocast on a GPU, fp32 on CPU; fp32: exact (TF32 off); tf32: TF32 "
        "matmuls (CUDA)",
        choices=["auto", "fp32", "tf32", "bf16"],
    )
    sequence_parallel: bool = option(
        False,
        "split norms and the residual stream along the sequence (Shard(1)) instead of "
        "replicating them",
    )
    loss_parallel: bool = option(
        False,
        "keep the logits split over the vocabulary and compute cross-entropy on the shards "
        "(loss_parallel())",
    )
    compile: bool = option(
        False,
        "torch.compile each transformer block (and the loss) after the split; on a GPU it "
        "is on unless --eager",
    )
    eager: bool = option(
        False,
        "on a GPU, skip the torch.compile that TP turns on there (DTensor's sharding "
        "propagation then runs on the host for every op)",
    )
    compile_backend: str = option(
        "inductor", "torch.compile's backend", choices=["inductor", "aot_eager", "eager"]
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        if self.compile and self.eager:
            raise ValueError("compile and eager contradict each other: pass one of them")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The forward's autocast dtype (None: fp32), after setting the fp32 matmul mode."""
    if precision == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        precision = "bf16" if cuda_bf16 else "fp32"
    if precision == "tf32" and device.type != "cuda":
        raise ValueError(
            f"--precision tf32 is a CUDA matmul mode and this run is on "
            f"{device.type}; use --precision fp32 (or bf16)"
        )
    if device.type == "cuda":  # a process-wide switch: set it every run, never inherit it
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = (
            precision == "tf32"
        )
    return torch.bfloat16 if precision == "bf16" else None


# --8<-- [start:plan]
def tp_plan(*, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """The Megatron-LM split of recipes/toy.py's TransformerLM: module path (``*`` = any one
    name) -> how its weights and activations are split, as ``parallelize_module`` takes it."""
    # Between blocks the residual stream is either replicated (every rank holds all of it) or, with
    # sequence parallel, split along the sequence dim: Shard(1) of [batch, seq, dim].
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        # Row-wise on an embedding splits the vocabulary rows; each rank looks up the ids it owns
        # and the partial results are summed (or reduce-scattered into the sequence shards).
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        # Position embeddings are [seq, dim]: their sequence dim is 0, so their shard is Shard(0).
        "pos_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(0) if sequence_parallel else Replicate()
        ),
        # Column-wise q/k/v: rank r gets heads [r*H/N, (r+1)*H/N): attention needs no communication.
        "layers.*.attn.wq": ColwiseParallel(),
        "layers.*.attn.wk": ColwiseParallel(),
        "layers.*.attn.wv": ColwiseParallel(),
        # Row-wise wo: takes its input's head shard, sums partial outputs across ranks.
        "layers.*.attn.wo": RowwiseParallel(output_layouts=residual),
        "layers.*.mlp.w_in": ColwiseParallel(),
        "layers.*.mlp.w_out": RowwiseParallel(output_layouts=residual),
        # Column-wise head: each rank computes logits for its slice of the vocabulary, all-gathered
        # (Replicate) unless loss parallel keeps them a DTensor sharded on the last dim.
        "output": ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    norms = ("layers.*.attn_norm", "layers.*.mlp_norm", "norm")
    if sequence_parallel:
        # LayerNorm normalizes over dim, so it runs on sequence shards unchanged...
        plan.update({name: SequenceParallel() for name in norms})
        # ...but attention and the MLP need whole sequences: all-gather them on the way in.
        # Pitfall: without these, q/k/v see a sequence shard and attention is silently wrong.
        for name in ("layers.*.attn", "layers.*.mlp"):
            plan[name] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
    else:
        # Replicated norms whose parameters still become DTensors. Pitfall: a model with both
        # DTensor and plain parameters fails in fused/foreach AdamW and clip_grad_norm_ on GPU.
        plan.update({name: ReplicateParallel() for name in norms})
    return plan


# --8<-- [end:plan]


# --8<-- [start:train]
def train(cfg: TPConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns the loss of each step (the same on every rank)."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)
    try:
        device, model_cfg = world.device, MODEL_PRESETS[cfg.model]
        rank, use_cuda = world.rank, world.device.type == "cuda"
        # Every dimension the plan splits must divide by the tensor-parallel size.
        check_tp_fits(
            world.world_size,
            n_heads=model_cfg.n_heads,
            mlp_width=model_cfg.mlp_ratio * model_cfg.dim,
            vocab_size=model_cfg.vocab_size,
            seq_len=model_cfg.seq_len,
        )
        dtype = autocast_dtype(cfg.precision, device)
        tp_mesh = init_device_mesh(device.type, (world.world_size,), mesh_dim_names=("tp",))
        # --8<-- [start:loop]
        # Same seed everywhere: each rank builds the full model, then keeps only its shards. (For a
        # model that does not fit one device, build on the "meta" device and initialize after.)
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        plan = tp_plan(sequence_parallel=cfg.sequence_parallel, loss_parallel=cfg.loss_parallel)
        # Each matched module's weights become DTensor shards over tp_mesh, its inputs and
        # outputs redistributed as the plan says: the collectives live in those hooks.
        parallelize_module(model, tp_mesh, plan)
        # On a GPU TP compiles unless told not to: in eager mode DTensor decides every op's
        # sharding on the host, and the GPU waits for it.
        loss_fn = lm_loss
        if cfg.compile or (use_cuda and not cfg.eager):  # after TP: traces DTensor ops once
            for block in [m for m in model.modules() if isinstance(m, Block)]:
                block.forward = torch.compile(block.forward, backend=cfg.compile_backend)
            if not cfg.loss_parallel:  # the loss on DTensor shards (loss_parallel) stays eager
                loss_fn = torch.compile(lm_loss, backend=cfg.compile_backend)
        # Pitfall: built before the split, the optimizer would update the replaced plain tensors.
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
        )  # one kernel on CUDA
        if observer:
            observer.model_ready(model, optimizer)

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # Pitfall: a DistributedSampler over the TP ranks would give each rank different samples,
        # and each rank would compute its slice of a different batch. Every TP rank reads the whole
        # batch: the sampler of a world of one, in single-process training's order.
        sampler = DistributedSampler(
            dataset, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed, drop_last=True
        )
        loader = DataLoader(
            dataset,
            batch_size=cfg.global_batch_size,
            sampler=sampler,
            drop_last=True,
            pin_memory=use_cuda,
        )
        # The loss and its backward must both run inside loss_parallel() when the logits are shards.
        loss_context = loss_parallel if cfg.loss_parallel else contextlib.nullcontext

        losses, step, epoch = [], 0, 0
        while step < cfg.steps:
            # Pitfall: without set_epoch every epoch repeats the first epoch's order
            sampler.set_epoch(epoch)
            for inputs, targets in loader:
                if step == cfg.steps:
                    break
                inputs = inputs.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                # TP alone has no mixed-precision policy of its own: bf16 is autocast (torchtitan)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype is not None):
                    logits = model(inputs)
                with loss_context():
                    loss = loss_fn(logits, targets)  # the cross entropy in fp32 either way
                    loss.backward()
                optimizer.step()
                # The same on every rank: they all computed the whole batch (under loss_parallel
                # the loss is a replicated DTensor).
                whole = loss.full_tensor() if isinstance(loss, DTensor) else loss
                losses.append(whole.item())
                if rank == 0:
                    print(f"step {step} loss {losses[-1]:.4f}", flush=True)
                if observer:
                    observer.step_end(step, losses[-1])
                step += 1
            epoch += 1
        # --8<-- [end:loop]
        return losses
    finally:
        cleanup_distributed()  # every way out: NCCL's communicators are freed, not leaked


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(TPConfig, prog="python -m recipes.tensor_parallel", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), TPConfig, argv)
    with exit_on_bad_input():  # a size that does not split: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
