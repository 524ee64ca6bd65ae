"""amp: fp32 is the plain loop exactly; bf16/fp16 track it; an fp16 overflow is skipped and halves the scale."""

import pytest
import torch

from recipes import amp
from recipes.core.config import RecipeError
from tests.helpers import (PYTHON, assert_losses_close, assert_states_close, last_json, plain_training_loop, run_alone,
                           run_cli, with_fields)

CFG = amp.AMPConfig(steps=6, device="cpu", keep_final_state=True, precision="fp32", timeout_s=60)

# How far a 16-bit run's per-step losses may drift from fp32's on the tiny model over 6 steps.
# bf16 keeps 8 significant bits (relative rounding 2**-9 ~ 2e-3 per op), fp16 keeps 11 (2**-12 ~ 2.4e-4);
# the rounding errors of many products average out, and we measured 3e-4 (bf16) and 4e-5 (fp16) on a
# loss of ~4.3. The bounds leave ~10x room and still fail if a run trains on a different trajectory.
LOSS_ATOL = {"bf16": 3e-3, "fp16": 5e-4}

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="the CUDA path needs a CUDA device"))]


def plain_fp32_loop(cfg: amp.AMPConfig):
    """The textbook loop, no autocast and no scaler: what --precision fp32 must equal bit for bit."""
    return plain_training_loop(cfg.model, steps=cfg.steps, global_batch_size=cfg.global_batch_size, lr=cfg.lr,
                               seed=cfg.seed)


def test_fp32_equals_the_plain_training_loop_exactly():
    result = run_alone(amp.train, with_fields(CFG, precision="fp32"))
    losses, state = plain_fp32_loop(CFG)
    assert result.losses == losses
    assert_states_close(result.final_state, state, atol=0.0)
    assert result.extras["skipped_steps"] == 0 and result.extras["final_scale"] == 1.0  # no scaler in fp32


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_and_fp16_losses_track_fp32(device):
    fp32, bf16, fp16 = (run_alone(amp.train, with_fields(CFG, device=device, precision=precision))
                        for precision in ("fp32", "bf16", "fp16"))
    for name, result in (("bf16", bf16), ("fp16", fp16)):
        assert result.device.startswith(device) and result.precision == name
        assert_losses_close(result.losses, fp32.losses, atol=LOSS_ATOL[name])
        # ...but not equal: autocast really computed in 16 bits (an unsupported dtype silently disables it).
        assert result.losses != fp32.losses, f"{name} gave fp32's exact losses: autocast did not run"
        assert result.losses[-1] < result.losses[0]
    # fp16 is closer to fp32 than bf16 is: more mantissa bits (the range is not exercised by this model).
    fp32_losses = torch.tensor(fp32.losses)
    assert (torch.tensor(fp16.losses) - fp32_losses).abs().max() < (torch.tensor(bf16.losses) - fp32_losses).abs().max()
    assert fp16.extras["skipped_steps"] == 0 and fp16.extras["final_scale"] == CFG.init_scale
    assert bf16.extras["final_scale"] == 1.0  # bf16 needs no scaler: it has fp32's exponent range


@pytest.mark.parametrize("device", DEVICES)
def test_injected_overflow_is_skipped_leaves_parameters_unchanged_and_halves_the_scale(device):
    k = 2
    overflowed = run_alone(amp.train, with_fields(CFG, device=device, precision="fp16", steps=k + 1, overflow_at_step=k))
    before = run_alone(amp.train, with_fields(CFG, device=device, precision="fp16", steps=k))
    assert overflowed.extras["skipped_steps"] == 1 and overflowed.extras["skipped_step_indices"] == [k]
    scales = overflowed.extras["scales"]
    assert scales[k] == scales[k - 1] / 2 == CFG.init_scale / 2
    assert overflowed.extras["final_scale"] == CFG.init_scale / 2
    # Step k ran forward and backward but changed no parameter (nor the optimizer's step count):
    # the state after steps 0..k equals the state after steps 0..k-1.
    assert overflowed.losses[:k] == before.losses
    # CUDA's embedding backward accumulates with atomics (order varies run to run), so allow float noise there.
    assert_states_close(overflowed.final_state, before.final_state, atol=0.0 if device == "cpu" else 1e-5)


def test_bad_choices_are_rejected_with_the_fix():
    with pytest.raises(RecipeError, match="overflow_at_step needs --precision fp16"):
        amp.AMPConfig(precision="bf16", overflow_at_step=1)
    if not torch.cuda.is_available():
        with pytest.raises(RecipeError, match="--device cuda needs a CUDA GPU.*use --device cpu"):
            run_alone(amp.train, with_fields(CFG, device="cuda"))


def test_cli_reports_the_skipped_step_as_json():
    proc = run_cli([PYTHON, "-m", "recipes.amp", "--precision", "fp16", "--device", "cpu", "--steps", "3",
                    "--overflow-at-step", "1"], timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = last_json(proc.stdout)
    assert result["extras"]["skipped_step_indices"] == [1] and result["extras"]["final_scale"] == CFG.init_scale / 2
    assert "(skipped: inf/nan gradient)" in proc.stdout
    bad = run_cli([PYTHON, "-m", "recipes.amp", "--precision", "fp32", "--overflow-at-step", "1"], timeout_s=120)
    assert bad.returncode == 2 and "error: overflow_at_step needs --precision fp16" in bad.stderr
    assert "Traceback" not in bad.stderr
