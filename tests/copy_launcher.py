"""Run several copied recipes from one torchrun launch: the launcher script of
tests/test_copy_recipes.py.

    torchrun --standalone --nproc_per_node=2 copy_launcher.py PLAN.json
    python copy_launcher.py PLAN.json       # the copies a user runs with plain python

Every copy runs as it would under its own ``torchrun ... train_mine.py ARGS``: in a process of
this torchrun rank (forked from it, so torch is imported once per rank instead of once per copy
and rank), in the copy's project folder, with the copy's folder first on ``sys.path``, torchrun's
variables, and the copy's own ``train_mine.py`` run as ``__main__``. Two things differ, because
one launch hosts several worlds one after the other: each copy meets on a port of its own
(``MASTER_PORT``: rank 0 picks a free one just before the copy starts and tells rank 1 through
torchrun's store; picked earlier, another test's world could take it meanwhile), with rank 0's
copy hosting the store
(``TORCHELASTIC_USE_AGENT_STORE=False``): a second ``init_process_group`` on torchrun's own store
would read the first world's keys. Each rank writes what its copy printed and its exit code to
``OUT/NAME/rank{R}.{stdout,stderr,json}``. This file imports nothing of the cookbook.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import json
import os
import runpy
import socket
import sys
import time
import traceback

import torch.distributed as dist

# torch's heavier modules too (DTensor alone takes ~1 s of CPU to import), for the same reason:
# a copy imports them again for nothing. Only torch's and third parties': the cookbook stays out.
PREIMPORT = (
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.device_mesh",
    "torch.nn.parallel",
    "torch.utils.data",
    "torchdata.stateful_dataloader",
)


def run_copy(copy: dict, rank: int, out_dir: str) -> None:
    """The copy's process: ``python train_mine.py ARGS`` in its project folder, then exit."""
    os.makedirs(out_dir, exist_ok=True)
    for fd, stream in ((1, "stdout"), (2, "stderr")):
        opened = os.open(
            os.path.join(out_dir, f"rank{rank}.{stream}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        )
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False, buffering=1)
    if "port" in copy:  # under torchrun
        os.environ.update(MASTER_PORT=str(copy["port"]), TORCHELASTIC_USE_AGENT_STORE="False")
    os.chdir(copy["project"])
    sys.path.insert(0, copy["project"])
    sys.argv = ["train_mine.py", *copy["args"]]
    code = 0
    try:
        # absolute, as `python train_mine.py` makes __main__.__file__ (Python >= 3.9): a copy
        # that starts processes with mp.spawn has them re-import its main module from that path
        runpy.run_path(os.path.join(copy["project"], "train_mine.py"), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter does: the traceback, exit 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    plan = json.loads(open(sys.argv[1], encoding="utf-8").read())
    # what only some copies import (lightning: ~2.7 s of CPU), where the plan says they run
    for name in PREIMPORT + tuple(plan.get("preimport", ())):
        try:
            importlib.import_module(name)
        except ImportError:  # a copy that needs it says so itself
            pass
    under_torchrun = "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    if under_torchrun:  # torchrun's own store (its agent hosts it): rank 0 posts the ports there
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            # rank 1 waits here for rank 0 to start each copy, at most a copy's whole run
            timeout=datetime.timedelta(seconds=60 + max(c["timeout_s"] for c in plan["copies"])),
        )
    # ``concurrent`` copies at a time (each its own world on its own port): copy i runs in slot
    # i % concurrent, after the copy before it in that slot, on every rank alike.
    slots = max(1, int(plan.get("concurrent", 1)))
    pending = [list(plan["copies"][slot::slots]) for slot in range(slots)]
    running = {}  # slot -> (pid, copy, started)
    while running or any(pending):
        for slot in range(slots):
            if slot in running or not pending[slot]:
                continue
            copy = pending[slot].pop(0)
            if under_torchrun:
                key = f"copy_launcher/port/{copy['name']}"
                if rank == 0:
                    store.set(key, str(free_port()))
                copy = {**copy, "port": int(store.get(key))}  # waits for rank 0 to start it
            started = time.monotonic()
            # Out of the collector's reach before forking: a collection in the copy would
            # otherwise write to every inherited object and duplicate this process's heap
            # (~0.3 s a process).
            gc.freeze()
            pid = os.fork()
            if pid == 0:
                run_copy(copy, rank, os.path.join(plan["out"], copy["name"]))
            running[slot] = (pid, copy, started)
        for slot, (pid, copy, started) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > started + copy["timeout_s"]:  # hung: killed, reported
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                code = "timeout"
            else:
                continue
            out_dir = os.path.join(plan["out"], copy["name"])
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
                json.dump({"exit": code, "seconds": round(time.monotonic() - started, 2)}, f)
            del running[slot]
        time.sleep(0.05)


if __name__ == "__main__":
    main()
