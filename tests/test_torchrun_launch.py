"""The sharded recipes launched by torchrun, as their pages tell users to run them: each equals
single-process training and logs from rank 0 only.

Slow: each launch is torchrun plus 2 fresh interpreters importing torch (~10 s of CPU on 2 cores).
The same train() runs in a spawned world in each recipe's default tests; test_ddp_torchrun,
test_elastic and test_multinode cover the launch path itself in the default run. Recipes whose
launch shows something of their own (a rank map, a schedule table, a checkpoint) keep that test
in their module.
"""

import re

import pytest

from recipes.core.prove import PROVABLE
from tests.helpers import assert_losses_close, last_json, run_cli, single_process_reference

# recipe: (its options, what its result must then report)
LAUNCHES = {
    "zero": ([], {}),
    "fsdp": (["--sharding-strategy", "shard_grad_op"], {}),
    "fsdp2": (["--explicit-prefetch"], {}),
    "tensor_parallel": (
        ["--sequence-parallel", "--loss-parallel"],
        {"sequence_parallel": True, "loss_parallel": True},
    ),
}
STEPS = 3


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(LAUNCHES))
def test_torchrun_launch_equals_single_process(recipe):
    options, extras = LAUNCHES[recipe]
    # A copyable recipe prints its steps only: the harness around it prints the result line.
    module = ["recipes.core.prove", recipe] if recipe in PROVABLE else [f"recipes.{recipe}"]
    launched = run_cli(
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            *module,
            *options,
            "--steps",
            str(STEPS),
        ],
        timeout_s=180,
    )
    assert launched.returncode == 0, launched.stderr[-2000:]
    result = last_json(launched.stdout)
    reference = single_process_reference(steps=STEPS)  # the same defaults, one process
    assert result["world_size"] == 2 and result["recipe"] == recipe
    assert {key: result["extras"][key] for key in extras} == extras
    assert_losses_close(result["losses"], reference.losses, atol=1e-5)
    assert result["param_checksum"] == pytest.approx(reference.param_checksum, abs=1e-3)
    # one line per step, from rank 0 only (a copyable recipe prints "step N loss X", plainly)
    steps = (
        len(re.findall(r"^step \d+ loss ", launched.stdout, re.M))
        if recipe in PROVABLE
        else launched.stdout.count("] step ")
    )
    assert steps == STEPS and "[rank1]" not in launched.stdout
