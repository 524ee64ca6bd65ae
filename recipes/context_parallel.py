"""Context parallelism: each rank holds a slice of every sequence; ring attention keeps the model.

    torchrun --standalone --nproc_per_node=2 -m recipes.context_parallel
    python -m recipes.context_parallel --impl torch     # torch's context_parallel API: needs CUDA

Copy with it: recipes/toy.py, recipes/dist_setup.py, recipes/options.py (the command line, from
the config).

Long sequences run out of memory in the activations. Context parallelism (CP) splits every
sequence across the ranks of a group: embeddings, norms, the MLP and the loss are per-token and
need nothing more, but attention needs every key and value of the sequence. Ring attention
passes the K/V blocks around the ring of ranks (send to the next, receive from the previous, N-1
times) and merges each block's partial result with the online softmax: the running log-sum-exp
rescales what came before. Nothing of size seq x seq ever exists on one rank.

Two implementations, one config field (``--impl``):

- ``ring``: this module's ``RingAttention``, an ``autograd.Function`` over ``batch_isend_irecv``
  whose backward is a second ring (the K/V gradients travel with their blocks and come home after N
  passes). It runs on any backend, gloo included, and is installed as
  ``F.scaled_dot_product_attention`` (as torch's own API does): the model is unchanged.
- ``torch``: ``torch.distributed.tensor.experimental.context_parallel``, which shards the buffers
  and dispatches SDPA to its ring kernels. It has sharding rules only for the flash, efficient and
  cuDNN kernels, which are CUDA's: on CPU it stops with that reason (tests skip it there).

Load balancing (``--load-balance``, the default): with causal masking the query at position p
reads keys 0..p, so a contiguous split gives the last rank nearly 2N-1 times the first one's work.
Rank i holds chunks i and 2N-1-i of the 2N chunks instead, and every rank computes as many scores
(``score_entries``). CP ranks hold the same weights and compute parts of one gradient: they are
averaged after backward (torchtitan folds the CP dimension into FSDP's).

Proven by tests/test_context_parallel.py: outputs and q/k/v gradients equal
``F.scaled_dot_product_attention`` on the whole sequence (causal or not, balanced or not, 2 and 4
ranks), a tiny HF Llama on sequence shards equals it whole, and training equals single-process
training (gloo/CPU). The ``torch`` path needs CUDA: it was not run on CPU.
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
class CPConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    global_batch_size: int = option(
        12, "sequences per optimizer step; every CP rank holds a slice of each", at_least=1
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
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)
    impl: str = option(
        "ring",
        "ring: this recipe's ring attention over send/recv (any backend); torch: "
        "torch.distributed.tensor.experimental.context_parallel (CUDA only)",
        choices=["ring", "torch"],
    )
    load_balance: bool = option(
        True,
        "rank i holds chunks i and 2N-1-i of every sequence, so that causal attention "
        "costs every rank the same",
    )

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        if self.impl == "torch" and not self.load_balance:
            raise ValueError(
                "load_balance off (--no-load-balance) applies to impl ring; torch's "
                "context_parallel picks its own (head-tail) load balancer: drop it or use ring"
            )


def check_cp_fits(seq_len: int, cp_size: int, load_balance: bool) -> None:
    """ValueError unless the sequence splits into equal chunks: N, or 2N when load-balanced."""
    chunks = 2 * cp_size if load_balance else cp_size
    if seq_len % chunks:
        per = 2 if load_balance else 1
        fits = [n for n in range(1, seq_len // per + 1) if seq_len % (per * n) == 0]
        hint = " (2 per rank: load balancing)" if load_balance else ""
        raise ValueError(
            f"context parallel over {cp_size} ranks cannot split seq_len={seq_len} "
            f"into {chunks} equal chunks{hint}; use a CP size of "
            f"{', '.join(map(str, fits))}"
        )


# --8<-- [start:layout]
def shard_positions(seq_len: int, cp_rank: int, cp_size: int, *, load_balance: bool = True):
    """The places in the whole sequence that ``cp_rank`` holds: chunk r of N, or chunks r and
    2N-1-r of 2N (a head and a tail: early queries are cheap, late ones dear; one of each)."""
    check_cp_fits(seq_len, cp_size, load_balance)
    if not load_balance:
        size = seq_len // cp_size
        return torch.arange(cp_rank * size, (cp_rank + 1) * size)
    size = seq_len // (2 * cp_size)
    tail = 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [
            torch.arange(cp_rank * size, (cp_rank + 1) * size),
            torch.arange(tail * size, (tail + 1) * size),
        ]
    )


def score_entries(layout: torch.Tensor, cp_rank: int) -> int:
    """How many query-key scores ``cp_rank`` computes per head under a causal mask: its work."""
    return sum(int((layout[cp_rank][:, None] >= k_pos[None, :]).sum()) for k_pos in layout)


# --8<-- [end:layout]


# --8<-- [start:ring]
def ring_send_recv(tensor: torch.Tensor, group: dist.ProcessGroup):
    """Start sending ``tensor`` to the next rank and receiving the previous rank's; returns wait().
    Started before a block's compute, waited after it: the transfer hides behind the math."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(tensor)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % size), group),
            dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % size), group),
        ]
    )

    def wait() -> torch.Tensor:
        for work in works:
            work.wait()
        return received

    return wait


def _scores(q, k, q_pos, k_pos, scale, causal):
    """Scaled scores of a query block against a key block. Causal: a query sees the keys at or
    before its global position (the blocks are not contiguous under load balancing)."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))
    return scores


class RingAttention(torch.autograd.Function):
    """SDPA over a sequence sharded across ``group`` as ``layout`` says ([N, seq/N] positions)."""

    @staticmethod
    def forward(ctx, q, k, v, layout, group, causal, scale):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        with torch.autocast(q.device.type, enabled=False):  # the merge needs fp32, bf16 in or not
            qf, kv = q.float(), torch.stack([k, v]).float()
            out = torch.zeros_like(qf)
            lse = torch.full(qf.shape[:-1], float("-inf"), device=q.device)
            for step in range(size):
                wait = ring_send_recv(kv, group) if step < size - 1 else None
                src = (rank - step) % size  # whose K/V block this is: it moved `step` hops
                q_pos, k_pos = layout[rank], layout[src]
                if not causal or bool((q_pos[:, None] >= k_pos[None, :]).any()):  # else: skip it
                    scores = _scores(qf, kv[0], q_pos, k_pos, scale, causal)
                    # Online softmax: the new log-sum-exp rescales the sum so far. Step 0 is the
                    # rank's own block, where every query sees itself: lse is finite from then on.
                    new_lse = torch.logaddexp(lse, scores.logsumexp(-1))
                    out = (
                        out * torch.exp(lse - new_lse)[..., None]
                        + torch.exp(scores - new_lse[..., None]) @ kv[1]
                    )
                    lse = new_lse
                if wait is not None:
                    kv = wait()
        ctx.save_for_backward(q, k, v, out, lse, layout)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, layout = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        with torch.autocast(q.device.type, enabled=False):
            qf, dout = q.float(), grad_out.float()
            delta = (dout * out).sum(-1, keepdim=True)  # softmax backward: rowsum(dO * O)
            dq = torch.zeros_like(qf)
            kv = torch.stack([k, v]).float()
            dkv = torch.zeros_like(kv)  # this block's dK and dV, summed over the ranks it visits
            for step in range(size):
                src = (rank - step) % size
                q_pos, k_pos = layout[rank], layout[src]
                if not causal or bool((q_pos[:, None] >= k_pos[None, :]).any()):
                    # The probabilities again, from the final lse: no seq x seq state was kept.
                    p = torch.exp(_scores(qf, kv[0], q_pos, k_pos, scale, causal) - lse[..., None])
                    dkv[1] += p.transpose(-2, -1) @ dout
                    ds = p * (dout @ kv[1].transpose(-2, -1) - delta) * scale
                    dq += ds @ kv[0]
                    dkv[0] += ds.transpose(-2, -1) @ qf
                if size > 1:
                    # K/V move on with their gradients; after the N-th pass the gradients of every
                    # block are back on the rank that owns it (the last pass sends only them).
                    moving = torch.cat([kv, dkv]) if step < size - 1 else dkv
                    moved = ring_send_recv(moving, group)()
                    kv, dkv = (moved[:2], moved[2:]) if step < size - 1 else (kv, moved)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


@contextlib.contextmanager
def ring_attention(group: dist.ProcessGroup, layout: torch.Tensor):
    """Inside, ``F.scaled_dot_product_attention`` is ring attention over ``group``: a model that
    calls it runs on sequence shards unchanged (torch's context_parallel patches it too)."""
    original = F.scaled_dot_product_attention

    def sdpa(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        if attn_mask is not None or dropout_p:
            raise NotImplementedError("ring attention here supports is_causal, scale, enable_gqa")
        if enable_gqa:  # grouped-query attention: each K/V head serves H / H_kv query heads
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        return RingAttention.apply(
            query, key, value, layout.to(query.device), group, is_causal, scale
        )

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


# --8<-- [end:ring]


# --8<-- [start:torch_cp]
@contextlib.contextmanager
def torch_context_parallel(mesh, buffers: list[torch.Tensor], seq_dims: list[int]):
    """torch's CP: shards ``buffers`` in place (head-tail load balanced) and makes SDPA a ring.
    Only the flash, efficient and cuDNN kernels have CP rules: the math kernel, CPU's, has none."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
    ]
    with (
        sdpa_kernel(kernels),
        context_parallel(
            mesh, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=set(buffers)
        ),
    ):
        yield


# --8<-- [end:torch_cp]


# --8<-- [start:train]
def train(cfg: CPConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns the loss of each step (the same on every rank)."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)
    try:
        device, seq_len = world.device, MODEL_PRESETS[cfg.model].seq_len
        rank, use_cuda = world.rank, world.device.type == "cuda"
        cp_size = world.world_size  # the CP group is the world here
        check_cp_fits(seq_len, cp_size, cfg.load_balance)
        if cfg.impl == "torch" and device.type != "cuda":
            raise ValueError(
                "--impl torch needs CUDA: torch's context_parallel has no CPU sharding rule for "
                "SDPA; use --impl ring (any backend, gloo included)"
            )
        dtype = autocast_dtype(cfg.precision, device)
        mesh = init_device_mesh(device.type, (cp_size,), mesh_dim_names=("cp",))
        group = mesh.get_group()
        layout = torch.stack(
            [
                shard_positions(seq_len, r, cp_size, load_balance=cfg.load_balance)
                for r in range(cp_size)
            ]
        )
        mine = layout[rank].to(device)
        # --8<-- [start:loop]
        # Same seed everywhere: CP ranks hold the same weights, like data-parallel replicas
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
        )  # one kernel on CUDA
        if observer:
            observer.model_ready(model, optimizer)

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # Pitfall: a DistributedSampler over the CP ranks would give each a different batch.
        # Every CP rank reads the whole batch (single-process order) and keeps its positions.
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
                f"context parallel ({cfg.impl}) over {cp_size} rank(s): {len(mine)} of "
                f"{seq_len} positions each, load_balance={cfg.load_balance}",
                flush=True,
            )

        losses, step, epoch = [], 0, 0
        while step < cfg.steps:
            # Pitfall: without set_epoch every epoch repeats the first epoch's order
            sampler.set_epoch(epoch)
            for inputs, targets in loader:
                if step == cfg.steps:
                    break
                inputs = inputs.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
                # Pitfall: a shard's positions are not 0..seq/N-1: the model must be told them
                positions = torch.arange(seq_len, device=device).expand_as(inputs).clone()
                if cfg.impl == "ring":
                    inputs, targets = inputs[:, mine], targets[:, mine]
                    positions = positions[:, mine]
                    sharding = ring_attention(group, layout)
                else:  # on entry: shards inputs, targets, positions in place, in its own order
                    sharding = torch_context_parallel(mesh, [inputs, targets, positions], [1, 1, 1])
                optimizer.zero_grad(set_to_none=True)
                with sharding:
                    with torch.autocast(
                        device.type, dtype=dtype or torch.float32, enabled=dtype is not None
                    ):
                        logits = model(inputs, positions=positions)
                    # Each rank's mean over its tokens; ranks hold as many, so their mean is the
                    # global mean. Backward inside: torch's CP must see the SDPA backward too.
                    loss = lm_loss(logits, targets)
                    loss.backward()
                # Each rank has the gradient of its tokens' loss: average them over the CP group
                for p in model.parameters():
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
                    p.grad /= cp_size
                optimizer.step()
                global_loss = loss.detach().float().clone()  # this rank's tokens' mean
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
        cleanup_distributed()  # every way out: NCCL's communicators are freed, not leaked


# --8<-- [end:train]


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
    return {"bf16": torch.bfloat16}.get(precision)


def make_parser() -> argparse.ArgumentParser:
    return config_parser(CPConfig, prog="python -m recipes.context_parallel", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), CPConfig, argv)
    with exit_on_bad_input():  # a size that does not split: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
