"""context_parallel: ring attention on sequence shards equals full attention (outputs, gradients,
training); load balancing evens the causal work; torch's own API where CUDA is."""

import itertools
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from recipes import context_parallel, ddp_torchrun
from recipes.core.observe import prove
from recipes.core.world import join_world
from tests.helpers import (
    CUDA_DEVICES,
    assert_losses_close,
    assert_states_close,
    ddp_result,
    last_json,
    run_alone,
    run_cli,
    spawn_world,
    with_fields,
)

STEPS = 3
CFG = context_parallel.CPConfig(steps=STEPS, precision="fp32", timeout_s=120)
# (causal, load_balance): the mask decides which blocks are skipped, the layout which are whose.
ATTENTION_CASES = list(itertools.product([True, False], repeat=2))


def attention_differences(world, causal: bool, load_balance: bool) -> list[float]:
    """Largest |ring - full| over every rank of the output and the q, k, v gradients."""
    cp_size, seq_len = world.world_size, 16
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(2, 3, seq_len, 8, generator=generator) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*full, is_causal=causal)
    expected.backward(grad_out)
    layout = torch.stack(
        [
            context_parallel.shard_positions(seq_len, r, cp_size, load_balance=load_balance)
            for r in range(cp_size)
        ]
    )
    mine = layout[world.rank]
    shards = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    with context_parallel.ring_attention(dist.group.WORLD, layout):
        out = F.scaled_dot_product_attention(*shards, is_causal=causal)
    out.backward(grad_out[:, :, mine])
    differences = torch.tensor(
        [(out - expected[:, :, mine]).abs().max()]
        + [(shard.grad - whole.grad[:, :, mine]).abs().max() for shard, whole in zip(shards, full)]
    )
    dist.all_reduce(differences, op=dist.ReduceOp.MAX)
    return differences.tolist()


def llama_differences(world) -> list[float]:
    """A model the cookbook did not write (tiny HF Llama: RoPE from position_ids, grouped-query
    attention through SDPA) on sequence shards: largest |CP - whole| of logits and gradients."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    whole = model(input_ids=ids).logits
    whole.square().mean().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    layout = torch.stack(
        [context_parallel.shard_positions(16, r, world.world_size) for r in range(world.world_size)]
    )
    mine = layout[world.rank]
    with context_parallel.ring_attention(dist.group.WORLD, layout):
        logits = model(input_ids=ids[:, mine], position_ids=mine.expand(2, -1)).logits
    (logits.square().sum() / whole.numel()).backward()  # this rank's share of the mean
    for p in model.parameters():
        dist.all_reduce(p.grad)
    differences = torch.tensor(
        [(logits - whole[:, mine]).abs().max()]
        + [(p.grad - expected[name]).abs().max() for name, p in model.named_parameters()]
    )
    dist.all_reduce(differences, op=dist.ReduceOp.MAX)
    return [differences[0].item(), differences[1:].max().item()]


def cp_world(configs, with_llama=False):
    with join_world("gloo", timeout_s=120) as world:
        attention = {case: attention_differences(world, *case) for case in ATTENTION_CASES}
        llama = llama_differences(world) if with_llama else None
        return attention, llama, [cp_result(cfg) for cfg in configs]


def cp_result(cfg):
    """context_parallel.train(cfg) measured by the harness: its RecipeResult with the final state
    and the split in extras (recipes.core.observe.ContextParallelObserver)."""
    return prove(context_parallel.train, cfg, name="context_parallel", keep_final_state=True)


def check_attention(attention):
    for (causal, load_balance), diffs in attention.items():
        worst = max(diffs)
        assert worst < 1e-5, (
            f"causal={causal} load_balance={load_balance}: output/dq/dk/dv differ by {diffs}"
        )


def reference(backend="gloo"):
    """Single-process training; on gloo it runs on CPU like the ring worlds, even on a GPU host."""
    return run_alone(
        ddp_result, ddp_torchrun.DDPConfig(steps=STEPS, precision="fp32", backend=backend)
    )


def test_ring_attention_and_training_equal_one_process_on_2_ranks():
    configs = [CFG, with_fields(CFG, load_balance=False)]
    attention, llama, results = spawn_world(cp_world, 2, configs, True, deadline_s=240)
    check_attention(attention)
    assert max(llama) < 1e-5, f"HF Llama on sequence shards: logits, gradients differ by {llama}"
    expected = reference()
    for cfg, result in zip(configs, results):
        assert result.extras["cp_size"] == 2 and result.extras["positions_per_rank"] == 8
        assert result.extras["load_balance"] == cfg.load_balance
        # the work each rank did, from the positions its model received: equal when balanced
        # (68 and 68 of the 136-score causal triangle), 36 and 100 when contiguous
        assert result.extras["score_entries_per_rank"] == (
            [68, 68] if cfg.load_balance else [36, 100]
        )
        assert_losses_close(result.losses, expected.losses, atol=1e-5)
        assert_states_close(result.final_state, expected.final_state, atol=1e-5)


@pytest.mark.slow  # 4 ranks on a 2-core machine: ~4x the 2-rank world's time for the same claim
def test_ring_attention_and_training_equal_one_process_on_4_ranks():
    attention, _, (result,) = spawn_world(cp_world, 4, [CFG], deadline_s=400)
    check_attention(attention)
    expected = reference()
    assert_losses_close(result.losses, expected.losses, atol=1e-5)
    assert_states_close(result.final_state, expected.final_state, atol=1e-5)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_load_balancing_gives_every_rank_the_same_causal_work(cp_size):
    def work(load_balance):
        layout = torch.stack(
            [
                context_parallel.shard_positions(16, r, cp_size, load_balance=load_balance)
                for r in range(cp_size)
            ]
        )
        assert sorted(layout.flatten().tolist()) == list(range(16)), "every position exactly once"
        return [context_parallel.score_entries(layout, r) for r in range(cp_size)]

    balanced, contiguous = work(True), work(False)
    assert len(set(balanced)) == 1, balanced
    assert sum(balanced) == sum(contiguous) == 16 * 17 // 2  # the causal triangle, split
    # Contiguous chunks of c: rank r's queries see r whole chunks and a triangle, so the last rank
    # does nearly 2N-1 times the first one's work (100 against 36 for N=2, c=8).
    c = 16 // cp_size
    assert contiguous == [r * c * c + c * (c + 1) // 2 for r in range(cp_size)]


def test_cp_size_that_does_not_split_the_sequence_is_rejected():
    with pytest.raises(
        ValueError,
        match=r"cannot split seq_len=16 into 6 equal chunks.*"
        r"use a CP size of 1, 2, 4, 8",
    ):
        context_parallel.check_cp_fits(16, 3, load_balance=True)
    with pytest.raises(ValueError, match=r"into 3 equal chunks; use a CP size of 1, 2, 4, 8, 16"):
        context_parallel.check_cp_fits(16, 3, load_balance=False)


def test_torch_impl_without_load_balancing_is_refused_from_code_and_command_line(capsys):
    # contradictory options: torch's context_parallel picks its own balancer, it cannot be off
    with pytest.raises(ValueError, match=r"^load_balance off .* applies to impl ring"):
        context_parallel.CPConfig(impl="torch", load_balance=False)
    with pytest.raises(SystemExit) as exit_info:
        context_parallel.main(["--impl", "torch", "--no-load-balance"])
    assert exit_info.value.code == 2
    assert "error: load_balance off" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.skipif(CUDA_DEVICES > 0, reason="checks the message given where there is no CUDA")
def test_torch_impl_without_cuda_fails_in_one_line(capsys):
    # In this process (a world of 1), through the CLI's own entry point: one line, exit code 2.
    with pytest.raises(SystemExit) as exit_info:
        context_parallel.main(["--impl", "torch", "--backend", "gloo"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        (
            "error: --impl torch needs CUDA: torch's context_parallel has no CPU sharding rule for "
            "SDPA; use --impl ring (any backend, gloo included)"
        )
    ]


@pytest.mark.skipif(
    CUDA_DEVICES == 0,
    reason="torch's context_parallel has no CPU sharding rule for SDPA: it needs CUDA",
)
def test_torch_context_parallel_equals_no_cp():
    # A world of 1 in this process (one GPU): torch's CP path, sharding and all, against plain SDPA.
    result = run_alone(cp_result, with_fields(CFG, impl="torch"))
    assert result.device.startswith("cuda") and result.extras["impl"] == "torch"
    expected = reference("nccl")
    assert_losses_close(result.losses, expected.losses, atol=1e-4)
    assert_states_close(result.final_state, expected.final_state, atol=1e-4)


# Three interpreter starts (torchrun and 2 workers, ~12 s of CPU): over this file's budget in the
# default run. The parity it checks is proven in-process above; this adds the launcher path.
@pytest.mark.slow
def test_torchrun_launch_equals_single_process():
    # the harness around the recipe prints the result line; the recipe prints its steps plainly
    launched = run_cli(
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "recipes.core.prove",
            "context_parallel",
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
    assert result["world_size"] == 2 and result["extras"]["impl"] == "ring"
    assert_losses_close(result["losses"], reference().losses, atol=1e-5)
    assert len(re.findall(r"^step \d+ loss ", launched.stdout, re.M)) == STEPS
    assert "[rank1]" not in launched.stdout
