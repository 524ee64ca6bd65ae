"""training_health: a NaN on one rank, a slow rank, a corrupted replica and a gradient spike are
each injected from here (the recipe has no fault injection) and named in one line: the rank, the
step, what went bad. Every rank stops together, or skips together; the NaN check costs one
all-reduce of 8 bytes a step; with no fault the losses are plain DDP's, exactly; a rank whose
torchrun agent is killed exits by itself; bad input is one line."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from recipes import ddp_torchrun, training_health
from recipes.toy import make_dataset
from tests.deadlines import scaled
from tests.helpers import PYTHON, REPO_ROOT, child_pids, ddp_result_only, run_world

CFG = training_health.HealthConfig(steps=4, backend="gloo", timeout_s=60, watch_launcher=False)
FAULT_RANK, FAULT_STEP, SLEEP_S = 1, 3, 0.25
PARAM = "layers.1.mlp.w_in.weight"  # the parameter the faults touch (not the first)


class Inject:
    """The test's observer: one fault, on rank FAULT_RANK, through hooks on the recipe's model."""

    def __init__(self, fault: str | None, at_step: int = FAULT_STEP):
        self.fault, self.at_step, self.step, self.optimizer = fault, at_step, 0, None

    def model_ready(self, ddp_model, optimizer):
        self.optimizer, model = optimizer, ddp_model.module
        if self.fault is None or dist.get_rank() != FAULT_RANK:
            return
        params = dict(model.named_parameters())
        now = lambda: self.step == self.at_step  # noqa: E731

        def before_forward(module, args):
            if self.fault == "slow":
                time.sleep(SLEEP_S)  # every step: this rank computes as the others do, later
            elif now() and self.fault == "nan parameter":
                params[PARAM].data.view(-1)[0] = float("nan")
            elif now() and self.fault == "diverge":
                params[PARAM].data.add_(1)  # finite: only the replica check can see it

        model.register_forward_pre_hook(before_forward)
        if self.fault == "nan loss":
            model.register_forward_hook(lambda m, a, out: out * float("nan") if now() else out)
        if self.fault in ("nan gradient", "spike"):
            scale = float("nan") if self.fault == "nan gradient" else 1000.0
            params[PARAM].register_hook(lambda grad: grad * scale if now() else grad)

    def step_end(self, step, loss):
        self.step = step + 1


def checked_run(case):
    """One rank: the recipe's train with one fault, its collectives counted; every rank's outcome
    gathered to rank 0 (a NonFiniteError on one rank only would be a hang, not a stop)."""
    cfg, fault = case
    calls = []
    real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast")}

    def counting(name):
        def call(tensor, *args, **kwargs):
            tensor_ = tensor[0] if isinstance(tensor, list) else tensor
            op = str(kwargs.get("op", "sum")).split(".")[-1].lower()
            calls.append((name, op if name == "all_reduce" else "", tensor_.dtype, tensor_.numel()))
            return real[name](tensor, *args, **kwargs)

        return call

    inject = Inject(fault)
    for name in real:
        setattr(dist, name, counting(name))
    try:
        outcome = training_health.train(cfg, observer=inject)
    except (training_health.NonFiniteError, training_health.ReplicaDivergenceError) as exc:
        outcome = (type(exc).__name__, str(exc))
    finally:
        for name, function in real.items():
            setattr(dist, name, function)
    adam_steps = {int(state["step"]) for state in inject.optimizer.state.values()}
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, (outcome, calls, adam_steps))
    return every_rank


def ddp_losses(cfg):
    """Plain DDP (recipes/ddp_torchrun.py) on the same config, in the same world."""
    return ddp_result_only(
        ddp_torchrun.DDPConfig(steps=cfg.steps, backend="gloo", precision="fp32", timeout_s=60)
    ).losses


def run_case(case):
    return ddp_losses(case[0]) if case[1] == "ddp" else checked_run(case)


CASES = {
    "clean": (dataclasses.replace(CFG, steps=4, check_every=2), None),
    "ddp": (CFG, "ddp"),
    "nan loss": (CFG, "nan loss"),
    "nan loss skip": (dataclasses.replace(CFG, steps=5, on_nonfinite="skip"), "nan loss"),
    "nan gradient": (CFG, "nan gradient"),
    "nan parameter skip": (dataclasses.replace(CFG, on_nonfinite="skip"), "nan parameter"),
    "slow": (CFG, "slow"),
    "diverge": (CFG, "diverge"),
    "spike": (dataclasses.replace(CFG, steps=4, spike_warmup=3), "spike"),
}

# Every case in one spawned world of 2: one world start instead of nine; a case that stops the
# world stops it with an exception each rank catches and returns as data.
pytestmark = pytest.mark.xdist_group("training_health")


@pytest.fixture(scope="module")
def runs():
    return dict(zip(CASES, run_world(run_case, 2, CASES.values(), deadline_s=180)))


def samples_of(rank: int, step: int, cfg=CFG) -> list[int]:
    """The sample indices rank ``rank`` trains on at ``step`` (first epoch), as DDP's sampler."""
    dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, seed=cfg.seed, drop_last=True)
    per_rank = cfg.global_batch_size // 2
    return list(sampler)[step * per_rank : (step + 1) * per_rank]


def test_with_no_fault_the_losses_are_plain_ddps_and_the_nan_check_is_one_8_byte_all_reduce(runs):
    every_rank = runs["clean"]
    for run, calls, adam_steps in every_rank:
        assert run.losses == runs["ddp"], "the checks changed the training"
        assert run.skipped_steps == [] and adam_steps == {4}
        assert not [w for w in run.warnings if "spike" in w], run.warnings
        flags = [c for c in calls if c[1] == "max"]
        assert flags == [("all_reduce", "max", torch.int64, 1)] * 4, calls  # 8 bytes a step
        # the rest per step: DDP's gradient bucket (through the hook) and DDP's logged loss;
        # every 2 steps one all_gather of the step times and one of the checksums; no broadcast
        losses = [c for c in calls if c[:2] == ("all_reduce", "avg")]
        assert losses == [("all_reduce", "avg", torch.float32, 1)] * 4, calls
        gathers = [c for c in calls if c[0] == "all_gather"]
        params = len(list(training_health.build_model("tiny").parameters()))
        assert (
            gathers
            == [
                ("all_gather", "", torch.float64, 2),
                ("all_gather", "", torch.int64, params),
            ]
            * 2
        )
        assert not [c for c in calls if c[0] == "broadcast"]
    assert every_rank[0][0].warnings == every_rank[1][0].warnings


@pytest.mark.parametrize(
    "case, what",
    [
        ("nan loss", "loss"),
        ("nan gradient", f"gradient {PARAM!r}"),
        # a bad weight stops the run even under --on-nonfinite skip: skipping cannot mend it
        ("nan parameter skip", f"parameter {PARAM!r}"),
    ],
)
def test_a_nan_on_rank_1_at_step_3_stops_every_rank_with_one_line_naming_it(case, what, runs):
    line = (
        f"non-finite {what} on rank {FAULT_RANK} at step {FAULT_STEP}, "
        f"samples {samples_of(FAULT_RANK, FAULT_STEP)}"
    )
    for outcome, calls, adam_steps in runs[case]:
        assert outcome == ("NonFiniteError", line)
        assert adam_steps == {FAULT_STEP}  # the bad step was never applied
        assert len([c for c in calls if c[0] == "broadcast"]) == 1  # the details, on failure


def test_skip_mode_skips_exactly_that_step_on_every_rank_and_goes_on(runs):
    line = (
        f"step {FAULT_STEP} skipped: non-finite loss on rank {FAULT_RANK} at step {FAULT_STEP}, "
        f"samples {samples_of(FAULT_RANK, FAULT_STEP)}"
    )
    for run, _, adam_steps in runs["nan loss skip"]:
        said = [w for w in run.warnings if not w.startswith("straggler")]  # timing: not ours
        assert run.skipped_steps == [FAULT_STEP] and said == [line]
        assert adam_steps == {4}  # 5 steps, one skipped, by every rank's optimizer
        finite = [loss for step, loss in enumerate(run.losses) if step != FAULT_STEP]
        assert len(run.losses) == 5 and all(torch.isfinite(torch.tensor(finite)))
        assert run.losses[:FAULT_STEP] == runs["clean"][0][0].losses[:FAULT_STEP]


def test_a_slow_rank_is_named_by_the_straggler_check(runs):
    for run, _, _ in runs["slow"]:
        named = [w for w in run.warnings if w.startswith("straggler")]
        assert len(named) == 1, run.warnings
        match = re.fullmatch(
            r"straggler at step 3: rank (\d+) works (\S+) ms a step, (\S+)x the median rank's "
            r"(\S+) ms",
            named[0],
        )
        assert match and int(match[1]) == FAULT_RANK, named
        assert float(match[2]) >= SLEEP_S * 1e3  # its own sleep, counted in its work
        assert float(match[4]) < SLEEP_S * 1e3  # the other rank's wait for it, not counted


def test_a_corrupted_replica_is_named_with_its_first_differing_parameter(runs):
    line = (
        f"replicas diverged at step 3: rank {FAULT_RANK}'s parameter {PARAM!r} differs from "
        "rank 0's"
    )
    for outcome, _, _ in runs["diverge"]:
        assert outcome == ("ReplicaDivergenceError", line)


def test_a_gradient_spike_is_logged_with_its_step_and_norm(runs):
    for run, _, adam_steps in runs["spike"]:
        spikes = [w for w in run.warnings if "spike" in w]
        assert len(spikes) == 1, run.warnings
        match = re.fullmatch(
            r"grad norm spike at step 3: (\S+) > mean (\S+) \+ 6 x sigma \S+", spikes[0]
        )
        assert match and float(match[1]) > 10 * float(match[2]), spikes
        assert adam_steps == {4}  # logged, not skipped


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(straggler_ratio=1.0), "straggler_ratio must be a finite number > 1, got 1.0"),
        (
            dict(straggler_ratio=float("nan")),
            "straggler_ratio must be a finite number > 1, got nan",
        ),
        (dict(spike_sigma="high"), "spike_sigma must be a finite number > 0, got 'high'"),
        (dict(spike_warmup=1), "spike_warmup must be a whole number >= 2, got 1"),
        (dict(steps=4, check_every=8), "check_every=8 is more than steps=4"),
    ],
)
def test_bad_input_is_one_line(changes, message):
    with pytest.raises(ValueError) as refused:
        training_health.HealthConfig(**changes)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--straggler-ratio", "fast"], "argument --straggler-ratio: invalid float value: 'fast'"),
        (["--spike-sigma", "inf"], "spike_sigma must be a finite number > 0, got inf"),
    ],
)
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record, under capsys
def test_a_threshold_that_is_not_a_number_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        training_health.main(argv)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"python -m recipes.training_health: error: {message}"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has exited
    except OSError:
        return False


# Slow: a real torchrun (an agent and two fresh ranks importing torch), ~10 s of CPU.
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ranks_whose_torchrun_agent_is_killed_exit_by_themselves(tmp_path):
    """SIGKILL of torchrun's agent alone (as the OOM killer may do) leaves its workers in sessions
    of their own, still running; the recipe's launcher watch ends them within seconds."""
    command = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += ["-m", "recipes.training_health", "--steps", "1000000", "--backend", "gloo"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    workers: list[int] = []
    with open(out_path, "w") as out, open(err_path, "w") as err:
        agent = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=err, env=env)
        try:
            deadline = time.monotonic() + scaled(120)
            while "step 0 loss" not in out_path.read_text() and time.monotonic() < deadline:
                assert agent.poll() is None, err_path.read_text()[-3000:]
                time.sleep(0.1)
            workers = child_pids(agent.pid)
            assert len(workers) == 2, (workers, err_path.read_text()[-3000:])
            os.kill(agent.pid, signal.SIGKILL)
            agent.wait()
            killed_at = time.monotonic()
            while any(alive(pid) for pid in workers) and time.monotonic() - killed_at < 30:
                time.sleep(0.1)
            gone_after_s = time.monotonic() - killed_at
            assert not any(alive(pid) for pid in workers), (
                f"orphans still alive after {gone_after_s}"
            )
            # poll_s is 1 s: a few seconds at most, even on a loaded machine
            assert gone_after_s < scaled(5), gone_after_s
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
            for pid in workers:  # never leave a rank behind, whatever failed above
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
    # Each rank watches for itself; the first to see the agent gone exits with the line, and a
    # peer may fail first in its next collective ("Connection closed by peer"): gone either way.
    lines = {line for line in err_path.read_text().splitlines() if "is gone" in line}
    expected = {
        f"rank {rank}: torchrun's agent (pid {agent.pid}) is gone; exiting" for rank in (0, 1)
    }
    assert lines and lines <= expected, err_path.read_text()[-3000:]
