"""ddp_torchrun: DDP on N ranks equals single-process training; torchrun and plain python agree."""

import pytest

from recipes import ddp_torchrun
from recipes.core.config import RecipeError
from recipes.core.spawn import spawn_world
from tests.helpers import (
    BACKENDS,
    CUDA_DEVICES,
    PYTHON,
    assert_losses_close,
    assert_states_close,
    last_json,
    run_cli,
    run_world,
    single_process_reference,
)

CFG = ddp_torchrun.DDPConfig(steps=4, keep_final_state=True, precision="fp32", timeout_s=60)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_equals_single_process(world_size, backend):
    reference = single_process_reference(steps=CFG.steps)
    (result,) = run_world(ddp_torchrun.train, world_size, [CFG], backend=backend)
    assert result.world_size == world_size and result.backend == backend
    assert_losses_close(result.losses, reference.losses, atol=1e-5)
    assert_states_close(result.final_state, reference.final_state, atol=1e-5)
    assert result.losses[-1] < result.losses[0], "the model should learn the synthetic sequences"


def test_torchrun_and_plain_python_print_the_same_losses():
    launched = run_cli(["torchrun", "--standalone", "--nproc_per_node=3", "-m", "recipes.ddp_torchrun"])
    assert launched.returncode == 0, launched.stderr[-2000:]
    alone = run_cli([PYTHON, "-m", "recipes.ddp_torchrun", "--precision", "fp32"])  # GPU hosts: no bf16
    assert alone.returncode == 0, alone.stderr[-2000:]
    launched_result, alone_result = last_json(launched.stdout), last_json(alone.stdout)
    assert (launched_result["world_size"], alone_result["world_size"]) == (3, 1)
    assert_losses_close(launched_result["losses"], alone_result["losses"], atol=1e-5)
    # Logs come from rank 0 only: one line per step.
    assert launched.stdout.count("] step ") == len(launched_result["losses"])
    assert "[rank1]" not in launched.stdout and "[rank2]" not in launched.stdout


def test_global_batch_that_does_not_divide_is_rejected_with_valid_sizes():
    with pytest.raises(RecipeError, match=r"global_batch_size=9 does not divide across 2 ranks; use a multiple of 2, e.g. 8 or 10"):
        spawn_world(ddp_torchrun.train, 2, ddp_torchrun.DDPConfig(global_batch_size=9), deadline_s=60)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "nccl"], "backend 'nccl' needs one CUDA device per local rank"),
        (["--model", "huge"], "invalid choice: 'huge'"),
        (["--no-such-option", "1"], "unrecognized arguments: --no-such-option"),
    ],
)
def test_bad_command_line_fails_in_one_line(args, message):
    if "nccl" in args and CUDA_DEVICES:
        pytest.skip("this machine has a GPU, so NCCL is a valid choice")
    proc = run_cli([PYTHON, "-m", "recipes.ddp_torchrun", *args], timeout_s=60)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
