"""fsdp2: fully_shard trains like DDP with every option; its pitfalls (fp16, clipping, no_sync) are guarded."""

import pytest

from recipes import fsdp2, zero
from recipes.core.config import RecipeError
from recipes.core.workload import MODEL_PRESETS, Block
from tests.helpers import (
    BACKENDS,
    SHARDED_BF16_ATOL,
    SHARDED_CLIP,
    SHARDED_INJECT_STEP,
    SHARDED_STEPS,
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

# Shared with tests/test_fsdp.py (assert_sharded_run_claims), which says why these values.
STEPS, CLIP, BF16_ATOL, INJECT_STEP = (SHARDED_STEPS, SHARDED_CLIP, SHARDED_BF16_ATOL,
                                       SHARDED_INJECT_STEP)
CFG = fsdp2.FSDP2Config(steps=STEPS, keep_final_state=True, precision="fp32", timeout_s=120)

RUNS = {
    "default": CFG,
    "no_reshard": with_fields(CFG, reshard_after_forward="false"),
    # CPU offload on a CPU world runs the offload code path (its tensors already live in host memory).
    "prefetch_offload": with_fields(CFG, explicit_prefetch=True, cpu_offload=True),
    "accumulate_sync": with_fields(CFG, micro_batches=3),
    "accumulate_no_sync": with_fields(CFG, micro_batches=3, accumulation="no_sync"),
    "clipped": with_fields(CFG, max_grad_norm=CLIP),
    "bf16": with_fields(CFG, precision="bf16"),
    "fp16": with_fields(CFG, precision="fp16", inject_inf_step=INJECT_STEP),
}
FP32_EXACT = ["default", "no_reshard", "prefetch_offload", "accumulate_sync", "accumulate_no_sync"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_shard_equals_ddp_with_every_option(backend):
    pairs = [(fsdp2.train, with_fields(cfg, backend=backend)) for cfg in RUNS.values()]
    pairs.append((recipe_result, zero.ZeroConfig(optimizer="adamw", steps=STEPS, backend=backend)))  # DDP's bytes
    *outputs, ddp = run_world(run_pair, 2, pairs, backend=backend, deadline_s=300)
    results = dict(zip(RUNS, outputs))
    reference = single_process_reference(steps=STEPS)

    for name in FP32_EXACT:
        assert_losses_close(results[name].losses, reference.losses, atol=1e-5)
        assert_states_close(results[name].final_state, reference.final_state, atol=1e-5)
        assert results[name].param_checksum == pytest.approx(reference.param_checksum, abs=1e-3), name

    ddp_memory = ddp.extras["memory_per_rank"][0]
    for memory in results["default"].extras["memory_per_rank"]:
        for key in ddp_memory:
            assert_about_fraction(memory[key], ddp_memory[key], 2, f"fully_shard {key}")

    # set_requires_gradient_sync(False) holds UNSHARDED gradients (N x), syncing every
    # micro-batch keeps them sharded; torch.nn.utils.clip_grad_norm_ on DTensor gradients returns
    # the whole model's norm; with the plain amp GradScaler an inf in ONE rank's shard is found on
    # EVERY rank (DTensor reduces found_inf over the mesh), so both skip the step.
    assert_sharded_run_claims(results, ddp_memory, reference)


def test_bad_options_fail_in_one_line():
    proc = run_cli([PYTHON, "-m", "recipes.fsdp2", "--reshard-after-forward", "maybe"], timeout_s=60)
    assert proc.returncode == 2
    assert "error: reshard_after_forward='maybe': use true, false, or a group size" in proc.stderr
    assert "Traceback" not in proc.stderr
    with pytest.raises(RecipeError, match="hsdp_replicas=2 does not divide world size 1"):
        run_alone(fsdp2.train, with_fields(CFG, hsdp_replicas=2))
    with pytest.raises(RecipeError, match="reshard_after_forward=2 does not divide the shard group size 1"):
        run_alone(fsdp2.train, with_fields(CFG, reshard_after_forward="2"))


@pytest.mark.slow
def test_three_ranks_uneven_shards_equal_ddp():
    """3 ranks: dim 0 of most parameters does not divide by 3, so shards are padded; still DDP's training."""
    reference = single_process_reference(steps=STEPS)
    for result in run_world(fsdp2.train, 3, [CFG, with_fields(CFG, explicit_prefetch=True)], deadline_s=300):
        assert_losses_close(result.losses, reference.losses, atol=1e-5)
        assert_states_close(result.final_state, reference.final_state, atol=1e-5)


def test_explicit_prefetch_gives_each_block_its_neighbours(monkeypatch):
    """Prefetch changes when the all-gathers run, not what they compute: the parity above cannot
    see it. So assert the order fully_shard was given, read back from each block's FSDP state
    (torch keeps it in _states_to_forward_prefetch / _states_to_backward_prefetch)."""
    seen = []
    real = fsdp2.apply_fully_shard

    def spy(model, mesh, **kwargs):
        model = real(model, mesh, **kwargs)
        states = [block._get_fsdp_state() for block in model.modules() if isinstance(block, Block)]
        index = {id(state): i for i, state in enumerate(states)}
        seen.append(([[index[id(t)] for t in state._states_to_forward_prefetch] for state in states],
                     [[index[id(t)] for t in state._states_to_backward_prefetch] for state in states]))
        return model

    monkeypatch.setattr(fsdp2, "apply_fully_shard", spy)
    for explicit in (True, False):  # the world of 1 in this process runs the same train()
        run_alone(fsdp2.train, with_fields(CFG, model="small", steps=1, explicit_prefetch=explicit))
    n = MODEL_PRESETS["small"].n_layers
    # Block i all-gathers block i+1 in forward; in backward (reverse order) block i+1 gathers i.
    forward = [[i + 1] for i in range(n - 1)] + [[]]
    backward = [[]] + [[i - 1] for i in range(1, n)]
    assert seen == [(forward, backward), ([[]] * n, [[]] * n)]
