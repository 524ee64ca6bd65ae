"""fsdp: every classic-FSDP strategy and option trains like DDP; its pitfalls are real and guarded."""

import pytest
from torch.distributed.fsdp import BackwardPrefetch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from recipes import fsdp, zero
from recipes.core.config import RecipeError
from recipes.core.state import full_state_on_rank0
from recipes.core.workload import Block, build_model
from recipes.core.world import join_world
from tests.helpers import (
    BACKENDS,
    SHARDED_BF16_ATOL,
    SHARDED_CLIP,
    SHARDED_INJECT_STEP,
    SHARDED_STEPS,
    CUDA_DEVICES,
    PYTHON,
    assert_about_fraction,
    assert_sharded_run_claims,
    assert_losses_close,
    assert_states_close,
    recipe_result,
    run_alone,
    run_cli,
    run_pair,
    run_world,
    single_process_reference,
    with_fields,
)

# Shared with tests/test_fsdp2.py (assert_sharded_run_claims). bf16 keeps 8 bits of mantissa
# (relative error 2^-8 = 0.4% per rounding): over 4 AdamW steps the losses stay within 1e-2 and the
# weights (about 0.1-1 in size, steps of lr=1e-3) within 2e-2 of fp32.
STEPS, CLIP, BF16_ATOL, INJECT_STEP = (SHARDED_STEPS, SHARDED_CLIP, SHARDED_BF16_ATOL,
                                       SHARDED_INJECT_STEP)
CFG = fsdp.FSDPConfig(steps=STEPS, keep_final_state=True, precision="fp32", timeout_s=120)

# name -> config; every one runs in the same 2-rank world.
RUNS = {
    "full": CFG,
    "shard_grad_op": with_fields(CFG, sharding_strategy="shard_grad_op"),
    "no_shard": with_fields(CFG, sharding_strategy="no_shard"),
    # One rank per "node": torch's HYBRID_SHARD alone would never all-reduce across the nodes.
    "hybrid_one_rank_per_node": with_fields(CFG, sharding_strategy="hybrid", ranks_per_node=1),
    "checkpointed": with_fields(CFG, activation_checkpointing=True),
    "wrap_size": with_fields(CFG, wrap_policy="size"),
    "wrap_module": with_fields(CFG, wrap_policy="module"),
    "wrap_none": with_fields(CFG, wrap_policy="none"),
    "prefetch": with_fields(CFG, backward_prefetch="post", forward_prefetch=True, limit_all_gathers=False),
    "prefetch_none": with_fields(CFG, backward_prefetch="none", sync_module_states=False),
    "accumulate_sync": with_fields(CFG, micro_batches=3),
    "accumulate_no_sync": with_fields(CFG, micro_batches=3, accumulation="no_sync"),
    "clipped": with_fields(CFG, max_grad_norm=CLIP),
    "bf16": with_fields(CFG, precision="bf16"),
    "fp16": with_fields(CFG, precision="fp16", inject_inf_step=INJECT_STEP),
    "fp16_amp_scaler": with_fields(CFG, precision="fp16", inject_inf_step=INJECT_STEP, grad_scaler="amp"),
}
FP32_EXACT = ["full", "shard_grad_op", "no_shard", "hybrid_one_rank_per_node", "checkpointed",
              "wrap_size", "wrap_module", "wrap_none", "prefetch", "prefetch_none", "accumulate_sync",
              "accumulate_no_sync"]


def sync_module_states_check(_cfg):
    """Each rank builds a DIFFERENT model (seed = rank): apply_fsdp must leave everyone with rank 0's."""
    with join_world("gloo") as world:
        model = fsdp.apply_fsdp(build_model("tiny", seed=world.rank), device=world.device,
                                auto_wrap_policy=ModuleWrapPolicy({Block}))
        state, _ = full_state_on_rank0(model)
        return state


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_strategy_and_option_equals_ddp_on_two_ranks(backend):
    runs, exact = dict(RUNS), list(FP32_EXACT)
    if backend == "nccl":  # CPU offload pins host memory: it needs a GPU
        runs["cpu_offload"] = with_fields(CFG, cpu_offload=True)
        exact.append("cpu_offload")
    pairs = [(fsdp.train, with_fields(cfg, backend=backend)) for cfg in runs.values()]
    pairs += [(recipe_result, zero.ZeroConfig(optimizer="adamw", steps=STEPS, backend=backend)),  # DDP's bytes
              (sync_module_states_check, None)]
    *outputs, ddp, synced = run_world(run_pair, 2, pairs, backend=backend, deadline_s=300)
    results = dict(zip(runs, outputs))
    reference = single_process_reference(steps=STEPS)

    # Parity: every fp32 strategy, wrap policy, prefetch setting and accumulation mode is DDP's training.
    for name in exact:
        assert_losses_close(results[name].losses, reference.losses, atol=1e-5)
        assert_states_close(results[name].final_state, reference.final_state, atol=1e-5)
        # The checksum comes from the gathered FULL parameters: the same number for every strategy.
        assert results[name].param_checksum == pytest.approx(reference.param_checksum, abs=1e-3), name
    # Activation checkpointing recomputes the same forward: bit-identical weights, not merely close.
    assert_states_close(results["checkpointed"].final_state, results["full"].final_state, atol=0.0)
    # sync_module_states: ranks that initialised differently all train rank 0's weights.
    assert_states_close(synced, {k: v.detach() for k, v in build_model("tiny", seed=0).state_dict().items()}, atol=0.0)

    # Memory on 2 ranks, against DDP's bytes (tests/test_memory.py does 4 ranks and explains the slack).
    ddp_memory = ddp.extras["memory_per_rank"][0]
    for name in ("full", "shard_grad_op"):
        for memory in results[name].extras["memory_per_rank"]:
            for key in ddp_memory:
                assert_about_fraction(memory[key], ddp_memory[key], 2, f"{name} {key}")
    assert results["no_shard"].extras["memory_per_rank"][0]["grad_bytes"] == ddp_memory["grad_bytes"]

    # no_sync holds UNSHARDED gradients (N x) while syncing every micro-batch keeps them sharded;
    # FSDP.clip_grad_norm_ returns the whole model's norm; bf16 computes in bf16 and reduces in
    # fp32; with ShardedGradScaler an inf in ONE rank's shard makes EVERY rank skip that step.
    assert_sharded_run_claims(results, ddp_memory, reference)
    # With the plain amp GradScaler only the injecting rank (1) notices: the ranks take different
    # decisions and the model's shards are no longer one consistent model.
    wrong = results["fp16_amp_scaler"].extras
    assert wrong["skipped_steps_per_rank"] == [[], [INJECT_STEP]]
    assert wrong["loss_scale_per_rank"] == [2.0**16, 2.0**15]


def test_bad_options_fail_in_one_line():
    proc = run_cli([PYTHON, "-m", "recipes.fsdp", "--sharding-strategy", "zero3"], timeout_s=60)
    assert proc.returncode == 2
    assert "invalid choice: 'zero3'" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(RecipeError, match="unknown wrap_policy='layer'; valid values: block, size, module, none"):
        fsdp.FSDPConfig(wrap_policy="layer")
    with pytest.raises(RecipeError, match="hybrid: world size 1 is not a multiple of ranks_per_node=2"):
        run_alone(fsdp.train, with_fields(CFG, sharding_strategy="hybrid", ranks_per_node=2))


@pytest.mark.skipif(CUDA_DEVICES > 0, reason="on a GPU host cpu_offload is valid (the NCCL run above covers it)")
def test_cpu_offload_on_a_cpu_only_world_says_why_it_cannot_run():
    with pytest.raises(fsdp.FSDPWrapError, match="cpu_offload needs a GPU"):
        run_alone(fsdp.train, with_fields(CFG, cpu_offload=True))
    # From the command line: FSDPWrapError is defined in __main__ there, and is still one line.
    proc = run_cli([PYTHON, "-m", "recipes.fsdp", "--cpu-offload", "--backend", "gloo"],
                   timeout_s=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: cpu_offload needs a GPU: ")


@pytest.mark.slow
def test_three_ranks_uneven_shards_equal_ddp():
    """3 ranks: flat parameters do not divide by 3, so shards are padded; the training is still DDP's."""
    reference = single_process_reference(steps=STEPS)
    configs = [CFG, with_fields(CFG, sharding_strategy="shard_grad_op"),
               with_fields(CFG, activation_checkpointing=True)]
    for result in run_world(fsdp.train, 3, configs, deadline_s=300):
        assert_losses_close(result.losses, reference.losses, atol=1e-5)
        assert_states_close(result.final_state, reference.final_state, atol=1e-5)


def test_prefetch_options_reach_every_unit(monkeypatch):
    """Prefetch changes when the all-gathers run, not what they compute: the parity above cannot
    see it. So assert that every FSDP unit train() builds holds the options it was given."""
    seen = []
    real = fsdp.apply_fsdp

    def spy(model, **kwargs):
        wrapped = real(model, **kwargs)
        seen.append({(unit.backward_prefetch, unit.forward_prefetch, unit.limit_all_gathers)
                     for unit in FSDP.fsdp_modules(wrapped)})
        return wrapped

    monkeypatch.setattr(fsdp, "apply_fsdp", spy)
    for name in ("prefetch", "prefetch_none", "full"):  # the world of 1 in this process
        run_alone(fsdp.train, with_fields(RUNS[name], steps=1))
    assert seen == [{(BackwardPrefetch.BACKWARD_POST, True, False)},  # every unit, root included
                    {(None, False, True)},
                    {(BackwardPrefetch.BACKWARD_PRE, False, True)}]
