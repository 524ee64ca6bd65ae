"""fsdp2: fully_shard trains like DDP with every option, and its calls, written out in the recipe,
do what recipes/parallelize.py's apply_fully_shard does.

The recipe is copyable (torch, recipes/toy.py, dist_setup.py and options.py) and returns its
losses; the harness (``prove``, through ``tests.helpers.fsdp2_result``) measures the rest from
outside: final weights, bytes per rank. Accumulation, fp16 loss scaling and clipping are not this
recipe's idea: tests/test_sharded_accumulation.py (set_requires_gradient_sync holds N x the
gradient bytes; equal to one process), tests/test_amp.py (one device) and
tests/test_grad_clipping.py (fully_shard layouts equal one process) assert theirs."""

import pytest
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Shard

from recipes import fsdp2, zero
from recipes.core.observe import Observer, prove
from recipes.parallelize import apply_fully_shard
from recipes.toy import MODEL_PRESETS, Block
from tests.helpers import (
    BACKENDS,
    PYTHON,
    assert_about_fraction,
    assert_losses_close,
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

STEPS = 4
# bf16 keeps 8 bits of mantissa (relative error 2^-8 = 0.4% per rounding): over 4 AdamW steps the
# losses stay within 1e-2 and the weights (about 0.1-1 in size, steps of lr=1e-3) within 2e-2.
BF16_ATOL = 2e-2
CFG = fsdp2.FSDP2Config(steps=STEPS, precision="fp32", timeout_s=120)

RUNS = {
    "default": CFG,
    "no_reshard": with_fields(CFG, reshard_after_forward=False),
    # CPU offload on a CPU world runs the offload code path (its tensors already live in host
    # memory).
    "prefetch_offload": with_fields(CFG, explicit_prefetch=True, cpu_offload=True),
    "bf16": with_fields(CFG, precision="bf16"),
}
FP32_EXACT = ["default", "no_reshard", "prefetch_offload"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_shard_equals_ddp_with_every_option(backend):
    pairs = [(fsdp2_result, with_fields(cfg, backend=backend)) for cfg in RUNS.values()]
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

    # MixedPrecisionPolicy's bf16 compute, fp32 reduction and fp32 master weights stay near fp32
    assert_losses_close(results["bf16"].losses, reference.losses, atol=BF16_ATOL / 2)
    assert_states_close(results["bf16"].final_state, reference.final_state, atol=BF16_ATOL)


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


class Layout(Observer):
    """What fully_shard made of the model, read once it is ready: every parameter's DTensor
    placements, local shape and mesh; every FSDP group's size, resharding and precision policy."""

    def model_ready(self, model, optimizer):
        super().model_ready(model, optimizer)
        self.extras["params"] = [
            (name, p.placements, tuple(p.to_local().shape), tuple(p.device_mesh.shape))
            for name, p in model.named_parameters()
        ]
        self.extras["groups"] = []
        for name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                resharded = group.post_forward_mesh_info is not None
                self.extras["groups"].append(
                    (name, len(group.fsdp_params), resharded, group.mp_policy)
                )


def sharded_both_ways(cfg):
    """fsdp2.train as written, then with its fully_shard calls handed to apply_fully_shard: the
    Blocks' calls deferred and the root's call given to apply_fully_shard with the same options.
    Returns (losses, parameter layouts, groups) of each, measured by the harness."""
    runs, inline, deferred = [], fsdp2.fully_shard, {}

    def composed(module, *, mesh, mp_policy, offload_policy, reshard_after_forward=None):
        if isinstance(module, Block):
            deferred["reshard_after_forward"] = reshard_after_forward
            return module
        return apply_fully_shard(
            module,
            mesh,
            block_types=(Block,),
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            **deferred,
        )

    for shard in (inline, composed):
        fsdp2.fully_shard = shard
        try:
            result = prove(fsdp2.train, cfg, name="fsdp2", observer=Layout(cfg.steps))
        finally:
            fsdp2.fully_shard = inline
        runs.append((result.losses, result.extras["params"], result.extras["groups"]))
    assert dist.get_world_size() == 2
    return runs


def test_the_recipes_fully_shard_calls_do_what_apply_fully_shard_does():
    """The recipe writes its fully_shard calls out (the lesson); the job and hybrid_parallel use
    parallelize.apply_fully_shard. Same groups, same shards per parameter, same losses."""
    configs = [CFG, with_fields(CFG, reshard_after_forward=False, precision="bf16")]
    for inline, composed in run_world(sharded_both_ways, 2, configs, deadline_s=300):
        assert inline == composed
        losses, params, groups = inline
        assert len(losses) == STEPS and all(p[1] == (Shard(0),) for p in params)
        n = MODEL_PRESETS[CFG.model].n_layers
        assert len(groups) == n + 1  # one per Block, then the root
