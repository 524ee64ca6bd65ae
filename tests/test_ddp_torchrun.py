"""ddp_torchrun: DDP on N ranks equals single-process training; torchrun and plain python agree;
rank 0's checkpoint loads into a plain model; bad input is one line.

The recipe is copyable (it imports torch and recipes/toy.py only) and returns its losses; the
harness (``recipes.core.observe.prove``, via ``tests.helpers.ddp_result``) measures the rest from
outside: final weights, checksum, bytes per rank."""

import contextlib
import io
import re
import warnings

import pytest
import torch

from recipes import ddp_torchrun
from recipes.toy import build_model
from tests.helpers import (
    BACKENDS,
    CUDA_DEVICES,
    PYTHON,
    assert_losses_close,
    assert_states_close,
    ddp_result,
    plain_training_loop,
    require_world,
    run_alone,
    run_cli,
    single_process_reference,
    spawn_world,
)

CFG = ddp_torchrun.DDPConfig(steps=4, precision="fp32", timeout_s=60)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ddp_equals_single_process(world_size, backend, tmp_path):
    """Losses and final weights equal one process's; rank 0's save loads into a plain model."""
    require_world(backend, world_size)
    reference = single_process_reference(steps=CFG.steps)
    saved = tmp_path / "model.pt"
    cfg = ddp_torchrun.DDPConfig(**{**vars(CFG), "backend": backend, "save_path": str(saved)})
    # The recipe joins the world itself here (init_process_group from the launcher's variables).
    result = spawn_world(ddp_result, world_size, cfg, deadline_s=120)
    assert result.world_size == world_size and result.backend == backend
    assert_losses_close(result.losses, reference.losses, atol=1e-5)
    assert_states_close(result.final_state, reference.final_state, atol=1e-5)
    assert result.losses[-1] < result.losses[0], "the model should learn the synthetic sequences"
    # Every rank holds the whole model state (the baseline of the sharding recipes' 1/N).
    assert len(result.extras["memory_per_rank"]) == world_size
    assert len({tuple(m.values()) for m in result.extras["memory_per_rank"]}) == 1
    # The save: model.module's state dict, so no "module." keys, and it loads into a plain
    # model as it is, with the trained weights.
    state = torch.load(saved, weights_only=True)
    assert not any(key.startswith("module.") for key in state), sorted(state)[:3]
    plain = build_model(cfg.model)
    plain.load_state_dict(state)  # strict: every key matches
    assert_states_close(
        {n: p.detach() for n, p in plain.named_parameters()}, result.final_state, atol=0.0
    )


def test_a_second_epoch_is_reshuffled_as_one_process_does():
    # 10 steps of 8 batches per epoch: steps 8 and 9 come from epoch 1, which set_epoch reshuffles
    # (without it, epoch 1 repeats epoch 0's order and these losses differ).
    cfg = ddp_torchrun.DDPConfig(steps=10, precision="fp32")
    losses = run_alone(ddp_torchrun.train, cfg)
    expected, _ = plain_training_loop(
        "tiny", steps=10, global_batch_size=cfg.global_batch_size, lr=cfg.lr, seed=cfg.seed
    )
    assert_losses_close(losses, expected, atol=1e-5)


STEP_LINE = re.compile(r"^step (\d+) loss (\d+\.\d{4})$", re.M)


# In the slow set (CI runs it): the default run launches ddp_torchrun under torchrun in
# tests/test_copy_recipes.py (2 ranks, each printed line against one process's loss), and runs a
# world of 1 in this module; this 3-rank launch costs ~9 s of CPU on the 4-minute suite.
@pytest.mark.slow
def test_torchrun_and_plain_python_print_the_same_losses():
    # GPU hosts: gloo and fp32 on both, so that 3 ranks need no 3 GPUs and nothing is bf16
    extra = ["--backend", "gloo", "--precision", "fp32"] if CUDA_DEVICES else []
    launched = run_cli(
        ["torchrun", "--standalone", "--nproc_per_node=3", "-m", "recipes.ddp_torchrun", *extra]
    )
    assert launched.returncode == 0, launched.stderr[-2000:]
    alone = run_cli([PYTHON, "-m", "recipes.ddp_torchrun", "--precision", "fp32", *extra])
    assert alone.returncode == 0, alone.stderr[-2000:]
    launched_lines, alone_lines = (
        STEP_LINE.findall(launched.stdout),
        STEP_LINE.findall(alone.stdout),
    )
    # Logs come from rank 0 only: one line per step (3 ranks printing would give 3 per step).
    steps = ddp_torchrun.DDPConfig().steps
    assert [int(step) for step, _ in launched_lines] == list(range(steps)), launched.stdout
    assert launched_lines == alone_lines
    reference = single_process_reference()  # the same defaults, in this process
    assert_losses_close([float(loss) for _, loss in launched_lines], reference.losses, atol=6e-5)


def main_in_a_rank(argv):
    """``ddp_torchrun.main(argv)`` on one rank of a spawned world: (exit code, what it printed to
    stderr)."""
    err = io.StringIO()
    # @record enables faulthandler on stderr, which a StringIO cannot take: it warns (and works)
    with contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Unable to enable fault handler")
        try:
            ddp_torchrun.main(argv)
        except SystemExit as exit_:
            return exit_.code, err.getvalue()
    return 0, err.getvalue()


def test_global_batch_that_does_not_divide_is_rejected_with_valid_sizes():
    code, stderr = spawn_world(main_in_a_rank, 2, ["--global-batch-size", "9"], deadline_s=60)
    assert code == 2
    assert stderr.splitlines() == [
        "error: global_batch_size=9 does not divide across 2 ranks; "
        "use a multiple of 2, e.g. 8 or 10"
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "nccl"], "backend nccl needs a CUDA device per rank and there is none"),
        (["--model", "huge"], "invalid choice: 'huge'"),
        (["--no-such-option", "1"], "unrecognized arguments: --no-such-option"),
        (["--lr", "inf"], "lr must be a finite number > 0, got inf"),
        (["--steps", "0"], "steps must be a whole number >= 1, got 0"),
    ],
)
def test_bad_command_line_fails_in_one_line(args, message):
    if "nccl" in args and CUDA_DEVICES:
        pytest.skip("this machine has a GPU, so NCCL is a valid choice")
    proc = run_cli([PYTHON, "-m", "recipes.ddp_torchrun", *args], timeout_s=60)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
