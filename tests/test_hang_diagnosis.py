"""hang_diagnosis: a rank that skips a collective is named, with the collective, by every tool.

Each world is bounded twice: the collective timeout (the stuck call raises) and spawn_world's
deadline (the world is killed and reported). Nothing here can hang.
"""

import os
from unittest import mock

import pytest
import torch

from recipes import hang_diagnosis
from recipes.core.observe import prove
from recipes.core.result import RecipeResult
from tests.deadlines import scaled
from tests.helpers import (
    PYTHON,
    _run_module_forked,
    assert_losses_close,
    plain_training_loop,
    spawn_world,
)

# Long enough for a slow step on a loaded 2-core machine, short enough to wait for once.
TIMEOUT_S = 8.0


def hang_result(cfg) -> RecipeResult:
    """recipes.hang_diagnosis.train(cfg) measured by the harness: its HangRun's error, finding and
    stuck_in in extras (with mode and trace_dir, recipes.core.observe.HangObserver). Module-level:
    spawn_world can pickle it."""
    return prove(hang_diagnosis.train, cfg, name="hang_diagnosis")


def diagnose(tmp_path, world_size: int, **changes) -> RecipeResult:
    cfg = hang_diagnosis.HangConfig(trace_dir=str(tmp_path), timeout_s=TIMEOUT_S, **changes)
    return spawn_world(hang_result, world_size, cfg, deadline_s=180)


@pytest.mark.timeout(240)
def test_flight_recorder_names_the_rank_that_skipped_and_the_collective(tmp_path):
    # Three ranks: ranks 0 and 2 agree on call #3, so the odd one out is known (with two it is not).
    result = diagnose(tmp_path, 3, skip_rank=1, skip_step=1)
    assert result.extras["error"], "rank 0 must time out in the all_reduce that rank 1 skipped"
    finding = result.extras["finding"]
    assert "rank 1 ran gloo:all_gather" in finding, finding
    assert "rank 1 skipped or reordered gloo:all_reduce" in finding, finding
    assert "hang_diagnosis.py" in finding, "the finding points at the skipped call's line"
    # torch's own analysis of the same dumps (they need the pg_config repair on torch 2.13 gloo).
    fr_trace = [
        PYTHON,
        "-m",
        "torch.distributed.flight_recorder.fr_trace",
        str(tmp_path),
        "--prefix",
        "rank_",
    ]
    # forked from the server that has imported torch (tests/helpers.py): fr_trace's own __main__
    # and streams, without a fresh interpreter's ~3 CPU s of imports
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = _run_module_forked(fr_trace, ("module", fr_trace[2]), fr_trace[3:], scaled(120), env)
    report = proc.stdout + proc.stderr
    if "gloo != 'nccl' or 'xccl'" in report:
        # torch 2.11's fr_trace reads NCCL/XCCL dumps only (it asserts the backend); the recipe's
        # own analysis above named rank 1 and all_reduce from the same dumps.
        assert tuple(map(int, torch.__version__.split(".")[:2])) < (2, 13), report[-3000:]
    else:
        assert "Culprit rank 1" in report, report[-3000:]
        assert "Expected collective type: 'all_reduce'" in report, report[-3000:]
    # The stacks: rank 0 hung in all_reduce, rank 1 in the all_gather it went on to.
    assert result.extras["stuck_in"] == "all_reduce"
    stack_1 = os.path.join(tmp_path, "stack_1.txt")
    assert hang_diagnosis.last_collective_in_stack(stack_1) == "all_gather"


@pytest.mark.timeout(240)
def test_detail_mode_names_both_calls_without_waiting_for_the_timeout(tmp_path):
    result = diagnose(tmp_path, 2, skip_rank=1, skip_step=1, mode="detail")
    assert result.extras["finding"] is not None, result.extras["error"]
    assert "ran ALLREDUCE" in result.extras["finding"], result.extras["finding"]
    assert "rank 1 ran ALLGATHER" in result.extras["finding"], result.extras["finding"]


@pytest.mark.timeout(240)
def test_a_clean_run_finds_no_mismatch_and_equals_one_process(tmp_path):
    result = diagnose(tmp_path, 2)
    assert result.extras["error"] is None and result.extras["finding"] is None
    reference, _ = plain_training_loop("tiny", steps=4, global_batch_size=12, lr=1e-3, seed=0)
    assert_losses_close(result.losses, reference, atol=1e-5)


def test_a_skip_rank_outside_the_world_is_one_line(tmp_path):
    with mock.patch.dict(os.environ), pytest.raises(ValueError, match="skip_rank=3 needs a world"):
        hang_diagnosis.train(hang_diagnosis.HangConfig(trace_dir=str(tmp_path), skip_rank=3))


def test_two_rank_vote_blames_the_higher_rank_as_fr_trace_does(tmp_path):
    """The documented limit: with two ranks, the lower rank is taken as right."""
    import pickle

    def entry(seq, name):
        return {
            "process_group": ("0", "default_pg"),
            "collective_seq_id": seq,
            "profiling_name": name,
            "frames": [{"filename": "/x/train.py", "line": 7}],
        }

    for rank, second in ((0, "gloo:all_reduce"), (1, "gloo:all_gather")):
        with open(tmp_path / f"rank_{rank}", "wb") as f:
            pickle.dump({"entries": [entry(1, "gloo:broadcast"), entry(2, second)]}, f)
    finding = hang_diagnosis.find_mismatch(str(tmp_path))
    assert finding.startswith(
        "collective #2 on default_pg: the others ran gloo:all_reduce "
        "(at train.py:7); rank 1 ran gloo:all_gather"
    ), finding
