"""pipeline_parallel: every schedule and both splits compute the unsplit model's losses, gradients, weights."""

import dataclasses

import pytest

from recipes import pipeline_parallel as pp
from recipes.core.config import RecipeError
from recipes.core.workload import build_model, lm_loss, make_dataset
from recipes.core.world import join_world, spawn_world
from tests.helpers import (BACKENDS, assert_losses_close, assert_states_close, last_json, plain_training_loop,
                           require_world, run_cli,
                           with_fields)

STEPS = 3
CFG = pp.PPConfig(steps=STEPS, n_layers=4, microbatches=4, keep_final_state=True, precision="fp32", timeout_s=120)
# Each schedule once; the tracer split with another micro-batch count; 4 stages for the multi-stage ones.
CONFIGS = [
    with_fields(CFG, schedule="gpipe"),
    with_fields(CFG, schedule="1f1b", split="tracer", microbatches=6),
    with_fields(CFG, schedule="interleaved_1f1b"),
    with_fields(CFG, schedule="interleaved_zero_bubble"),
    with_fields(CFG, schedule="zbv_zero_bubble"),
]


def unsplit_reference(cfg: pp.PPConfig):
    """Single-process training of the same model (same blocks, seed, data, optimizer), whole batch per step."""
    return plain_training_loop(pp.model_config(cfg.model, cfg.n_layers), steps=cfg.steps,
                               global_batch_size=cfg.global_batch_size, lr=cfg.lr, seed=cfg.seed)


def gradient_differences(world, configs) -> list[float]:
    """One pipeline step per config; the largest |pipeline - unsplit| over this rank's gradients."""
    worst = []
    for cfg in configs:
        model_cfg = pp.model_config(cfg.model, cfg.n_layers)
        dataset = make_dataset(model_cfg, cfg.global_batch_size, seed=cfg.seed)
        inputs, targets = dataset.tokens[:, :-1][:cfg.global_batch_size], dataset.tokens[:, 1:][:cfg.global_batch_size]
        reference = build_model(model_cfg, seed=cfg.seed)
        lm_loss(reference(inputs), targets).backward()
        reference_grads = {name: p.grad for name, p in reference.named_parameters()}

        ids, num_stages = pp.stage_placement(cfg.schedule, world.rank, world.world_size, cfg.stages_per_rank)
        if cfg.split == "manual":
            stages = pp.manual_stages(model_cfg, ids, num_stages, seed=cfg.seed, device=world.device)
        else:
            example = inputs[: cfg.global_batch_size // cfg.microbatches].to(world.device)
            stages = pp.traced_stages(model_cfg, ids, num_stages, seed=cfg.seed, device=world.device,
                                      example_microbatch=example)
        schedule = pp.build_schedule(cfg.schedule, stages, cfg.microbatches)
        loss = pp.pipeline_step(schedule, stages, inputs.to(world.device), targets.to(world.device))
        assert abs(loss - lm_loss(reference(inputs), targets).item()) < 1e-5, "the step's loss on every rank"
        names = [name for stage in stages for name, _ in stage.submod.named_parameters()]
        assert names and set(names) <= reference_grads.keys(), "stages keep the unsplit model's parameter names"
        worst.append(max((p.grad.cpu() - reference_grads[name]).abs().max().item()
                         for stage in stages for name, p in stage.submod.named_parameters()))
    return worst


def pipeline_world(configs, backend):
    with join_world(backend, timeout_s=120) as world:
        return gradient_differences(world, configs), [pp.train(cfg) for cfg in configs]


def runs_here(cfg: pp.PPConfig, backend: str) -> bool:
    try:
        pp.check_schedule_runs_here(cfg.schedule, backend)
        return True
    except RecipeError:  # torch < 2.13 on gloo: ZB-V is refused, tested below
        return False


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_schedule_equals_the_unsplit_model(backend):
    require_world(backend, 2)
    configs = [with_fields(cfg, backend=backend) for cfg in CONFIGS if runs_here(cfg, backend)]
    differences, results = spawn_world(pipeline_world, 2, configs, backend, timeout_s=300)
    reference_losses, reference_state = unsplit_reference(CFG)  # every config trains the same model and data
    for cfg, difference, result in zip(configs, differences, results):
        label = f"{cfg.schedule}/{cfg.split}"
        assert difference < 1e-5, f"{label}: a gradient differs by {difference:.2e}"
        assert_losses_close(result.losses, reference_losses, atol=1e-5)
        assert_states_close(result.final_state, reference_state, atol=1e-5)
        extras = result.extras
        assert (extras["schedule"], extras["split"], extras["microbatches"]) == (cfg.schedule, cfg.split, cfg.microbatches)
        v = 1 if cfg.schedule in ("gpipe", "1f1b") else 2
        assert (extras["num_stages"], extras["stages_per_rank"]) == (2 * v, v), label
        # The bubble, in theory and as measured: (p-1)/(v*m+p-1), and each rank's idle share of a step.
        assert extras["bubble_fraction_theory"] == pytest.approx(1 / (v * cfg.microbatches + 1)), label
        assert len(extras["idle_fraction_measured_per_rank"]) == 2
        assert all(0.0 <= idle < 1.0 for idle in extras["idle_fraction_measured_per_rank"]), label
    placement = {cfg.schedule: r.extras["stage_ids_per_rank"] for cfg, r in zip(configs, results)}
    assert placement["interleaved_1f1b"] == [[0, 2], [1, 3]]  # loop: rank r holds r, r+p
    # V: rank 0 holds the first and the last stage (computed, not run: torch < 2.13 refuses it on gloo)
    assert [pp.stage_placement("zbv_zero_bubble", r, 2)[0] for r in range(2)] == [[0, 3], [1, 2]]
    if "zbv_zero_bubble" in placement:
        assert placement["zbv_zero_bubble"] == [[0, 3], [1, 2]]


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(n_layers=0, schedule="interleaved_1f1b"), r"2 blocks cannot fill 4 pipeline stages .* --n-layers 4"),
        (dict(schedule="1f1b", n_layers=4, microbatches=1), r"1f1b needs at least one micro-batch per stage"),
        (dict(schedule="gpipe", stages_per_rank=2), r"gpipe runs one stage per rank"),
        (dict(schedule="zbv_zero_bubble", stages_per_rank=3), r"exactly 2 stages per rank"),
        (dict(microbatches=5), r"global_batch_size=12 does not divide across 1 ranks x 5 micro-batches"),
        (dict(schedule="interleaved_1f1b", microbatches=3, global_batch_size=6, n_layers=8), None),
    ],
)
def test_layouts_the_schedule_cannot_run_are_rejected(changes, message):
    cfg = dataclasses.replace(CFG, **changes)
    if message is None:  # 3 micro-batches on 2 ranks: 1 round of 3, which torch accepts
        pp.check_pipeline_fits(cfg, 2)
        return
    with pytest.raises(RecipeError, match=message):
        pp.check_pipeline_fits(cfg, 2)


def test_torchrun_launch_equals_single_process():
    launched = run_cli(["torchrun", "--standalone", "--nproc_per_node=2", "-m", "recipes.pipeline_parallel",
                        "--schedule", "interleaved_1f1b", "--n-layers", "4", "--steps", "2"], timeout_s=180)
    assert launched.returncode == 0, launched.stderr[-2000:]
    result = last_json(launched.stdout)
    assert result["world_size"] == 2 and result["extras"]["num_stages"] == 4
    assert_losses_close(result["losses"], unsplit_reference(with_fields(CFG, steps=2))[0], atol=1e-5)
    assert launched.stdout.count("] step ") == 2 and "[rank1]" not in launched.stdout


@pytest.mark.skipif(pp.torch_version() >= pp.SELF_SEND_FREE_TORCH,
                    reason=f"torch {pp.torch.__version__} runs zbv_zero_bubble on gloo: the parity test covers it")
def test_zbv_on_gloo_is_refused_where_torch_would_send_to_itself():
    cfg = with_fields(CFG, schedule="zbv_zero_bubble", backend="gloo")
    with pytest.raises(RecipeError, match="zbv_zero_bubble on gloo needs torch >= 2.13"):
        spawn_world(pp.train, 2, cfg, timeout_s=60)
