"""grad_accumulation: one all-reduce round per optimizer step, and the same update as the whole
batch at once. The rounds are counted from outside, by the harness's DDP communication hook
(recipes.core.observe.GradAccumulationObserver); the recipe itself only trains."""

import contextlib
import functools
import io
import re
import warnings

import pytest

from recipes import ddp_torchrun, grad_accumulation
from tests.helpers import (
    BACKENDS,
    assert_losses_close,
    assert_states_close,
    ddp_result,
    recipe_result,
    run_alone,
    run_world,
    spawn_world,
)

STEPS = 4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size, micro_batches", [(2, 3), (3, 2)])
def test_no_sync_communicates_once_per_step_and_matches_the_whole_batch(
    world_size, micro_batches, backend
):
    whole_batch = run_alone(ddp_result, ddp_torchrun.DDPConfig(steps=STEPS, precision="fp32"))
    config = functools.partial(
        grad_accumulation.GradAccumulationConfig,
        steps=STEPS,
        micro_batches=micro_batches,
        precision="fp32",
    )
    with_no_sync, without = run_world(
        recipe_result, world_size, [config(), config(use_no_sync=False)], backend=backend
    )
    # Communication: exactly one all-reduce round per optimizer step with no_sync, one per
    # micro-batch without.
    assert with_no_sync.extras["allreduce_rounds_per_step"] == [1] * STEPS
    assert without.extras["allreduce_rounds_per_step"] == [micro_batches] * STEPS
    assert (
        without.extras["bucket_allreduces"]
        == micro_batches * with_no_sync.extras["bucket_allreduces"]
    )
    # Each forward is one micro-batch: the global batch cut over ranks and micro-batches
    assert with_no_sync.extras["micro_batch_size"] == 12 // (world_size * micro_batches)
    # Equivalence: k micro-batches on N ranks == one step on the global batch in one process.
    for result in (with_no_sync, without):
        assert_losses_close(result.losses, whole_batch.losses, atol=1e-5)
        assert_states_close(result.final_state, whole_batch.final_state, atol=1e-5)


def main_in_a_rank(argv):
    """``grad_accumulation.main(argv)`` on one rank of a spawned world: (exit code, stderr)."""
    err = io.StringIO()
    # @record enables faulthandler on stderr, which a StringIO cannot take: it warns (and works)
    with contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Unable to enable fault handler")
        try:
            grad_accumulation.main(argv)
        except SystemExit as exit_:
            return exit_.code, err.getvalue()
    return 0, err.getvalue()


def test_micro_batches_that_do_not_divide_are_rejected():
    # Every rank refuses, rank 0 says it once (the copyable recipe raises a plain ValueError: it
    # cannot import the harness's RecipeError)
    code, stderr = spawn_world(
        main_in_a_rank, 2, ["--global-batch-size", "12", "--micro-batches", "4"], deadline_s=60
    )
    assert code == 2
    assert stderr.splitlines() == [
        "error: global_batch_size=12 does not divide across 2 ranks x "
        "4 micro-batches; use a multiple of 8, e.g. 8 or 16"
    ]


@pytest.mark.parametrize("micro_batches", [0, -1])  # once: ZeroDivisionError, RuntimeError
def test_micro_batches_below_one_are_refused_before_any_world(micro_batches, capsys):
    # the config refuses (no world exists here to join); the command line refuses with argparse's
    # usage and one line
    with pytest.raises(ValueError, match=rf"^micro_batches must be .*>= 1, got {micro_batches}$"):
        grad_accumulation.GradAccumulationConfig(micro_batches=micro_batches)
    with pytest.raises(SystemExit) as exit_:
        grad_accumulation.main(["--micro-batches", str(micro_batches)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        rf"python -m recipes.grad_accumulation: error: micro_batches must be .*>= 1, "
        rf"got {micro_batches}",
        err.splitlines()[-1],
    ), err
    assert "Traceback" not in err
