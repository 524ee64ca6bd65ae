"""Speed: compile (recipes/parallelize.py's apply_compile) and the harness's tokens/s and MFU
(recipes.core.throughput)"""

import pytest
import torch
import torch.nn as nn

from recipes import amp, ddp_torchrun, fsdp2, tensor_parallel
from recipes.core.throughput import PEAK_TFLOPS, Workload, flops_per_token, peak_flops
from recipes.core.workload import MODEL_PRESETS, Block, build_model
from recipes.parallelize import CompileTargetError, apply_compile
from tests.helpers import (
    assert_losses_close,
    assert_states_close,
    ddp_result,
    fsdp2_result,
    recipe_result,
    run_alone,
    run_world,
    tp_result,
    with_fields,
)


@pytest.mark.parametrize("preset", ["tiny", "small", "100m"])
def test_flops_per_token_is_six_times_every_matmul_parameter_plus_attention(preset):
    cfg = MODEL_PRESETS[preset]
    model = build_model(cfg) if preset != "100m" else None
    if (
        model is not None
    ):  # the formula's matmul parameters are exactly the model's nn.Linear weights
        matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        attention = 12 * cfg.n_layers * cfg.dim * cfg.seq_len
        assert flops_per_token(cfg) == 6 * matmul_params + attention
    if preset == "100m":  # the figure issue #9's MFU column was computed with (641 MFLOP per token)
        assert round(flops_per_token(cfg) / 1e6) == 642


def test_mfu_is_null_on_cpu_and_uses_the_device_peak_on_a_gpu(monkeypatch):
    workload = Workload(MODEL_PRESETS["100m"], global_batch_size=32, precision="bf16")
    on_cpu = workload.measure(0.0369, torch.device("cpu"), devices=1)
    assert on_cpu["mfu"] is None and on_cpu["tokens_per_second"] == pytest.approx(32 * 512 / 0.0369)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    gpu = torch.device("cuda", 0)
    assert peak_flops(gpu, "bf16") == PEAK_TFLOPS["H200"]["bf16"] * 1e12
    on_h200 = workload.measure(0.0369, gpu, devices=1)
    # issue #9 measured 36.9 ms a step (bf16 + fused) as 28.8% MFU against 989 TFLOP/s
    assert on_h200["mfu"] == pytest.approx(0.288, abs=0.001)
    assert workload.measure(0.0369, gpu, devices=2)["mfu"] == pytest.approx(on_h200["mfu"] / 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert workload.measure(0.0369, gpu, devices=1)["mfu"] is None  # never a made-up peak


def test_a_result_reports_tokens_per_second_from_its_step_time():
    # gloo: on CPU, where no peak is known, on every machine (an H200 has an fp32 peak: MFU is a
    # number)
    cfg = ddp_torchrun.DDPConfig(steps=3, precision="fp32", backend="gloo")
    result = run_alone(ddp_result, cfg)
    tokens_per_step = 12 * MODEL_PRESETS["tiny"].seq_len  # the default global batch, 12 sequences
    assert result.precision == "fp32" and result.mfu is None
    assert result.tokens_per_second == pytest.approx(tokens_per_step / result.seconds_per_step)
    assert result.model_tflops == pytest.approx(
        result.tokens_per_second * flops_per_token(MODEL_PRESETS["tiny"]) / 1e12
    )


def test_apply_compile_keeps_names_and_refuses_a_model_without_the_block():
    model = build_model("tiny")
    names = [name for name, _ in model.named_parameters()]
    apply_compile(model, block_types=(Block,), backend="eager")
    assert [name for name, _ in model.named_parameters()] == names  # checkpoints stay loadable
    with pytest.raises(
        CompileTargetError,
        match=r"matched no block in Sequential; its module classes are: Linear, "
        r"Sequential; pass block_types",
    ):
        apply_compile(nn.Sequential(nn.Linear(2, 2)), block_types=(Block,))
    with pytest.raises(CompileTargetError, match="exactly one of block_types"):
        apply_compile(model)


# Compiled runs use the aot_eager backend: it traces forward and backward through AOTAutograd as
# inductor does, without generating C++ (CI may have no compiler; inductor adds ~40 s per model).
COMPILED = dict(
    compile=True, compile_backend="aot_eager", steps=2, keep_final_state=True, precision="fp32"
)


def train_with(recipe_and_config):
    train, cfg = recipe_and_config
    return train(cfg)


# slow: inductor compiles the sharded blocks on two ranks, 10 s of CPU, which the default suite's
# 4 minutes on 2 cores no longer had room for once every recipe ran as a copy too. CI runs it
# (the slow set); the default run keeps compile's parity in one process
# (test_compile_keeps_the_bare_loop_equal_and_contradictions_are_refused).
@pytest.mark.slow
def test_compile_keeps_sharded_training_equal_on_fsdp2_and_tp():
    # Two ranks, where compiling meets the sharding: fully_shard's hooks around the compiled
    # forward, and DTensor ops traced inside it. (DDP and amp compile in one process below:
    # cheaper.)
    configs = []
    # fsdp2 and tensor_parallel are copyable: the harness keeps their final state
    # (fsdp2_result, tp_result), not their configs
    without_state = {k: v for k, v in COMPILED.items() if k != "keep_final_state"}
    for train, eager in (
        (fsdp2_result, fsdp2.FSDP2Config(**{**without_state, "compile": False})),
        (tp_result, tensor_parallel.TPConfig(**{**without_state, "compile": False})),
    ):
        configs += [(train, eager), (train, with_fields(eager, compile=True))]
    results = run_world(train_with, 2, configs, deadline_s=170)
    for eager, compiled in zip(results[::2], results[1::2]):
        assert compiled.recipe == eager.recipe
        # measured difference: 0 on torch 2.13 (aot_eager runs the same aten kernels)
        assert_losses_close(compiled.losses, eager.losses, atol=1e-6)
        assert_states_close(compiled.final_state, eager.final_state, atol=1e-6)


def test_compile_keeps_ddp_and_amp_bf16_equal():
    for train, cfg in (
        (
            ddp_result,
            ddp_torchrun.DDPConfig(
                **{k: v for k, v in COMPILED.items() if k != "keep_final_state"}, backend="gloo"
            ),
        ),
        (
            recipe_result,
            amp.AMPConfig(
                **{k: v for k, v in COMPILED.items() if k not in ("keep_final_state", "precision")},
                precision="bf16",
                device="cpu",
            ),
        ),
    ):
        eager, compiled = run_alone(train, with_fields(cfg, compile=False)), run_alone(train, cfg)
        assert_losses_close(compiled.losses, eager.losses, atol=1e-6)
        assert_states_close(compiled.final_state, eager.final_state, atol=1e-6)


def performance_config(**fields):
    # copyable: the harness keeps the final state (recipe_result), not the config
    from recipes import performance

    return performance.PerformanceConfig(
        **{k: v for k, v in COMPILED.items() if k != "keep_final_state"}, device="cpu", **fields
    )


def assert_compiling_changes_nothing(compiled_cfg, eager_cfg) -> None:
    eager, compiled = run_alone(recipe_result, eager_cfg), run_alone(recipe_result, compiled_cfg)
    # the harness looks at the blocks: it says whether the compiled run really compiled
    assert compiled.extras["compiled"] is True and eager.extras["compiled"] is False
    assert_losses_close(compiled.losses, eager.losses, atol=1e-6)
    assert_states_close(compiled.final_state, eager.final_state, atol=1e-6)


def test_compile_keeps_the_bare_loop_equal_and_contradictions_are_refused():
    """Issue 25's compile path in the bare loop, the blocks and the loss compiled, against its
    eager run: it must change the speed, never the numbers."""
    perf = performance_config()
    assert_compiling_changes_nothing(perf, with_fields(perf, compile=False))
    # contradictions are refused by the config itself, before any training
    with pytest.raises(ValueError, match="compile_scope model needs compile"):
        with_fields(perf, compile=False, compile_scope="model")
    with pytest.raises(ValueError, match="compile_mode reduce-overhead needs compile_scope model"):
        with_fields(perf, compile_mode="reduce-overhead")


# Slow (issue 30, the default run's budget): two more compiles, ~7 CPU s of the 11 the three
# took together. The default run keeps compile's parity in the bare loop (above), under DDP and
# under amp's bf16 (test_compile_keeps_ddp_and_amp_bf16_equal); CI runs these two.
@pytest.mark.slow
def test_whole_model_scope_and_checkpointing_under_compile_keep_training_equal():
    """The whole forward and loss as one graph, and op-level selective checkpointing traced
    with its policy, each against its eager run."""
    from recipes import activation_checkpointing

    perf = performance_config(compile_scope="model")
    assert_compiling_changes_nothing(perf, with_fields(perf, compile=False, compile_scope="blocks"))
    # the copyable recipe, measured by the harness (recipe_result): the blocks tell it "compiled"
    checkpointed = activation_checkpointing.ACConfig(
        **{k: v for k, v in COMPILED.items() if k != "keep_final_state"},
        model="tiny",
        mode="op_selective",
        device="cpu",
    )
    assert_compiling_changes_nothing(checkpointed, with_fields(checkpointed, compile=False))


# In the slow set (CI runs it), for the default run's budget (issue 30): two TP runs and a compile
# on CPU, ~6 CPU s. Compile's parity stays in the default run (the two tests above).
@pytest.mark.slow
def test_tensor_parallel_compiles_by_default_on_a_gpu_only():
    """On CPU the default stays eager; --compile turns it on, and the result says which ran (the
    harness looks at the blocks). On a GPU (where there is one) the default compiles and --eager is
    the way out of it (recipes/tensor_parallel.py says why)."""
    cfg = tensor_parallel.TPConfig(steps=1, precision="fp32", backend="gloo")
    assert run_alone(tp_result, cfg).extras["compiled"] is False
    compiled = run_alone(tp_result, with_fields(cfg, compile=True, compile_backend="aot_eager"))
    assert compiled.extras["compiled"] is True
    if torch.cuda.is_available():
        on_gpu = with_fields(cfg, backend="nccl", compile_backend="aot_eager")
        assert run_alone(tp_result, on_gpu).extras["compiled"] is True
        assert run_alone(tp_result, with_fields(on_gpu, eager=True)).extras["compiled"] is False
