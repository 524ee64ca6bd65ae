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
import threading
import time

import pytest
import torch
import torch.distributed as dist

from recipes import preflight
from recipes.core.spawn import free_port
from tests.deadlines import scaled
from tests.helpers import PYTHON, REPO_ROOT, run_cli, spawn_world

HOST = socket.gethostname()


def test_a_healthy_world_under_torchrun_passes_and_prints_the_table():
    proc = run_cli(
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "recipes.preflight",
            "--timeout-s",
            "60",
        ],
        timeout_s=120,
        env={"GLOO_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "WARN"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # one row for this host with both ranks, the device, and the versions
    row = next(
        line for line in out.splitlines() if line.startswith(HOST + " ") and "env:" not in line
    )
    assert row.split()[1] == "0,1" and " cpu " in row and torch.__version__ in row, row
    env_line = next(line for line in out.splitlines() if line.startswith(f"{HOST} env: "))
    for setting in (
        "WORLD_SIZE=2",
        "LOCAL_WORLD_SIZE=2",
        "GLOO_SOCKET_IFNAME=lo",
        "NCCL_DEBUG=WARN",
        "MASTER_ADDR=",
        "MASTER_PORT=",
    ):
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
    out, err = spawn_world(
        _main_with_a_faulty_rank_1, 2, ["--timeout-s", "30", "--matmul-size", "64"], deadline_s=60
    )
    # rank 0's own checks passed; it names rank 1's two failures with its host
    assert (
        f"error: preflight: rank 1 on {HOST}: device: matmul gave 129 where 128 was expected "
        f"(4096 of 4096 entries wrong)" in err
    ), err
    assert f"error: preflight: rank 1 on {HOST}: all_reduce gave 103, expected 3" in err, err
    assert "rank 0 on" not in err, err
    assert "2 check(s) FAILED" in out and f"{HOST} " in out, out


def test_a_rank_that_never_arrives_is_named_within_the_timeout():
    # A world of 2 under Slurm's variables in which only rank 0 is started.
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "localhost",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    start = time.monotonic()
    proc = run_cli([PYTHON, "-m", "recipes.preflight", "--timeout-s", "3"], env=env, timeout_s=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == (
        f"error: preflight: rank 0 on {HOST}: joining the world did not "
        "finish within 3 s; rank(s) 1 never arrived"
    ), proc.stderr
    # the line itself says the watchdog fired at 3 s (torch's own timeout, 5 s later, words it
    # otherwise); the wall time adds start-up, which on 2 shared cores under load can take long
    assert elapsed < 3 + scaled(30), f"took {elapsed:.1f} s"


def test_bad_input_is_one_line_and_exit_2(capsys):
    # refused by the config before any world: in-process, no launch needed
    with pytest.raises(SystemExit) as exit_info:
        preflight.main(["--timeout-s", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m recipes.preflight: error: timeout_s must be a finite number > 0, got 0.0"
    )


STUCK_RANK_1 = """
import os, time
from recipes import preflight
stuck = os.environ["SLURM_PROCID"] == "1"
if stuck:  # injected by the test: rank 1's device check never returns
    preflight.check_device = lambda *args: time.sleep(120)
# rank 1 waits longer: its own watchdog, had it fired first at the same 3 s, would have ended it,
# and rank 0 would report the connection rank 1 closed instead of where rank 1 stopped
preflight.main(["--timeout-s", "8" if stuck else "3"])
"""


def test_a_check_that_hangs_is_named_with_the_ranks_that_never_got_past_it(tmp_path):
    from tests.helpers import _run_module_forked

    script = tmp_path / "stuck_rank_1.py"
    script.write_text(STUCK_RANK_1)
    port = str(free_port())
    procs: dict[int, object] = {}

    def rank_main(rank: int) -> None:
        env = {
            **os.environ,
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": "2",
            "SLURM_STEP_ID": "0",
            "SLURM_LOCALID": str(rank),
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_JOB_NODELIST": "localhost",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": REPO_ROOT,
        }
        env.pop("RANK", None)
        procs[rank] = _run_module_forked(
            [PYTHON, str(script)], ("path", str(script)), [], scaled(60), env
        )

    start = time.monotonic()
    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - start
    assert [procs[rank].returncode for rank in (0, 1)] == [1, 1]
    assert procs[0].stderr.strip() == (
        f"error: preflight: rank 0 on {HOST}: barrier did not "
        "finish within 3 s; rank(s) 1 never reached barrier"
    )
    # (before it, torch may log that the store's host, rank 0, has gone: it exited first)
    assert procs[1].stderr.strip().splitlines()[-1] == (
        f"error: preflight: rank 1 on {HOST}: device check did not finish within 8 s"
    )
    # the line itself says the watchdog fired at 3 s (torch's own timeout, 5 s later, words it
    # otherwise); the wall time adds start-up, which on 2 shared cores under load can take long
    assert elapsed < 8 + scaled(30), f"took {elapsed:.1f} s"
