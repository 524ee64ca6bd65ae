"""memory_estimate: the ZeRO paper's formulas, its own example, and bytes measured on a real 2-rank
world."""

import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from recipes.core.memory import model_state_bytes
from recipes.core.workload import Block, build_model, lm_loss, make_dataset
from recipes.core.world import join_world
from recipes.memory_estimate import (
    LAYOUTS,
    MODEL_PRESETS,
    EstimateConfig,
    EstimateError,
    activation_bytes,
    estimate,
    gpu_memory,
    main,
    make_parser,
    model_state_per_rank,
)
from recipes.parallelize import apply_fsdp, apply_fully_shard
from tests.helpers import PYTHON, last_json, run_cli, spawn_world

GB = 1e9


def _row(result, optimizer, stage, offload=False):
    (row,) = [
        r
        for r in result["rows"]
        if (r["optimizer"], r["stage"], r["offload"]) == (optimizer, stage, offload)
    ]
    return row


def test_the_papers_example_7_5b_params_on_64_ranks():
    # ZeRO paper, Figure 1 / section 5: Psi = 7.5B, N = 64, K = 12 (mixed-precision Adam).
    result = estimate(EstimateConfig(params=7.5e9, world_size=64, optimizer="adam-mixed"))
    device_gb = {
        stage: _row(result, "adam-mixed", stage)["device"]["total_bytes"] / GB
        for stage in ("ddp", "zero1", "zero2", "zero3")
    }
    assert device_gb["ddp"] == pytest.approx(120.0)
    assert round(device_gb["zero1"], 1) == 31.4
    assert round(device_gb["zero2"], 1) == 16.6
    assert round(device_gb["zero3"], 1) == 1.9
    # The exact values behind the paper's rounding: (2+2)Psi + 12Psi/64, 2Psi + 14Psi/64, 16Psi/64.
    assert device_gb["zero1"] == pytest.approx(31.40625)
    assert device_gb["zero2"] == pytest.approx(16.640625)
    assert device_gb["zero3"] == pytest.approx(1.875)


@pytest.mark.parametrize("layout_name", ["adam-mixed", "adam-fp32"])
@pytest.mark.parametrize("world_size", [1, 8, 64])
def test_formulas_of_each_stage(layout_name, world_size):
    psi, n, layout = 1e9, world_size, LAYOUTS[layout_name]
    p, g, k = layout.param_bytes, layout.grad_bytes, layout.optimizer_bytes
    assert p + g + k == 16, "Adam is 16 bytes per parameter in both layouts"
    expected = {
        "ddp": (p + g + k) * psi,
        "zero1": (p + g) * psi + k * psi / n,
        "zero2": p * psi + (g + k) * psi / n,
        "zero3": (p + g + k) * psi / n,
    }
    for stage, total in expected.items():
        figures = model_state_per_rank(psi, n, stage, layout)
        assert figures["device"]["total_bytes"] == pytest.approx(total)
        assert figures["host"]["total_bytes"] == 0
        if stage == "ddp":
            continue
        # Offload moves exactly the sharded parts to the host; the sum is unchanged.
        offloaded = model_state_per_rank(psi, n, stage, layout, offload=True)
        assert offloaded["device"]["total_bytes"] + offloaded["host"][
            "total_bytes"
        ] == pytest.approx(total)
        replicated = {"zero1": (p + g) * psi, "zero2": p * psi, "zero3": 0.0}[stage]
        assert offloaded["device"]["total_bytes"] == pytest.approx(replicated)
    if world_size == 1:  # one rank: sharding saves nothing
        assert (
            len(
                {
                    round(model_state_per_rank(psi, 1, s, layout)["device"]["total_bytes"])
                    for s in expected
                }
            )
            == 1
        )


def test_ddp_has_no_offload_row_and_bad_input_is_refused():
    with pytest.raises(EstimateError, match="DDP has no CPU offload"):
        model_state_per_rank(1e9, 8, "ddp", LAYOUTS["adam-fp32"], offload=True)
    with pytest.raises(EstimateError, match="world_size must be a whole number >= 1, got 0"):
        EstimateConfig(world_size=0)
    with pytest.raises(EstimateError, match="world_size must be a whole number >= 1, got 2.5"):
        EstimateConfig(world_size=2.5)
    for params in (-1.0, 0.0, float("nan"), float("inf")):  # nan, inf: once a table of nan
        message = rf"^params must be a finite number > 0, got {params!r}$"
        with pytest.raises(EstimateError, match=message):
            EstimateConfig(params=params)
    with pytest.raises(
        EstimateError, match="optimizer must be one of both, adam-mixed, adam-fp32, got 'sgd'"
    ):
        EstimateConfig(optimizer="sgd")
    rows = estimate(EstimateConfig())["rows"]
    assert len(rows) == 2 * 7  # two layouts x (DDP + ZeRO-1/2/3 with and without offload)


def test_cli_prints_the_table_and_the_same_figures_as_json_last():
    proc = run_cli(
        [PYTHON, "-m", "recipes.memory_estimate", "--params", "7.5e9", "--world-size", "64"],
        timeout_s=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = last_json(proc.stdout)
    assert data == json.loads(json.dumps(estimate(EstimateConfig(params=7.5e9, world_size=64))))
    table = proc.stdout.strip().splitlines()[:-1]
    zero3 = next(
        line for line in table if line.startswith("ZeRO-3 (P_os+g+p) ") and "offload" not in line
    )
    assert zero3.split()[-2:] == [
        "1.88",
        "0.00",
    ]  # device total, host total (GB) of mixed-precision Adam
    assert any(
        "FULL_SHARD" in line and "fully_shard" in line and "FSDPStrategy" in line for line in table
    )
    assert any("SHARD_GRAD_OP" in line for line in table) and any(
        "ZeroRedundancyOptimizer" in line for line in table
    )
    assert any(
        "CPUOffload(offload_params=True)" in line and "CPUOffloadPolicy" in line for line in table
    )


def test_bad_input_on_the_command_line_is_usage_and_one_line_exit_2(capsys):
    for argv, message in (
        (["--params", "nan"], "params must be a finite number > 0, got nan"),
        (["--tp", "3"], "heads=32 must divide by tp=3; pick a tp that divides it"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        out, err = capsys.readouterr()
        assert exit_info.value.code == 2 and out == ""
        assert (
            err.strip().splitlines()[-1] == f"python -m recipes.memory_estimate: error: {message}"
        )


# --------------------------------------------------------------------------------------------------
# The estimate against bytes measured on the real tiny model (fp32 AdamW, one optimizer step, 2
# ranks).


def _wrap(strategy, model, world):
    """The model and optimizer of each strategy, as the recipes build them (recipes.zero, .fsdp,
    .fsdp2)."""
    if strategy == "ddp":
        wrapped = DDP(model)
        return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    if strategy == "zero1":  # as recipes.zero builds it
        wrapped = DDP(model)
        return wrapped, ZeroRedundancyOptimizer(
            wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3
        )
    if strategy == "fsdp_full_shard":
        wrapped = apply_fsdp(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device=world.device)
        return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    if strategy == "fully_shard":
        wrapped = apply_fully_shard(
            model, init_device_mesh(world.device.type, (world.world_size,)), block_types=(Block,)
        )
        return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    raise AssertionError(strategy)


def measure_per_rank_bytes(strategies):
    """Every rank's model_state_bytes after one optimizer step, per strategy (runs in the spawned
    world)."""
    with join_world("gloo", timeout_s=120) as world:
        rows = make_dataset("tiny", 12).tokens[
            6 * world.rank : 6 * world.rank + 6
        ]  # this rank's 6 sequences
        inputs, targets = rows[:, :-1], rows[:, 1:]
        measured = {}
        for strategy in strategies:
            wrapped, optimizer = _wrap(strategy, build_model("tiny", seed=0), world)
            lm_loss(wrapped(inputs), targets).backward()
            # measured now: after step(), before zero_grad(), gradients still present
            optimizer.step()
            per_rank = [None] * world.world_size
            dist.all_gather_object(per_rank, model_state_bytes(wrapped, optimizer))
            measured[strategy] = per_rank
        return measured


def test_estimate_matches_bytes_measured_on_a_real_world_of_2():
    model = build_model("tiny")
    psi = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    largest = max(p.numel() for p in model.parameters())
    fp32 = LAYOUTS["adam-fp32"]
    measured = spawn_world(
        measure_per_rank_bytes,
        2,
        ["ddp", "zero1", "fsdp_full_shard", "fully_shard"],
        deadline_s=180,
    )

    # Tolerances, stated: AdamW keeps a 4-byte scalar `step` per parameter tensor that the formulas
    # (bytes per parameter) do not count; the rest must agree exactly or within the named slack.
    step_bytes = 4 * n_tensors

    def estimate_of(stage):
        return model_state_per_rank(psi, 2, stage, fp32)["device"]

    # DDP: every rank holds all of it.
    for per_rank in measured["ddp"]:
        assert per_rank["param_bytes"] == estimate_of("ddp")["param_bytes"] == 4 * psi
        assert per_rank["grad_bytes"] == estimate_of("ddp")["grad_bytes"] == 4 * psi
        assert per_rank["optimizer_bytes"] == estimate_of("ddp")["optimizer_bytes"] + step_bytes

    # ZeRO-1: whole parameter tensors are dealt to ranks, so one rank may hold up to one tensor's
    # state more than 8 * psi / N; over all ranks it adds up exactly.
    zero1 = measured["zero1"]
    for per_rank in zero1:
        assert per_rank["param_bytes"] == 4 * psi and per_rank["grad_bytes"] == 4 * psi
        assert (
            abs(per_rank["optimizer_bytes"] - estimate_of("zero1")["optimizer_bytes"])
            <= 8 * largest + step_bytes
        )
    assert sum(r["optimizer_bytes"] for r in zero1) == 8 * psi + step_bytes
    assert max(r["optimizer_bytes"] for r in zero1) < 0.6 * measured["ddp"][0]["optimizer_bytes"]

    # FULL_SHARD (classic FSDP and fully_shard): 1/N of everything, plus the padding that makes each
    # flat buffer / each tensor's dim 0 divide by N: at most N-1 elements per parameter tensor.
    pad_bytes = 4 * (2 - 1) * n_tensors
    for strategy in ("fsdp_full_shard", "fully_shard"):
        for per_rank in measured[strategy]:
            assert (
                abs(per_rank["param_bytes"] - estimate_of("zero3")["param_bytes"]) <= pad_bytes
            ), (strategy, per_rank)
            assert abs(per_rank["grad_bytes"] - estimate_of("zero3")["grad_bytes"]) <= pad_bytes, (
                strategy,
                per_rank,
            )
            assert (
                abs(per_rank["optimizer_bytes"] - estimate_of("zero3")["optimizer_bytes"])
                <= 2 * pad_bytes + step_bytes
            )
            assert per_rank["param_bytes"] <= measured["ddp"][0]["param_bytes"] / 2 + pad_bytes


# --------------------------------------------------------------------------------------------------
# One strategy's bytes per GPU (gpu_memory, the docs' calculator): TP/PP, HSDP, activations.


def _gpu(**kwargs):
    return gpu_memory(EstimateConfig(**kwargs))


def test_activations_follow_korthikanti_per_layer_formulas():
    # Korthikanti et al. 2022, section 4: 16-bit activations per layer and micro-batch.
    s, b, h, a, L, V = 2048, 2, 1024, 16, 8, 1000
    shape = dict(seq_len=s, micro_batch=b, hidden=h, heads=a, layers=L, vocab=V, precision="mixed")
    logits = 4 * s * b * V
    none = s * b * h * (34 + 5 * a * s / h)
    assert activation_bytes(EstimateConfig(**shape, flash_attention=False)) == pytest.approx(
        L * none + logits
    )
    # Flash attention and selective recomputation drop the s x s scores: 34 s b h per layer.
    flash = activation_bytes(EstimateConfig(**shape))
    assert flash == pytest.approx(L * 34 * s * b * h + logits)
    assert activation_bytes(
        EstimateConfig(**shape, flash_attention=False, checkpointing="selective")
    ) == pytest.approx(flash)
    # Full recomputation: 2 s b h per layer, plus one layer's activations while it is recomputed.
    full = activation_bytes(EstimateConfig(**shape, checkpointing="full"))
    assert full == pytest.approx(L * 2 * s * b * h + 34 * s * b * h + logits)
    # TP over 4 ranks: without sequence parallel 10 + 24/t; with it 34/t; the logits split too.
    t = 4
    tp_only = activation_bytes(EstimateConfig(**shape, tp=t, sequence_parallel=False))
    assert tp_only == pytest.approx(L * s * b * h * (10 + 24 / t) + logits / t)
    tp_sp = activation_bytes(EstimateConfig(**shape, tp=t))
    assert tp_sp == pytest.approx(L * s * b * h * 34 / t + logits / t)
    # fp32 activations cost twice the 16-bit figure; the fp32 logits do not change.
    fp32 = activation_bytes(EstimateConfig(**{**shape, "precision": "fp32"}))
    assert fp32 == pytest.approx(2 * L * 34 * s * b * h + logits)


def test_pipeline_stages_hold_pp_micro_batches_on_the_first_stage():
    s, b, h, L, V = 1024, 1, 512, 8, 50000
    shape = dict(seq_len=s, micro_batch=b, hidden=h, heads=8, layers=L, vocab=V)
    per_layer, logits = 34 * s * b * h, 4 * s * b * V
    # 1F1B: the first stage keeps pp micro-batches of its L/pp layers (= L layers' worth), the last
    # stage one micro-batch and the logits: the larger is the GPU's peak.
    for pp in (2, 4, 8):
        first, last = pp * (L // pp) * per_layer, (L // pp) * per_layer + logits
        assert activation_bytes(EstimateConfig(**shape, pp=pp)) == pytest.approx(max(first, last))
    assert activation_bytes(EstimateConfig(**shape, pp=8)) == pytest.approx(per_layer + logits)
    # The parameters are divided by the stages (and by TP) before the sharding divides them again.
    psi = 8e9
    for tp, pp, n in ((1, 1, 8), (2, 4, 2), (8, 2, 4)):
        got = _gpu(params=psi, world_size=n, tp=tp, pp=pp, strategy="zero3", **shape)
        assert got["device"]["param_bytes"] == pytest.approx(2 * psi / (tp * pp * n))
        assert got["gpus"] == n * tp * pp and got["params_per_gpu"] == psi / (tp * pp)


def test_each_strategy_per_gpu_matches_the_table_and_hsdp_shards_over_its_group():
    psi, n = 7.5e9, 64
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        got = _gpu(params=psi, world_size=n, strategy=strategy, precision="mixed")
        table = model_state_per_rank(psi, n, strategy, LAYOUTS["adam-mixed"])["device"]
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert got["device"][key] == table[key]
        assert got["device"]["total_bytes"] == pytest.approx(
            table["total_bytes"] + got["device"]["activation_bytes"]
        )
    # HSDP: ZeRO-3 inside a group of shard_size ranks, the groups replicate: 16 * psi / 8 each.
    hsdp = _gpu(params=psi, world_size=n, strategy="hsdp", shard_size=8, precision="autocast")
    assert hsdp["shard_over"] == 8
    assert hsdp["device"]["param_bytes"] == 4 * psi / 8
    assert sum(hsdp["device"][k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")) == (
        pytest.approx(16 * psi / 8)
    )
    # Offload moves the sharded parts to the host; ZeRO-3 keeps no model state on the device.
    off = _gpu(params=psi, world_size=n, strategy="zero3", offload=True)
    assert off["host_bytes"] == pytest.approx(16 * psi / n)
    assert off["device"]["total_bytes"] == off["device"]["activation_bytes"]


def test_fits_compares_with_the_gpu_and_presets_set_the_shape():
    cfg = EstimateConfig(model="llama3-70b", params=1.0, layers=1, world_size=8, strategy="ddp")
    assert (cfg.params, cfg.layers, cfg.hidden, cfg.heads, cfg.vocab) == (
        70.6e9,
        80,
        8192,
        64,
        128256,
    )
    assert not gpu_memory(cfg)["fits"]  # 16 bytes x 70.6e9 replicated
    small = _gpu(model="100m", world_size=1, strategy="ddp", seq_len=512, gpu_memory_gib=24)
    assert small["fits"] and small["gpu_bytes"] == 24 * 2**30
    assert small["device"]["total_bytes"] < small["gpu_bytes"]
    (model_option,) = [a for a in make_parser()._actions if a.dest == "model"]
    assert set(model_option.choices) == {"custom", *MODEL_PRESETS}  # every preset can be asked for


def test_per_gpu_inputs_that_do_not_divide_are_refused():
    with pytest.raises(EstimateError, match="^heads=32 must divide by tp=3; pick a tp"):
        EstimateConfig(tp=3)
    with pytest.raises(EstimateError, match="^layers=32 must divide by pp=3; pick a pp"):
        EstimateConfig(pp=3)
    with pytest.raises(EstimateError, match="^shard_size=8 must divide world_size=12"):
        EstimateConfig(world_size=12, strategy="hsdp")
    with pytest.raises(EstimateError, match="^DDP has no CPU offload"):
        EstimateConfig(strategy="ddp", offload=True)
    with pytest.raises(EstimateError, match="checkpointing must be one of none, selective, full"):
        EstimateConfig(checkpointing="some")
