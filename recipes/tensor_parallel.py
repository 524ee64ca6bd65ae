r"""Tensor parallelism with DTensor: every layer's weights split across ranks, the same model.

    torchrun --standalone --nproc_per_node=2 -m recipes.tensor_parallel
    torchrun --standalone --nproc_per_node=4 -m recipes.tensor_parallel --sequence-parallel \
        --loss-parallel
    python -m recipes.tensor_parallel                   # a world of 1: tensor-parallel degree 1

Copy with it: recipes/toy.py, recipes/dist_setup.py, recipes/parallelize.py (``apply_tp``, its
plans and checks, ``apply_compile``).

The whole world is one tensor-parallel group (a 1-D DeviceMesh named "tp"); for tensor parallel
inside each of several data-parallel replicas see recipes.hybrid_parallel. ``apply_tp`` is the
Megatron-LM split, written with ``torch.distributed.tensor.parallel`` as torchtitan's
``parallelize.py`` does:

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
(checked with torch 2.13) and NCCL. It prints one line per step from rank 0: the step and the loss
of the whole batch, which every rank computed.

Speed: TP alone has no mixed-precision policy of its own, so ``--precision auto`` (bf16 on a GPU) is
autocast around the forward, as torchtitan does; AdamW is fused. Every op on a DTensor pays for
sharding propagation on the host: on one H200 (100m, torch 2.11) a world-1 step ran 129.8 ms
against the bare loop's 67.4 at batch 64. So on a GPU this recipe compiles by default (``--eager``
turns it off): the compiled blocks trace the DTensor ops once. Compiled, a step ran 51.8 ms
against 51.3 for the compiled bare loop at batch 64; at batch 32, 51.1 ms against 112.4 eager
and 27.8 for the compiled bare loop: the replicated parts outside the blocks (embeddings, norm,
output head) still pay DTensor's host cost (scripts/bench.py, 2026-11-26).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.parallelize import apply_compile, apply_tp, check_tp_fits, transformer_lm_plan
from recipes.toy import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset


@dataclass
class TPConfig:
    model: str = "tiny"  # a key of MODEL_PRESETS
    steps: int = 6
    global_batch_size: int = 12  # sequences per step; every tensor-parallel rank reads them all
    lr: float = 1e-3
    seed: int = 0  # same seed -> same weights and data order on every rank, on any world size
    precision: str = "auto"  # auto: bf16 autocast on a GPU, fp32 on CPU
    sequence_parallel: bool = False
    loss_parallel: bool = False
    compile: bool = False  # on a GPU TP compiles anyway, unless eager
    eager: bool = False
    compile_backend: str = "inductor"
    backend: str = "auto"  # auto: nccl with a GPU for each local rank, else gloo
    timeout_s: float = 300.0


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
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


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
        # model that does not fit one device, build on the "meta" device and initialize after
        # apply_tp.)
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        apply_tp(
            model,
            tp_mesh,
            plan=transformer_lm_plan(
                sequence_parallel=cfg.sequence_parallel, loss_parallel=cfg.loss_parallel
            ),
        )
        # On a GPU TP compiles unless told not to: in eager mode DTensor decides every op's
        # sharding on the host, and the GPU waits for it (+92% at batch 64 on an H200, issue 25).
        compiled = cfg.compile or (use_cuda and not cfg.eager)
        loss_fn = lm_loss
        if compiled:  # after TP: the compiled blocks trace the DTensor ops and their collectives
            apply_compile(model, block_types=(Block,), backend=cfg.compile_backend)
            if not cfg.loss_parallel:  # the loss on DTensor shards (loss_parallel) stays eager
                loss_fn = torch.compile(lm_loss, backend=cfg.compile_backend)
        # Pitfall: built before apply_tp, the optimizer would update the replaced plain tensors.
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
        )  # one kernel on CUDA
        # fp16's 5 exponent bits flush small gradients to zero: scale the loss (else a no-op)
        scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
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
                # TP alone has no mixed-precision policy of its own: bf16 is autocast (torchtitan)
                with torch.autocast(
                    device.type, dtype=dtype or torch.float32, enabled=dtype is not None
                ):
                    logits = model(inputs)
                optimizer.zero_grad(set_to_none=True)
                with loss_context():
                    loss = loss_fn(logits, targets)  # the cross entropy in fp32 either way
                    scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
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


def _number(kind, *, above=None, at_least=None):
    """An argparse type: a finite ``kind`` in range, else one line that says what is valid."""
    bound = f"> {above}" if above is not None else f">= {at_least}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not math.isfinite(value) or not (
            value > above if above is not None else value >= at_least
        ):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    return parse


def _backend(text: str) -> str:
    if text == "nccl" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            "backend 'nccl' needs one CUDA device per local rank and this machine has none; "
            "use --backend gloo"
        )
    return text


def make_parser() -> argparse.ArgumentParser:
    defaults = TPConfig()
    parser = argparse.ArgumentParser(
        prog="python -m recipes.tensor_parallel",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("--model", choices=sorted(MODEL_PRESETS), default=defaults.model, help="model size")
    add("--steps", type=_number(int, at_least=1), default=defaults.steps, help="optimizer steps")
    add(
        "--global-batch-size",
        type=_number(int, at_least=1),
        default=defaults.global_batch_size,
        help="sequences per optimizer step; every tensor-parallel rank computes a part of each",
    )
    add("--lr", type=_number(float, above=0), default=defaults.lr, help="AdamW's")
    add(
        "--seed",
        type=_number(int, at_least=0),
        default=defaults.seed,
        help="model init and data order; the same seed gives the same losses on any world size",
    )
    add(
        "--precision",
        choices=["auto", "fp32", "tf32", "bf16", "fp16"],
        default=defaults.precision,
        help="auto: bf16 autocast on a GPU, fp32 on CPU; fp32: exact (TF32 off); tf32: TF32 "
        "matmuls (CUDA); fp16: autocast with a loss scaler",
    )
    add(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=defaults.sequence_parallel,
        help="split norms and the residual stream along the sequence (Shard(1)) instead of "
        "replicating them",
    )
    add(
        "--loss-parallel",
        action=argparse.BooleanOptionalAction,
        default=defaults.loss_parallel,
        help="keep the logits split over the vocabulary and compute cross-entropy on the shards "
        "(loss_parallel())",
    )
    add(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=defaults.compile,
        help="torch.compile each transformer block (and the loss) after the split; on a GPU it "
        "is on unless --eager",
    )
    add(
        "--eager",
        action=argparse.BooleanOptionalAction,
        default=defaults.eager,
        help="on a GPU, skip the torch.compile that TP turns on there (DTensor's sharding "
        "propagation then runs on the host for every op: about 2x slower on an H200)",
    )
    add(
        "--compile-backend",
        choices=["inductor", "aot_eager", "eager"],
        default=defaults.compile_backend,
        help="torch.compile's backend; inductor is the fast one",
    )
    add(
        "--backend",
        type=_backend,
        choices=["auto", "nccl", "gloo"],
        default=defaults.backend,
        help="process-group backend; auto: nccl with a GPU per local rank, else gloo",
    )
    add(
        "--timeout-s",
        type=_number(float, above=0),
        default=defaults.timeout_s,
        help="seconds a collective waits for its peers before failing",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    cfg = TPConfig(**vars(make_parser().parse_args(argv)))
    try:
        train(cfg)
    except ValueError as exc:  # bad input every rank sees (a size that does not split)
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
