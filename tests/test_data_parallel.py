"""data_parallel: nn.DataParallel trains exactly like the plain model (on CPU: one device, and it says so)."""

import pytest
import torch

from recipes import data_parallel
from tests.helpers import (
    PYTHON,
    assert_losses_close,
    assert_states_close,
    last_json,
    run_cli,
    single_process_reference,
)


def test_data_parallel_equals_single_device_training():
    reference = single_process_reference(steps=4)
    result = data_parallel.train(data_parallel.DataParallelConfig(steps=4, keep_final_state=True, precision="fp32"))
    # On GPUs the batch is split and gradients summed in another order: equal within fp32 rounding.
    atol = 1e-5 if torch.cuda.device_count() > 1 else 0.0
    assert_losses_close(result.losses, reference.losses, atol=atol)
    assert_states_close(result.final_state, reference.final_state, atol=atol + 1e-5)
    assert "module." not in "".join(result.final_state), "the state must come from dp_model.module"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message; this machine has a GPU")
def test_cli_says_it_runs_on_one_cpu_device():
    proc = run_cli([PYTHON, "-m", "recipes.data_parallel", "--steps", "2"], timeout_s=60)
    assert proc.returncode == 0, proc.stderr
    assert "no GPU visible" in proc.stdout
    assert last_json(proc.stdout)["extras"]["gpus"] == 0
