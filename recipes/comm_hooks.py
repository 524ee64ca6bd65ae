"""DDP communication hooks: gradients sent in fp16 or bf16, as PowerSGD's factors, or your way.

    torchrun --standalone --nproc_per_node=2 -m recipes.comm_hooks           # PowerSGD, rank 2
    torchrun --standalone --nproc_per_node=2 -m recipes.comm_hooks --hook fp16  # bf16: CUDA torch
    torchrun --standalone --nproc_per_node=2 -m recipes.comm_hooks --hook allreduce  # counts bytes

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/options.py (the command line, from the config).

DDP all-reduces each bucket of gradients once the backward has filled it. A communication hook
replaces that all-reduce: DDP hands it the bucket (``GradBucket``, its gradients flattened into
one tensor) and copies the value of the Future it returns back into the gradients. The loop is
DDP's plus one ``register_comm_hook`` call.

- ``none``: DDP's own fp32 all-reduce. ``allreduce``: the same, written by hand as a hook that
  counts the bytes it sends: how to write one (equal to DDP bit for bit, asserted).
- ``fp16`` / ``bf16``: torch's ``fp16_compress_hook`` / ``bf16_compress_hook``: half the bytes.
- ``powersgd``: torch's ``powerSGD_hook`` (Vogels et al. 2019) sends each gradient matrix M
  (n x m) as P = M Q (n x r) and Q = M^T P (m x r), with error feedback (what the rank-r
  approximation left out joins the next step's gradient). Vectors, and matrices too small to
  shrink by ``min_compression_rate`` (2), go whole.

PowerSGD starts at step ``powersgd_start_step`` (torch's ``start_powerSGD_iter``; plain
all-reduces before it). torch's default is 1000, and its guide says about a tenth of the run. With
error feedback torch refuses less than 2: DDP rebuilds its buckets after the first step, and the
errors are kept per bucket. The default here is 2, the earliest torch takes, so that a run of a
few steps shows PowerSGD at all; in a real run start at about a tenth of the steps (early
gradients suffer most from the approximation).

``--static-graph`` tells DDP the graph is the same every step (torch's docs: it then needs no
search for unused parameters, and allows reentrant checkpointing); ``--gradient-as-bucket-view``
makes each ``p.grad`` a view into DDP's bucket, one copy of the gradients fewer. Neither changes
a loss (asserted). Left out: PowerSGD's factors in fp16 (``fp16_compress_wrapper``) and hooks that
run the optimizer step.
"""

# No ``from __future__ import annotations``: DDP checks a hook's annotations when it is registered,
# as objects (``dist.GradBucket``), and refuses the strings that import would make of them.
import argparse
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, resolve_precision, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset

HOOKS = ["none", "allreduce", "fp16", "bf16", "powersgd"]


@dataclass
class CommHooksConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    global_batch_size: int = option(12, "sequences per step, summed over all ranks", at_least=1)
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    hook: str = option("powersgd", "what DDP sends for each bucket of gradients", choices=HOOKS)
    powersgd_rank: int = option(2, "PowerSGD's matrix_approximation_rank", at_least=1)
    powersgd_start_step: int = option(
        2, "plain all-reduces before PowerSGD starts (start_powerSGD_iter)", at_least=2
    )
    static_graph: bool = option(False, "DDP(static_graph=True): the same graph every step")
    gradient_as_bucket_view: bool = option(False, "DDP(gradient_as_bucket_view=True)")
    precision: str = option(
        "auto",
        "auto: bf16 autocast on a GPU, fp32 on CPU; fp32: exact",
        choices=["auto", "fp32", "bf16"],
    )
    seed: int = option(0, "model init and data order, the same on every rank", at_least=0)
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        if self.hook == "powersgd" and self.powersgd_start_step >= self.steps:
            raise ValueError(
                f"powersgd_start_step={self.powersgd_start_step} leaves PowerSGD no step of the "
                f"{self.steps}: every step would be a plain all-reduce; use steps > "
                f"{self.powersgd_start_step} or a smaller powersgd_start_step"
            )


# --8<-- [start:hook]
@dataclass
class SentBytes:
    """The hand-written hook's state: the bytes it handed to all_reduce, one total per step."""

    process_group: dist.ProcessGroup | None = None  # None: the whole world
    per_step: list[int] = field(default_factory=list)
    this_step: int = 0


def counting_allreduce_hook(
    state: SentBytes, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP's own all-reduce as a hook, which also counts what it sends. DDP calls it once per
    bucket, as soon as the backward has filled the bucket, and copies the Future's value (the
    average over the ranks) back into the gradients."""
    group = state.process_group or dist.group.WORLD
    grads = bucket.buffer()  # every gradient of the bucket, flattened into one tensor
    state.this_step += grads.numel() * grads.element_size()
    if bucket.is_last():  # the step's last bucket (the first layers' gradients)
        state.per_step.append(state.this_step)
        state.this_step = 0
    grads.div_(group.size())  # divided before the sum, as DDP does: a sum of averages
    work = dist.all_reduce(grads, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# --8<-- [end:hook]


# --8<-- [start:choose]
def check_powersgd_rank(model: torch.nn.Module, *, rank: int, min_compression_rate=2) -> None:
    """Refuses a PowerSGD rank that torch would quietly clamp to a gradient matrix's size (that
    matrix then goes whole) or at which no matrix is worth compressing: one line, the limit."""
    # powerSGD_hook views every gradient as shape[0] x the rest; vectors are never compressed
    matrices = [
        (name, p.shape[0], p[0].numel()) for name, p in model.named_parameters() if p.dim() > 1
    ]
    if not matrices:
        raise ValueError("PowerSGD compresses 2-D gradients and this model has none; use fp16")
    name, rows, cols = min(matrices, key=lambda matrix: min(matrix[1:]))
    if rank > min(rows, cols):
        raise ValueError(
            f"powersgd_rank={rank} is above the size of the gradient matrix of {name} ({rows} x "
            f"{cols}): torch would send it whole; use a rank of at most {min(rows, cols)}"
        )
    # torch compresses an n x m matrix when (n + m) * rank * min_compression_rate < n * m
    useful = max((n * m - 1) // ((n + m) * min_compression_rate) for _, n, m in matrices)
    if rank > useful:
        raise ValueError(
            f"powersgd_rank={rank} compresses no gradient of this model (each matrix is smaller "
            f"than {min_compression_rate}x its factors): use a rank of at most {useful}"
        )


def make_comm_hook(kind: str, model: torch.nn.Module, *, powersgd_rank=2, start_step=2, seed=0):
    """(state, hook) for ``model.register_comm_hook``; (None, None) keeps DDP's all-reduce."""
    if kind == "none":
        return None, None
    if kind == "allreduce":
        return SentBytes(), counting_allreduce_hook
    if kind == "bf16" and torch.version.cuda is None and torch.version.hip is None:
        raise ValueError(  # torch refuses bf16_compress_hook there, whatever the backend
            "hook bf16: torch registers bf16_compress_hook only in a CUDA or ROCm build with "
            "NCCL 2.10+, and this torch has neither; use hook fp16"
        )
    compress = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
    if kind in compress:  # the state is the process group: None, the whole world
        return None, compress[kind]
    if kind != "powersgd":
        raise ValueError(f"hook {kind!r}: use one of {', '.join(HOOKS)}")
    check_powersgd_rank(model, rank=powersgd_rank)
    state = powersgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=powersgd_rank,
        start_powerSGD_iter=start_step,  # plain all-reduces before it; torch refuses < 2 here
        min_compression_rate=2,  # torch's default: what check_powersgd_rank assumes
        use_error_feedback=True,  # keep what the approximation left out for the next step
        warm_start=True,  # start from last step's Q: a better approximation for no traffic
        random_seed=seed,  # the same random Q on every rank
    )
    return state, powersgd.powerSGD_hook


# --8<-- [end:choose]


# --8<-- [start:train]
def train(cfg: CommHooksConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns the global batch's loss of each step (every rank)."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)  # torchrun's, or a world of 1
    try:
        device, rank, world_size = world.device, world.rank, world.world_size
        local_rank, use_cuda = world.local_rank, device.type == "cuda"
        if cfg.global_batch_size % world_size:
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide across {world_size} "
                f"ranks; use a multiple of {world_size}"
            )
        per_rank_batch = cfg.global_batch_size // world_size
        bf16 = resolve_precision(cfg.precision, device) == "bf16"  # the hooks still see fp32

        # --8<-- [start:loop]
        # Pitfall: the same seed on every rank, or the replicas start different (DDP broadcasts
        # rank 0's weights at construction, but a model built differently still diverges)
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        state, hook = make_comm_hook(  # checked against the model before any collective
            cfg.hook,
            model,
            powersgd_rank=cfg.powersgd_rank,
            start_step=cfg.powersgd_start_step,
            seed=cfg.seed,
        )
        model = DDP(
            model,
            device_ids=[local_rank] if use_cuda else None,
            static_graph=cfg.static_graph,
            gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        )
        if hook is not None:  # once, before the first backward: DDP refuses a second hook
            model.register_comm_hook(state, hook)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
        )  # one kernel on CUDA
        if observer:
            observer.model_ready(model, optimizer)

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # Each rank reads a disjoint 1/world_size of every epoch: the union of the ranks' batches
        # at step s is one process's batch s. drop_last keeps every global batch full.
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        loader = DataLoader(
            dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True, pin_memory=use_cuda
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
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = lm_loss(model(inputs), targets)  # this rank's sequences' mean
                loss.backward()  # the hook runs here, once per bucket, overlapped with backward
                optimizer.step()  # every rank applies the same averaged gradient
                # Pitfall: rank 0's loss alone is its share of the batch (a half on 2 ranks)
                global_loss = loss.detach().float().clone()
                dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
                losses.append(global_loss.item())
                line = f"step {step} loss {losses[-1]:.4f}"
                if isinstance(state, SentBytes):  # the hand-written hook's own count
                    line += f" all-reduced {state.per_step[-1]} bytes"
                if rank == 0:
                    print(line, flush=True)
                if observer:
                    observer.step_end(step, losses[-1])
                step += 1
            epoch += 1
        # --8<-- [end:loop]
        if cfg.hook == "powersgd" and rank == 0:
            _, before, after = state.compression_stats()  # torch's own count, PowerSGD steps only
            compressed_steps = cfg.steps - cfg.powersgd_start_step
            print(
                f"PowerSGD rank {cfg.powersgd_rank} from step {cfg.powersgd_start_step}: each "
                f"step sent {after // compressed_steps} of {before // compressed_steps} gradient "
                f"elements ({before / after:.1f}x fewer), as torch counts them",
                flush=True,
            )
        return losses
    finally:
        cleanup_distributed()


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(CommHooksConfig, prog="python -m recipes.comm_hooks", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), CommHooksConfig, argv)
    with exit_on_bad_input():  # a rank the model cannot take: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
