"""One world harness: join a ``torch.distributed`` world, and spawn one that cannot hang.

Three ways in, one function (``join_world``):

- under torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` are set;
- from a process started by ``spawn_world`` or ``torch.multiprocessing.spawn``: the same variables,
  set by the parent before the work starts;
- alone: none of them is set, and the process is a world of 1 (no torchrun needed).

Backend and device: NCCL on ``cuda:LOCAL_RANK`` when every local rank has its own GPU, otherwise gloo
on CPU. ``--backend`` or ``RECIPES_BACKEND`` overrides the choice.

Never a hang: every collective has a timeout (``init_process_group(timeout=...)``); ``spawn_world``
polls its ranks, stops the world at the first failure and re-raises it with the rank's number, the
collective it was in and its traceback, and a world that outlives its deadline is killed with a report
of where each rank was waiting.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recipes.core.config import RecipeError

__all__ = ["World", "join_world", "resolve_backend", "spawn_world", "RankError", "WorldTimeoutError", "free_port"]

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
    """A rank of a spawned world failed; ``str()`` is one line, ``remote_traceback`` has the details."""

    def __init__(self, message: str, *, rank: int, operation: str | None, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.operation = operation
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback:
            text += f"\n--- traceback of rank {self.rank} ---\n{self.remote_traceback}"
        return text


class WorldTimeoutError(RankError, TimeoutError):
    """A spawned world did not finish in time; the message says where each rank was waiting."""


def resolve_backend(requested: str = "auto", local_world_size: int = 1) -> str:
    """``auto`` -> NCCL when each local rank can have a GPU of its own, else gloo. NCCL without GPUs is an error."""
    if requested == "auto":
        requested = os.environ.get(BACKEND_ENV, "auto") or "auto"
    if requested not in BACKENDS:
        raise RecipeError(f"unknown backend {requested!r}; valid values: {', '.join(BACKENDS)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        return "nccl" if gpus >= local_world_size and gpus > 0 and dist.is_nccl_available() else "gloo"
    if requested == "nccl" and (gpus < local_world_size or not dist.is_nccl_available()):
        raise RecipeError(
            f"backend 'nccl' needs one CUDA device per local rank: {local_world_size} local rank(s), "
            f"{gpus} GPU(s) visible; use --backend gloo (or RECIPES_BACKEND=gloo)"
        )
    return requested


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


@contextlib.contextmanager
def join_world(backend: str = "auto", *, timeout_s: float = 300.0) -> Iterator[World]:
    """Join the world the environment describes; destroy the process group on every way out.

    If a process group already exists (a test running several recipes in one world), it is reused and
    left for its owner to destroy.
    """
    if dist.is_initialized():
        yield _current_world()
        return
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = _env_int("RANK", 0) if under_launcher else 0
    world_size = _env_int("WORLD_SIZE", 1) if under_launcher else 1
    local_rank = _env_int("LOCAL_RANK", rank) if under_launcher else 0
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size) if under_launcher else 1
    backend = resolve_backend(backend, local_world_size)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if under_launcher:
            dist.init_process_group(
                backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout,
                device_id=device if device.type == "cuda" else None,
            )
        else:  # a world of 1 needs no rendezvous: an in-memory store is enough
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    except dist.DistNetworkError as exc:
        if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
            raise RecipeError(
                f"MASTER_PORT {os.environ.get('MASTER_PORT')} is already in use on this host; pick a free one "
                "(MASTER_PORT=<port>, or torchrun --standalone / --master-port)"
            ) from None
        raise
    launcher = os.environ.get("RECIPES_LAUNCHER", "torchrun") if under_launcher else "single"
    try:
        yield World(rank, world_size, local_rank, local_world_size, backend, device, launcher)
    except BaseException as exc:
        # Stamp the failure before teardown: destroying the group makes the peers fail too, and
        # spawn_world reports the rank that failed first, not the echoes.
        with contextlib.suppress(AttributeError, TypeError):
            exc.failed_at = getattr(exc, "failed_at", time.time())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _current_world() -> World:
    backend = dist.get_backend()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = _env_int("LOCAL_RANK", rank)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return World(rank, world_size, local_rank, _env_int("LOCAL_WORLD_SIZE", world_size), backend, device,
                 os.environ.get("RECIPES_LAUNCHER", "torchrun"))


# ----------------------------------------------------------------------------------------------------
# spawn_world: N ranks on a free loopback port, rank 0's result back, failures re-raised, no hangs.


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            raise RecipeError(
                f"MASTER_PORT {port} is already in use on {host}; set MASTER_PORT to a free port, "
                "or unset it and a free one is picked"
            ) from None


def spawn_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    master_port: int | None = None,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh processes and return rank 0's return value.

    ``fn`` must be importable (a module-level function), as with any spawn. Each rank sees the torchrun
    variables, so ``fn`` joins the world with ``join_world``. The first rank to fail stops the world and
    its exception comes back as ``RankError`` (or ``RecipeError`` for bad input).
    """
    if master_port is None:
        master_port = int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else free_port()
    check_port_free(master_port)
    ctx = mp.get_context("spawn")
    workdir = tempfile.mkdtemp(prefix="recipes-world-")
    processes = []
    try:
        for rank in range(world_size):
            rank_env = {
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "RANK": str(rank),
                "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                "RECIPES_LAUNCHER": "spawn", **(env or {}),
            }
            proc = ctx.Process(target=_rank_main, args=(fn, rank, rank_env, workdir, args, kwargs), name=f"rank{rank}")
            proc.start()
            processes.append(proc)
        return _supervise(processes, workdir, timeout_s)
    finally:
        for proc in processes:
            if proc.is_alive():
                proc.kill()
        for proc in processes:
            proc.join(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def _rank_main(fn, rank, rank_env, workdir, args, kwargs) -> None:
    os.environ.update(rank_env)
    # On SIGUSR1 the parent gets this rank's Python stack: how a timed-out world says where it hung.
    stack_file = open(os.path.join(workdir, f"stack{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    try:
        result = fn(*args, **kwargs)
        gc.collect()  # free process-group holders now, not during shutdown (see recipes/core/cli.py)
        if rank == 0:
            _write_atomically(os.path.join(workdir, "result.pkl"), pickle.dumps(result))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)]
        report = {
            "time": getattr(exc, "failed_at", time.time()), "type": type(exc).__name__, "message": _first_line(str(exc)),
            "traceback": traceback.format_exc(), "operation": collective_in_frames(frames[::-1]),
            "is_recipe_error": isinstance(exc, RecipeError),
        }
        _write_atomically(os.path.join(workdir, f"error{rank}.pkl"), pickle.dumps(report))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip teardown: a process group whose peer is gone can block in its destructor
    finally:
        stack_file.close()


def _supervise(processes, workdir: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [proc.exitcode for proc in processes]
        errors = _read_errors(workdir, len(processes))
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)] + list(errors)
        if failed:
            time.sleep(0.5)  # let the other ranks report: the first failure is the cause, not the echoes
            _raise_first_failure([proc.exitcode for proc in processes], _read_errors(workdir, len(processes)))
        if all(code == 0 for code in codes):
            with open(os.path.join(workdir, "result.pkl"), "rb") as f:
                return pickle.load(f)
        if time.monotonic() > deadline:
            _raise_timeout(processes, workdir, timeout_s)
        time.sleep(0.02)


def _read_errors(workdir: str, world_size: int) -> dict[int, dict]:
    errors = {}
    for rank in range(world_size):
        path = os.path.join(workdir, f"error{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                errors[rank] = pickle.load(f)
    return errors


def _raise_first_failure(codes: list[int | None], errors: dict[int, dict]) -> None:
    # A rank that died without raising (killed, os._exit, segfault) is the cause of the others' errors.
    silent = [rank for rank, code in enumerate(codes) if code not in (None, 0) and rank not in errors]
    if silent:
        rank, code = silent[0], codes[silent[0]]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        raise RankError(f"rank {rank} {how} without raising an error; the other ranks were stopped",
                        rank=rank, operation=None)
    rank = min(errors, key=lambda r: errors[r]["time"])
    report = errors[rank]
    where = f" in {report['operation']}" if report["operation"] else ""
    message = f"rank {rank} failed{where}: {report['type']}: {report['message']}"
    if report["is_recipe_error"]:
        raise RecipeError(f"rank {rank}: {report['message']}")
    raise RankError(message, rank=rank, operation=report["operation"], remote_traceback=report["traceback"])


def _raise_timeout(processes, workdir: str, timeout_s: float) -> None:
    for proc in processes:
        if proc.is_alive() and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(1.0)
    places, stacks = [], []
    for rank, proc in enumerate(processes):
        if proc.exitcode is not None:
            places.append(f"rank {rank} had exited with code {proc.exitcode}")
            continue
        with open(os.path.join(workdir, f"stack{rank}.txt")) as f:
            stack = f.read()
        frames = re.findall(r'File "(.+?)", line (\d+) in (\S+)', stack)
        operation = collective_in_frames([(name, int(line), func) for name, line, func in frames])
        user = next((f"{func} ({os.path.basename(name)}:{line})" for name, line, func in frames
                     if "/torch/" not in name and "multiprocessing" not in name), "unknown code")
        places.append(f"rank {rank} waiting in {operation or 'no collective'} called from {user}")
        stacks.append(f"rank {rank}:\n{stack}")
    raise WorldTimeoutError(
        f"world of {len(processes)} did not finish within {timeout_s:.0f}s: " + "; ".join(places),
        rank=0, operation=None, remote_traceback="\n".join(stacks),
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
