"""sharded_accumulation: three ways to accumulate under fully_shard, each collective counted
exactly, the gradient bytes held between micro-batches measured, and every way equal to one
process on ragged sequences once the loss is normalised by tokens."""

import types

import pytest

from recipes import sharded_accumulation as acc
from recipes.core.observe import prove
from recipes.parallelize import MeshError, checked_mesh
from tests.helpers import (
    PYTHON,
    assert_states_close,
    last_json,
    plain_training_loop,
    run_alone,
    run_world,
)
from tests.helpers import run_cli as cli

STEPS, MICRO, BATCH, PAD = 2, 2, 8, 0.5


def config(mode, mesh, **changes):
    return acc.ShardedAccumulationConfig(
        mode=mode,
        mesh=mesh,
        steps=STEPS,
        micro_batches=MICRO,
        global_batch_size=BATCH,
        pad_fraction=PAD,
        precision="fp32",
        **changes,
    )


def accumulation_result(cfg):
    """acc.train(cfg) measured by the harness: its RecipeResult with the final state gathered to
    rank 0, and each step's collectives and the gradient bytes held between micro-batches
    (recipes.core.observe.AccumulationObserver, from outside)."""
    return prove(acc.train, cfg, name="sharded_accumulation", keep_final_state=True)


def test_three_ways_count_their_collectives_hold_their_bytes_and_equal_one_process():
    runs = {
        "every": config("reduce_scatter_every", [4]),
        "sync_last": config("sync_last", [4]),
        "ddp_helper": config("ddp_no_sync_helper", [4]),
        "hsdp_every": config("reduce_scatter_every", [2, 2]),
        "hsdp_last": config("hsdp_all_reduce_last", [2, 2]),
        "naive_mean": config("sync_last", [4], loss_normalisation="batches"),
    }
    results = dict(zip(runs, run_world(accumulation_result, 4, runs.values(), deadline_s=300)))
    ragged = acc.make_ragged_dataset("tiny", BATCH, pad_fraction=PAD, seed=0)
    assert len({int(n) for n in ragged.lengths[:BATCH]}) > 2  # ragged indeed
    ref_losses, ref_state = plain_training_loop(
        "tiny", steps=STEPS, global_batch_size=BATCH, lr=1e-3, seed=0, dataset=ragged
    )

    every = results["every"].extras
    groups, full = every["fsdp_groups"], every["grad_bytes_unsharded"]
    assert groups == 3  # 2 Blocks + the root
    for name, result in results.items():  # the same traffic in every step
        steps = result.extras["collectives_per_step"]
        assert len(steps) == STEPS and all(step == steps[0] for step in steps), name
    per_step = {name: r.extras["collectives_per_step"][0] for name, r in results.items()}
    # The token count is one fp32 all-reduce over all 4 ranks. The harness counts each step from
    # the end of the one before, so the step's loss line (one fp32 all-reduce of each rank's
    # share) is counted too: 2 calls of 4 bytes here, 1 where the loss is a mean of batch means.
    tokens = {"calls": 2, "bytes": 8}
    assert per_step["naive_mean"]["all_reduce over 4"] == {"calls": 1, "bytes": 4}
    # reduce-scatter every micro-batch: k x G calls, k x the gradient bytes
    assert per_step["every"]["reduce_scatter over 4"] == {
        "calls": MICRO * groups,
        "bytes": MICRO * full,
    }
    assert per_step["every"]["all_reduce over 4"] == tokens
    # sync only on the last micro-batch: G calls, the gradient bytes once
    assert per_step["sync_last"]["reduce_scatter over 4"] == {"calls": groups, "bytes": full}
    # Pitfall: the DDP-style no_sync helper does nothing: exactly the traffic of "every".
    assert per_step["ddp_helper"] == per_step["every"]
    # HSDP: the shard group reduce-scatters each micro-batch; the replica all-reduce of the
    # half-size shards runs every micro-batch by default, once with set_requires_all_reduce.
    for name in ("hsdp_every", "hsdp_last"):
        assert per_step[name]["reduce_scatter over 2"] == {
            "calls": MICRO * groups,
            "bytes": MICRO * full,
        }
        assert per_step[name]["all_reduce over 4"] == tokens
    assert per_step["hsdp_every"]["all_reduce over 2"] == {
        "calls": MICRO * groups,
        "bytes": MICRO * full // 2,
    }
    assert per_step["hsdp_last"]["all_reduce over 2"] == {"calls": groups, "bytes": full // 2}
    # Accumulation changes no all-gather.
    assert len({str(per_step[n]["all_gather over 4"]) for n in ("every", "sync_last")}) == 1
    assert per_step["hsdp_every"]["all_gather over 2"] == per_step["hsdp_last"]["all_gather over 2"]

    # Gradient bytes each rank holds between micro-batches: sharded (1/N) unless sync is off.
    held = {name: r.extras["grad_bytes_between_micro_batches"] for name, r in results.items()}
    assert held == {
        "every": full // 4,
        "sync_last": full,
        "ddp_helper": full // 4,
        "hsdp_every": full // 2,
        "hsdp_last": full // 2,
        "naive_mean": full,
    }

    # Every way, normalised by tokens, equals one process on the whole ragged batch...
    for name in ("every", "sync_last", "ddp_helper", "hsdp_every", "hsdp_last"):
        assert results[name].losses == pytest.approx(ref_losses, abs=1e-5), name
        assert_states_close(results[name].final_state, ref_state, atol=1e-5)
    # ... and the naive mean of micro-batch means does not.
    naive = results["naive_mean"]
    assert abs(naive.losses[0] - ref_losses[0]) > 1e-3
    with pytest.raises(AssertionError):
        assert_states_close(naive.final_state, ref_state, atol=1e-5)


def test_hsdp_mode_without_a_two_dim_mesh_is_one_line():
    # refused by the config itself, before any world (from code as from the command line)
    with pytest.raises(
        ValueError,
        match=r"^mode hsdp_all_reduce_last needs a replicate x shard "
        r"mesh, e.g. --mesh 2 2 on 4 ranks$",
    ):
        acc.train(acc.ShardedAccumulationConfig(mode="hsdp_all_reduce_last"))


def test_a_mesh_whose_product_is_not_the_world_size_is_one_line():
    world = types.SimpleNamespace(world_size=2, device=types.SimpleNamespace(type="cpu"))
    with pytest.raises(
        MeshError,
        match=r"^mesh 3 has 3 ranks but the world has 2; pass sizes "
        r">= 1 whose product is 2$",
    ):
        acc.data_parallel_mesh(world, [3])
    with pytest.raises(MeshError, match=r"^mesh 2x2 has 4 ranks but the world has 2"):
        checked_mesh(world, [2, 2], ("replicate", "shard"))


@pytest.mark.slow  # a torchrun launch of 2 ranks (3 interpreters); the same code runs spawned above
def test_torchrun_launch_prints_the_counted_collectives():
    # through the harness, as scripts/collect_results.py runs it (the copy test launches the
    # recipe itself under torchrun)
    proc = cli(
        [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "recipes.core.prove",
            "sharded_accumulation",
            "--mode",
            "sync_last",
            "--steps",
            "1",
        ],
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    extras = last_json(proc.stdout)["extras"]
    groups, full = extras["fsdp_groups"], extras["grad_bytes_unsharded"]
    (step,) = extras["collectives_per_step"]
    assert step["reduce_scatter over 2"] == {"calls": groups, "bytes": full}


def test_fp16_without_a_loss_scaler_is_one_line():
    with pytest.raises(ValueError, match=r"^--precision fp16 needs a GradScaler"):
        run_alone(acc.train, acc.ShardedAccumulationConfig(precision="fp16"))


def test_values_that_contradict_each_other_are_refused_by_the_config():
    with pytest.raises(ValueError, match=r"^pad_fraction must be < 1 .*got 1.0$"):
        acc.ShardedAccumulationConfig(pad_fraction=1.0)
    with pytest.raises(ValueError, match=r"^mesh=\(2, 0\): use \[shard\] or \[replicate, shard\]"):
        acc.ShardedAccumulationConfig(mesh=(2, 0))
    with pytest.raises(ValueError, match=r"^mesh=\(1, 1, 2\): use"):
        acc.ShardedAccumulationConfig(mesh=(1, 1, 2))
