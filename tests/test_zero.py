"""zero: DDP + ZeroRedundancyOptimizer trains exactly like DDP and keeps 1/N of AdamW's state per
rank.

The recipe returns its losses; the harness measures the rest from outside (``recipe_result``:
bytes per rank, each rank's optimizer partition, the norms clip_grad_norm_ returned)."""

import os
import tempfile

import pytest
import torch

from recipes import zero
from tests.helpers import (
    BACKENDS,
    PYTHON,
    assert_losses_close,
    assert_states_close,
    recipe_result,
    run_alone,
    run_cli,
    run_world,
    single_process_reference,
    with_fields,
)

CFG = zero.ZeroConfig(steps=4, precision="fp32", timeout_s=120)
CLIP = 0.5  # below the tiny model's gradient norms (about 0.5-0.55): clipping really happens


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero1_equals_ddp_with_half_the_optimizer_state(backend):
    reference = single_process_reference(steps=4)
    clipped_reference = run_alone(
        recipe_result, with_fields(CFG, optimizer="adamw", max_grad_norm=CLIP)
    )
    with tempfile.TemporaryDirectory() as folder:
        saved = os.path.join(folder, "zero.pt")
        configs = [
            with_fields(CFG, optimizer="adamw"),
            with_fields(CFG, save_path=saved),
            with_fields(CFG, max_grad_norm=CLIP),
        ]
        ddp, zero1, clipped = run_world(recipe_result, 2, configs, backend=backend)
        checkpoint = torch.load(saved, map_location="cpu", weights_only=True)

    for result in (ddp, zero1):
        assert_losses_close(result.losses, reference.losses, atol=1e-5)
        assert_states_close(result.final_state, reference.final_state, atol=1e-5)
    assert_losses_close(clipped.losses, clipped_reference.losses, atol=1e-5)
    assert_states_close(clipped.final_state, clipped_reference.final_state, atol=1e-5)
    # DDP's gradients are full on every rank, so the plain clip_grad_norm_ norm is the global one.
    assert clipped.extras["grad_norms"] == pytest.approx(
        clipped_reference.extras["grad_norms"], rel=1e-5
    )
    assert max(clipped.extras["grad_norms"]) > CLIP

    # Every parameter tensor is owned by exactly one rank, and the split is near even.
    numel = sum(t.numel() for t in reference.final_state.values())
    owned = zero1.extras["optimizer_numel_per_rank"]
    assert sum(owned) == numel and ddp.extras["optimizer_numel_per_rank"] == [numel, numel]
    largest = max(t.numel() for t in reference.final_state.values())
    assert max(owned) <= numel / 2 + largest
    # Memory: the optimizer state is split (the sum over ranks is DDP's: no state is held twice);
    # parameters and gradients are not (that is ZeRO-2/3, recipes/fsdp.py).
    ddp_memory = ddp.extras["memory_per_rank"][0]
    zero_memory = zero1.extras["memory_per_rank"]
    assert sum(m["optimizer_bytes"] for m in zero_memory) == ddp_memory["optimizer_bytes"]
    for memory in zero_memory:
        assert memory["optimizer_bytes"] <= ddp_memory["optimizer_bytes"] / 2 + 8 * largest + 4
        assert (
            memory["param_bytes"] == ddp_memory["param_bytes"]
            and memory["grad_bytes"] == ddp_memory["grad_bytes"]
        )
    # consolidate_state_dict(to=0) gathered every rank's partition: rank 0's saved optimizer holds
    # one state per parameter tensor, beside the trained weights.
    assert len(checkpoint["optimizer"]["state"]) == len(reference.final_state)
    assert_states_close(checkpoint["model"], reference.final_state, atol=1e-5)


def test_unknown_optimizer_fails_in_one_line():
    proc = run_cli([PYTHON, "-m", "recipes.zero", "--optimizer", "sgd"], timeout_s=60)
    assert proc.returncode == 2
    assert "invalid choice: 'sgd'" in proc.stderr and "Traceback" not in proc.stderr


def test_a_save_path_that_names_a_folder_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^save_path='.*' is a folder; name the file to write"):
        zero.ZeroConfig(save_path=str(tmp_path))
