"""Collectives: every torch.distributed communication call, each checked against its expected value.

    torchrun --standalone --nproc_per_node=4 -m recipes.collectives
    torchrun --standalone --nproc_per_node=3 -m recipes.collectives --portable-only  # fallbacks
    python -m recipes.collectives                          # a world of 1: point-to-point is skipped

Copy with it: recipes/dist_setup.py (joining and leaving the world), recipes/options.py (the
command line, from the config).

Every rank contributes a tensor that any rank can compute from the contributor's rank number
(``contribution(rank)``: integers, so sums are exact in any order). Each call's result is compared
with the value computed locally from the rank numbers; a mismatch raises ``CollectiveMismatch`` on
the rank that saw it. ``run`` returns what each op did, in order: "ok", "fallback: <why>" (the
backend lacks it and a portable equivalent ran instead) or "skipped: <why>"; rank 0 prints it,
one line per op.

Each op's comment says what moves where, for ranks r0..r2 holding a, b, c.

Pitfalls named where they bite: every rank must call every collective in the same order (a rank
that skips one leaves the others waiting until the timeout - ``--skip-on-rank`` shows it: a user
option, not a test's, because watching the timeout fire is the lesson); ``new_group`` must be
called by *all* ranks, members or not; a ring of blocking send/recv can deadlock unless half the
ranks receive first; ``src``/``dst`` are global ranks.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from recipes.dist_setup import DistInfo, cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names still
# work, with a FutureWarning); torch 2.11 has only the old names. Use the new name where it exists.
dist_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
dist_reduce_scatter_single = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


@dataclass
class CollectivesConfig:
    seed: int = option(
        0,
        "seed of the values each rank contributes (any rank can recompute any other's)",
        at_least=0,
    )
    numel: int = option(4, "elements in each rank's tensor", at_least=1)
    backend: str = option(
        "auto",
        "process-group backend; auto: nccl with a GPU per local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(
        60.0,
        "collective timeout in seconds: a rank left waiting errors out instead of hanging",
        above=0,
    )
    portable_only: bool = option(
        False, "use the portable fallbacks even where the backend has the op"
    )
    skip_on_rank: int = option(
        -1,
        "this rank does not call the first all_reduce, to watch the others time out in it "
        "(after --timeout-s) instead of hanging; -1 = none",
        at_least=-1,
    )

    def __post_init__(self) -> None:
        check_options(self)  # the ranges and choices above: one line each
        # (a skip_on_rank outside the world is checked in run(): it needs the world's size)


class CollectiveMismatch(RuntimeError):
    """A collective returned something other than what the rank numbers say it must."""


class Unsupported(Exception):
    """Raised by an op to take its portable fallback."""


_UNSUPPORTED_WORDS = (
    "not supported",
    "unsupported",
    "does not support",
    "cannot use",
    "not implemented",
)


class Ctx:
    """What each op needs: who we are, the contributions, and the check that raises on a
    mismatch."""

    def __init__(self, world: DistInfo, cfg: CollectivesConfig, pass_id: int):
        self.rank, self.world_size = world.rank, world.world_size
        self.device, self.backend = world.device, world.backend
        self.cfg = cfg
        self.pass_id = pass_id
        self.op = ""

    def contribution(self, rank: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.cfg.seed * 100_003 + rank)
        return (
            torch.randint(-50, 50, (self.cfg.numel,), generator=generator).float().to(self.device)
        )

    def check(self, actual: Any, expected: Any) -> None:
        if isinstance(expected, torch.Tensor):
            same = actual.shape == expected.shape and torch.allclose(
                actual, expected, rtol=1e-6, atol=1e-5
            )
        else:
            same = actual == expected
        if not same:
            raise CollectiveMismatch(
                f"{self.op} on rank {self.rank} of {self.world_size}: expected {_show(expected)}, "
                f"got {_show(actual)}"
            )

    def try_op(self, primary: Callable[[], None]) -> None:
        """Run the backend's op, or raise Unsupported if the backend lacks it (every rank hits the
        same case)."""
        if self.cfg.portable_only:
            raise Unsupported("portable_only requested")
        try:
            primary()
        except (RuntimeError, ValueError) as exc:
            if not any(word in str(exc).lower() for word in _UNSUPPORTED_WORDS):
                raise  # a real failure (a timeout, a dead peer) is never papered over
            raise Unsupported(f"{self.backend} lacks it ({_first_line(exc)})") from None


def _show(value: Any) -> str:
    return str(value.tolist()) if isinstance(value, torch.Tensor) else repr(value)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]


# --8<-- [start:reductions]
def all_reduce_sum(ctx: Ctx) -> str:
    """all_reduce(SUM): every rank ends with the elementwise sum.  r0:a r1:b r2:c -> all: a+b+c"""
    tensor = ctx.contribution(ctx.rank)
    if ctx.rank == ctx.cfg.skip_on_rank:
        # Demonstration: this rank "forgets" the collective. The others wait in all_reduce until the
        # process group's timeout and then raise, naming the op; nothing hangs forever. (A rank that
        # went on to its next collective instead would be matched with the wrong call: sleep, like a
        # stuck rank.)
        time.sleep(2 * ctx.cfg.timeout_s + 5)
        raise RuntimeError(
            f"rank {ctx.rank} skipped all_reduce on purpose, and the other ranks did not time out"
        )
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)  # in place
    ctx.check(tensor, sum(ctx.contribution(r) for r in range(ctx.world_size)))
    return "ok"


def all_reduce_avg(ctx: Ctx) -> str:
    """all_reduce(AVG): the mean.  all: (a+b+c)/3.  Older gloo lacks AVG: SUM, then divide
    locally."""
    tensor, note = ctx.contribution(ctx.rank), "ok"
    try:
        ctx.try_op(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.AVG))
    except Unsupported as why:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= ctx.world_size
        note = f"fallback: {why}; SUM / world_size"
    ctx.check(tensor, sum(ctx.contribution(r) for r in range(ctx.world_size)) / ctx.world_size)
    return note


def all_reduce_max(ctx: Ctx) -> str:
    """all_reduce(MAX): the elementwise maximum.  all: max(a, b, c)"""
    tensor = ctx.contribution(ctx.rank)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    ctx.check(tensor, torch.stack([ctx.contribution(r) for r in range(ctx.world_size)]).amax(dim=0))
    return "ok"


def reduce_scatter_single(ctx: Ctx) -> str:
    """reduce_scatter: each rank's input has world_size chunks; rank j gets the sum of everyone's
    chunk j.

    r0:[a0 a1 a2] r1:[b0 b1 b2] r2:[c0 c1 c2] -> r0:a0+b0+c0 r1:a1+b1+c1 r2:a2+b2+c2.
    (reduce_scatter_tensor before torch 2.13.) Fallback: all_reduce the whole input, keep own chunk.
    """

    def chunks_of(rank: int) -> torch.Tensor:  # chunk j of rank r: contribution(r) + 1000 j
        return torch.cat([ctx.contribution(rank) + 1000 * j for j in range(ctx.world_size)])

    output, note = torch.empty(ctx.cfg.numel, device=ctx.device), "ok"
    try:
        ctx.try_op(
            lambda: dist_reduce_scatter_single(output, chunks_of(ctx.rank), op=dist.ReduceOp.SUM)
        )
    except Unsupported as why:
        full = chunks_of(ctx.rank)
        dist.all_reduce(full, op=dist.ReduceOp.SUM)  # world_size x the traffic: fine for a fallback
        output = full.chunk(ctx.world_size)[ctx.rank].clone()
        note = f"fallback: {why}; all_reduce + slice"
    ctx.check(output, sum(ctx.contribution(r) + 1000 * ctx.rank for r in range(ctx.world_size)))
    return note


# --8<-- [end:reductions]


# --8<-- [start:one_to_all]
def broadcast(ctx: Ctx) -> str:
    """broadcast(src): the src rank's tensor overwrites everyone's.  src=r2: all: c  (src is a
    global rank)"""
    src = ctx.world_size - 1
    tensor = ctx.contribution(ctx.rank)
    dist.broadcast(tensor, src=src)
    ctx.check(tensor, ctx.contribution(src))
    return "ok"


def scatter(ctx: Ctx) -> str:
    """scatter(src=0): rank 0 holds one tensor per rank; rank j receives the j-th.  r0:[x0 x1 x2] ->
    rj: xj"""

    def piece(j: int) -> torch.Tensor:
        return -ctx.contribution(j)

    output = torch.empty(ctx.cfg.numel, device=ctx.device)
    dist.scatter(
        output, [piece(j) for j in range(ctx.world_size)] if ctx.rank == 0 else None, src=0
    )
    ctx.check(output, piece(ctx.rank))
    return "ok"


def gather(ctx: Ctx) -> str:
    """gather(dst=0): rank 0 receives every rank's tensor, the others receive nothing.  r0: [a b
    c]"""
    gathered = (
        [torch.empty(ctx.cfg.numel, device=ctx.device) for _ in range(ctx.world_size)]
        if ctx.rank == 0
        else None
    )
    dist.gather(ctx.contribution(ctx.rank), gathered, dst=0)
    if ctx.rank == 0:
        ctx.check(
            torch.stack(gathered), torch.stack([ctx.contribution(r) for r in range(ctx.world_size)])
        )
    return "ok"


# --8<-- [end:one_to_all]


# --8<-- [start:all_to_all]
def all_gather(ctx: Ctx) -> str:
    """all_gather: everyone receives everyone's tensor, as a list.  all: [a, b, c]"""
    gathered = [torch.empty(ctx.cfg.numel, device=ctx.device) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, ctx.contribution(ctx.rank))
    ctx.check(
        torch.stack(gathered), torch.stack([ctx.contribution(r) for r in range(ctx.world_size)])
    )
    return "ok"


def all_gather_single(ctx: Ctx) -> str:
    """all_gather into one tensor (all_gather_into_tensor before torch 2.13): all: [a b c]
    concatenated.

    One flat buffer instead of a list: what FSDP uses to rebuild a sharded parameter.
    """
    output = torch.empty(ctx.world_size * ctx.cfg.numel, device=ctx.device)
    dist_all_gather_single(output, ctx.contribution(ctx.rank))
    ctx.check(output, torch.cat([ctx.contribution(r) for r in range(ctx.world_size)]))
    return "ok"


def all_to_all_single(ctx: Ctx) -> str:
    """all_to_all: rank i sends its chunk j to rank j; rank j's output is everyone's chunk j, by
    source.

    r0:[a0 a1 a2] r1:[b0 b1 b2] r2:[c0 c1 c2] -> r0:[a0 b0 c0] r1:[a1 b1 c1] r2:[a2 b2 c2]  (a
    transpose) Fallback: all_gather every input and pick out the chunks addressed to this rank.
    """

    # the chunk rank r sends to rank j: contribution(r) + 1000 j
    def chunks_of(rank: int) -> torch.Tensor:
        return torch.cat([ctx.contribution(rank) + 1000 * j for j in range(ctx.world_size)])

    output, note = torch.empty(ctx.world_size * ctx.cfg.numel, device=ctx.device), "ok"
    try:
        ctx.try_op(lambda: dist.all_to_all_single(output, chunks_of(ctx.rank)))
    except Unsupported as why:
        inputs = [
            torch.empty(ctx.world_size * ctx.cfg.numel, device=ctx.device)
            for _ in range(ctx.world_size)
        ]
        dist.all_gather(inputs, chunks_of(ctx.rank))
        output = torch.cat([sent.chunk(ctx.world_size)[ctx.rank] for sent in inputs])
        note = f"fallback: {why}; all_gather + select"
    ctx.check(
        output, torch.cat([ctx.contribution(r) + 1000 * ctx.rank for r in range(ctx.world_size)])
    )
    return note


# --8<-- [end:all_to_all]


# --8<-- [start:sync_and_p2p]
def barrier(ctx: Ctx) -> str:
    """barrier: no data; no rank leaves until every rank has arrived.

    The check: each rank counts itself in the process group's key-value store before the barrier;
    after it, every rank must see all world_size arrivals.
    """
    # private, but present from torch 1.x to 2.13
    store = dist.distributed_c10d._get_default_store()
    key = f"recipes.collectives/barrier/{ctx.pass_id}"
    store.add(key, 1)
    dist.barrier()
    ctx.check(store.add(key, 0), ctx.world_size)  # add(key, 0) reads the counter
    return "ok"


def send_recv_ring(ctx: Ctx) -> str:
    """send/recv: each rank sends its tensor to the next rank and receives the previous one's.

    r0 -> r1 -> r2 -> r0.  Pitfall: if every rank sends first, a blocking ring can deadlock; even
    ranks send first and odd ranks receive first, which breaks the cycle for any world size.
    """
    if ctx.world_size == 1:
        return "skipped: a world of 1 has no peer"
    right, left = (ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size
    received = torch.empty(ctx.cfg.numel, device=ctx.device)
    if ctx.rank % 2 == 0:
        dist.send(ctx.contribution(ctx.rank), dst=right)
        dist.recv(received, src=left)
    else:
        dist.recv(received, src=left)
        dist.send(ctx.contribution(ctx.rank), dst=right)
    ctx.check(received, ctx.contribution(left))
    return "ok"


def isend_irecv_ring(ctx: Ctx) -> str:
    """isend/irecv: the same ring without blocking - post both, then wait for both.

    ``batch_isend_irecv`` issues the isend and irecv as one group: with NCCL, separately posted
    point-to-point calls around a ring can deadlock while the ranks set up their pairwise
    connections.
    """
    if ctx.world_size == 1:
        return "skipped: a world of 1 has no peer"
    right, left = (ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size
    received = torch.empty(ctx.cfg.numel, device=ctx.device)
    requests = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, ctx.contribution(ctx.rank), right),
            dist.P2POp(dist.irecv, received, left),
        ]
    )
    for request in requests:
        request.wait()
    ctx.check(received, ctx.contribution(left))
    return "ok"


def new_group(ctx: Ctx) -> str:
    """Subgroups: even and odd ranks all_reduce among themselves.  r0,r2: a+c   r1: b

    Pitfall: every rank must call new_group for every group, in the same order, members or not;
    and new_group([]) means "all ranks", not "no ranks".
    """
    members = {parity: list(range(parity, ctx.world_size, 2)) for parity in (0, 1)}
    groups = {parity: dist.new_group(ranks) for parity, ranks in members.items() if ranks}
    mine = ctx.rank % 2
    tensor = ctx.contribution(ctx.rank)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=groups[mine])
    ctx.check(tensor, sum(ctx.contribution(r) for r in members[mine]))
    for group in groups.values():
        dist.destroy_process_group(group)
    return "ok"


# --8<-- [end:sync_and_p2p]


# --8<-- [start:objects]
def all_gather_object(ctx: Ctx) -> str:
    """all_gather_object: any picklable object from every rank, to every rank (pickled, so slow)."""
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, {"rank": ctx.rank, "square": ctx.rank**2})
    ctx.check(gathered, [{"rank": r, "square": r**2} for r in range(ctx.world_size)])
    return "ok"


def broadcast_object_list(ctx: Ctx) -> str:
    """broadcast_object_list(src=0): rank 0's list of objects replaces everyone's list, in place."""
    objects = (
        [{"lr": 3e-4, "note": "from rank 0"}, "vocab", 42] if ctx.rank == 0 else [None, None, None]
    )
    dist.broadcast_object_list(objects, src=0)
    ctx.check(objects, [{"lr": 3e-4, "note": "from rank 0"}, "vocab", 42])
    return "ok"


def scatter_object_list(ctx: Ctx) -> str:
    """scatter_object_list(src=0): rank j receives the j-th object of rank 0's list."""
    received: list[Any] = [None]
    dist.scatter_object_list(
        received,
        [f"work item {j}" for j in range(ctx.world_size)] if ctx.rank == 0 else None,
        src=0,
    )
    ctx.check(received[0], f"work item {ctx.rank}")
    return "ok"


# --8<-- [end:objects]


# The order every rank runs them in. Each returns "ok", "fallback: <why>" or "skipped: <why>".
OPS: dict[str, Callable[[Ctx], str]] = {
    op.__name__: op
    for op in (
        all_reduce_sum,
        all_reduce_avg,
        all_reduce_max,
        broadcast,
        all_gather,
        all_gather_single,
        reduce_scatter_single,
        gather,
        scatter,
        all_to_all_single,
        barrier,
        send_recv_ring,
        isend_irecv_ring,
        new_group,
        all_gather_object,
        broadcast_object_list,
        scatter_object_list,
    )
}
_passes = itertools.count()  # every rank runs the same passes, so the counters agree across ranks


# --8<-- [start:run]
def run(cfg: CollectivesConfig) -> dict[str, str]:
    """Every op of ``OPS`` on this rank, in order; returns op -> "ok" / "fallback: .." / ".."."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)
    try:
        # Checked on every rank alike, before any collective: all of them refuse together
        if cfg.skip_on_rank >= world.world_size or (
            cfg.skip_on_rank >= 0 and world.world_size == 1
        ):
            raise ValueError(
                f"skip_on_rank={cfg.skip_on_rank} needs a world of at least 2 with "
                f"that rank in it; this world has {world.world_size} rank(s)"
            )
        ctx = Ctx(world, cfg, next(_passes))
        if world.is_main:
            print(
                f"{len(OPS)} collectives on {world.world_size} rank(s), backend "
                f"{world.backend}, device {world.device}",
                flush=True,
            )
        report = {}
        for name, op in OPS.items():
            ctx.op = name
            report[name] = op(ctx)
            if world.is_main:
                print(f"{name:<22} {report[name]}", flush=True)
        return report
    finally:
        cleanup_distributed()


# --8<-- [end:run]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(CollectivesConfig, prog="python -m recipes.collectives", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), CollectivesConfig, argv)
    with exit_on_bad_input():  # a skip_on_rank outside the world: one line from rank 0, exit 2
        run(cfg)


if __name__ == "__main__":
    main()
