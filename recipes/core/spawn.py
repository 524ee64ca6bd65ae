"""Spawn a world that cannot hang: N ranks on a free loopback port, rank 0's result back,
failures re-raised with the rank and collective, and a world that outlives its deadline killed
with a report of where each rank was waiting.

For the tests: a rank's function joins the world the torchrun variables describe, as a recipe does
(``setup_distributed``; ``recipes.core.world.join_world`` in a with-block). Two limits, two names:
``deadline_s`` here bounds the whole spawned world; the ``timeout_s`` of the join bounds each
collective.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from recipes.core.errors import RecipeError, first_line, is_user_error, write_atomically
from recipes.core.world import (
    RankError,
    WorldTimeoutError,
    collective_in_frames,
    release_ended_groups,
)

__all__ = ["check_port_free", "free_port", "spawn_world"]


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
    deadline_s: float = 120.0,
    master_port: int | None = None,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh processes and return rank 0's return
    value.

    ``fn`` must be importable (a module-level function), as with any spawn. Each rank sees the
    torchrun variables, so ``fn`` joins the world with ``join_world`` (``setup_distributed``).
    The first rank to fail stops the world and its exception comes back as ``RankError`` (or
    ``RecipeError`` for bad input). A world still running after ``deadline_s`` is killed
    (``WorldTimeoutError``, naming where each rank waited).
    """
    if master_port is None:
        from_env = os.environ.get("MASTER_PORT")
        master_port = int(from_env) if from_env else free_port()
    check_port_free(master_port)
    ctx = _rank_context()
    workdir = tempfile.mkdtemp(prefix="recipes-world-")
    processes = []
    try:
        for rank in range(world_size):
            rank_env = {  # the whole environment: a forked rank inherits the server's, not ours
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port),
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
                **(env or {}),
            }
            proc = ctx.Process(
                target=_rank_main,
                name=f"rank{rank}",
                args=(fn, rank, rank_env, workdir, args, kwargs),
            )
            proc.start()
            processes.append(proc)
        return _supervise(processes, workdir, deadline_s)
    finally:
        for proc in processes:
            if proc.is_alive():
                proc.kill()
        for proc in processes:
            proc.join(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


# Imported once by the fork server, so that a rank starts in a fraction of a second instead of
# about 2 s of imports per rank (which, on 2 cores, was most of the test suite's time).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "torch.nn.parallel",
    "recipes.core.world",
    "recipes.core.spawn",
    "recipes.dist_setup",
    "recipes.core.observe",
    "recipes.core.workload",
    "recipes.core.result",
]


def preload_in_fork_server(*modules: str) -> None:
    """Have the fork server import ``modules`` too when it starts, so that no rank imports them
    again: what a caller's own rank functions need (a test suite's helpers import pytest, which
    every rank would otherwise import when it unpickles its function). Call it before the first
    world: the server reads the list once."""
    _PRELOAD.extend(module for module in modules if module not in _PRELOAD)


def _rank_context() -> Any:
    """The multiprocessing context ranks start in: ``forkserver`` where the platform has it
    (Linux), else ``spawn``. Both start ranks from a process that has not touched CUDA or started
    threads (what fork from the test process itself would risk); the fork server has also
    imported torch already."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read once, when the server starts
    return ctx


def freeze_inherited_objects() -> None:
    """Call first in a process forked from the fork server. Its objects (torch and the
    preloaded modules) move out of the garbage collector's reach. Otherwise each collection in the
    child (``join_world`` runs one, and so does a gen-2 collection) writes to every inherited
    object's header, and copy-on-write duplicates the server's heap: about 0.3 s of CPU per
    rank, most of a small world's cost. ``gc.freeze`` only splices lists, so it is instant."""
    gc.freeze()


def _rank_main(fn, rank, rank_env, workdir, args, kwargs) -> None:
    freeze_inherited_objects()
    os.environ.clear()
    os.environ.update(rank_env)
    dist.set_debug_level_from_env()  # read at import, which the fork server did before this
    # On SIGUSR1 the parent gets this rank's Python stack: how a timed-out world says where it hung.
    stack_file = open(os.path.join(workdir, f"stack{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    try:
        result = fn(*args, **kwargs)
        release_ended_groups()
        if rank == 0:
            write_atomically(os.path.join(workdir, "result.pkl"), pickle.dumps(result))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)]
        report = {
            "time": getattr(exc, "failed_at", time.time()),
            "type": type(exc).__name__,
            "message": first_line(str(exc)),
            "traceback": traceback.format_exc(),
            "operation": collective_in_frames(frames[::-1]),
            "is_recipe_error": is_user_error(exc),
        }
        write_atomically(os.path.join(workdir, f"error{rank}.pkl"), pickle.dumps(report))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip teardown: a process group whose peer is gone can block in its destructor
    finally:
        stack_file.close()


def _supervise(processes, workdir: str, deadline_s: float) -> Any:
    deadline = time.monotonic() + deadline_s
    while True:
        codes = [proc.exitcode for proc in processes]
        errors = _read_errors(workdir, len(processes))
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)] + list(errors)
        if failed:
            _raise_first_failure(*_settled(processes, workdir))
        if all(code == 0 for code in codes):
            with open(os.path.join(workdir, "result.pkl"), "rb") as f:
                return pickle.load(f)
        if time.monotonic() > deadline:
            _raise_timeout(processes, workdir, deadline_s)
        time.sleep(0.02)


# After the first failure, how long the others get to exit or report before the cause is named.
SETTLE_S = 5.0


def _settled(processes, workdir: str) -> tuple[list[int | None], dict[int, dict]]:
    """The exit codes and error reports once every rank has exited or reported, or SETTLE_S
    later (a rank blocked in a collective may do neither): the first failure is the cause, not
    the echoes. A rank that died silently is known only by its exit code, which the fork server
    passes on once it has reaped the process: on a loaded machine that came after the survivor's
    report of the broken connection (a fixed 0.5 s wait then named the survivor)."""
    settle = time.monotonic() + SETTLE_S
    while True:
        codes = [proc.exitcode for proc in processes]
        errors = _read_errors(workdir, len(processes))
        if time.monotonic() > settle or all(
            code is not None or rank in errors for rank, code in enumerate(codes)
        ):
            return codes, errors
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
    # A rank that died without raising (killed, os._exit, segfault) caused the others' errors.
    silent = [
        rank for rank, code in enumerate(codes) if code not in (None, 0) and rank not in errors
    ]
    if silent:
        rank, code = silent[0], codes[silent[0]]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        raise RankError(
            f"rank {rank} {how} without raising an error; the other ranks were stopped",
            rank=rank,
            operation=None,
        )
    rank = min(errors, key=lambda r: errors[r]["time"])
    report = errors[rank]
    where = f" in {report['operation']}" if report["operation"] else ""
    message = f"rank {rank} failed{where}: {report['type']}: {report['message']}"
    if report["is_recipe_error"]:
        raise RecipeError(f"rank {rank}: {report['message']}")
    raise RankError(
        message, rank=rank, operation=report["operation"], remote_traceback=report["traceback"]
    )


def _raise_timeout(processes, workdir: str, deadline_s: float) -> None:
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
        user = next(
            (
                f"{func} ({os.path.basename(name)}:{line})"
                for name, line, func in frames
                if "/torch/" not in name and "multiprocessing" not in name
            ),
            "unknown code",
        )
        places.append(f"rank {rank} waiting in {operation or 'no collective'} called from {user}")
        stacks.append(f"rank {rank}:\n{stack}")
    raise WorldTimeoutError(
        f"world of {len(processes)} did not finish within {deadline_s:.0f}s: " + "; ".join(places),
        rank=0,
        operation=None,
        remote_traceback="\n".join(stacks),
    )
