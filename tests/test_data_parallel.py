"""data_parallel: nn.DataParallel trains exactly like the plain model (on CPU: one device, and it
says so)."""

import re

import pytest
import torch

from recipes import data_parallel
from tests.helpers import (
    PYTHON,
    assert_losses_close,
    assert_states_close,
    recipe_result,
    run_cli,
    single_process_reference,
)


class CountingDataParallel(torch.nn.DataParallel):
    """nn.DataParallel that records that it was built and called (the test swaps it in)."""

    built: list["CountingDataParallel"] = []

    def __init__(self, module, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        self.forwards = 0
        CountingDataParallel.built.append(self)

    def forward(self, *inputs, **kwargs):
        self.forwards += 1
        return super().forward(*inputs, **kwargs)


def test_data_parallel_equals_single_device_training(monkeypatch, tmp_path):
    """What this can prove depends on the GPUs. Without one, nn.DataParallel keeps no device_ids
    and its forward is ``self.module(*inputs)``: nothing is split, replicated or gathered, so the
    training IS single-device training, and atol 0 pins only that the recipe's loop (data order,
    optimizer, loss) is the reference's. The splitting itself (scatter, replicas, the gradient sum
    onto GPU 0) needs CUDA devices; with two or more it is compared at fp32 rounding (1e-5).
    What holds everywhere: the recipe really trains through one DataParallel over every visible
    GPU, each step's forward goes through it, and the state it saves is the bare model's."""
    monkeypatch.setattr(torch.nn, "DataParallel", CountingDataParallel)
    CountingDataParallel.built.clear()
    reference = single_process_reference(steps=4)
    saved = tmp_path / "model.pt"
    result = recipe_result(
        data_parallel.DataParallelConfig(steps=4, precision="fp32", save_path=str(saved))
    )
    [dp_model] = CountingDataParallel.built
    assert dp_model.forwards == 4, "every step's forward must go through the DataParallel wrapper"
    assert dp_model.device_ids == list(range(torch.cuda.device_count()))  # [] on CPU: pass-through
    assert result.extras["gpus"] == torch.cuda.device_count()
    # On GPUs the batch is split and gradients summed in another order: equal within fp32 rounding.
    atol = 1e-5 if torch.cuda.device_count() > 1 else 0.0
    assert_losses_close(result.losses, reference.losses, atol=atol)
    # On CPU the weights too are bit for bit; on GPUs the earlier tolerance stays.
    state_atol = atol + 1e-5 if torch.cuda.device_count() else 0.0
    assert_states_close(result.final_state, reference.final_state, atol=state_atol)
    # The file the recipe saved: the bare model's names (no "module." prefix: assert_states_close
    # checks them) and its trained weights, loadable into a plain model.
    state = torch.load(saved, map_location="cpu", weights_only=True)
    assert_states_close(state, reference.final_state, atol=state_atol)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the CPU message; this machine has a GPU"
)
def test_cli_says_it_runs_on_one_cpu_device():
    proc = run_cli([PYTHON, "-m", "recipes.data_parallel", "--steps", "2"], timeout_s=60)
    assert proc.returncode == 0, proc.stderr
    assert "no GPU visible" in proc.stdout
    assert re.findall(r"^step (\d) loss \d+\.\d{4}$", proc.stdout, re.M) == ["0", "1"], proc.stdout
