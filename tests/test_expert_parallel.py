"""expert_parallel: the MoE with its experts on 2 ranks computes what the one-process MoE does
(outputs, gradients, token counts, training); capacity drops are explicit; bad layouts fail."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from recipes import expert_parallel
from recipes.core.world import join_world
from tests.helpers import (
    assert_losses_close,
    assert_states_close,
    last_json,
    recipe_result,
    run_alone,
    run_cli,
    spawn_world,
    with_fields,
)

STEPS = 3
CFG = expert_parallel.EPConfig(steps=STEPS, precision="fp32", timeout_s=120, backend="gloo")
TOKENS, DIM, EXPERTS = 24, 16, 4


def layer_differences(world, capacity_factor: float) -> dict:
    """One MoE layer, split across the world, against the same layer whole in this process.
    Without capacity the reference sees the whole batch; with it, each rank's tokens (capacity is
    per rank's tokens, so that is the computation EP must equal)."""
    torch.manual_seed(0)
    whole = expert_parallel.MoE(DIM, 32, EXPERTS, 2, capacity_factor)
    split = expert_parallel.MoE(DIM, 32, EXPERTS, 2, capacity_factor)
    split.load_state_dict(whole.state_dict())
    expert_parallel.apply_ep(nn.Sequential(split), init_device_mesh("cpu", (world.world_size,)))
    generator = torch.Generator().manual_seed(1)
    x, grad_out = (
        torch.randn(TOKENS, DIM, generator=generator),
        torch.randn(TOKENS, DIM, generator=generator),
    )
    share = TOKENS // world.world_size
    mine = slice(world.rank * share, (world.rank + 1) * share)
    x_whole = (x if capacity_factor == math.inf else x[mine]).clone().requires_grad_()
    x_mine = x[mine].clone().requires_grad_()
    y_whole, y_mine = whole(x_whole), split(x_mine)
    if capacity_factor < math.inf:  # EP reports the group's drops: sum the one-process runs' drops
        dropped = torch.tensor(whole.dropped_tokens)
        dist.all_reduce(dropped)
        return {
            "output": (y_mine - y_whole).abs().max().item(),
            "dropped": (split.dropped_tokens, int(dropped)),
        }
    ((y_whole * grad_out).sum() + whole.aux_loss).backward()
    ((y_mine * grad_out[mine]).sum() + split.aux_loss).backward()
    dist.all_reduce(split.router.weight.grad)  # the replicated router's gradient: summed
    local = slice(
        world.rank * EXPERTS // world.world_size, (world.rank + 1) * EXPERTS // world.world_size
    )
    aux = split.aux_loss.detach().clone()
    dist.all_reduce(aux)
    return {
        "output": (y_mine - y_whole[mine]).abs().max().item(),
        "input grad": (x_mine.grad - x_whole.grad[mine]).abs().max().item(),
        "router grad": (split.router.weight.grad - whole.router.weight.grad).abs().max().item(),
        "w_in grad": (split.w_in.grad - whole.w_in.grad[local]).abs().max().item(),
        "w_out grad": (split.w_out.grad - whole.w_out.grad[local]).abs().max().item(),
        "aux loss": (aux - whole.aux_loss).abs().item(),
        "counts": (split.tokens_per_expert, whole.tokens_per_expert),
    }


def ep_world(configs):
    with join_world("gloo", timeout_s=120) as world:
        layers = [layer_differences(world, capacity) for capacity in (math.inf, 0.5)]
        # the recipe measured by the harness (recipes.core.observe.ExpertParallelObserver: the
        # placement, the final state with every rank's experts gathered)
        return layers, [recipe_result(cfg) for cfg in configs]


def test_experts_on_2_ranks_equal_the_one_process_moe():
    configs = [CFG, with_fields(CFG, capacity_factor=0.5)]
    (exact, capped), (result, dropping) = spawn_world(ep_world, 2, configs, deadline_s=240)
    # 1. One layer: outputs, every gradient, the aux loss and the token counts.
    counts_ep, counts_one = exact.pop("counts")
    assert counts_ep == counts_one and sum(counts_ep) == TOKENS * 2
    worst = max(exact, key=exact.get)
    assert exact[worst] < 1e-5, f"{worst} differs by {exact[worst]:.2e}: {exact}"
    # With a capacity the same tokens are dropped as in one process on this rank's tokens.
    assert capped["output"] < 1e-5 and capped["dropped"][0] == capped["dropped"][1] > 0
    # 2. Training: losses (aux included), final weights (experts gathered), token counts.
    expected = run_alone(recipe_result, CFG)
    assert result.extras["ep_size"] == 2 and result.extras["experts_per_rank"] == 2
    assert_losses_close(result.losses, expected.losses, atol=1e-5)
    assert_losses_close(result.extras["aux_losses"], expected.extras["aux_losses"], atol=1e-5)
    assert_states_close(result.final_state, expected.final_state, atol=1e-5)
    assert result.extras["tokens_per_expert"] == expected.extras["tokens_per_expert"]
    routed = CFG.global_batch_size * 16 * CFG.top_k  # tiny: 16 positions per sequence
    assert all(sum(counts) == routed for counts in result.extras["tokens_per_expert"])
    assert result.extras["dropped_tokens"] == [0, 0]
    assert all(dropped > 0 for dropped in dropping.extras["dropped_tokens"])


def test_layouts_that_cannot_be_placed_fail_in_one_line():
    with pytest.raises(
        expert_parallel.ExpertParallelError,
        match=r"num_experts=6 cannot be placed evenly on 4 ranks; use "
        r"a multiple of 4 experts, or an EP size of 1, 2, 3, 6",
    ):
        expert_parallel.check_ep_fits(6, 4)
    # refused by train before it joins any world: every rank at once, no rank left waiting
    with pytest.raises(ValueError, match=r"top_k=5 > num_experts=4.*use --top-k 4 or less"):
        expert_parallel.train(expert_parallel.EPConfig(top_k=5))
    with pytest.raises(
        expert_parallel.ExpertParallelError, match=r"apply_ep found no MoE layer.*Linear"
    ):
        expert_parallel.apply_ep(nn.Sequential(nn.Linear(2, 2)), None)


# Three interpreter starts (torchrun and 2 workers, ~12 s of CPU): over this file's budget in the
# default run. The parity it checks is proven in-process above; this adds the launcher path.
@pytest.mark.slow
def test_torchrun_launch_equals_one_process():
    # through the harness (the recipe's own lines first, then the result's JSON)
    launched = run_cli(
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "recipes.core.prove",
            "expert_parallel",
            "--steps",
            str(STEPS),
            "--precision",
            "fp32",
            "--backend",
            "gloo",
        ],
        timeout_s=180,
    )
    assert launched.returncode == 0, launched.stderr[-2000:]
    result = last_json(launched.stdout)
    assert result["world_size"] == 2 and len(result["extras"]["tokens_per_expert"]) == 2
    expected = run_alone(recipe_result, CFG)
    assert_losses_close(result["losses"], expected.losses, atol=1e-5)
    assert launched.stdout.count("\nstep ") == STEPS and "[rank1]" not in launched.stdout


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["--top-k", "5"],
            "error: top_k=5 > num_experts=4: a token needs top_k different experts; "
            "use --top-k 4 or less",
        ),
        # 0 reads as "no capacity" to some and as "room for no token" to others: refused, naming
        # both.
        (
            ["--capacity-factor", "0"],
            "error: capacity_factor must be > 0, got 0: an expert would take "
            "no token and every token would be dropped; leave it out (inf: "
            "none dropped) or use e.g. 1.25",
        ),
        # (the line goes on with the fix, as for 0: train checks every capacity, in one place)
        (
            ["--capacity-factor", "-1"],
            "error: capacity_factor must be > 0, got -1; leave it out "
            "(inf: none dropped) or use e.g. 1.25",
        ),
        # refused, not run as fp32 under tf32's name (a world of 1, in this process)
        pytest.param(
            ["--precision", "tf32", "--backend", "gloo"],
            "error: --precision tf32 is a CUDA matmul mode and this run is on cpu; use "
            "--precision fp32 (or bf16)",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="tf32 runs on CUDA"),
        ),
    ],
)
def test_bad_command_line_is_one_line_and_exit_code_2(capsys, args, line):
    with pytest.raises(SystemExit) as exit_info:
        expert_parallel.main(args)
    assert exit_info.value.code == 2
    # a value the config refuses: argparse's usage, then the line (prog: error: ...); a refusal
    # that needs the device (tf32 on CPU): the line alone, from rank 0
    *usage, last = capsys.readouterr().err.strip().splitlines()
    assert last in (line, f"python -m recipes.expert_parallel: {line}"), last
    assert all(text.startswith(("usage:", " ")) for text in usage), usage
    with pytest.raises(
        expert_parallel.ExpertParallelError, match="capacity_factor must be > 0, got 0: an expert"
    ):
        expert_parallel.MoE(8, 16, 4, 2, capacity_factor=0.0)  # the layer a user copies, too


def test_a_refusal_of_a_copyable_function_is_one_line_and_exit_code_2(capsys, monkeypatch):
    """apply_ep raises ExpertParallelError (a ValueError of its module, so that it copies alone):
    the recipe's main says it in one line, exit code 2."""
    message = "apply_ep found no MoE layer in the model; its modules: ['Linear', 'Sequential']"
    # a model without MoE layers where the recipe builds its own: apply_ep's refusal, in a
    # world of 1 (this process), through the recipe's own main
    monkeypatch.setattr(
        expert_parallel, "build_moe_model", lambda cfg, device: nn.Sequential(nn.Linear(2, 2))
    )
    with pytest.raises(SystemExit) as exit_info:
        expert_parallel.main(["--backend", "gloo"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]
