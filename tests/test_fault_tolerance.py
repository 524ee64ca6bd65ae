"""fault_tolerance: with no failure, 2 replica groups equal DDP on the same global batch; a group
killed mid-step does not stop the other (it keeps committing steps alone, and reloads nothing);
the killed group, restarted, heals from the live peer and both end with identical weights and
optimizer state; bad input (no lighthouse, 0 groups, torchft missing) is one line."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import threading
import time

import pytest
import torch

from recipes import fault_tolerance
from tests.deadlines import scaled
from tests.helpers import PYTHON, REPO_ROOT, child_pids, run_cli, single_process_reference

NEEDS_TORCHFT = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None,
    reason="the fault_tolerance recipe needs torchft: pip install -e .[ft]",
)
QUIET = {"RUST_LOG": "warn"}  # torchft's Rust side logs every quorum at info
STEP = re.compile(r"^step (\d+) loss (\S+) quorum (\d+)$", re.M)


def lighthouse(min_replicas: int, **timeouts_ms):
    """torchft's coordination server, in this process, on a free port."""
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas, **timeouts_ms)


def steps(log: str) -> list[tuple[int, float, int]]:
    return [(int(s), float(loss), int(q)) for s, loss, q in STEP.findall(log)]


# slow: two groups and a lighthouse, ~6 CPU s (torch and torchft imported twice)
@pytest.mark.slow
@NEEDS_TORCHFT
def test_two_groups_without_failure_equal_ddp(tmp_path):
    """2 groups of 1 rank (each its share of the global batch of 12) equal the DDP recipe, which
    tests/test_ddp_torchrun.py holds equal on 1, 2 and 3 ranks. Not bit for bit: each group's loss
    is the mean over its 6 sequences and the two gradients are averaged after, where one process
    sums over 12 at once: float32 rounding in another order, ~1e-7 in the weights after 4 AdamW
    steps (measured 1.6e-7 after 20); losses are compared as printed (4 decimals)."""
    server = lighthouse(2, join_timeout_ms=10_000)  # min 2: the first step waits for both
    runs = [None, None]

    def group(replica_id):
        runs[replica_id] = run_cli(
            [PYTHON, "-m", "recipes.fault_tolerance", "--replica-id", str(replica_id),
             "--lighthouse", server.address(), "--steps", "4",
             "--save-path", str(tmp_path / f"group{replica_id}.pt")],
            timeout_s=120, env=QUIET,
        )  # fmt: skip

    try:
        threads = [threading.Thread(target=group, args=(r,)) for r in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        server.shutdown()
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    reference = single_process_reference(steps=4)
    logged = [steps(run.stdout) for run in runs]
    assert [q for _, _, q in logged[0]] == [2] * 4, runs[0].stdout
    assert logged[0] == logged[1]
    torch.testing.assert_close(
        torch.tensor([loss for _, loss, _ in logged[0]]),
        torch.tensor(reference.losses),
        atol=6e-5,  # printed with 4 decimals
        rtol=0,
    )
    states = [torch.load(tmp_path / f"group{r}.pt") for r in (0, 1)]
    for name, expected in reference.final_state.items():
        torch.testing.assert_close(states[0]["model"][name], expected, atol=1e-6, rtol=0)
        assert torch.equal(states[0]["model"][name], states[1]["model"][name])


# The test's hand on the groups: a sitecustomize the ranks import at start (PYTHONPATH), nothing
# of it in the recipe. FT_HOLD="STEP:PATH,...": at each STEP, after the quorum was asked for, the
# group waits until PATH exists (a group that waits forever is one killed mid-step).
# FT_MARK=PATH: created when the group first asks the lighthouse for a quorum.
PACER = """
import os
if os.environ.get("FT_HOLD") or os.environ.get("FT_MARK"):
    import time
    import torchft.optim

    holds = dict(hold.split(":", 1) for hold in os.environ.get("FT_HOLD", "").split(",") if hold)
    zero_grad = torchft.optim.OptimizerWrapper.zero_grad

    def paced(self, *args, **kwargs):
        zero_grad(self, *args, **kwargs)  # the quorum is asked for
        if os.environ.get("FT_MARK"):
            open(os.environ.pop("FT_MARK"), "w").close()
        path, waited = holds.get(str(self.manager.current_step())), 0.0
        while path and not os.path.exists(path):
            time.sleep(0.02)
            waited += 0.02
            if waited > 600:  # the test is gone: leave nothing behind
                os._exit(3)

    torchft.optim.OptimizerWrapper.zero_grad = paced
"""
KILL_AT, REJOIN_AT, STEPS = 10, 30, 50


def kill_group(proc) -> None:
    """SIGKILL a replica group: its torchrun agent and the workers, which torchrun starts in
    sessions of their own (a killpg of the agent's alone leaves them running)."""
    for pid in child_pids(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_for(what, predicate, deadline_s: float, procs=()):
    deadline = time.monotonic() + scaled(deadline_s)
    while not predicate():
        for proc in procs:
            assert proc.poll() is None, f"a group exited ({proc.returncode}) waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# slow: three torchrun launches (~20 s of CPU) and a failure that waits for torchft's timeouts
@pytest.mark.slow
@NEEDS_TORCHFT
def test_killed_group_does_not_stop_the_other_and_heals_when_it_returns(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(PACER)
    # heartbeats stop 2 s before a group counts as dead; a quorum waits 2 s for stragglers
    # (times the run's factor, tests/deadlines.py: a starved group is slow, not dead)
    beat_ms = int(scaled(2) * 1000)
    server = lighthouse(1, join_timeout_ms=beat_ms, heartbeat_timeout_ms=beat_ms)
    logs, procs = {}, []
    up = {name: tmp_path / f"{name}.up" for name in ("survivor", "first", "again")}

    def launch(name, replica_id, **env):
        logs[name] = tmp_path / f"{name}.log"
        with open(logs[name], "w") as out:
            procs.append(
                subprocess.Popen(
                    ["torchrun", "--standalone", "--nproc_per_node=1", "-m",
                     "recipes.fault_tolerance", "--replica-id", str(replica_id),
                     "--lighthouse", server.address(), "--steps", str(STEPS),
                     "--timeout-s", "10", "--save-path", str(tmp_path / f"{name}.pt")],
                    cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, **QUIET, "OMP_NUM_THREADS": "1",
                         "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}", **env},
                )
            )  # fmt: skip
        return procs[-1]

    def logged(name):
        return steps(logs[name].read_text())

    try:
        # group 0 survives. It waits at step 2 until group 1 is up, and at REJOIN_AT (alone, its
        # steps during the outage made) until group 1 is up again
        survivor = launch(
            "survivor",
            0,
            FT_HOLD=f"2:{up['first']},{REJOIN_AT}:{up['again']}",
            FT_MARK=up["survivor"],
        )
        # group 1 starts once the survivor has asked for its first quorum: started together on
        # a loaded machine, group 1 could come up first and run alone to its hold at KILL_AT
        wait_for("the survivor's first quorum", up["survivor"].exists, 120, [survivor])
        # group 1's first run stops inside step KILL_AT, after its quorum: the survivor is in
        # that step's all-reduce, waiting for it, when the whole group (torchrun and its
        # worker) is killed
        first = launch("first", 1, FT_HOLD=f"{KILL_AT}:{tmp_path / 'never'}", FT_MARK=up["first"])
        wait_for(
            f"the survivor's step {KILL_AT - 1} with both groups",
            lambda: any(s == KILL_AT - 1 and q == 2 for s, _, q in logged("survivor")),
            120, [survivor, first],
        )  # fmt: skip
        time.sleep(1)  # into step KILL_AT's all-reduce
        kill_group(first)
        killed_after = max(s for s, _, _ in logged("survivor"))
        wait_for(
            f"the survivor's step {REJOIN_AT - 1}, alone",
            lambda: any(s == REJOIN_AT - 1 for s, _, _ in logged("survivor")),
            120, [survivor],
        )  # fmt: skip
        outage = [(s, q) for s, _, q in logged("survivor") if s > killed_after]
        again = launch("again", 1, FT_MARK=up["again"])
        for proc in (survivor, again):
            proc.wait(timeout=scaled(120))
    finally:
        for proc in procs:
            kill_group(proc)
        server.shutdown()
    text = {name: path.read_text() for name, path in logs.items()}
    assert survivor.returncode == 0 and again.returncode == 0, text["survivor"][-3000:]
    # the outage: the survivor committed steps KILL_AT .. REJOIN_AT - 1 alone, without a restart
    # (one process, no healing: nothing reloaded); step KILL_AT's first try, which the killed
    # group was part of, was not committed
    assert [s for s, _ in outage] == list(range(KILL_AT, REJOIN_AT)), outage
    assert all(q == 1 for _, q in outage), outage
    assert f"step {KILL_AT} not committed" in text["survivor"], text["survivor"][-3000:]
    assert "healed" not in text["survivor"]
    # the restarted group healed from its live peer, then both stepped together to the end
    healed = re.search(r"^healed from a live peer at step (\d+)$", text["again"], re.M)
    assert healed and REJOIN_AT <= int(healed.group(1)) < STEPS - 1, text["again"][-3000:]
    assert logged("survivor")[-1][0] == logged("again")[-1][0] == STEPS - 1
    assert logged("again")[-1][2] == 2
    states = [torch.load(tmp_path / f"{name}.pt") for name in ("survivor", "again")]
    for part in ("model", "optimizer"):
        flat = [
            torch.cat([t.reshape(-1).float() for t in tensors(state[part])]) for state in states
        ]
        assert torch.equal(flat[0], flat[1]), f"the groups' {part} states differ"


def tensors(state) -> list[torch.Tensor]:
    """Every tensor of a (nested) state dict, in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in tensors(state[key])]
    if isinstance(state, list | tuple):
        return [t for item in state for t in tensors(item)]
    return []


def test_zero_replica_groups_is_one_line():
    run = run_cli([PYTHON, "-m", "recipes.fault_tolerance", "--replica-groups", "0"], timeout_s=60)
    assert run.returncode == 2
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .endswith("replica_groups must be a whole number >= 1, got 0")
    )


@NEEDS_TORCHFT
def test_a_lighthouse_that_is_not_there_is_one_line_within_the_connect_timeout():
    run = run_cli(
        [PYTHON, "-m", "recipes.fault_tolerance", "--lighthouse", "http://localhost:9",
         "--connect-timeout-s", "1"],
        timeout_s=60, env=QUIET,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "no torchft lighthouse at http://localhost:9 within 1 s" in lines[0]


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(replica_id=2), "replica_id=2 is not below replica_groups=2"),
        (dict(min_replica_size=3), "min_replica_size=3 is more than replica_groups=2"),
        (dict(lighthouse="localhost:29510"), "must be a URL"),
    ],
)
def test_bad_config_is_one_line(changes, message):
    with pytest.raises(ValueError) as refused:
        fault_tolerance.FaultTolerantConfig(**changes)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_missing_torchft_is_one_line(monkeypatch):
    monkeypatch.setattr(fault_tolerance, "torchft", None)
    with pytest.raises(ValueError, match="^fault_tolerance needs torchft: pip install torchft$"):
        fault_tolerance.train(fault_tolerance.FaultTolerantConfig())
