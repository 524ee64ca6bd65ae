"""Join the distributed world, and leave it: the lines every recipe starts and ends with.

Copy this file with any recipe that calls ``setup_distributed``: it imports torch and nothing else.
recipes/ddp_torchrun.py writes the same calls out in the open; the other recipes call these two.

Where the world comes from, in order:

- torchrun (or ``torch.multiprocessing`` with the same variables): ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
- Slurm, one task per GPU (``srun python train.py``): ``SLURM_PROCID``, ``SLURM_NTASKS``,
  ``SLURM_LOCALID`` of a task that srun started (it has ``SLURM_STEP_ID``); the master address
  is the first host of ``SLURM_JOB_NODELIST`` and the port ``MASTER_PORT`` or one derived from
  the job id;
- neither: a world of one process, so the same script runs alone without a launcher.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "DistInfo",
    "setup_distributed",
    "cleanup_distributed",
    "first_slurm_host",
    "resolve_precision",
]


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(backend: str = "auto", *, timeout_s: float = 300.0) -> DistInfo:
    """``init_process_group`` for the launcher that started this process; returns where it stands.

    ``backend="auto"``: NCCL on ``cuda:LOCAL_RANK`` when this node has a GPU for every local rank,
    gloo on CPU otherwise. A process group that already exists (a caller that joined first) is
    used as it is, and ``cleanup_distributed`` leaves it to that caller.
    """
    if dist.is_initialized():
        return _current()
    rank, world_size, local_rank, local_world_size = _world_from_environment()
    if backend == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        backend = "nccl" if 0 < local_world_size <= gpus else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: use 'auto', 'gloo' or 'nccl'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "backend nccl needs a CUDA device for each local rank and this machine has none; "
            "use backend gloo (or auto)"
        )
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        # Pitfall: without set_device every rank's NCCL work lands on cuda:0
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # timeout: a collective that a peer never joins fails after this long instead of hanging
    timeout = datetime.timedelta(seconds=timeout_s)
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        # a world of one needs no rendezvous: an in-memory store is enough
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    else:
        # Pitfall: torchrun --max-restarts keeps ONE store for the whole job and torch adds no
        # per-restart prefix: a restarted rank reads the dead attempt's gloo addresses
        # ("Gloo connectFullMesh failed ... Connection refused") or hangs. Each attempt (and
        # world size, after a membership change) gets a namespace of its own.
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"attempt{attempt}/world{world_size}", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if backend == "nccl" else None,  # NCCL: connect eagerly, one GPU
        )
        # Every rank past its handshake before any goes on: a rank that refuses bad input right
        # after joining would otherwise leave the others with "connectFullMesh failed"
        dist.barrier()
    _OWNED.append(True)
    return DistInfo(rank, local_rank, world_size, device, backend)


def cleanup_distributed() -> None:
    """``destroy_process_group``, once, from the caller that created the group: call it in a
    ``finally`` so that an exception does not leave NCCL's communicators behind."""
    if _OWNED and dist.is_initialized():
        _OWNED.clear()
        # Pitfall: DDP's reducer holds the group too. If the reducer is its last holder (the
        # caller's model freed later, at exit say), the group goes down inside the reducer's
        # destructor and gloo's threads can hang or abort the process ("terminate called without
        # an active exception"). Held here, it is freed at exit, after the models.
        _ENDED_GROUPS.append(dist.group.WORLD)
        dist.destroy_process_group()


def resolve_precision(requested: str, device: torch.device) -> str:
    """``auto`` -> bf16 on a GPU that has it, else fp32; checked against ``device``. Sets the fp32
    matmul mode on CUDA: TF32 for ``tf32`` only (a process-wide switch: set on every run, never
    inherited from an earlier one). Refuses, in one ``ValueError`` line, a mode ``device`` lacks."""
    on_cuda = device.type == "cuda"
    if requested == "auto":
        requested = "bf16" if on_cuda and torch.cuda.is_bf16_supported() else "fp32"
    if requested == "tf32" and not on_cuda:
        raise ValueError(
            f"precision tf32 is a CUDA matmul mode and this run is on {device.type}; "
            "use precision fp32 (or bf16)"
        )
    if requested == "bf16" and on_cuda and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{torch.cuda.get_device_name(device)} has no bf16; use precision tf32")
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = (
            requested == "tf32"
        )
    return requested


_OWNED: list[bool] = []  # whether setup_distributed created the current group
_ENDED_GROUPS: list = []


@atexit.register
def _free_ended_groups() -> None:
    gc.collect()  # the models first (DDP's reducers), while the interpreter is whole
    _ENDED_GROUPS.clear()


def _world_from_environment() -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) from torchrun's variables, else Slurm's,
    else a world of one. Slurm's also set MASTER_ADDR/MASTER_PORT for ``env://``."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size = int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", env["RANK"]))
        return (
            int(env["RANK"]),
            world_size,
            local_rank,
            int(env.get("LOCAL_WORLD_SIZE", world_size)),
        )
    # --8<-- [start:slurm]
    # Pitfall: the batch script itself (sbatch, no srun) also has SLURM_PROCID=0 and
    # SLURM_NTASKS=N; only a task that srun started has SLURM_STEP_ID. Without this check a
    # `python train.py` in the batch script waits for N-1 peers that nobody starts.
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        rank, world_size = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local_rank = int(env.get("SLURM_LOCALID", 0))
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
        local_world_size = tasks_on_node(per_node, int(env.get("SLURM_NODEID", 0)))
        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodes and "MASTER_ADDR" not in env:
            raise ValueError("Slurm set SLURM_PROCID but no SLURM_JOB_NODELIST: set MASTER_ADDR")
        if "MASTER_ADDR" not in env:  # a MASTER_ADDR set by the user wins over the node list
            env["MASTER_ADDR"] = first_slurm_host(nodes)
        # the same port on every task of the job, different for jobs that share a node
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 10000))
        env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
        return rank, world_size, local_rank, local_world_size
    # --8<-- [end:slurm]
    return 0, 1, 0, 1


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """This node's task count from Slurm's per-node list: "2(x3),1" -> 2, 2, 2, 1 for nodes 0-3."""
    counts: list[int] = []
    for count, times in re.findall(r"(\d+)(?:\(x(\d+)\))?", tasks_per_node):
        counts += [int(count)] * int(times or 1)
    return counts[min(node, len(counts) - 1)] if counts else 1


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[03-05,9],cpu1" -> "gpu03" (what
    ``scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1`` prints)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot read a host from SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + re.split(r"[-,]", ranges)[0]


def _current() -> DistInfo:
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), device, backend)
