"""One world harness: join a ``torch.distributed`` world (spawning one: ``recipes.core.spawn``).

Four ways in, one function (``join_world``):

- under torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
  are set (each restart joins in a store namespace of its own: see ``_attempt_store``);
- from a process started by ``spawn_world`` or ``torch.multiprocessing.spawn``: the same variables,
  set by the parent before the work starts;
- under ``srun``, one task per GPU: no torchrun variables, but ``SLURM_PROCID``/``SLURM_NTASKS``/
  ``SLURM_LOCALID`` and the node list, read as ``recipes.dist_setup`` reads them;
- alone: none of them is set, and the process is a world of 1 (no torchrun needed).

Backend and device: NCCL on ``cuda:LOCAL_RANK`` when every local rank has its own GPU, otherwise
gloo on CPU. ``--backend`` or ``RECIPES_BACKEND`` overrides the choice.

Never a hang: every collective has a timeout (``init_process_group(timeout=...)``), and joining
itself is bounded by a timer; ``spawn_world`` polls its ranks, stops the world at the first failure
and re-raises it with the rank's number, the collective it was in and its traceback, and a world
that outlives its deadline is killed with a report of where each rank was waiting. When a peer
dies, the survivors name it (``Liveness``) and exit without tearing down the broken group.

A copyable recipe joins the world itself (recipes/dist_setup.py, or ``init_process_group`` in the
open) and carries none of this: ``python -m recipes.core.prove`` runs it inside
``guard_recipe_world``, which gives it the same bounded join, heartbeat and survivor's report.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from recipes.core.config import RecipeError

__all__ = [
    "RankError",
    "World",
    "JoinError",
    "WorldTimeoutError",
    "is_collective_failure",
    "guard_recipe_world",
    "join_world",
    "report_and_exit",
    "resolve_backend",
]

BACKEND_ENV = "RECIPES_BACKEND"
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class World:
    """Where this process stands in the world."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    launcher: str  # "torchrun", "spawn" or "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


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


def resolve_backend(requested: str = "auto", local_world_size: int = 1) -> str:
    """``auto`` -> NCCL when each local rank can have a GPU of its own, else gloo. NCCL without
    GPUs is an error."""
    if requested == "auto":
        requested = os.environ.get(BACKEND_ENV, "auto") or "auto"
    if requested not in BACKENDS:
        raise RecipeError(f"unknown backend {requested!r}; valid values: {', '.join(BACKENDS)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        enough = gpus >= local_world_size and gpus > 0 and dist.is_nccl_available()
        return "nccl" if enough else "gloo"
    if requested == "nccl" and (gpus < local_world_size or not dist.is_nccl_available()):
        raise RecipeError(
            f"backend 'nccl' needs one CUDA device per local rank: {local_world_size} local "
            "rank(s), "
            f"{gpus} GPU(s) visible; use --backend gloo (or RECIPES_BACKEND=gloo)"
        )
    return requested


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


@contextlib.contextmanager
def join_world(backend: str = "auto", *, timeout_s: float = 300.0) -> Iterator[World]:
    """Join the world the environment describes; destroy the process group on every way out.

    If a process group already exists (a test running several recipes in one world), it is reused
    and left for its owner to destroy. Joining itself is bounded: a world that is not complete
    within ``timeout_s`` (+ a 2 s grace) ends this process with one line (see ``_init_deadline``).
    """
    if dist.is_initialized():
        yield _current_world()
        return
    release_ended_groups()  # a process that runs worlds one after another holds one at a time
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    launcher = os.environ.get("RECIPES_LAUNCHER", "torchrun") if under_launcher else "single"
    if not under_launcher and "SLURM_PROCID" in os.environ:
        # srun, one task per GPU: no torchrun variables. Read Slurm's as recipes.dist_setup does
        # (one reading for both); for a world of more than one it also sets RANK, WORLD_SIZE,
        # LOCAL_RANK and MASTER_ADDR/PORT (the node list's first host, a port from the job id).
        from recipes.dist_setup import _world_from_environment

        try:
            _, slurm_world_size, _, local_world_size = _world_from_environment()
        except ValueError as exc:  # a Slurm variable that is not a number, no node list
            raise RecipeError(str(exc)) from None
        if slurm_world_size > 1:
            os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
            under_launcher, launcher = True, "slurm"
    rank = _env_int("RANK", 0) if under_launcher else 0
    world_size = _env_int("WORLD_SIZE", 1) if under_launcher else 1
    local_rank = _env_int("LOCAL_RANK", rank) if under_launcher else 0
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size) if under_launcher else 1
    backend = resolve_backend(backend, local_world_size)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    liveness = None
    if under_launcher:
        with _init_deadline(rank, timeout_s):
            try:
                store = _attempt_store(rank, world_size, timeout)
                dist.init_process_group(
                    backend,
                    store=store,
                    rank=rank,
                    world_size=world_size,
                    timeout=timeout,
                    device_id=device if device.type == "cuda" else None,
                )
            except dist.DistError as exc:  # a store or a peer that never answered: one line
                raise _join_failed(rank, world_size, exc) from None
        if world_size > 1:
            liveness = Liveness(store, rank, world_size)
    else:  # a world of 1 needs no rendezvous: an in-memory store is enough
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    world_broken = False
    try:
        yield World(rank, world_size, local_rank, local_world_size, backend, device, launcher)
    except BaseException as exc:
        # Stamp the failure before teardown: destroying the group makes the peers fail too, and
        # spawn_world reports the rank that failed first, not the echoes.
        with contextlib.suppress(AttributeError, TypeError):
            exc.failed_at = getattr(exc, "failed_at", time.time())
        if liveness is not None and is_collective_failure(exc):
            # An echo of a peer's death: say which peer, and leave the group alone. Destroying a
            # gloo group whose peer is gone can block, or abort the process ("terminate called
            # without an active exception"); the caller exits without teardown (os._exit).
            world_broken = True
            _name_the_lost_peer(liveness, rank, exc)
        elif liveness is not None:
            liveness.record_exit(_first_line(f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        if liveness is not None:
            liveness.stop()
        if dist.is_initialized() and not world_broken:
            _keep_groups_past_teardown()
            dist.destroy_process_group()


def _join_failed(rank: int, world_size: int, exc: BaseException) -> JoinError:
    return JoinError(
        f"rank {rank}: joining the world of {world_size} via {_store_address()} failed "
        f"({_first_line(str(exc))[:200]}); check that every rank was started with the same "
        "MASTER_ADDR, MASTER_PORT and WORLD_SIZE, and can reach that address"
    )


def _name_the_lost_peer(liveness: Liveness, rank: int, exc: BaseException) -> None:
    """``exc.peer_report``: which peer died (``Liveness.explain``), for ``cli._collective_failed``
    to print; a store that stops answering meanwhile ends the process with what is known."""
    unnamed = (
        f"rank {rank}: a collective failed ({_first_line(str(exc))[:160]}) and the store "
        f"at {_store_address()} stopped answering while naming the lost rank: a host is "
        "unreachable (network down, or the node of rank 0 / of torchrun's agent is gone)"
    )
    with (
        _deadline(12.0, lambda: report_and_exit(unnamed, 1, echo=True)),
        contextlib.suppress(AttributeError, TypeError),
    ):
        exc.peer_report = liveness.explain()


# The process groups of worlds that ended, held until release_ended_groups() (see below).
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
    process groups ``join_world`` kept: call it once the run's models are gone. It also runs at
    exit, while the interpreter is whole: freed during interpreter shutdown instead, a gloo
    group's threads can abort the process ("terminate called without an active exception")."""
    gc.collect()
    _ENDED_GROUPS.clear()


atexit.register(release_ended_groups)


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The launcher's store (MASTER_ADDR:MASTER_PORT), in a namespace of this attempt's own.

    Why: torchrun's agent keeps ONE TCPStore for the whole job (c10d rendezvous shares its store
    with the workers, static rendezvous reuses its own) and torch adds no per-restart prefix, so
    the workers of a restart read the keys the dead attempt left: gloo addresses of processes that
    are gone ("Gloo connectFullMesh failed ... Connection refused") or counters that never add up
    (a hang). TORCHELASTIC_RESTART_COUNT numbers the restarts after a failure; the world size tells
    apart the re-rendezvous after a membership change, which keeps the count.
    """
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    except dist.DistNetworkError as exc:
        if _port_in_use(exc):
            raise _port_in_use(exc) from None
        raise
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"recipes/attempt{attempt}/world{world_size}", store)


def _port_in_use(exc: BaseException) -> RecipeError | None:
    """The one line for a store that could not listen on MASTER_PORT; None for other errors."""
    if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
        return RecipeError(
            f"MASTER_PORT {os.environ.get('MASTER_PORT')} is already in use on this host; pick "
            "a free one (MASTER_PORT=<port>, or torchrun --standalone / --master-port)"
        )
    return None


@contextlib.contextmanager
def _init_deadline(rank: int, timeout_s: float) -> Iterator[None]:
    """End the process if joining takes longer than ``timeout_s`` (+2 s, so that torch's own, more
    specific timeout wins when it fires). ``init_process_group`` can wait past its ``timeout``
    (a peer that connected and then stalled, a store host that accepts but never answers), and a
    call blocked in C++ cannot be interrupted from Python: a timer thread is the only bound."""
    with _deadline(
        timeout_s + 2.0,
        lambda: report_and_exit(
            f"rank {rank}: joining the world (init_process_group via {_store_address()}) did not "
            f"finish within {timeout_s:g}s; a rank did not start or cannot reach the others - "
            "check that every rank was launched with the same MASTER_ADDR/MASTER_PORT and "
            "WORLD_SIZE",
            1,
        ),
    ):
        yield


@contextlib.contextmanager
def _deadline(seconds: float, give_up: Callable[[], None]) -> Iterator[None]:
    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _store_address() -> str:
    return f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"


def report_and_exit(message: str, code: int, *, echo: bool = False) -> NoReturn:
    """One line on stderr, the same line in torchrun's error file, then exit without teardown.

    Under torchrun, the error file (TORCHELASTIC_ERROR_FILE, what ``@record`` would write) is what
    its "Root Cause" summary prints; without it the summary says "To enable traceback see ...".
    torchrun names as root cause the failure with the smallest timestamp, in whole seconds, ties
    going to the lowest local rank: ``echo=True`` (this rank failed because a peer died) stamps
    the failure one second later, so that the dead peer, not rank 0, is named.
    """
    print(f"error: {message}", file=sys.stderr, flush=True)
    write_torchrun_error_file(message, delay_s=1 if echo else 0)
    sys.stdout.flush()
    os._exit(code)  # skip teardown: a process group whose peer is gone can block or abort in it


def write_torchrun_error_file(message: str, *, delay_s: int = 0) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # The format torch.distributed.elastic reads (ProcessFailure._get_error_data): a plain-string
    # message with a top-level timestamp is printed as it is.
    data = {"message": message, "timestamp": str(int(time.time()) + delay_s)}
    with contextlib.suppress(OSError):
        _write_atomically(path, json.dumps(data).encode())


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


class Liveness:
    """Which peer died: every rank keeps a heartbeat in the store and notes how it exits.

    A survivor's collective only says that a connection broke. What names the peer: a key a rank
    writes when it fails with an error of its own (``exit/R``); for ranks on this host, whether
    their process still runs (``/proc``); for other hosts, a heartbeat that stopped advancing.
    The first survivor to know publishes its verdict, and every rank's heartbeat thread keeps a
    copy: a survivor whose collective breaks later (when rank 0, the store's host in a world
    started without torchrun's agent, has already left) still names the rank that died first.
    The heartbeat thread has its own store connection, so it never waits behind the main thread.
    """

    PERIOD_S = 1.0

    def __init__(self, store: dist.Store, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.store = dist.PrefixStore("liveness", store)
        self.host = socket.gethostname()
        self.store.set(f"proc/{rank}", json.dumps({"host": self.host, "pid": os.getpid()}))
        self.procs: dict[int, dict] = {}  # every rank's host and pid, once all have registered
        self.verdict = ""  # the first survivor's verdict, copied by the heartbeat thread
        self._stop = threading.Event()
        self._beat_store = self._own_connection()
        self._thread = threading.Thread(target=self._beat, name="recipes-heartbeat", daemon=True)
        self._thread.start()

    def _own_connection(self) -> dist.Store | None:
        try:
            client = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=datetime.timedelta(seconds=5),
            )
        except (KeyError, ValueError, RuntimeError):
            return None  # no heartbeat; the other signs still work
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"recipes/attempt{attempt}/world{self.world_size}"
        return dist.PrefixStore("liveness", dist.PrefixStore(prefix, client))

    def _beat(self) -> None:
        store = self._beat_store
        while store is not None and not self._stop.wait(self.PERIOD_S):
            try:
                store.add(f"beat/{self.rank}", 1)
                keys = [f"proc/{r}" for r in range(self.world_size)]
                if not self.procs and store.check(keys):
                    self.procs = {r: json.loads(store.get(key)) for r, key in enumerate(keys)}
                if store.check(["verdict"]):
                    self.verdict = store.get("verdict").decode()
            except Exception:  # noqa: BLE001 - the store's host is gone: nothing left to tell
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.PERIOD_S)

    def record_exit(self, line: str) -> None:
        with contextlib.suppress(Exception):
            self.store.set(f"exit/{self.rank}", line)

    def explain(self) -> str:
        """One phrase naming the dead or failed peers, or what is known when none can be named."""
        probe = self._beat_store or self.store
        verdict = self._explain(probe)
        try:
            if not probe.check(["verdict"]):
                probe.set("verdict", verdict)
            if self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
                # This process hosts the store: stay long enough for every heartbeat thread to
                # copy the verdict before the store goes with it.
                time.sleep(2.5 * self.PERIOD_S)
        except Exception:  # noqa: BLE001 - the store is gone; the verdict is still this rank's
            pass
        return verdict

    def _dead_here(self, procs: dict[int, dict], wait_s: float = 1.0) -> list[int]:
        """Peers on this host whose process is gone (polled briefly: a killed process takes a
        moment to leave, and its sockets close before it does)."""
        deadline = time.monotonic() + wait_s
        while True:
            gone = [
                r
                for r, p in procs.items()
                if r != self.rank and p["host"] == self.host and not _running(p["pid"])
            ]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.1)

    def _explain(self, probe: dist.Store, wait_s: float = 3.0) -> str:
        peers = [r for r in range(self.world_size) if r != self.rank]
        try:
            failed = {
                r: probe.get(f"exit/{r}").decode() for r in peers if probe.check([f"exit/{r}"])
            }
            if failed:
                return "; ".join(f"rank {r} failed first: {line}" for r, line in failed.items())
            procs = self.procs or {
                r: json.loads(probe.get(f"proc/{r}")) for r in peers if probe.check([f"proc/{r}"])
            }
            gone = self._dead_here(procs)
            # The first survivor's verdict wins over /proc, read AFTER it: a survivor publishes,
            # then exits, so one that exited before the look above has published by now, and
            # must not be counted among the dead (two survivors that fail in the same collective
            # look at the same moment).
            if probe.check(["verdict"]):
                return probe.get("verdict").decode()
            if gone:
                return _no_longer_running(gone, procs)
            beats = {r: _count(probe, r) for r in peers}
            time.sleep(wait_s)  # a live peer beats every PERIOD_S: several times in wait_s
            stale = [r for r in peers if _count(probe, r) == beats[r]]
            if stale:
                named = ", ".join(f"rank {r} ({procs.get(r, {}).get('host', '?')})" for r in stale)
                whose = " stopped its" if len(stale) == 1 else " stopped their"
                return named + whose + " heartbeat (dead, or unreachable)"
            return "every other rank is still alive: one of them is stuck or failed differently"
        except Exception:  # noqa: BLE001 - the store itself is unreachable
            if self.verdict:
                return self.verdict
            gone = self._dead_here(self.procs, wait_s=0)
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            return (
                _no_longer_running(gone, self.procs) + f" and the store at {where} is gone"
                if gone
                else f"the store at {where} is unreachable too: the host of rank 0 "
                "(or of torchrun's agent) is gone"
            )


def _no_longer_running(ranks: list[int], procs: dict[int, dict]) -> str:
    named = ", ".join(f"rank {r} (pid {procs[r]['pid']})" for r in ranks)
    return (
        named
        + (" is" if len(ranks) == 1 else " are")
        + " no longer running (killed, or exited without an error)"
    )


def _count(store: dist.Store, rank: int) -> int:
    return int(store.add(f"beat/{rank}", 0))


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie is dead
    except OSError:
        return False


def _current_world() -> World:
    backend = dist.get_backend()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = _env_int("LOCAL_RANK", rank)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return World(
        rank,
        world_size,
        local_rank,
        _env_int("LOCAL_WORLD_SIZE", world_size),
        backend,
        device,
        os.environ.get("RECIPES_LAUNCHER", "torchrun"),
    )


def collective_in_frames(frames_innermost_first: list[tuple[str, int, str]]) -> str | None:
    """The public torch.distributed call a rank was in, from its frames (innermost first)."""
    for filename, _line, func in frames_innermost_first:
        if filename.endswith("distributed_c10d.py") and not func.startswith("_"):
            return func
    return None


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def _write_atomically(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


@contextlib.contextmanager
def guard_recipe_world(timeout_s: float = 300.0) -> Iterator[None]:
    """What ``join_world`` gives a harness-built recipe, for a copyable one that joins and leaves
    the world itself (``init_process_group`` / ``destroy_process_group``, in the open or through
    recipes/dist_setup.py): ``python -m recipes.core.prove`` runs every recipe inside it.

    - Joining is bounded: a world of more than one rank that is not joined within ``timeout_s``
      (+2 s) ends this process with one line (``_init_deadline``); a store or a peer that never
      answered is a ``JoinError`` (a busy MASTER_PORT a ``RecipeError``), one line each.
    - Once the group exists, every rank keeps a heartbeat (``Liveness``), in the store namespace
      of this attempt and world size, as ``join_world``'s.
    - The recipe's teardown (its ``finally``) while a collective failure propagates is skipped:
      destroying a gloo group whose peer is gone can block or abort the process. The exception
      leaves with ``peer_report``, the dead peer named, for ``cli._collective_failed`` to print
      before the process ends without teardown. A rank failing with an error of its own writes
      it for its peers (``exit/R``: "rank R failed first").

    ``dist.init_process_group`` and ``dist.destroy_process_group`` are wrapped for the call; where
    a process group exists already (a test's world), nothing changes.
    """
    if dist.is_initialized():
        yield
        return
    env = os.environ
    slurm_task = "SLURM_STEP_ID" in env  # srun's task: dist_setup reads Slurm's variables
    rank = _env_int("RANK", _env_int("SLURM_PROCID", 0) if slurm_task else 0)
    world_size = _env_int("WORLD_SIZE", _env_int("SLURM_NTASKS", 1) if slurm_task else 1)
    init, destroy = dist.init_process_group, dist.destroy_process_group
    joining = contextlib.ExitStack()  # the join's deadline, ended once the group exists
    if world_size > 1:
        joining.enter_context(_init_deadline(rank, timeout_s))
    joined, lives = [], []  # whether the group was made; its Liveness (worlds of 2 or more)

    def guarded_init(*args, **kwargs):
        init(*args, **kwargs)
        joining.close()
        joined.append(True)
        if dist.get_world_size() > 1 and "MASTER_ADDR" in env:
            with contextlib.suppress(RuntimeError, ValueError):  # no heartbeat: no names
                lives.append(
                    Liveness(
                        _liveness_store(dist.get_world_size()),
                        dist.get_rank(),
                        dist.get_world_size(),
                    )
                )

    def guarded_destroy(*args, **kwargs):
        exc = sys.exc_info()[1]  # what propagates through the recipe's finally, if anything
        if lives and exc is not None and is_collective_failure(exc):
            return  # the broken group stays: the process ends without teardown (see above)
        if lives and exc is not None:
            lives[0].record_exit(_first_line(f"{type(exc).__name__}: {exc}"))
        if lives:
            lives.pop().stop()
        destroy(*args, **kwargs)

    dist.init_process_group, dist.destroy_process_group = guarded_init, guarded_destroy
    try:
        yield
    except BaseException as exc:
        if not joined and isinstance(exc, dist.DistError):
            raise _port_in_use(exc) or _join_failed(rank, world_size, exc) from None
        if lives and is_collective_failure(exc):
            _name_the_lost_peer(lives[0], lives[0].rank, exc)
        elif lives:
            lives[0].record_exit(_first_line(f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        joining.close()
        dist.init_process_group, dist.destroy_process_group = init, destroy
        for liveness in lives:
            liveness.stop()


def _liveness_store(world_size: int) -> dist.Store:
    """The launcher's store, in the namespace ``Liveness`` keeps its own connection in."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=30),
    )
    return dist.PrefixStore(f"recipes/attempt{attempt}/world{world_size}", client)
