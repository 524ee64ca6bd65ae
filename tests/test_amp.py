"""amp: fp32 is the plain loop exactly; bf16/fp16 track it; an fp16 overflow is skipped and halves
the scale.

The recipe is measured from outside (``recipe_result``: the harness's ``prove``); the overflow is
injected by this test's own observer, not by an option of the recipe.
"""

import re

import pytest
import torch

from recipes import amp
from recipes.core.observe import Observer
from tests.helpers import (
    PYTHON,
    assert_losses_close,
    assert_states_close,
    plain_training_loop,
    recipe_result,
    run_cli,
    with_fields,
)

CFG = amp.AMPConfig(steps=6, device="cpu", precision="fp32")

# How far a 16-bit run's per-step losses may drift from fp32's on the tiny model over 6 steps.
# bf16 keeps 8 significant bits (relative rounding 2**-9 ~ 2e-3 per op), fp16 keeps 11 (2**-12 ~
# 2.4e-4); the rounding errors of many products average out, and we measured 3e-4 (bf16) and 4e-5
# (fp16) on a loss of ~4.3. The bounds leave ~10x room and still fail if a run trains on a different
# trajectory.
LOSS_ATOL = {"bf16": 3e-3, "fp16": 5e-4}

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="the CUDA path needs a CUDA device"
        ),
    ),
]


class OverflowAt(Observer):
    """Puts one inf into the first parameter's gradient in the backward of step ``at``: what an fp16
    overflow in backward looks like to the scaler. A tensor hook on the parameter, registered when
    the recipe reports its model ready: the recipe itself has no fault-injection option."""

    def __init__(self, steps: int, at: int):
        super().__init__(steps)
        self.at, self.next_step = at, 0

    def model_ready(self, model, optimizer):
        super().model_ready(model, optimizer)
        next(model.parameters()).register_hook(self._inject)

    def step_end(self, step, loss):
        super().step_end(step, loss)
        self.next_step = step + 1

    def _inject(self, grad):
        if self.next_step != self.at:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad


def plain_fp32_loop(cfg: amp.AMPConfig):
    """The textbook loop, no autocast and no scaler: what --precision fp32 must equal bit for
    bit."""
    return plain_training_loop(
        cfg.model,
        steps=cfg.steps,
        global_batch_size=cfg.global_batch_size,
        lr=cfg.lr,
        seed=cfg.seed,
    )


def test_fp32_equals_the_plain_training_loop_exactly():
    result = recipe_result(with_fields(CFG, precision="fp32"))
    losses, state = plain_fp32_loop(CFG)
    assert result.losses == losses
    assert_states_close(result.final_state, state, atol=0.0)
    # no scaler in fp32: nothing skipped, the (disabled) scale stays 1
    assert result.extras["skipped_steps"] == [] and result.extras["scales"][-1] == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_and_fp16_losses_track_fp32(device):
    fp32, bf16, fp16 = (
        recipe_result(with_fields(CFG, device=device, precision=precision))
        for precision in ("fp32", "bf16", "fp16")
    )
    for name, result in (("bf16", bf16), ("fp16", fp16)):
        assert result.device.startswith(device) and result.precision == name
        assert_losses_close(result.losses, fp32.losses, atol=LOSS_ATOL[name])
        # ...but not equal: autocast really computed in 16 bits (an unsupported dtype silently
        # disables it).
        assert result.losses != fp32.losses, (
            f"{name} gave fp32's exact losses: autocast did not run"
        )
        assert result.losses[-1] < result.losses[0]
    # fp16 is closer to fp32 than bf16 is: more mantissa bits (the range is not exercised by this
    # model).
    fp32_losses = torch.tensor(fp32.losses)
    assert (torch.tensor(fp16.losses) - fp32_losses).abs().max() < (
        torch.tensor(bf16.losses) - fp32_losses
    ).abs().max()
    assert fp16.extras["skipped_steps"] == [] and fp16.extras["scales"][-1] == CFG.init_scale
    assert bf16.extras["scales"][-1] == 1.0  # bf16 needs no scaler: it has fp32's exponent range


@pytest.mark.parametrize("device", DEVICES)
def test_injected_overflow_is_skipped_leaves_parameters_unchanged_and_halves_the_scale(
    device, capsys
):
    k = 2
    fp16 = with_fields(CFG, device=device, precision="fp16")
    overflowed = recipe_result(with_fields(fp16, steps=k + 1), observer=OverflowAt(k + 1, at=k))
    printed = capsys.readouterr().out
    before = recipe_result(with_fields(fp16, steps=k))
    assert len(overflowed.extras["skipped_steps"]) == 1 and overflowed.extras["skipped_steps"] == [
        k
    ]
    scales = overflowed.extras["scales"]
    assert scales[k] == scales[k - 1] / 2 == CFG.init_scale / 2
    assert scales[-1] == CFG.init_scale / 2
    # Step k ran forward and backward but changed no parameter (nor the optimizer's step count):
    # the state after steps 0..k equals the state after steps 0..k-1.
    assert overflowed.losses[:k] == before.losses
    # CUDA's embedding backward accumulates with atomics (order varies run to run), so allow float
    # noise there.
    assert_states_close(
        overflowed.final_state, before.final_state, atol=0.0 if device == "cpu" else 1e-5
    )
    # The recipe's own line says so, with the halved scale.
    assert re.search(
        rf"^step {k} loss \d+\.\d{{4}} scale 32768 \(skipped: inf/nan gradient\)$", printed, re.M
    ), printed


def test_bad_choices_are_rejected_with_the_fix():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="^device cuda needs a CUDA GPU.*use device cpu"):
            recipe_result(with_fields(CFG, device="cuda"))
    with pytest.raises(
        ValueError, match="^precision tf32 is a CUDA matmul mode.*use precision fp32"
    ):
        recipe_result(with_fields(CFG, precision="tf32"))


def test_cli_prints_each_step_and_refuses_in_one_line():
    proc = run_cli(
        [PYTHON, "-m", "recipes.amp", "--precision", "fp16", "--device", "cpu", "--steps", "3"],
        timeout_s=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = re.findall(r"^step (\d) loss (\d+\.\d{4}) scale 65536$", proc.stdout, re.M)
    assert [int(step) for step, _ in printed] == [0, 1, 2], proc.stdout
    reference = recipe_result(with_fields(CFG, precision="fp16", steps=3))
    assert_losses_close([float(loss) for _, loss in printed], reference.losses, atol=6e-5)
    if torch.cuda.is_available():
        bad = run_cli([PYTHON, "-m", "recipes.amp", "--steps", "0"], timeout_s=120)
        assert bad.returncode == 2 and re.search(r"error: steps must be .*>= 1, got 0", bad.stderr)
    else:
        bad = run_cli([PYTHON, "-m", "recipes.amp", "--device", "cuda"], timeout_s=120)
        assert bad.returncode == 2
        assert bad.stderr.strip().splitlines()[-1] == (
            "python -m recipes.amp: error: device cuda needs a CUDA GPU and none is visible; "
            "use device cpu (or auto)"
        )
    assert "Traceback" not in bad.stderr
