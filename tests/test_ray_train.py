"""recipes/ray_train.py: the cookbook's train functions under Ray Train's TorchTrainer, on a local
Ray cluster of 2 CPU workers. ddp_torchrun under Ray equals its own 2-rank run; the job under
Ray equals the job's 2-rank run (losses and weights, bit for bit); a worker SIGKILLed mid-run is
restarted by Ray (FailureConfig) with its whole group, the job resumes from its checkpoint and
ends bit-exact; bad input is one line and exit 2, before Ray starts."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from recipes import ddp_torchrun, fsdp2, ray_train
from tests.helpers import PYTHON, REPO_ROOT, ddp_result_only, fsdp2_result, run_cli, spawn_world
from tests.test_job import job_in_a_rank, shards

__all__ = ["shards"]  # the job's session shards (tests/test_job.py), prepared once per run

# One local Ray cluster at a time on this machine: with two, Ray Train's placement-group cleaner
# finds both by their processes and raises in its thread (a traceback; the runs go on). These
# tests share a worker with the copy test, whose launch runs ray_train's copy.
pytestmark = pytest.mark.xdist_group("copy_recipes")

# The bad-input tests refuse before Ray is imported: they run where Ray is not installed (the
# README's install), and so does the one that hides Ray. The runs under Ray need it.
needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="the ray_train recipe needs Ray Train: pip install -e .[ray]",
)


def refused(argv: list[str], capsys) -> str:
    """``python -m recipes.ray_train ARGV`` in this process: exit 2 and its one line."""
    with pytest.raises(SystemExit) as exit_:
        ray_train.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith(("usage:", " "))]
    assert len(lines) == 1, err
    return lines[0]


# --- bad input: one line, exit 2, and Ray never starts (each ~0.1 CPU s) ---


def test_bad_flags_of_its_own_are_one_line(capsys):
    line = refused(["--workers", "0"], capsys)
    assert line == "python -m recipes.ray_train: error: workers must be a whole number >= 1, got 0"
    assert "invalid choice: 'lightning'" in refused(["--recipe", "lightning"], capsys)


def test_more_workers_than_the_local_cluster_has_cpus_is_one_line_not_a_hang(capsys):
    line = refused(["--workers", "3", "--cpus", "2"], capsys)
    assert "workers=3 needs 3 CPUs (one a worker) and the local Ray cluster has 2" in line
    # a config built in code is refused alike
    with pytest.raises(ValueError, match="use --workers 2 or fewer"):
        ray_train.RayTrainConfig(workers=3, cpus=2)


def test_a_cluster_address_needs_storage_every_node_sees(capsys):
    line = refused(["--address", "auto"], capsys)
    assert "--address needs --storage-path: a folder every node sees" in line


def test_the_recipes_own_bad_flag_is_that_recipes_one_line(capsys):
    line = refused(["--recipe", "job", "--", "--stepz", "3"], capsys)
    assert line == "python -m recipes.job: error: unrecognized arguments: --stepz 3", line
    line = refused(["--recipe", "ddp_torchrun", "--", "--steps", "0"], capsys)
    assert line.startswith("python -m recipes.ddp_torchrun: error: steps must be"), line


def test_without_ray_it_says_how_to_install_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    line = refused(["--workers", "1"], capsys)
    assert line == "error: ray_train needs Ray Train: pip install 'ray[train]'"


def test_a_config_of_another_recipe_is_refused():
    with pytest.raises(ValueError, match="recipe job takes a JobConfig, got DDPConfig"):
        ray_train.train(ray_train.RayTrainConfig(recipe="job"), ddp_torchrun.DDPConfig())


# slow only because CI installs Ray for the slow set: without a cluster, ~3 s
@pytest.mark.slow
@needs_ray
def test_the_local_cluster_settings_yield_to_the_callers_and_are_removed_after(monkeypatch):
    import ray

    seen = {}

    def no_cluster(**_):
        seen.update({name: os.environ.get(name) for name in ray_train.LOCAL_CLUSTER_ENV})
        raise RuntimeError("no cluster in this test")

    monkeypatch.setattr(ray, "init", no_cluster)
    monkeypatch.setenv("RAY_worker_niceness", "7")  # the caller's own value is kept
    monkeypatch.delenv("RAY_USAGE_STATS_ENABLED", raising=False)  # an unset one, set for the run
    with pytest.raises(RuntimeError, match="no cluster in this test"):
        ray_train.train(ray_train.RayTrainConfig(workers=1))
    assert seen["RAY_worker_niceness"] == "7" and seen["RAY_USAGE_STATS_ENABLED"] == "0"
    assert os.environ["RAY_worker_niceness"] == "7"  # and after the run, as it was
    assert "RAY_USAGE_STATS_ENABLED" not in os.environ


# --- under Ray (slow: each run starts a local Ray cluster, ~35 s and ~40 CPU s on 2 cores) ---


def under_ray(args: list[str], *, env: dict | None = None) -> dict:
    """``python -m recipes.ray_train ARGS`` as a user runs it; its JSON line."""
    proc = run_cli([PYTHON, "-m", "recipes.ray_train", *args], timeout_s=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # quiet: what rank 0 printed and the result; of Ray's own lines (they name Ray) only the
    # raylet's notice of a worker that died
    lines = proc.stdout.splitlines()
    ours = [line for line in lines if "A worker died or was killed" not in line]
    assert not [line for line in ours if "ray" in line.lower() and line[0] != "{"], proc.stdout
    return json.loads([line for line in lines if line.startswith("{")][-1])


# slow: a local Ray cluster and 2 workers (~35 s, ~40 CPU s each), and the 2-rank reference.
# fsdp2 calls setup_distributed, which takes the process group Ray made as it finds it;
# ddp_torchrun leaves Ray's group and joins its own, in the open.
@pytest.mark.slow
@needs_ray
@pytest.mark.parametrize(
    "recipe, in_a_rank, config",
    [
        ("fsdp2", fsdp2_result, fsdp2.FSDP2Config),
        ("ddp_torchrun", ddp_result_only, ddp_torchrun.DDPConfig),
    ],
)
def test_a_recipe_under_ray_equals_it_on_two_ranks(recipe, in_a_rank, config):
    result = under_ray(["--recipe", recipe, "--", "--steps", "4", "--precision", "fp32"])
    reference = spawn_world(in_a_rank, 2, config(steps=4, precision="fp32"), deadline_s=120)
    assert result["result"] == reference.losses  # the same world, the same floats


STEPS = 8
JOB_ARGS = [
    "--model", "tiny", "--seq-len", "16", "--steps", str(STEPS), "--global-batch-size", "12",
    "--accumulation", "2", "--warmup-steps", "2", "--eval-every", "4", "--eval-windows", "8",
    "--checkpoint-every", "2", "--num-workers", "1", "--prepare", "false",
    "--tensorboard", "false",
]  # fmt: skip


@pytest.fixture(scope="module")
def job_reference(shards, tmp_path_factory) -> dict:
    """The job on 2 ranks of a spawned world, without Ray."""
    out = tmp_path_factory.mktemp("ray-reference") / "out"
    return spawn_world(
        job_in_a_rank, 2, [*JOB_ARGS, "--data-dir", str(shards), "--out-dir", str(out)],
        deadline_s=150,
    )  # fmt: skip


# slow: a local Ray cluster and 2 workers running the job (~40 s, ~45 CPU s)
@pytest.mark.slow
@needs_ray
def test_the_job_under_ray_equals_its_two_rank_run(shards, job_reference, tmp_path):
    out = tmp_path / "out"
    result = under_ray(
        ["--recipe", "job", "--", *JOB_ARGS, "--data-dir", str(shards), "--out-dir", str(out)]
    )["result"]
    assert result["world_size"] == 2 and result["resumed_from"] is None
    assert result["losses"] == job_reference["losses"]
    assert result["weights_sha256"] == job_reference["weights_sha256"]


# The test's hand on a Ray worker: a sitecustomize every Ray process imports at start
# (PYTHONPATH, inherited from the driver). Ray sets RANK only when the loop is about to run, so
# the check is made at each step; torch is patched when the job imports its LR scheduler, not
# in every Ray process at start. Rank JOB_KILL_RANK SIGKILLs itself after step JOB_KILL_AT_STEP,
# once: the marker keeps the restarted worker alive. Nothing of it is in the recipe.
KILLER = """
import os
if os.environ.get("JOB_KILL_AT_STEP"):
    import importlib.abc
    import importlib.util
    import signal
    import sys

    def patch(schedulers):
        step_once = schedulers.LRScheduler.step

        def step(self, *args, **kwargs):
            step_once(self, *args, **kwargs)
            marker = os.environ["JOB_KILL_MARKER"]
            if (
                os.environ.get("RANK") == os.environ["JOB_KILL_RANK"]
                and self.last_epoch == int(os.environ["JOB_KILL_AT_STEP"])
                and not os.path.exists(marker)
            ):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

        schedulers.LRScheduler.step = step

    class WhenImported(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "torch.optim.lr_scheduler":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def run_and_patch(module):
                run(module)
                patch(module)

            spec.loader.exec_module = run_and_patch
            return spec

    sys.meta_path.insert(0, WhenImported())
"""
KILL_AT = 5  # after step 5, before step 6's checkpoint: the restart resumes from step 4


# slow: a local Ray cluster, 2 workers, one killed and the group restarted (~60 s, ~70 CPU s)
@pytest.mark.slow
@needs_ray
def test_a_killed_worker_is_restarted_by_ray_and_the_job_ends_bit_exact(
    shards, job_reference, tmp_path
):
    (tmp_path / "killer").mkdir()
    (tmp_path / "killer" / "sitecustomize.py").write_text(KILLER)
    marker, out = tmp_path / "killed", tmp_path / "out"
    env = {
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "killer"), REPO_ROOT]),
        "JOB_KILL_AT_STEP": str(KILL_AT),
        "JOB_KILL_RANK": "1",
        "JOB_KILL_MARKER": str(marker),
    }
    result = under_ray(
        ["--recipe", "job", "--max-failures", "1", "--",
         *JOB_ARGS, "--data-dir", str(shards), "--out-dir", str(out)],
        env=env,
    )["result"]  # fmt: skip
    assert marker.exists(), "rank 1 was never killed"
    # Ray restarted the group, the loop ran again, the job resumed from its step-4 checkpoint
    assert result["resumed_from"] == 4 and result["first_step"] == 5
    assert result["losses"] == job_reference["losses"][4:]
    assert result["weights_sha256"] == job_reference["weights_sha256"]
