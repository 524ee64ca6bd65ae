"""Ulysses sequence parallelism: all-to-all trades a sequence shard for a group of heads.

    torchrun --standalone --nproc_per_node=2 -m recipes.ulysses
    torchrun --standalone --nproc_per_node=4 -m recipes.ulysses --model small

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/options.py (the command line, from the config).

DeepSpeed-Ulysses (Jacobs et al., 2023), beside the ring attention of context_parallel.py: every
rank of a group of N holds a contiguous 1/N of every sequence. Embeddings, norms, the MLP and the
loss are per-token and need nothing more. Around attention, one ``all_to_all`` per tensor turns
q, k and v from [batch, heads, seq/N, head_dim] (every head, this rank's tokens) into
[batch, heads/N, seq, head_dim] (the whole sequence, this rank's heads): attention, any kernel,
runs unchanged on whole sequences, and a fourth ``all_to_all`` takes the output back to the
sequence shard. The backward of an all_to_all is the inverse all_to_all of the gradient
(``AllToAll``). The price: a rank attends with heads/N heads, so the heads must divide over the
ranks (refused in one line otherwise); ring attention has no such limit.

``ulysses_attention`` installs it as ``F.scaled_dot_product_attention``, as context_parallel's
ring does: the toy model and a Hugging Face Llama (attn_implementation="sdpa") run on sequence
shards unchanged, given their tokens' global positions. The ranks hold the same weights and each
computes part of one gradient: they are averaged over the group after backward, as in
context_parallel.py. The group is the whole world here; a data-parallel dimension beside it (a
2-D mesh, as torchtitan and DeepSpeed build) is left out: this file is the one idea.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset


@dataclass
class UlyssesConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    global_batch_size: int = option(
        12, "sequences per optimizer step; every rank holds a slice of each", at_least=1
    )
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    # the same seed -> the same weights and data order on every rank, on any world size
    seed: int = option(0, "model init and data order", at_least=0)
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each


def check_ulysses_fits(heads: int, seq_len: int, ranks: int) -> None:
    """ValueError unless every rank gets heads/N whole heads and seq_len/N whole positions."""
    if heads % ranks:
        fits = [n for n in range(1, heads + 1) if heads % n == 0]
        raise ValueError(
            f"Ulysses over {ranks} ranks cannot split {heads} attention heads (each rank attends "
            f"with heads/ranks of them); use {', '.join(map(str, fits))} ranks, or ring attention "
            "(recipes/context_parallel.py), which has no limit on heads"
        )
    if seq_len % ranks:
        fits = [n for n in range(1, seq_len + 1) if seq_len % n == 0 and heads % n == 0]
        raise ValueError(
            f"Ulysses over {ranks} ranks cannot split seq_len={seq_len} into equal shards; use "
            f"{', '.join(map(str, fits))} ranks"
        )


# --8<-- [start:all_to_all]
def all_to_all(x: torch.Tensor, group, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Cut ``x`` into N pieces along ``scatter_dim``, send piece i to rank i, and join the N pieces
    received along ``gather_dim``, in rank order: one collective, (N-1)/N of ``x`` leaves."""
    size = dist.get_world_size(group)
    # all_to_all_single sends the i-th of N equal slices of dim 0 to rank i: pieces on dim 0
    send = torch.stack(x.chunk(size, dim=scatter_dim))
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # gloo has it on CPU, nccl on GPUs
    return torch.cat(received.unbind(0), dim=gather_dim)


class AllToAll(torch.autograd.Function):
    """``all_to_all`` that autograd can go through: the backward sends each piece of the gradient
    back where the piece came from, the inverse all_to_all. (torch's differentiable one,
    ``torch.distributed.nn.functional.all_to_all_single``, is deprecated in 2.13.)"""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return all_to_all(x, group, scatter_dim=scatter_dim, gather_dim=gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        back = all_to_all(grad, ctx.group, scatter_dim=gather_dim, gather_dim=scatter_dim)
        return back, None, None, None


# --8<-- [end:all_to_all]


# --8<-- [start:ulysses]
HEADS, SEQ = 1, 2  # SDPA's layout: [batch, heads, seq, head_dim]


def ulysses_sdpa(query, key, value, *, group, attention=F.scaled_dot_product_attention, **kwargs):
    """``attention`` (SDPA by default; any function of SDPA's layout) on the whole sequence, from
    q, k, v shards [batch, heads, seq/N, head_dim] that hold positions r*seq/N .. (r+1)*seq/N - 1
    on rank r: contiguous, in rank order, so that the gathered sequence is in order and is_causal
    means what it says. Returns this rank's shard of the output, in the same layout."""
    size = dist.get_world_size(group)
    check_ulysses_fits(query.shape[HEADS], query.shape[SEQ] * size, size)
    if kwargs.pop("attn_mask", None) is not None:  # the shard's mask, not the whole sequence's
        raise NotImplementedError("Ulysses here supports is_causal, not attn_mask; pass is_causal")
    if key.shape[HEADS] % size:  # fewer K/V heads than ranks (grouped-query attention)
        # each rank needs the K/V heads of its query heads: repeat them (more bytes, still exact)
        groups = query.shape[HEADS] // key.shape[HEADS]
        key, value = key.repeat_interleave(groups, HEADS), value.repeat_interleave(groups, HEADS)
    # every head of this rank's positions -> heads/N heads of every position: 3 all_to_alls
    q, k, v = (AllToAll.apply(t, group, HEADS, SEQ) for t in (query, key, value))
    out = attention(q, k, v, **kwargs)  # whole sequences: any kernel, causal as written
    return AllToAll.apply(out, group, SEQ, HEADS)  # and back: the 4th all_to_all


@contextlib.contextmanager
def ulysses_attention(*, group):
    """Inside, ``F.scaled_dot_product_attention`` is Ulysses over ``group``: a model that calls it
    runs on contiguous sequence shards unchanged (context_parallel's ring_attention does the
    same). Outside, SDPA is SDPA again."""
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        options = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)
        return ulysses_sdpa(query, key, value, group=group, attention=original, **options)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


# --8<-- [end:ulysses]


# --8<-- [start:train]
def train(cfg: UlyssesConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns the loss of each step (the same on every rank)."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)  # torchrun's, or a world of 1
    try:
        device, rank, sp_size = world.device, world.rank, world.world_size  # the group: the world
        preset, use_cuda = MODEL_PRESETS[cfg.model], device.type == "cuda"
        check_ulysses_fits(preset.n_heads, preset.seq_len, sp_size)  # one line, before any work
        bf16 = use_cuda and torch.cuda.is_bf16_supported()
        mesh = init_device_mesh(device.type, (sp_size,), mesh_dim_names=("sp",))
        group = mesh.get_group("sp")
        shard_len = preset.seq_len // sp_size
        # contiguous, in rank order: the all_to_all joins the shards back in sequence order
        mine = torch.arange(rank * shard_len, (rank + 1) * shard_len, device=device)
        # --8<-- [start:loop]
        # Same seed everywhere: the ranks hold the same weights, like data-parallel replicas
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
        )  # one kernel on CUDA
        if observer:
            observer.model_ready(model, optimizer)

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # Pitfall: a DistributedSampler over the group would give each rank a different batch.
        # Every rank reads the whole batch (single-process order) and keeps its positions.
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
        if rank == 0:
            print(
                f"ulysses over {sp_size} rank(s): {shard_len} of {preset.seq_len} positions and "
                f"{preset.n_heads // sp_size} of {preset.n_heads} heads each",
                flush=True,
            )

        losses, step, epoch = [], 0, 0
        while step < cfg.steps:
            # Pitfall: without set_epoch every epoch repeats the first epoch's order
            sampler.set_epoch(epoch)
            for inputs, targets in loader:
                if step == cfg.steps:
                    break
                inputs = inputs.to(device, non_blocking=True)[:, mine]
                targets = targets.to(device, non_blocking=True)[:, mine]
                # Pitfall: a shard's positions are not 0..seq/N-1: the model must be told them
                positions = mine.expand_as(inputs)
                optimizer.zero_grad(set_to_none=True)
                with ulysses_attention(group=group):
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                        logits = model(inputs, positions=positions)
                    # Each rank's mean over its tokens; ranks hold as many, so their mean is the
                    # global mean. The backward runs the 4 inverse all_to_alls of every layer.
                    loss = lm_loss(logits, targets)
                    loss.backward()
                # Each rank has the gradient of its tokens' loss: average them over the group
                for p in model.parameters():
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
                    p.grad /= sp_size
                optimizer.step()
                global_loss = loss.detach().float().clone()  # this rank's tokens' mean
                dist.all_reduce(global_loss, op=dist.ReduceOp.AVG, group=group)
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
        cleanup_distributed()  # every way out: NCCL's communicators are freed, not leaked


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(UlyssesConfig, prog="python -m recipes.ulysses", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), UlyssesConfig, argv)
    with exit_on_bad_input():  # heads that do not divide over the ranks: one line, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
