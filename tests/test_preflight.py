"""recipes.preflight: a healthy world passes and prints its table; a rank whose check fails, and a
rank that never arrives, are named, and every rank exits non-zero within the timeout.

Faults are injected from here, never through the recipe's options: a spawned rank patches
``torch.matmul`` and ``dist.all_reduce`` before calling the recipe's ``main``, and the missing rank
is simply never started.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import time

import torch
import torch.distributed as dist

from recipes import preflight
from recipes.core.spawn import free_port, spawn_world
from tests.helpers import PYTHON, run_cli

HOST = socket.gethostname()


def test_a_healthy_world_under_torchrun_passes_and_prints_the_table():
    proc = run_cli(["torchrun", "--standalone", "--nproc_per_node=2", "-m", "recipes.preflight",
                    "--timeout-s", "60"], timeout_s=120,
                   env={"GLOO_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "WARN"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # one row for this host with both ranks, the device, and the versions
    row = next(line for line in out.splitlines()
               if line.startswith(HOST + " ") and "env:" not in line)
    assert row.split()[1] == "0,1" and " cpu " in row and torch.__version__ in row, row
    env_line = next(line for line in out.splitlines() if line.startswith(f"{HOST} env: "))
    for setting in ("WORLD_SIZE=2", "LOCAL_WORLD_SIZE=2", "GLOO_SOCKET_IFNAME=lo",
                    "NCCL_DEBUG=WARN", "MASTER_ADDR=", "MASTER_PORT="):
        assert setting in env_line, f"{setting} missing from {env_line}"
    assert "preflight: 2 rank(s) on 1 host(s), gloo: every check passed" in out
    assert out.count("free GiB") == 1, "only rank 0 prints the table"
    assert "error" not in proc.stderr


def _main_with_a_faulty_rank_1(argv: list[str]):
    """One rank of the preflight (under spawn_world). Rank 1's device multiplies wrongly (one more
    than the product) and its all_reduce result is off by 100: what the recipe must catch."""
    if os.environ["RANK"] == "1":
        real_matmul, real_all_reduce = torch.matmul, dist.all_reduce

        def bad_all_reduce(tensor, *args, **kwargs):
            work = real_all_reduce(tensor, *args, **kwargs)
            tensor.add_(100)
            return work

        torch.matmul = lambda a, b: real_matmul(a, b) + 1
        dist.all_reduce = bad_all_reduce
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            preflight.main(argv)
        except SystemExit as exit_:
            code = exit_.code
    if code != 1:  # every rank must fail, not only the faulty one
        raise AssertionError(f"rank {os.environ['RANK']} exited {code}: {err.getvalue()}")
    return out.getvalue(), err.getvalue()


def test_a_rank_whose_check_fails_is_named_and_every_rank_exits_1():
    out, err = spawn_world(_main_with_a_faulty_rank_1, 2, ["--timeout-s", "30",
                                                           "--matmul-size", "64"],
                           deadline_s=60)
    # rank 0's own checks passed; it names rank 1's two failures with its host
    assert f"error: preflight: rank 1 on {HOST}: device: matmul gave 129 where 128 was expected " \
           f"(4096 of 4096 entries wrong)" in err, err
    assert f"error: preflight: rank 1 on {HOST}: all_reduce gave 103, expected 3" in err, err
    assert "rank 0 on" not in err, err
    assert "2 check(s) FAILED" in out and f"{HOST} " in out, out


def test_a_rank_that_never_arrives_is_named_within_the_timeout():
    # A world of 2 under Slurm's variables in which only rank 0 is started.
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
           "SLURM_JOB_NODELIST": "localhost",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    start = time.monotonic()
    proc = run_cli([PYTHON, "-m", "recipes.preflight", "--timeout-s", "3"], env=env, timeout_s=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == (f"error: preflight: rank 0 on {HOST}: joining the world did not "
                                   "finish within 3 s; rank(s) 1 never arrived"), proc.stderr
    assert elapsed < 3 + 10, f"took {elapsed:.1f} s"


def test_bad_input_is_one_line_and_exit_2():
    proc = run_cli([PYTHON, "-m", "recipes.preflight", "--timeout-s", "0"], timeout_s=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "python -m recipes.preflight: error: --timeout-s 0: use a number of seconds > 0")
