"""lightning_fabric: the raw DDP loop converted to Fabric gives the raw loop's losses and weights.

The recipe is copyable (torch, lightning, recipes/toy.py and dist_setup.py) and returns its losses;
the harness (``prove``, through ``tests.helpers.recipe_result``) measures the rest from outside:
final weights, the first step a resumed run trained (``recipes.core.observe.ResumableObserver``),
and here, through an observer of the test's own, the gradient all-reduces DDP ran."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from recipes import ddp_torchrun
from recipes.core.observe import ResumableObserver
from tests.helpers import (
    CUDA_DEVICES,
    NEEDS_LIGHTNING,
    LazyModule,
    assert_losses_close,
    assert_states_close,
    ddp_result,
    in_one_world,
    last_json,
    recipe_result,
    run_alone,
    run_cli,
    spawn_world,
)
from tests.once import once_per_run

lightning_fabric = LazyModule("recipes.lightning_fabric")  # imported when first used

# Its tests share module fixtures that run whole worlds: one worker runs them all (pyproject:
# --dist loadgroup), so the fixtures run once rather than once per worker.
pytestmark = [NEEDS_LIGHTNING, pytest.mark.xdist_group("lightning_fabric")]

STEPS = 6
REFERENCE = ddp_torchrun.DDPConfig(steps=STEPS, precision="fp32", timeout_s=120)


def fabric_cfg(**changes) -> lightning_fabric.FabricConfig:
    fields = {"steps": STEPS, "timeout_s": 120, "precision": "32-true"}
    return lightning_fabric.FabricConfig(**(fields | changes))


class CountingGradSyncs(ResumableObserver):
    """A DDP comm hook on the DistributedDataParallel inside Fabric's wrapper, registered when the
    model is ready (before the first backward): it counts the gradient all-reduces (buckets x
    synced backwards) into ``extras["grad_syncs"]``."""

    def model_ready(self, model, optimizer):
        super().model_ready(model, optimizer)
        self.extras["grad_syncs"] = 0

        def counting_allreduce(state, bucket):
            self.extras["grad_syncs"] += 1
            return default_hooks.allreduce_hook(state, bucket)

        model._forward_module.register_comm_hook(None, counting_allreduce)


def _run_phase(phase):
    name, cfg = phase
    if name == "raw_ddp":
        return ddp_result(cfg)
    if name.startswith("count"):
        return recipe_result(cfg, observer=CountingGradSyncs(cfg, keep_final_state=True))
    return recipe_result(cfg)


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """Rank 0's results of every phase, run in order in one gloo world of 2."""

    def build(folder: Path):
        ckpt_dir = str(folder)
        phases = [
            ("raw_ddp", REFERENCE),
            ("fabric", fabric_cfg(checkpoint_every_n_steps=3, checkpoint_dir=ckpt_dir)),
            ("fabric_resumed", fabric_cfg(resume_from=os.path.join(ckpt_dir, "step-3.ckpt"))),
            ("count_accumulate", fabric_cfg(accumulate_grad_batches=3)),
            ("count_plain", fabric_cfg()),
        ]
        results = spawn_world(in_one_world, 2, _run_phase, phases, "gloo", 120, deadline_s=300)
        return {name: result for (name, _), result in zip(phases, results)} | {"ckpt_dir": ckpt_dir}

    return once_per_run(tmp_path_factory, "lightning-fabric-world", build)


def test_fabric_ddp_equals_raw_ddp(world):
    raw, fabric = world["raw_ddp"], world["fabric"]
    assert (fabric.world_size, fabric.backend) == (2, "gloo")
    assert_losses_close(fabric.losses, raw.losses, atol=1e-5)
    assert_states_close(fabric.final_state, raw.final_state, atol=1e-5)
    assert fabric.losses[-1] < fabric.losses[0], "the model should learn the synthetic sequences"


def test_fabric_save_writes_one_unwrapped_checkpoint_and_load_resumes_exactly(world):
    assert sorted(os.listdir(world["ckpt_dir"])) == ["step-3.ckpt", "step-6.ckpt"]
    checkpoint = torch.load(os.path.join(world["ckpt_dir"], "step-3.ckpt"), weights_only=False)
    assert set(checkpoint) == {"model", "optimizer", "step"} and checkpoint["step"] == 3
    # Saved from the unwrapped model: no DDP "module." prefix, loads into a plain TransformerLM.
    assert set(checkpoint["model"]) == set(world["raw_ddp"].final_state)
    resumed = world["fabric_resumed"]
    assert resumed.extras["start_step"] == 3
    assert_losses_close(resumed.losses, world["fabric"].losses[3:], atol=1e-6)
    assert_states_close(resumed.final_state, world["fabric"].final_state, atol=1e-6)


def test_accumulation_with_no_backward_sync_equals_one_big_batch_and_syncs_once_per_step(world):
    accumulated, plain = world["count_accumulate"], world["count_plain"]
    assert_losses_close(accumulated.losses, world["raw_ddp"].losses, atol=1e-5)
    assert_states_close(accumulated.final_state, world["raw_ddp"].final_state, atol=1e-5)
    # 3 backwards per step, one gradient sync: as many all-reduces as the plain run's one backward
    # per step.
    assert plain.extras["grad_syncs"] >= STEPS
    assert accumulated.extras["grad_syncs"] == plain.extras["grad_syncs"]


# Slow: a torchrun launch (torchrun and its workers each import torch: ~10 s of CPU).
# The same code runs in a spawned world in the default run; test_ddp_torchrun, test_elastic
# and test_multinode cover the launch path itself there, and tests/test_copy_recipes.py runs a
# copy of this recipe under torchrun.
@pytest.mark.slow
def test_torchrun_launch_equals_raw_and_logs_from_rank_zero_only():
    proc = run_cli(
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "recipes.core.prove",
            "lightning_fabric",
            "--accumulate-grad-batches",
            "2",
        ],
        timeout_s=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    assert result["world_size"] == 2
    assert_losses_close(result["losses"], run_alone(ddp_result, REFERENCE).losses, atol=1e-5)
    # one line per step, from rank 0 only (the recipe prints them there)
    assert len([line for line in proc.stdout.splitlines() if line.startswith("step ")]) == STEPS
    assert "[rank1]" not in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.skipif(CUDA_DEVICES > 0, reason="on a GPU machine 16-mixed is valid")
def test_fp16_mixed_on_cpu_is_an_error_not_a_silent_bf16_run():
    with pytest.raises(
        ValueError, match="precision '16-mixed' needs CUDA.*use --precision bf16-mixed"
    ):
        lightning_fabric.train(fabric_cfg(precision="16-mixed"))


def test_global_batch_that_does_not_divide_into_micro_batches_is_rejected():
    with pytest.raises(
        ValueError, match=r"global_batch_size=12 does not divide across 1 ranks x 5 micro-batches"
    ):
        lightning_fabric.train(fabric_cfg(accumulate_grad_batches=5))


def test_a_truncated_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    # a save cut short (a full disk, a killed job): refused as bad input, not fabric.load's
    # traceback
    truncated = tmp_path / "step-3.ckpt"
    truncated.write_bytes(b"PK\x03\x04 not a whole checkpoint")
    with pytest.raises(SystemExit) as exit_info:
        lightning_fabric.main(["--resume-from", str(truncated), "--precision", "32-true"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: --resume-from {truncated} cannot be read as a checkpoint"), (
        err
    )


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"accumulate_grad_batches": 0},
            "accumulate_grad_batches must be a whole number >= 1, got 0",
        ),
        ({"lr": -1.0}, "lr must be a finite number > 0, got -1.0"),
        ({"model": "huge"}, "model must be one of 100m, small, tiny, got 'huge'"),
    ],
)
def test_a_config_built_in_code_is_checked_like_the_command_line(changes, message):
    # not a ZeroDivisionError (or a KeyError) from inside train: the command line's one line
    with pytest.raises(ValueError, match=f"^{message}$".replace("(", r"\(").replace(")", r"\)")):
        fabric_cfg(**changes)
