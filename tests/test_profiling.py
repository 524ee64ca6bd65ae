"""profiling: a trace per rank holding DDP's gradient all-reduce, communication told from compute,
the top ops, a CUDA memory snapshot whose peak is the result's, and training unchanged by it all."""

import json
import os
import pickle
import re

import pytest
import torch

from recipes import profiling
from tests.helpers import (
    PYTHON,
    assert_losses_close,
    assert_states_close,
    last_json,
    plain_training_loop,
    recipe_result,
    run_cli,
    run_world,
    with_fields,
)

# wait 1 + warmup 1 + active 2 = 4 profiled steps: the smallest window that skips step 0.
# The harness (recipe_result: prove) measures the run from outside, with the final state.
CFG = profiling.ProfilingConfig(
    steps=4, wait=1, warmup=1, active=2, precision="fp32", backend="gloo", timeout_s=60
)
# DDP's gradient all-reduce on gloo, as torch records it: launched on the training thread, then run
# on one of gloo's worker threads. The tiny model's gradients fit in one bucket: one of each per
# step.
GLOO_ALL_REDUCE = ("c10d::allreduce_", "gloo:all_reduce")


def trace_events(path: str) -> tuple[list[dict], dict]:
    with open(path) as f:
        trace = json.load(f)  # valid JSON, as Perfetto and chrome://tracing read it
    assert trace["traceEvents"], f"{path} holds no trace events"
    return trace["traceEvents"], trace.get("distributedInfo", {})


def test_two_ranks_trace_the_gradient_all_reduce_and_train_as_one_process(tmp_path):
    cfg = with_fields(CFG, trace_dir=str(tmp_path / "world"))
    reference_losses, reference_state = plain_training_loop(
        cfg.model,
        steps=cfg.steps,
        lr=cfg.lr,
        seed=cfg.seed,
        global_batch_size=cfg.global_batch_size,
    )
    alone = recipe_result(with_fields(cfg, trace_dir=str(tmp_path / "alone")))
    (result,) = run_world(recipe_result, 2, [cfg])

    # Profiling changes nothing that is trained: equal to the textbook loop with no profiler at all.
    for run in (alone, result):
        assert_losses_close(run.losses, reference_losses, atol=1e-5)
        assert_states_close(run.final_state, reference_state, atol=1e-5)

    extras = result.extras
    expected_paths = [os.path.join(cfg.trace_dir, f"trace-rank{rank}.json") for rank in range(2)]
    assert extras["trace_paths"] == expected_paths
    for rank, path in enumerate(expected_paths):
        events, info = trace_events(path)
        names = {event.get("name") for event in events}
        assert {"forward", "backward", "optimizer", *GLOO_ALL_REDUCE} <= names, (
            f"rank {rank}: {names}"
        )
        assert info.get("rank") == rank and info.get("world_size") == 2, (
            "one file per rank, named by rank"
        )

    # Every collective in the profiled steps is DDP's gradient all-reduce: one per step, nothing
    # else (the logged loss is averaged once after the loop, not by an all-reduce inside each step).
    assert extras["communication_events"] == {name: cfg.active for name in GLOO_ALL_REDUCE}
    assert 0 < extras["communication_ms_per_step"] < extras["profiled_step_ms"]

    top_ops = extras["top_ops"]
    assert extras["top_ops_sorted_by"] == "self_cpu_time_total"
    assert 0 < len(top_ops) <= cfg.top_ops
    assert all(isinstance(name, str) and ms >= 0 and calls >= 1 for name, ms, calls in top_ops)
    assert [ms for _, ms, _ in top_ops] == sorted((ms for _, ms, _ in top_ops), reverse=True)
    assert not {"ProfilerStep*", "forward", "backward", "optimizer"} & {
        name for name, _, _ in top_ops
    }, "annotations are regions, not ops"
    assert (
        extras["memory_snapshot"].startswith("needs CUDA")
        and extras["window_peak_allocated_bytes"] is None
    )


# Slow: a torchrun launch (torchrun and its workers each import torch: ~10 s of CPU).
# The same code runs in a spawned world in the default run; test_ddp_torchrun, test_elastic
# and test_multinode cover the launch path itself there.
@pytest.mark.slow
def test_torchrun_prints_the_top_ops_table_and_the_result_as_json(tmp_path):
    # 6 steps around the default 4-step window: with the schedule's default repeat=0, a second cycle
    # would start after the window and replace its events.
    proc = run_cli(
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "recipes.core.prove",
            "profiling",
            "--precision",
            "fp32",
            "--backend",
            "gloo",
            "--steps",
            "6",
            "--top-ops",
            "5",
            "--trace-dir",
            str(tmp_path),
        ],
        timeout_s=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    assert (
        result["recipe"] == "profiling" and result["world_size"] == 2 and len(result["losses"]) == 6
    )
    assert result["extras"]["communication_events"] == {name: 2 for name in GLOO_ALL_REDUCE}
    assert (
        "top 5 ops by self_cpu_time_total:" in proc.stdout and "Self CPU time total" in proc.stdout
    )
    # The table's rows are the result's top_ops (the table cuts names longer than ~55 characters).
    assert len(result["extras"]["top_ops"]) == 5
    for name, _, _ in result["extras"]["top_ops"]:
        assert name[:50] in proc.stdout, f"{name} is in the result but not in the printed table"
    assert all(os.path.exists(path) for path in result["extras"]["trace_paths"])
    # one line per step, from rank 0 only (2 ranks printing would give 12)
    assert len(re.findall(r"^step \d+ loss \d+\.\d{4} \(rank 0's share\)$", proc.stdout, re.M)) == 6


def test_a_profile_window_longer_than_the_run_fails_in_one_line():
    proc = run_cli(
        [
            PYTHON,
            "-m",
            "recipes.profiling",
            "--wait",
            "2",
            "--warmup",
            "2",
            "--active",
            "3",
            "--steps",
            "6",
        ],
        timeout_s=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "python -m recipes.profiling: error: wait 2 + warmup 2 + active 3 = 7 profiled steps, "
        "more than steps 6; use steps 7 or profile fewer steps"
    )
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"active": 0}, r"^active must be .*>= 1, got 0$"),
        ({"wait": -1}, r"^wait must be .*>= 0, got -1$"),
        ({"top_ops": 0}, r"^top_ops must be .*>= 1, got 0$"),
    ],
)
def test_bad_values_are_refused_with_the_fix(changes, message):
    with pytest.raises(ValueError, match=message):
        profiling.ProfilingConfig(**changes)


def test_a_trace_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    # by the config, built in code or from the command line, before any rank joins
    with pytest.raises(profiling.TraceDirError, match=r"^trace_dir .* is a file; name a directory"):
        with_fields(CFG, trace_dir=str(tmp_path / "file"))
    with pytest.raises(profiling.TraceDirError, match=r"is a file, so nothing can be created"):
        with_fields(CFG, trace_dir=str(tmp_path / "file" / "under"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the memory snapshot needs CUDA")
def test_the_memory_snapshot_holds_the_profiled_steps_and_the_peak_the_result_reports(tmp_path):
    result = recipe_result(with_fields(CFG, backend="auto", trace_dir=str(tmp_path)))
    extras = result.extras
    assert (
        result.device.startswith("cuda") and extras["top_ops_sorted_by"] == "self_device_time_total"
    )
    assert extras["memory_snapshot"] == str(tmp_path / "memory-snapshot-rank0.pickle")
    with open(extras["memory_snapshot"], "rb") as f:
        snapshot = pickle.load(f)  # what pytorch.org/memory_viz reads
    assert (
        snapshot["segments"] and 0 < extras["memory_snapshot_events"] < CFG.memory_history_entries
    )
    # The snapshot is the allocator's whole record of the window: replayed, it reaches the peak
    # the allocator counted over the same steps, to the byte.
    assert extras["snapshot_peak_requested_bytes"] == extras["window_peak_requested_bytes"]
    # The run ends with the window (steps 2 and 3 of 0-3): the window's peak, in whole blocks as
    # the result counts them, is the run's, steps 0 and 1 (the recipe's peak before the window,
    # folded back in here: the window reset the allocator's peak that the harness reads) included.
    run_peak = max(result.peak_memory_bytes, extras["peak_allocated_before_window_bytes"])
    assert extras["window_peak_allocated_bytes"] == run_peak
    assert extras["window_peak_requested_bytes"] <= extras["window_peak_allocated_bytes"]
    # A world of 1 launches DDP's all-reduce (NCCL has nothing to send), but it is there by name.
    assert extras["communication_events"].get("c10d::allreduce_") == CFG.active
    assert 0 <= extras["communication_ms_per_step"] < extras["profiled_step_ms"]
