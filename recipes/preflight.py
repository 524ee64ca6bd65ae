"""Preflight: before a long job, check every rank's device, the rendezvous and the collectives.

    torchrun --standalone --nproc_per_node=2 -m recipes.preflight
    srun --ntasks-per-node=8 python -m recipes.preflight --timeout-s 120   # Slurm, one task per GPU

Copy with it: recipes/dist_setup.py (``setup_distributed``), recipes/options.py (the command line,
from the config). Run it as the job's first step, with the launcher, the nodes and the environment
the training will use: in about ten seconds it says whether every rank can use its device, join
the world and exchange tensors with the others, or which host and rank cannot. Model:
stas00/ml-engineering's ``torch-distributed-gpu-test.py`` (barrier and all_reduce); this adds
checked values, a table per host, a bound on every wait.

Checks, on every rank: the rendezvous (``setup_distributed``); the device (a matmul against its
known value); a barrier; ``all_reduce``, ``all_gather`` and a ``send``/``recv`` ring, each against
its value. Rank 0 prints a row per host (ranks, device, free memory, torch / CUDA / NCCL) and the
distributed variables set there. Every verdict reaches every rank (``all_gather_object``): if one
failed, all exit 1 and rank 0 names host, rank and check. A rank that never arrives, or a check
that hangs, ends every waiting rank after ``--timeout-s`` naming the ranks that never got there.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config

# The variables that decide where a rank connects and what it sees; NCCL_*, GLOO_*, ... by prefix.
ENV_NAMES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES",
    "SLURM_JOB_ID",
    "SLURM_JOB_NODELIST",
    "TORCHELASTIC_RUN_ID",
)
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")


@dataclass
class PreflightConfig:
    timeout_s: float = option(
        60.0,
        "seconds for the whole preflight, joining included: a rank that "
        "never arrives or a check that hangs ends every rank after this",
        above=0,
    )
    backend: str = option(
        "auto",
        "auto: NCCL with one GPU per local rank, else gloo",
        choices=["auto", "gloo", "nccl"],
    )
    matmul_size: int = option(
        512, "the device check multiplies two square matrices of this size", at_least=1
    )

    def __post_init__(self) -> None:
        # the ranges and choices above: one line each. (backend nccl on a rank without its GPU is
        # not refused here: it is what the preflight finds, and names, on the rank it happens)
        check_options(self)


# --8<-- [start:watch]
class StageMarks:
    """Rank r sets ``<stage>/<r>`` in the rendezvous store as it reaches each stage, so that on a
    timeout any rank can name the ranks that never got there.

    Its own store client, from a thread: ``init_process_group`` blocks until every rank has come,
    so the store is reached beside it. (Under Slurm, setup_distributed sets MASTER_ADDR.)"""

    def __init__(self, timeout_s: float):
        self.store: dist.Store | None = None
        self.world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._connect, args=(timeout_s,), daemon=True)
        self._thread.start()

    def _connect(self, timeout_s: float) -> None:
        needed = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
        while not all(name in os.environ for name in needed):
            # Pitfall: a join faster than one poll sets _stop with the variables already there
            if self._stop.wait(0.05) and not all(name in os.environ for name in needed):
                return  # a world of one: no store to reach
        env = os.environ
        try:
            store = dist.TCPStore(
                env["MASTER_ADDR"],
                int(env["MASTER_PORT"]),
                is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        except Exception:  # nobody hosts the store: the report says so (see why_stuck)
            return
        # Pitfall: torchrun keeps one store for the whole job; a restart would see the last
        # attempt's keys and count its ranks as arrived. One namespace per attempt.
        attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.world_size = int(env["WORLD_SIZE"])
        self.store = dist.PrefixStore(f"preflight/{attempt}/", store)
        self.mark("arrived")

    def joined(self) -> None:
        """The world exists, so the store is up: wait for the client (a world of one has none)."""
        self._stop.set()
        self._thread.join()

    def mark(self, stage: str) -> None:
        if self.store is not None:
            self.store.set(f"{stage}/{os.environ['RANK']}", socket.gethostname())

    def why_stuck(self, stage: str) -> str:
        """'; rank(s) 3, 5 never reached STAGE', or what the store cannot tell."""
        if self.store is None:
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            return f"; no store answered at {where}" if stage == "arrived" else ""
        try:
            missing = [r for r in range(self.world_size) if not self.store.check([f"{stage}/{r}"])]
        except Exception:  # the store's host is gone: nothing more to learn from it
            return ""
        what = "arrived" if stage == "arrived" else f"reached {stage}"
        return f"; rank(s) {', '.join(map(str, missing))} never {what}" if missing else ""


class Watchdog:
    """Ends the process with one line when the preflight has not finished by its deadline:
    ``init_process_group`` can wait past its own timeout, and a call blocked in C++ cannot be
    interrupted from Python; only another thread can end the process."""

    def __init__(self, timeout_s: float, marks: StageMarks):
        self.stage, self.marks, self.timeout_s = "arrived", marks, timeout_s
        self._done = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def enter(self, stage: str) -> None:
        self.stage = stage
        self.marks.mark(stage)

    def _watch(self) -> None:
        if self._done.wait(self.timeout_s):
            return
        stage = self.stage
        what = "joining the world" if stage == "arrived" else stage
        fail(f"{what} did not finish within {self.timeout_s:g} s{self.marks.why_stuck(stage)}")

    def stop(self) -> None:
        self._done.set()


# --8<-- [end:watch]


def fail(message: str) -> None:
    """One line naming this rank and host, then exit 1 at once: a rank blocked in a collective
    would otherwise hold the process (and its GPU) past the timeout."""
    _FAILING.acquire()  # the watchdog and the main thread can fail at once: one line, the first
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    print(
        f"error: preflight: rank {rank} on {socket.gethostname()}: {message}",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


_FAILING = threading.Lock()


# --8<-- [start:checks]
def check_device(device: torch.device, size: int) -> str:
    """'' when the device allocates and multiplies correctly, else what went wrong.

    Ones times twos: every entry is 2 * size, exact in fp32 and in TF32, so any other value is a
    broken device, not rounding."""
    product = torch.matmul(
        torch.ones(size, size, device=device), torch.full((size, size), 2.0, device=device)
    )
    wrong = int((product != 2.0 * size).sum())  # .sum() on the device, int() waits for it
    if wrong:
        return (
            f"device: matmul gave {product.flatten()[0].item():g} where {2.0 * size:g} was "
            f"expected ({wrong} of {size * size} entries wrong)"
        )
    return ""


def check_collectives(rank: int, world_size: int, device: torch.device) -> list[str]:
    """all_reduce, all_gather and a send/recv ring, each against the value it must give."""
    problems = []
    expected = world_size * (world_size + 1) / 2
    total = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(total)  # 1 + 2 + ... + world_size
    if not torch.all(total == expected):
        problems.append(f"all_reduce gave {total[0].item():g}, expected {expected:g}")
    gathered = [torch.empty(4, device=device) for _ in range(world_size)]
    dist.all_gather(gathered, torch.full((4,), float(rank), device=device))
    if not all(torch.all(chunk == r) for r, chunk in enumerate(gathered)):
        got = [chunk[0].item() for chunk in gathered]
        problems.append(f"all_gather gave {got}, expected {list(range(world_size))}")
    if world_size > 1:  # each rank sends its rank to the right, receives from the left
        left, right = (rank - 1) % world_size, (rank + 1) % world_size
        received = torch.full((4,), -1.0, device=device)
        # one batch: with NCCL, a separate isend and irecv between the same two ranks can deadlock
        for work in dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, torch.full((4,), float(rank), device=device), right),
                dist.P2POp(dist.irecv, received, left),
            ]
        ):
            work.wait()
        if not torch.all(received == left):
            problems.append(f"send/recv from rank {left} gave {received[0].item():g}")
    return problems


def describe_rank(info, device: torch.device) -> dict:
    """What rank 0's table shows about this rank."""
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
    else:
        free_bytes = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        name = "cpu"
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # a CPU build of torch has no NCCL
        nccl = "-"
    env = {
        k: v for k, v in sorted(os.environ.items()) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)
    }
    return {
        "host": socket.gethostname(),
        "rank": info.rank,
        "device": name,
        "free_gib": free_bytes / 2**30,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "-",
        "nccl": nccl,
        "env": env,
    }


# --8<-- [end:checks]


# --8<-- [start:run]
def run(cfg: PreflightConfig) -> dict:
    """Every check on this rank; returns {"ok", "hosts", "failures"}, the same on every rank."""
    marks = StageMarks(cfg.timeout_s)
    watchdog = Watchdog(cfg.timeout_s, marks)
    try:
        # +5 s: the watchdog, which can still read the store, speaks before torch's timeout
        info = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s + 5)
    except Exception as error:  # wrong address, refused port, a store that timed out first
        fail(f"joining the world failed: {type(error).__name__}: {str(error).splitlines()[0]}")
    try:
        marks.joined()
        watchdog.enter("device check")
        problems = []
        try:
            problems += [p for p in [check_device(info.device, cfg.matmul_size)] if p]
        except Exception as error:  # out of memory, a CUDA error: this rank's device is unusable
            problems.append(f"device: {type(error).__name__}: {str(error).splitlines()[0]}")
        for problem in problems:  # said at once: the collectives below may never return
            print(
                f"error: preflight: rank {info.rank} on {socket.gethostname()}: {problem}",
                file=sys.stderr,
                flush=True,
            )
        try:
            watchdog.enter("barrier")
            dist.barrier()
            watchdog.enter("collectives")
            problems += check_collectives(info.rank, info.world_size, info.device)
            watchdog.enter("report")
            everyone = [None] * info.world_size
            dist.all_gather_object(everyone, (describe_rank(info, info.device), problems))
        except Exception as error:  # a peer died or reset the connection: one line, not a trace
            fail(
                f"{watchdog.stage} failed: {type(error).__name__}: "
                f"{str(error).splitlines()[0]}{marks.why_stuck(watchdog.stage)}"
            )
        watchdog.enter("done")
    finally:
        watchdog.stop()
        cleanup_distributed()
    failures = [(row["host"], row["rank"], problem) for row, found in everyone for problem in found]
    return {
        "ok": not failures,
        "hosts": per_host([row for row, _ in everyone]),
        "failures": failures,
        "backend": info.backend,
        "world_size": info.world_size,
    }


# --8<-- [end:run]


def per_host(rows: list[dict]) -> list[dict]:
    """One entry per host, ranks in order; free memory is the lowest of the host's ranks."""
    hosts: dict[str, dict] = {}
    for row in sorted(rows, key=lambda r: r["rank"]):
        host = hosts.setdefault(row["host"], {**row, "ranks": [], "devices": []})
        host["ranks"].append(row["rank"])
        host["devices"].append(row["device"])
        host["free_gib"] = min(host["free_gib"], row["free_gib"])
    return list(hosts.values())


def format_report(result: dict) -> str:
    lines = [f"{'host':<20} {'ranks':<12} {'device':<28} {'free GiB':>8}  torch / CUDA / NCCL"]
    for h in result["hosts"]:
        ranks = ",".join(map(str, h["ranks"]))
        device = ", ".join(sorted(set(h["devices"])))
        lines.append(
            f"{h['host']:<20} {ranks:<12} {device:<28} {h['free_gib']:>8.1f}  "
            f"{h['torch']} / {h['cuda']} / {h['nccl']}"
        )
    for h in result["hosts"]:  # the lowest rank's variables on each host
        env = " ".join(f"{k}={v}" for k, v in h["env"].items()) or "(none set)"
        lines.append(f"{h['host']} env: {env}")
    verdict = "every check passed" if result["ok"] else f"{len(result['failures'])} check(s) FAILED"
    lines.append(
        f"preflight: {result['world_size']} rank(s) on {len(result['hosts'])} host(s), "
        f"{result['backend']}: {verdict}"
    )
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    return config_parser(PreflightConfig, prog="python -m recipes.preflight", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), PreflightConfig, argv)
    with exit_on_bad_input():  # bad input every rank sees: one line from rank 0, exit 2
        result = run(cfg)
    if int(os.environ.get("RANK", 0)) == 0:
        print(format_report(result), flush=True)
        for host, rank, problem in result["failures"]:
            print(f"error: preflight: rank {rank} on {host}: {problem}", file=sys.stderr)
    if not result["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
