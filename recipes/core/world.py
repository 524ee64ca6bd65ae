"""The harness's side of a world: a with-block to join one, and a guard around a recipe's own join.

There is one way in, for recipes and harness alike: ``recipes.dist_setup.setup_distributed``
(torchrun's variables, else Slurm's, else a world of one). ``join_world`` is that call and
``cleanup_distributed`` as a with-block, for the tests' ranks (``recipes.core.spawn``).

``recipe_world`` is the one place the harness stands between a recipe and torch's process-group
calls, for ``prove`` (``python -m recipes.core.prove``): it rebinds ``dist.init_process_group``
and ``dist.destroy_process_group`` for the recipe's call, and nothing else does. Inside a world
that exists already (a test running recipes in its world) both do nothing: the recipe trains in
the caller's world. Otherwise the recipe joins and leaves as written, and gets what no recipe a
user copies carries: a bounded join, a heartbeat that lets a survivor name the rank that died
(``recipes.core.liveness``), and no teardown of a group broken by a dead peer.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import time
from collections.abc import Iterator

import torch.distributed as dist

from recipes import dist_setup
from recipes.core.errors import RecipeError, first_line, report_and_exit
from recipes.core.liveness import (
    Liveness,
    deadline,
    liveness_store,
    name_the_lost_peer,
    store_address,
)
from recipes.dist_setup import DistInfo, setup_distributed

__all__ = [
    "JoinError",
    "RankError",
    "WorldTimeoutError",
    "collective_in_frames",
    "is_collective_failure",
    "join_world",
    "recipe_world",
    "release_ended_groups",
]


class RankError(RuntimeError):
    """A rank of a spawned world failed; ``str()`` is one line, ``remote_traceback`` the details."""

    def __init__(
        self, message: str, *, rank: int, operation: str | None, remote_traceback: str = ""
    ):
        super().__init__(message)
        self.rank = rank
        self.operation = operation
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback:
            text += f"\n--- traceback of rank {self.rank} ---\n{self.remote_traceback}"
        return text


class JoinError(RuntimeError):
    """This rank could not join its world (a peer or the store never answered); one line."""


class WorldTimeoutError(RankError, TimeoutError):
    """A spawned world did not finish in time; the message says where each rank was waiting."""


@contextlib.contextmanager
def join_world(backend: str = "auto", *, timeout_s: float = 300.0) -> Iterator[DistInfo]:
    """``setup_distributed`` on the way in, ``cleanup_distributed`` on every way out.

    A process group that exists already (a test running several recipes in one world) is used as
    it is and left for its owner. A failure is stamped with its time before teardown
    (``exc.failed_at``: ``spawn_world`` reports the rank that failed first, not the echoes); after
    a broken collective in a world of two or more the group is left alone: destroying a gloo group
    whose peer is gone can block or abort the process (the rank exits without teardown).
    """
    created = not dist.is_initialized()
    if created:
        release_ended_groups()  # a process that runs worlds one after another holds one at a time
    world = setup_distributed(backend, timeout_s=timeout_s)
    if created:
        # The harness owns this group, not the recipes it runs in it: a recipe's own
        # cleanup_distributed (it sees a group it did not create) must leave it for the next run.
        dist_setup._OWNED.clear()
    broken = False
    try:
        yield world
    except BaseException as exc:
        with contextlib.suppress(AttributeError, TypeError):
            exc.failed_at = getattr(exc, "failed_at", time.time())
        broken = world.world_size > 1 and is_collective_failure(exc)
        raise
    finally:
        if created and not broken and dist.is_initialized():
            _keep_groups_past_teardown()
            dist.destroy_process_group()


_ENDED_GROUPS: list[dist.ProcessGroup] = []


def _keep_groups_past_teardown() -> None:
    """Hold this world's process groups past ``destroy_process_group`` until
    ``release_ended_groups``.

    Why: DDP's reducer holds its process group. When the reducer is the group's last holder, the
    group is destroyed inside the reducer's destructor, which runs with the GIL held (a pybind11
    binding that does not release it: pytorch/pytorch#56297). A gloo group's destructor joins its
    worker threads, and a worker still freeing a finished collective (all_gather_object's tensors)
    needs the GIL: the process hangs after printing its result, 1 two-host torchrun run in about
    8 here. Held in this list, a group is destroyed when the list lets go of it, through torch's
    Python binding of ProcessGroup, which releases the GIL first.
    """
    _ENDED_GROUPS.extend(dist.distributed_c10d._world.pg_map)


def release_ended_groups() -> None:
    """Free what finished runs built (models and hooks, often in reference cycles), then the
    process groups kept past their teardown: call it once the run's models are gone. It also runs at
    exit, while the interpreter is whole: freed during interpreter shutdown instead, a gloo
    group's threads can abort the process ("terminate called without an active exception")."""
    gc.collect()
    _ENDED_GROUPS.clear()


atexit.register(release_ended_groups)


def _port_in_use(exc: BaseException) -> RecipeError | None:
    """The one line for a store that could not listen on MASTER_PORT; None for other errors."""
    if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
        return RecipeError(
            f"MASTER_PORT {os.environ.get('MASTER_PORT')} is already in use on this host; pick "
            "a free one (MASTER_PORT=<port>, or torchrun --standalone / --master-port)"
        )
    return None


def is_collective_failure(exc: BaseException) -> bool:
    """True for the errors a collective raises when a peer is gone or stuck."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(word in str(exc) for word in COLLECTIVE_WORDS)


COLLECTIVE_WORDS = (
    "gloo",
    "Gloo",
    "Connection closed",
    "Connection reset",
    "Timed out",
    "NCCL",
    "mismatch between collectives",
)


def collective_in_frames(frames_innermost_first: list[tuple[str, int, str]]) -> str | None:
    """The public torch.distributed call a rank was in, from its frames (innermost first)."""
    for filename, _line, func in frames_innermost_first:
        if filename.endswith("distributed_c10d.py") and not func.startswith("_"):
            return func
    return None


@contextlib.contextmanager
def recipe_world(timeout_s: float = 300.0) -> Iterator[None]:
    """The recipe's own ``init_process_group`` / ``destroy_process_group``, adapted to the harness
    (see the module): ``prove`` runs every recipe inside it.

    - In a world that exists already, both do nothing for the call.
    - Otherwise joining is bounded: a world of more than one rank that is not joined within
      ``timeout_s`` (+2 s, so that torch's own, more specific timeout wins) ends this process with
      one line; a store or a peer that never answered is a ``JoinError`` (a busy MASTER_PORT a
      ``RecipeError``), one line each.
    - Once the group exists, every rank keeps a heartbeat (``Liveness``).
    - The recipe's teardown (its ``finally``) while a collective failure propagates is skipped.
      The exception leaves with ``peer_report``, the dead peer named. A rank failing with an
      error of its own writes it for its peers (``exit/R``: "rank R failed first").
    - The groups are held past ``destroy_process_group`` (``_keep_groups_past_teardown``).
    """
    init, destroy = dist.init_process_group, dist.destroy_process_group
    if dist.is_initialized():  # the caller's world: it made the group, it destroys it
        dist.init_process_group = dist.destroy_process_group = lambda *args, **kwargs: None
        try:
            yield
        finally:
            dist.init_process_group, dist.destroy_process_group = init, destroy
        return
    env = os.environ
    slurm_task = "SLURM_STEP_ID" in env  # srun's task: setup_distributed reads Slurm's variables
    rank = _env_int("RANK", _env_int("SLURM_PROCID", 0) if slurm_task else 0)
    world_size = _env_int("WORLD_SIZE", _env_int("SLURM_NTASKS", 1) if slurm_task else 1)
    joining = contextlib.ExitStack()  # the join's deadline, ended once the group exists
    if world_size > 1:
        joining.enter_context(deadline(timeout_s + 2.0, lambda: _join_timed_out(rank, timeout_s)))
    joined, lives = [], []  # whether the group was made; its Liveness (worlds of 2 or more)

    def guarded_init(*args, **kwargs):
        init(*args, **kwargs)
        joining.close()
        joined.append(True)
        if dist.get_world_size() > 1 and "MASTER_ADDR" in env:
            with contextlib.suppress(RuntimeError, ValueError):  # no heartbeat: no names
                size = dist.get_world_size()
                lives.append(Liveness(liveness_store(size), dist.get_rank(), size))

    def guarded_destroy(*args, **kwargs):
        exc = sys.exc_info()[1]  # what propagates through the recipe's finally, if anything
        if lives and exc is not None and is_collective_failure(exc):
            return  # the broken group stays: the process ends without teardown
        if lives and exc is not None:
            lives[0].record_exit(first_line(f"{type(exc).__name__}: {exc}"))
        if lives:
            lives.pop().stop()
        _keep_groups_past_teardown()
        destroy(*args, **kwargs)

    dist.init_process_group, dist.destroy_process_group = guarded_init, guarded_destroy
    try:
        yield
    except BaseException as exc:
        if not joined and isinstance(exc, dist.DistError):
            raise _port_in_use(exc) or _join_failed(rank, world_size, exc) from None
        if lives and is_collective_failure(exc):
            name_the_lost_peer(lives[0], lives[0].rank, exc)
        elif lives:
            lives[0].record_exit(first_line(f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        joining.close()
        dist.init_process_group, dist.destroy_process_group = init, destroy
        for liveness in lives:
            liveness.stop()


def _join_timed_out(rank: int, timeout_s: float) -> None:
    report_and_exit(
        f"rank {rank}: joining the world (init_process_group via {store_address()}) did not "
        f"finish within {timeout_s:g}s; a rank did not start or cannot reach the others - "
        "check that every rank was launched with the same MASTER_ADDR/MASTER_PORT and "
        "WORLD_SIZE",
        1,
    )


def _join_failed(rank: int, world_size: int, exc: BaseException) -> JoinError:
    return JoinError(
        f"rank {rank}: joining the world of {world_size} via {store_address()} failed "
        f"({first_line(str(exc))[:200]}); check that every rank was started with the same "
        "MASTER_ADDR, MASTER_PORT and WORLD_SIZE, and can reach that address"
    )


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default
