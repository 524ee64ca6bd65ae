"""grad_accumulation: one all-reduce round per optimizer step, and the same update as the whole
batch at once."""

import functools

import pytest

from recipes import ddp_torchrun, grad_accumulation
from recipes.core.config import RecipeError
from recipes.core.spawn import spawn_world
from tests.helpers import ddp_result, BACKENDS, assert_losses_close, assert_states_close, run_alone, run_world

STEPS = 4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size, micro_batches", [(2, 3), (3, 2)])
def test_no_sync_communicates_once_per_step_and_matches_the_whole_batch(world_size, micro_batches,
                                                                        backend):
    whole_batch = run_alone(ddp_result, ddp_torchrun.DDPConfig(
        steps=STEPS, precision="fp32"))
    config = functools.partial(grad_accumulation.GradAccumulationConfig, steps=STEPS,
                               micro_batches=micro_batches, keep_final_state=True,
                               precision="fp32")
    with_no_sync, without = run_world(grad_accumulation.train, world_size,
                                      [config(), config(use_no_sync=False)], backend=backend)
    # Communication: exactly one all-reduce round per optimizer step with no_sync, one per
    # micro-batch without.
    assert with_no_sync.extras["allreduce_rounds_per_step"] == [1] * STEPS
    assert without.extras["allreduce_rounds_per_step"] == [micro_batches] * STEPS
    assert (without.extras["bucket_allreduces"]
            == micro_batches * with_no_sync.extras["bucket_allreduces"])
    # Equivalence: k micro-batches on N ranks == one step on the global batch in one process.
    for result in (with_no_sync, without):
        assert_losses_close(result.losses, whole_batch.losses, atol=1e-5)
        assert_states_close(result.final_state, whole_batch.final_state, atol=1e-5)


def test_micro_batches_that_do_not_divide_are_rejected():
    cfg = grad_accumulation.GradAccumulationConfig(global_batch_size=12, micro_batches=4)
    with pytest.raises(RecipeError, match=r"does not divide across 2 ranks x 4 micro-batches; "
                                          r"use a multiple of 8"):
        spawn_world(grad_accumulation.train, 2, cfg, deadline_s=60)


@pytest.mark.parametrize("micro_batches", [0, -1])  # once: ZeroDivisionError, RuntimeError
def test_micro_batches_below_one_are_refused_before_any_world(micro_batches):
    with pytest.raises(RecipeError, match=rf"^micro_batches must be >= 1, got {micro_batches}$"):
        grad_accumulation.GradAccumulationConfig(micro_batches=micro_batches)
