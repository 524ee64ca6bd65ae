"""fsdp2: fully_shard trains like DDP with every option; its pitfalls (fp16, clipping, no_sync) are
guarded.

The recipe is copyable (torch, recipes/toy.py, dist_setup.py and parallelize.py) and returns its
losses; the harness (``prove``, through ``tests.helpers.fsdp2_result``) measures the rest from
outside: final weights, bytes per rank, the last forward's bytes, clipped norms, skipped steps. The
fp16 fault (an inf in one rank's gradient shard) is injected from here, through an observer."""

import math

import pytest
import torch
import torch.distributed as dist

from recipes import fsdp2, zero
from recipes.core.observe import Observer, ShardedObserver, prove
from recipes.core.state import all_ranks
from recipes.toy import MODEL_PRESETS, Block
from tests.helpers import (
    BACKENDS,
    PYTHON,
    SHARDED_BF16_ATOL,
    SHARDED_CLIP,
    SHARDED_INJECT_STEP,
    SHARDED_STEPS,
    assert_about_fraction,
    assert_losses_close,
    assert_sharded_run_claims,
    assert_states_close,
    fsdp2_result,
    recipe_result,
    run_alone,
    run_cli,
    run_pair,
    run_world,
    single_process_reference,
    with_fields,
)

# Shared with tests/test_fsdp.py (assert_sharded_run_claims), which says why these values.
STEPS, CLIP, BF16_ATOL, INJECT_STEP = (
    SHARDED_STEPS,
    SHARDED_CLIP,
    SHARDED_BF16_ATOL,
    SHARDED_INJECT_STEP,
)
INJECT_RANK = 1
CFG = fsdp2.FSDP2Config(steps=STEPS, precision="fp32", timeout_s=120)


class InfOnOneRank(ShardedObserver):
    """The fp16 overflow that one rank sees, injected from the test: at INJECT_STEP, rank 1 puts an
    inf into its own shard of the first parameter's gradient. The hook is the one fully_shard
    calls on a sharded parameter once its reduce-scatter has landed: after backward, before the
    recipe's ``scaler.unscale_``. Also reads each rank's final loss scale from the recipe's own
    GradScaler (``scalers``: see ``fp16_with_an_inf_on_one_rank``)."""

    def __init__(self, cfg, scalers: list):
        super().__init__(cfg, keep_final_state=True)
        self.scalers = scalers

    def model_ready(self, model, optimizer):
        super().model_ready(model, optimizer)
        first = next(p for p in model.parameters() if p.to_local().numel())
        first.register_post_accumulate_grad_hook(self.inject)

    def inject(self, param):
        if len(self.durations) == INJECT_STEP and dist.get_rank() == INJECT_RANK:
            param.grad.to_local().view(-1)[0] = math.inf

    def measure(self, step):
        if step == self.steps - 1:  # after scaler.update(): the scale the next step would use
            self.extras["loss_scale_per_rank"] = all_ranks(self.scalers[-1].get_scale())
        super().measure(step)


def fp16_with_an_inf_on_one_rank(cfg):
    """fsdp2 in fp16 under InfOnOneRank. The recipe's GradScaler is caught as it is made:
    torch.amp.GradScaler is a recording subclass for the run (this rank's process only)."""
    scalers, real = [], torch.amp.GradScaler

    class Recorded(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            scalers.append(self)

    torch.amp.GradScaler = Recorded
    try:
        return prove(fsdp2.train, cfg, name="fsdp2", observer=InfOnOneRank(cfg, scalers))
    finally:
        torch.amp.GradScaler = real


RUNS = {
    "default": CFG,
    "no_reshard": with_fields(CFG, reshard_after_forward=False),
    # CPU offload on a CPU world runs the offload code path (its tensors already live in host
    # memory).
    "prefetch_offload": with_fields(CFG, explicit_prefetch=True, cpu_offload=True),
    "accumulate_sync": with_fields(CFG, micro_batches=3),
    "accumulate_no_sync": with_fields(CFG, micro_batches=3, accumulation="no_sync"),
    "clipped": with_fields(CFG, max_grad_norm=CLIP),
    "bf16": with_fields(CFG, precision="bf16"),
    "fp16": with_fields(CFG, precision="fp16"),
}
FP32_EXACT = ["default", "no_reshard", "prefetch_offload", "accumulate_sync", "accumulate_no_sync"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_shard_equals_ddp_with_every_option(backend):
    pairs = [
        (
            fp16_with_an_inf_on_one_rank if name == "fp16" else fsdp2_result,
            with_fields(cfg, backend=backend),
        )
        for name, cfg in RUNS.items()
    ]
    pairs.append(
        (recipe_result, zero.ZeroConfig(optimizer="adamw", steps=STEPS, backend=backend))
    )  # DDP's bytes
    *outputs, ddp = run_world(run_pair, 2, pairs, backend=backend, deadline_s=300)
    results = dict(zip(RUNS, outputs))
    reference = single_process_reference(steps=STEPS)

    for name in FP32_EXACT:
        assert_losses_close(results[name].losses, reference.losses, atol=1e-5)
        assert_states_close(results[name].final_state, reference.final_state, atol=1e-5)
        assert results[name].param_checksum == pytest.approx(reference.param_checksum, abs=1e-3), (
            name
        )

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
    proc = run_cli(
        [PYTHON, "-m", "recipes.fsdp2", "--reshard-after-forward", "maybe"], timeout_s=60
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    assert "reshard_after_forward='maybe': use true, false, or a group size" in errors[0]
    assert "Traceback" not in proc.stderr
    with pytest.raises(ValueError, match="hsdp_replicas=2 does not divide world size 1"):
        run_alone(fsdp2.train, with_fields(CFG, hsdp_replicas=2))
    with pytest.raises(
        ValueError, match="reshard_after_forward=2 does not divide the shard group size 1"
    ):
        run_alone(fsdp2.train, with_fields(CFG, reshard_after_forward=2))


@pytest.mark.slow
def test_three_ranks_uneven_shards_equal_ddp():
    """3 ranks: dim 0 of most parameters does not divide by 3, so shards are padded; still DDP's
    training."""
    reference = single_process_reference(steps=STEPS)
    for result in run_world(
        fsdp2_result, 3, [CFG, with_fields(CFG, explicit_prefetch=True)], deadline_s=300
    ):
        assert_losses_close(result.losses, reference.losses, atol=1e-5)
        assert_states_close(result.final_state, reference.final_state, atol=1e-5)


class PrefetchOrder(Observer):
    """Reads, once the model is ready, the prefetch order fully_shard was given, from each block's
    FSDP state (torch keeps it in _states_to_forward_prefetch / _states_to_backward_prefetch), as
    block indices."""

    def model_ready(self, model, optimizer):
        super().model_ready(model, optimizer)
        states = [block._get_fsdp_state() for block in model.modules() if isinstance(block, Block)]
        index = {id(state): i for i, state in enumerate(states)}
        self.extras["prefetch"] = (
            [[index[id(t)] for t in state._states_to_forward_prefetch] for state in states],
            [[index[id(t)] for t in state._states_to_backward_prefetch] for state in states],
        )


def test_explicit_prefetch_gives_each_block_its_neighbours():
    """Prefetch changes when the all-gathers run, not what they compute: the parity above cannot
    see it. So assert the order fully_shard was given, read back from the model the recipe
    built."""
    seen = []
    for explicit in (True, False):  # the world of 1 in this process runs the same train()
        cfg = with_fields(CFG, model="small", steps=1, explicit_prefetch=explicit)
        seen.append(
            prove(fsdp2.train, cfg, name="fsdp2", observer=PrefetchOrder(cfg.steps)).extras[
                "prefetch"
            ]
        )
    n = MODEL_PRESETS["small"].n_layers
    # Block i all-gathers block i+1 in forward; in backward (reverse order) block i+1 gathers i.
    forward = [[i + 1] for i in range(n - 1)] + [[]]
    backward = [[]] + [[i - 1] for i in range(1, n)]
    assert seen == [(forward, backward), ([[]] * n, [[]] * n)]
