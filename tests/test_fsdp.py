"""fsdp: every classic-FSDP strategy and option trains like DDP; its pitfalls are real and guarded.

The recipe is copyable (torch, recipes/toy.py, dist_setup.py and parallelize.py) and returns its
losses; the harness (``prove``, with ``recipes.core.observe.ClassicFSDPObserver``) measures the rest
from outside: final weights, bytes per rank, the last forward's bytes, clipped norms, skipped
steps. The fp16 fault (an inf in one rank's gradient shard) is injected from here, through the
recipe's own loss scaler. Accumulation and clipping are other recipes' lessons; what the recipe's
docstring says of them under classic FSDP (``no_sync`` holds unsharded gradients,
``model.clip_grad_norm_`` is the whole model's norm) is checked here on its ``wrap_with_fsdp``."""

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import BackwardPrefetch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from recipes import fsdp, zero
from recipes.core.memory import model_state_bytes
from recipes.core.observe import ClassicFSDPObserver, Observer, prove
from recipes.core.state import all_ranks, full_state_on_rank0
from recipes.core.workload import Block, build_model, lm_loss, make_dataset
from recipes.core.world import join_world
from recipes.parallelize import apply_fsdp
from tests.helpers import (
    BACKENDS,
    CUDA_DEVICES,
    PYTHON,
    assert_about_fraction,
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

STEPS = 4
CLIP = 0.25  # half the tiny model's first gradient norm (about 0.5): the step clips
# bf16 keeps 8 bits of mantissa (relative error 2^-8 = 0.4% per rounding): over 4 AdamW steps the
# losses stay within 1e-2 and the weights (about 0.1-1 in size, steps of lr=1e-3) within 2e-2.
BF16_ATOL = 2e-2
INJECT_STEP, INJECT_RANK = 2, 1
CFG = fsdp.FSDPConfig(steps=STEPS, precision="fp32", timeout_s=120)


def fsdp_result(cfg, observer=None):
    """recipes.fsdp.train(cfg) measured by the harness, with the final state gathered to rank 0.
    Module-level: spawn_world can pickle it."""
    return prove(fsdp.train, cfg, name="fsdp", keep_final_state=True, observer=observer)


class LossScaleObserver(ClassicFSDPObserver):
    """Reads each rank's final loss scale from the recipe's own scaler (``scalers``: caught as it
    is made, see ``fp16_with_an_inf_on_one_rank``), after its last ``update()``."""

    def __init__(self, cfg, scalers: list):
        super().__init__(cfg, keep_final_state=True)
        self.scalers = scalers

    def measure(self, step):
        if step == self.steps - 1:  # after scaler.update(): the scale the next step would use
            self.extras["loss_scale_per_rank"] = all_ranks(self.scalers[-1].get_scale())
        super().measure(step)


def fp16_with_an_inf_on_one_rank(cfg):
    """fsdp in fp16, with the fp16 overflow that one rank sees injected from the test: both of the
    recipe's scaler classes (``fsdp.ShardedGradScaler``, ``torch.amp.GradScaler``) are recording
    subclasses for the run (this rank's process only) that, at INJECT_STEP on rank INJECT_RANK,
    first put an inf into that rank's first non-empty gradient shard: after the step's backward
    (and its reduce-scatter), as the scaler looks for infs (in ``unscale_``, or in
    ``_check_inf_per_device``, where ``step`` looks for a fused optimizer)."""
    scalers, real = [], (fsdp.ShardedGradScaler, torch.amp.GradScaler)

    def recording(base):
        class Recorded(base):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.unscaled = 0
                scalers.append(self)

            def inject(self, optimizer):
                if self.unscaled == INJECT_STEP and dist.get_rank() == INJECT_RANK:
                    grad = next(
                        p.grad
                        for group in optimizer.param_groups
                        for p in group["params"]
                        if p.grad is not None and p.grad.numel()
                    )
                    grad.view(-1)[0] = math.inf
                self.unscaled += 1

            def unscale_(self, optimizer):
                self.inject(optimizer)
                return super().unscale_(optimizer)

            def _check_inf_per_device(self, optimizer):
                self.inject(optimizer)
                return super()._check_inf_per_device(optimizer)

        return Recorded

    fsdp.ShardedGradScaler, torch.amp.GradScaler = (recording(base) for base in real)
    try:
        return fsdp_result(cfg, observer=LossScaleObserver(cfg, scalers))
    finally:
        fsdp.ShardedGradScaler, torch.amp.GradScaler = real


def fp16_fused_with_an_inf_on_one_rank(cfg):
    """The same with the recipe's AdamW forced fused (what CUDA would pick; CPU has the kernel
    too). A fused optimizer's ``scaler.step`` looks for infs itself, without ShardedGradScaler's
    all-reduce of found_inf: the reason the recipe keeps a foreach AdamW in fp16."""
    real = torch.optim.AdamW

    class FusedAdamW(real):
        def __init__(self, params, **kwargs):
            super().__init__(params, **{**kwargs, "fused": True})

    torch.optim.AdamW = FusedAdamW  # in this rank's process only
    try:
        return fp16_with_an_inf_on_one_rank(cfg)
    finally:
        torch.optim.AdamW = real


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
    "prefetch": with_fields(
        CFG, backward_prefetch="post", forward_prefetch=True, limit_all_gathers=False
    ),
    "prefetch_none": with_fields(CFG, backward_prefetch="none", sync_module_states=False),
    "bf16": with_fields(CFG, precision="bf16"),
    # both with an inf in rank 1's shard at INJECT_STEP (fp16_with_an_inf_on_one_rank)
    "fp16": with_fields(CFG, precision="fp16"),
    "fp16_amp_scaler": with_fields(CFG, precision="fp16", grad_scaler="amp"),
    "fp16_fused": with_fields(CFG, precision="fp16"),
}
RUNNERS = {
    "fp16": fp16_with_an_inf_on_one_rank,
    "fp16_amp_scaler": fp16_with_an_inf_on_one_rank,
    "fp16_fused": fp16_fused_with_an_inf_on_one_rank,
}
FP32_EXACT = [
    "full",
    "shard_grad_op",
    "no_shard",
    "hybrid_one_rank_per_node",
    "checkpointed",
    "wrap_size",
    "wrap_module",
    "wrap_none",
    "prefetch",
    "prefetch_none",
]


def sync_module_states_check(_cfg):
    """Each rank builds a DIFFERENT model (seed = rank): apply_fsdp must leave everyone with rank
    0's."""
    with join_world("gloo") as world:
        model = apply_fsdp(
            build_model("tiny", seed=world.rank),
            device=world.device,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
        )
        state, _ = full_state_on_rank0(model)
        return state


def accumulation_and_clipping(_cfg):
    """Classic FSDP's own calls for two other recipes' ideas, on the recipe's wrap: the gradient
    bytes a rank holds after a micro-batch's backward, synced or in ``no_sync()``; then, on a
    fresh wrap, torch's ``clip_grad_norm_`` (this rank's shard) and FSDP's (the whole model's),
    and the weights after one SGD step with FSDP's clipped gradients (on rank 0)."""
    with join_world("gloo") as world:
        inputs, targets = global_batch()
        share = CFG.global_batch_size // world.world_size
        mine = slice(world.rank * share, (world.rank + 1) * share)

        def wrapped():
            return fsdp.wrap_with_fsdp(
                build_model("tiny", seed=0),
                CFG,
                precision="fp32",
                device=world.device,
                world_size=world.world_size,
            )

        held = {}
        for accumulation in ("sync", "no_sync"):
            model = wrapped()
            with model.no_sync() if accumulation == "no_sync" else contextlib.nullcontext():
                lm_loss(model(inputs[mine]), targets[mine]).backward()
            held[accumulation] = model_state_bytes(model)["grad_bytes"]
        model = wrapped()
        lm_loss(model(inputs[mine]), targets[mine]).backward()
        shard_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)  # scales by 1
        total_norm = model.clip_grad_norm_(CLIP)
        torch.optim.SGD(model.parameters(), lr=1.0).step()
        state, _ = full_state_on_rank0(model)
        return held, all_ranks(float(total_norm)), all_ranks(float(shard_norm)), state


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The first CFG.global_batch_size sequences of the recipe's dataset."""
    dataset = make_dataset("tiny", CFG.global_batch_size, seed=CFG.seed)
    return next(iter(torch.utils.data.DataLoader(dataset, batch_size=CFG.global_batch_size)))


def one_process_clipped_step() -> tuple[float, dict]:
    """The same step in one process: the norm torch's clip_grad_norm_ reports, the weights."""
    inputs, targets = global_batch()
    model = build_model("tiny", seed=0)
    lm_loss(model(inputs), targets).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return float(norm), {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_strategy_and_option_equals_ddp_on_two_ranks(backend):
    runs, exact = dict(RUNS), list(FP32_EXACT)
    if backend == "nccl":  # CPU offload pins host memory: it needs a GPU
        runs["cpu_offload"] = with_fields(CFG, cpu_offload=True)
        exact.append("cpu_offload")
    pairs = [
        (
            RUNNERS.get(name, fsdp_result),
            with_fields(cfg, backend=backend),
        )
        for name, cfg in runs.items()
    ]
    pairs += [
        (
            recipe_result,
            zero.ZeroConfig(optimizer="adamw", steps=STEPS, backend=backend),
        ),  # DDP's bytes
        (sync_module_states_check, None),
        (accumulation_and_clipping, None),
    ]
    *outputs, ddp, synced, calls = run_world(run_pair, 2, pairs, backend=backend, deadline_s=300)
    results = dict(zip(runs, outputs))
    reference = single_process_reference(steps=STEPS)

    # Parity: every fp32 strategy, wrap policy, prefetch setting and accumulation mode is DDP's
    # training.
    for name in exact:
        assert_losses_close(results[name].losses, reference.losses, atol=1e-5)
        assert_states_close(results[name].final_state, reference.final_state, atol=1e-5)
        # The checksum comes from the gathered FULL parameters: the same number for every strategy.
        assert results[name].param_checksum == pytest.approx(reference.param_checksum, abs=1e-3), (
            name
        )
    # Activation checkpointing recomputes the same forward: bit-identical weights, not merely close.
    assert_states_close(results["checkpointed"].final_state, results["full"].final_state, atol=0.0)
    # sync_module_states: ranks that initialised differently all train rank 0's weights.
    assert_states_close(
        synced,
        {k: v.detach() for k, v in build_model("tiny", seed=0).state_dict().items()},
        atol=0.0,
    )

    # Memory on 2 ranks, against DDP's bytes (tests/test_memory.py does 4 ranks and explains the
    # slack).
    ddp_memory = ddp.extras["memory_per_rank"][0]
    for name in ("full", "shard_grad_op"):
        for memory in results[name].extras["memory_per_rank"]:
            for key in ddp_memory:
                assert_about_fraction(memory[key], ddp_memory[key], 2, f"{name} {key}")
    assert (
        results["no_shard"].extras["memory_per_rank"][0]["grad_bytes"] == ddp_memory["grad_bytes"]
    )

    # no_sync holds UNSHARDED gradients (N x) while syncing every micro-batch keeps them sharded.
    held, total_norms, shard_norms, clipped_state = calls
    assert_about_fraction(held["sync"], ddp_memory["grad_bytes"], 2, "synced micro-batch")
    assert held["no_sync"] >= 0.9 * 2 * held["sync"] and held["no_sync"] >= ddp_memory["grad_bytes"]
    # FSDP.clip_grad_norm_ returns the whole model's norm, on every rank, and clips by it; torch's
    # function on a rank's shard returns that shard's norm, less than the whole.
    norm, one_process_state = one_process_clipped_step()
    assert norm > CLIP, "the step must clip"
    assert total_norms == pytest.approx([norm, norm], rel=1e-5)
    assert all(shard_norm < 0.99 * norm for shard_norm in shard_norms), shard_norms
    assert_states_close(clipped_state, one_process_state, atol=1e-5)

    # bf16 computes in bf16 and reduces in fp32.
    assert_losses_close(results["bf16"].losses, reference.losses, atol=BF16_ATOL / 2)
    assert_states_close(results["bf16"].final_state, reference.final_state, atol=BF16_ATOL)
    # With ShardedGradScaler an inf in ONE rank's shard makes EVERY rank skip that step and halve
    # its scale (2^16 once halved).
    fp16 = results["fp16"].extras
    assert fp16["skipped_steps_per_rank"] == [[INJECT_STEP], [INJECT_STEP]]
    assert fp16["loss_scale_per_rank"] == [2.0**15, 2.0**15]
    until = INJECT_STEP + 1
    assert_losses_close(results["fp16"].losses[:until], reference.losses[:until], atol=BF16_ATOL)
    # With the plain amp GradScaler, or with a fused AdamW (whose step() checks for infs without
    # the sharded scaler's all-reduce), only the injecting rank (1) notices: the ranks take
    # different decisions and the model's shards are no longer one consistent model.
    for name in ("fp16_amp_scaler", "fp16_fused"):
        wrong = results[name].extras
        assert wrong["skipped_steps_per_rank"] == [[], [INJECT_STEP]], name
        assert wrong["loss_scale_per_rank"] == [2.0**16, 2.0**15], name


def test_bad_options_fail_in_one_line():
    proc = run_cli([PYTHON, "-m", "recipes.fsdp", "--sharding-strategy", "zero3"], timeout_s=60)
    assert proc.returncode == 2
    assert "invalid choice: 'zero3'" in proc.stderr and "Traceback" not in proc.stderr
    # refused by the config itself, from code as from the command line (recipes/options.py)
    with pytest.raises(
        ValueError, match="wrap_policy must be one of block, size, module, none, got 'layer'"
    ):
        run_alone(fsdp.train, with_fields(CFG, wrap_policy="layer"))
    with pytest.raises(
        ValueError, match="hybrid: world size 1 is not a multiple of ranks_per_node=2"
    ):
        run_alone(fsdp.train, with_fields(CFG, sharding_strategy="hybrid", ranks_per_node=2))


@pytest.mark.skipif(
    CUDA_DEVICES > 0, reason="on a GPU host cpu_offload is valid (the NCCL run above covers it)"
)
def test_cpu_offload_on_a_cpu_only_world_says_why_it_cannot_run():
    with pytest.raises(ValueError, match="^cpu_offload needs a GPU"):
        run_alone(fsdp.train, with_fields(CFG, cpu_offload=True))
    # From the command line: refused by the config, argparse's usage and one line.
    proc = run_cli(
        [PYTHON, "-m", "recipes.fsdp", "--cpu-offload", "--backend", "gloo"], timeout_s=60
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "error: cpu_offload needs a GPU: " in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_three_ranks_uneven_shards_equal_ddp():
    """3 ranks: flat parameters do not divide by 3, so shards are padded; the training is still
    DDP's."""
    reference = single_process_reference(steps=STEPS)
    configs = [
        CFG,
        with_fields(CFG, sharding_strategy="shard_grad_op"),
        with_fields(CFG, activation_checkpointing=True),
    ]
    for result in run_world(fsdp_result, 3, configs, deadline_s=300):
        assert_losses_close(result.losses, reference.losses, atol=1e-5)
        assert_states_close(result.final_state, reference.final_state, atol=1e-5)


class UnitOptions(Observer):
    """The prefetch options of every FSDP unit of the model the recipe built, read once ready."""

    def model_ready(self, model, optimizer):
        super().model_ready(model, optimizer)
        self.extras["units"] = {
            (unit.backward_prefetch, unit.forward_prefetch, unit.limit_all_gathers)
            for unit in FSDP.fsdp_modules(model)
        }


# A world of 1 on purpose (what is asserted is each unit's options): FSDP says it shards nothing.
@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`:UserWarning")
def test_prefetch_options_reach_every_unit():
    """Prefetch changes when the all-gathers run, not what they compute: the parity above cannot
    see it. So assert that every FSDP unit train() builds holds the options it was given."""
    seen = []
    for name in ("prefetch", "prefetch_none", "full"):  # the world of 1 in this process
        cfg = with_fields(RUNS[name], steps=1)
        result = prove(fsdp.train, cfg, name="fsdp", observer=UnitOptions(cfg.steps))
        seen.append(result.extras["units"])
    assert seen == [
        {(BackwardPrefetch.BACKWARD_POST, True, False)},  # every unit, root included
        {(None, False, True)},
        {(BackwardPrefetch.BACKWARD_PRE, False, True)},
    ]
