r"""Tensor parallelism with DTensor: every layer's weights split across ranks, the same model.

    torchrun --standalone --nproc_per_node=2 -m recipes.tensor_parallel
    torchrun --standalone --nproc_per_node=4 -m recipes.tensor_parallel --sequence-parallel \
        --loss-parallel
    python -m recipes.tensor_parallel                   # a world of 1: tensor-parallel degree 1

The whole world is one tensor-parallel group (a 1-D DeviceMesh named "tp"); for tensor parallel
inside each of several data-parallel replicas see recipes.hybrid_parallel. ``apply_tp`` is the
Megatron-LM split, written with ``torch.distributed.tensor.parallel`` as torchtitan's
``parallelize.py`` does:

- attention: ``wq``/``wk``/``wv`` column-wise (each rank computes n_heads / N whole heads; the
model's
  attention infers its local head count from the projection's output size), ``wo`` row-wise (its
  all-reduce sums the heads' contributions);
- MLP: ``w_in`` column-wise, ``w_out`` row-wise: one all-reduce per MLP, none between the two
matmuls;
- embeddings row-wise (vocabulary rows split), the output head column-wise (vocabulary columns
split);
- ``--sequence-parallel``: the norms and residual stream are split along the sequence instead of
  replicated (the all-reduces become reduce-scatter + all-gather; activations take 1/N of the
  memory);
- ``--loss-parallel``: the logits stay split over the vocabulary and cross-entropy is computed on
the
  shards (``loss_parallel()``), so the full [batch, seq, vocab] logits never exist on one rank.

Every tensor-parallel rank must see the SAME batch (it computes a part of every sample, not a part
of the batch): the loader here is the single-process one on every rank. The losses and weights equal
single-process training (tests/test_tensor_parallel.py, worlds of 2 and 4); forward outputs and full
gradients equal the unsplit model's. Runs on gloo/CPU (checked with torch 2.13) and NCCL.

Speed: TP alone has no mixed-precision policy of its own, so ``--precision auto`` (bf16 on a GPU) is
autocast around the forward, as torchtitan does; AdamW is fused. Every op on a DTensor pays for
sharding propagation on the host: on one H200 (100m, torch 2.11) a world-1 step ran 129.8 ms
against the bare loop's 67.4 at batch 64. So on a GPU this recipe compiles by default (``--eager``
turns it off): the compiled blocks trace the DTensor ops once. Compiled, a step ran 51.8 ms
against 51.3 for the compiled bare loop at batch 64; at batch 32, 51.1 ms against 112.4 eager
and 27.8 for the compiled bare loop: the replicated parts outside the blocks (embeddings, norm,
output head) still pay DTensor's host cost (scripts/bench.py, 2026-11-26).

``apply_tp``, the two ready-made plans (the cookbook's model, a Llama-style model) and the checks
that make a wrong plan fail loudly (``check_tp_plan``, ``check_heads_divide``,
``check_ties_split_alike``) live in recipes/parallelize.py, each copyable alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from recipes.core.cli import run_cli
from recipes.core.config import CompileOption, RecipeError, TrainConfig, opt
from recipes.core.log import get_logger
from recipes.core.memory import model_state_bytes
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.state import full_state_on_rank0
from recipes.core.speed import (apply_compile, compile_loss, autocast, make_adamw, make_grad_scaler,
                                setup_precision)
from recipes.core.throughput import Workload
from recipes.core.workload import (
    MODEL_PRESETS,
    Block,
    ModelConfig,
    build_model,
    distributed_loader,
    iterate_steps,
    lm_loss,
    make_dataset,
)
from recipes.core.world import join_world
from recipes.parallelize import (  # noqa: F401  (re-exported: copyable, with the others)
    ReplicateParallel, TPPlanError, apply_tp, check_heads_divide, check_ties_split_alike,
    check_tp_plan, llama_plan, matching_modules, retie, tied_parameters,
    transformer_lm_plan, weight_split)

log = get_logger(__name__)


@dataclass
class TPConfig(CompileOption, TrainConfig):
    sequence_parallel: bool = opt(
        False, "split norms and the residual stream along the sequence (Shard(1)) instead of "
        "replicating them")
    loss_parallel: bool = opt(
        False, "keep the logits split over the vocabulary and compute cross-entropy on the shards "
        "(loss_parallel())")
    eager: bool = opt(
        False, "on a GPU, skip the torch.compile that TP turns on there (DTensor's sharding "
        "propagation then runs on the host for every op: about 2x slower on an H200)")


def check_tp_fits(model_cfg: ModelConfig, tp_size: int) -> None:
    """RecipeError unless every split dimension divides by ``tp_size``: heads, MLP width,
    vocabulary and sequence (the position embedding's rows). DTensor could shard unevenly; equal
    shards keep it simple."""
    sizes = {"n_heads": model_cfg.n_heads, "mlp width": model_cfg.mlp_ratio * model_cfg.dim,
             "vocab_size": model_cfg.vocab_size, "seq_len": model_cfg.seq_len}
    bad = [f"{name}={size}" for name, size in sizes.items() if size % tp_size]
    if bad:
        fits = [n for n in range(1, model_cfg.n_heads + 1)
                if all(size % n == 0 for size in sizes.values())]
        raise RecipeError(f"tensor parallel over {tp_size} ranks cannot split {', '.join(bad)}; "
                          f"use a tensor-parallel size of {', '.join(map(str, fits))}")


def as_float(value: torch.Tensor) -> float:
    """A scalar that may be a (replicated) DTensor, e.g. the loss under loss_parallel()."""
    return float((value.full_tensor() if isinstance(value, DTensor) else value).item())


# --8<-- [start:train]
def train(cfg: TPConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        model_cfg = MODEL_PRESETS[cfg.model]
        check_tp_fits(model_cfg, world.world_size)
        tp_mesh = init_device_mesh(world.device.type, (world.world_size,), mesh_dim_names=("tp",))
        # Same seed everywhere: each rank builds the full model, then keeps only its shards. (For a
        # model that does not fit one device, build on the "meta" device and initialize after
        # apply_tp.)
        model = build_model(cfg.model, seed=cfg.seed, device=world.device)
        params_unsplit_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        plan = transformer_lm_plan(sequence_parallel=cfg.sequence_parallel,
                                   loss_parallel=cfg.loss_parallel)
        apply_tp(model, tp_mesh, plan=plan)
        # On a GPU TP compiles unless told not to: in eager mode DTensor decides every op's
        # sharding on the host, and the GPU waits for it (+92% at batch 64 on an H200, issue 25).
        compiled = cfg.compile or (world.device.type == "cuda" and not cfg.eager)
        if compiled:  # after TP: the compiled blocks trace the DTensor ops and their collectives
            apply_compile(model, block_types=(Block,), backend=cfg.compile_backend)
        # the loss on DTensor shards (loss_parallel) stays eager
        loss_fn = (compile_loss(lm_loss, backend=cfg.compile_backend)
                   if compiled and not cfg.loss_parallel else lm_loss)
        # TP alone has no mixed-precision policy of its own: bf16 is autocast (as torchtitan does).
        precision = setup_precision(cfg.precision, world.device)
        # Built after apply_tp: it must see the DTensors.
        optimizer = make_adamw(model.parameters(), lr=cfg.lr, device=world.device)
        scaler = make_grad_scaler(world.device, precision)
        # Pitfall: a DistributedSampler over the TP ranks would give each rank different samples,
        # and each rank would compute its slice of a different batch. Every TP rank reads the whole
        # batch.
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        loader, sampler = distributed_loader(dataset, rank=0, world_size=1,
                                             per_rank_batch_size=cfg.global_batch_size,
                                             seed=cfg.seed)
        # The loss and its backward must both run inside loss_parallel() when the logits are shards.
        loss_context = loss_parallel if cfg.loss_parallel else contextlib.nullcontext
        log.info("tensor parallel over %d rank(s), backend %s, sequence_parallel=%s, "
                 "loss_parallel=%s",
                 world.world_size, world.backend, cfg.sequence_parallel, cfg.loss_parallel)

        losses, timer = [], StepTimer(world.device)
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
            with timer:
                inputs, targets = inputs.to(world.device), targets.to(world.device)
                with autocast(world.device, precision):
                    logits = model(inputs)
                optimizer.zero_grad(set_to_none=True)
                with loss_context():
                    loss = loss_fn(logits, targets)  # the cross entropy in fp32 either way
                    scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                if step == 0:
                    state_bytes = model_state_bytes(model, optimizer)  # gradients still present
            # The same on every rank: they all computed the whole batch.
            losses.append(as_float(loss))
            log.info("step %d loss %.4f time %.1f ms", step, losses[-1], timer.durations[-1] * 1e3)

        full_state, checksum = full_state_on_rank0(model)  # every rank joins the all-gathers
        return make_result(
            "tensor_parallel", world, losses, checksum, timer,
            keep_final_state=full_state if cfg.keep_final_state and world.is_main else None,
            workload=Workload(model_cfg, cfg.global_batch_size, precision),
            tp_size=world.world_size, sequence_parallel=cfg.sequence_parallel,
            loss_parallel=cfg.loss_parallel, compiled=compiled,
            param_bytes_per_rank=state_bytes["param_bytes"],
            param_bytes_unsplit=params_unsplit_bytes,
            param_fraction_per_rank=state_bytes["param_bytes"] / params_unsplit_bytes,
            optimizer_bytes_per_rank=state_bytes["optimizer_bytes"],
        )
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, TPConfig, __doc__)
