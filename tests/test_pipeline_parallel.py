"""pipeline_parallel: every schedule and both splits compute the unsplit model's losses, gradients
and weights; so does a 2-stage pipeline of Hugging Face GPT-2 (tied weights) and Llama."""

import dataclasses
import types

import pytest
import torch

from recipes import pipeline_parallel as pp
from recipes._pipeline_parallel_split import (
    GPT2,
    LLAMA,
    TRANSFORMER_LM,
    PipelineSplitError,
    StageModule,
    even_split,
    stage_modules,
)
from recipes.core.state import all_ranks
from recipes.core.workload import build_model, lm_loss, make_dataset
from recipes.core.world import join_world
from tests.helpers import (
    BACKENDS,
    assert_losses_close,
    assert_states_close,
    last_json,
    plain_training_loop,
    recipe_result,
    require_world,
    run_cli,
    spawn_world,
    with_fields,
)

STEPS = 3
# (the final state: recipe_result keeps it; the recipe itself returns its losses only)
CFG = pp.PPConfig(steps=STEPS, n_layers=4, microbatches=4, precision="fp32", timeout_s=120)
# Each schedule once; the tracer split with another micro-batch count; 4 stages for the
# multi-stage ones.
CONFIGS = [
    with_fields(CFG, schedule="gpipe"),
    with_fields(CFG, schedule="1f1b", split="tracer", microbatches=6),
    with_fields(CFG, schedule="interleaved_1f1b"),
    with_fields(CFG, schedule="interleaved_zero_bubble"),
    with_fields(CFG, schedule="zbv_zero_bubble"),
    with_fields(CFG, schedule="dualpipev"),
]


def unsplit_reference(cfg: pp.PPConfig):
    """Single-process training of the same model (blocks, seed, data, optimizer), whole batches."""
    return plain_training_loop(
        pp.model_config(cfg.model, cfg.n_layers),
        steps=cfg.steps,
        global_batch_size=cfg.global_batch_size,
        lr=cfg.lr,
        seed=cfg.seed,
    )


def gradient_differences(world, configs) -> list[float]:
    """One pipeline step per config; the largest |pipeline - unsplit| over this rank's gradients."""
    worst = []
    for cfg in configs:
        model_cfg = pp.model_config(cfg.model, cfg.n_layers)
        dataset = make_dataset(model_cfg, cfg.global_batch_size, seed=cfg.seed)
        batch = dataset.tokens[: cfg.global_batch_size]
        inputs, targets = batch[:, :-1], batch[:, 1:]
        reference = build_model(model_cfg, seed=cfg.seed)
        lm_loss(reference(inputs), targets).backward()
        reference_grads = {name: p.grad for name, p in reference.named_parameters()}

        ids, num_stages = pp.stage_placement(
            cfg.schedule, world.rank, world.world_size, cfg.stages_per_rank
        )
        model = build_model(model_cfg, seed=cfg.seed)
        split = even_split(model, TRANSFORMER_LM, num_stages)
        if cfg.split == "manual":
            stages = pp.manual_stages(
                model, split, ids, num_stages, wiring=TRANSFORMER_LM, device=world.device
            )
        else:
            example = inputs[: cfg.global_batch_size // cfg.microbatches].to(world.device)
            stages = pp.traced_stages(
                model, split, ids, device=world.device, example_microbatch=example
            )
        schedule = pp.build_schedule(cfg.schedule, stages, cfg.microbatches)
        loss = pp.pipeline_step(schedule, stages, inputs.to(world.device), targets.to(world.device))
        expected = lm_loss(reference(inputs), targets).item()
        assert abs(loss - expected) < 1e-5, "the step's loss on every rank"
        names = [name for stage in stages for name, _ in stage.submod.named_parameters()]
        assert names and set(names) <= reference_grads.keys(), "stages keep the model's names"
        worst.append(
            max(
                (p.grad.cpu() - reference_grads[name]).abs().max().item()
                for stage in stages
                for name, p in stage.submod.named_parameters()
            )
        )
    return worst


def pipeline_world(configs, backend):
    with join_world(backend, timeout_s=120) as world:
        # the recipe measured by the harness (recipes.core.observe.PipelineObserver: the layout,
        # each rank's timeline, the final state gathered from every stage)
        return gradient_differences(world, configs), [recipe_result(cfg) for cfg in configs]


def runs_here(cfg: pp.PPConfig, backend: str) -> bool:
    try:
        pp.check_schedule_runs_here(cfg.schedule, backend)
        return True
    except ValueError:  # torch < 2.13 on gloo: the V schedules are refused, tested below
        return False


def check_timeline(extras: dict, label: str) -> None:
    """Each rank's recorded actions: every micro-batch's F and B (or I then W) once per stage,
    one action at a time, inside the step; the idle fraction a real share of it."""
    m = extras["microbatches"]
    for rank, actions in enumerate(extras["timeline_per_rank"]):
        window = extras["step_window_ms_per_rank"][rank]
        for stage in extras["stage_ids_per_rank"][rank]:
            kinds = sorted(kind for kind, s, *_ in actions if s == stage)
            assert kinds.count("F") == m and kinds.count("B") + kinds.count("I") == m, label
            assert kinds.count("W") == kinds.count("I"), f"{label}: a W for every I"
        spans = sorted((start, end) for *_, start, end in actions)
        assert all(0.0 <= start <= end <= window for start, end in spans), label
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), label
        assert 0.0 <= extras["idle_fraction_measured_per_rank"][rank] < 1.0, label
    kinds = {kind for actions in extras["timeline_per_rank"] for kind, *_ in actions}
    split_backward = extras["schedule"] not in ("gpipe", "1f1b", "interleaved_1f1b")
    assert ("W" in kinds) == split_backward, f"{label}: zero-bubble schedules split the backward"


# The spawned world's own deadline (300 s) comes first: the suite-wide 180 s is short for 6
# schedules on a 2-core machine under load.
@pytest.mark.timeout(330)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_schedule_equals_the_unsplit_model(backend):
    require_world(backend, 2)
    configs = [with_fields(cfg, backend=backend) for cfg in CONFIGS if runs_here(cfg, backend)]
    differences, results = spawn_world(pipeline_world, 2, configs, backend, deadline_s=300)
    # every config trains the same model and data
    reference_losses, reference_state = unsplit_reference(CFG)
    for cfg, difference, result in zip(configs, differences, results):
        label = f"{cfg.schedule}/{cfg.split}"
        assert difference < 1e-5, f"{label}: a gradient differs by {difference:.2e}"
        assert_losses_close(result.losses, reference_losses, atol=1e-5)
        assert_states_close(result.final_state, reference_state, atol=1e-5)
        extras = result.extras
        assert (extras["schedule"], extras["split"], extras["microbatches"]) == (
            cfg.schedule,
            cfg.split,
            cfg.microbatches,
        )
        v = 1 if cfg.schedule in ("gpipe", "1f1b") else 2
        assert (extras["num_stages"], extras["stages_per_rank"]) == (2 * v, v), label
        # The bubble in theory, (p-1)/(v*m+p-1), and each rank's measured timeline and idle share.
        expected_bubble = 1 / (v * cfg.microbatches + 1)
        assert extras["bubble_fraction_theory"] == pytest.approx(expected_bubble), label
        assert len(extras["idle_fraction_measured_per_rank"]) == 2
        check_timeline(extras, label)
    placement = {cfg.schedule: r.extras["stage_ids_per_rank"] for cfg, r in zip(configs, results)}
    assert placement["interleaved_1f1b"] == [[0, 2], [1, 3]]  # loop: rank r holds r, r+p
    # V: rank 0 holds the first and the last stage (computed, not run: torch < 2.13 refuses it on
    # gloo)
    for schedule in pp.V_SCHEDULES:
        assert [pp.stage_placement(schedule, r, 2)[0] for r in range(2)] == [[0, 3], [1, 2]]
        if schedule in placement:
            assert placement[schedule] == [[0, 3], [1, 2]]


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(n_layers=0, schedule="interleaved_1f1b"),
            r"2 blocks cannot fill 4 pipeline stages .* --n-layers 4",
        ),
        (
            dict(schedule="1f1b", n_layers=4, microbatches=1),
            r"1f1b needs at least one micro-batch per stage",
        ),
        (
            dict(schedule="dualpipev", n_layers=4, microbatches=2),
            r"dualpipev needs at least one micro-batch per stage: microbatches=2 < 4 stages",
        ),
        (dict(schedule="gpipe", stages_per_rank=2), r"gpipe runs one stage per rank"),
        (dict(schedule="zbv_zero_bubble", stages_per_rank=3), r"exactly 2 stages per rank"),
        (
            dict(microbatches=5),
            r"global_batch_size=12 does not divide across 1 ranks x 5 micro-batches",
        ),
        (dict(schedule="interleaved_1f1b", microbatches=3, global_batch_size=6, n_layers=8), None),
    ],
)
def test_layouts_the_schedule_cannot_run_are_rejected(changes, message):
    if message is None:  # 3 micro-batches on 2 ranks: 1 round of 3, which torch accepts
        pp.check_config_fits(dataclasses.replace(CFG, **changes), 2)
        return
    # what needs no world (stages per rank, micro-batches that divide the batch) is refused by
    # the config itself, from code as from the command line; the rest by check_config_fits
    with pytest.raises(ValueError, match=message):
        pp.check_config_fits(dataclasses.replace(CFG, **changes), 2)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--microbatches", "5"], "global_batch_size=12 does not divide across 1 ranks x 5"),
        (["--schedule", "gpipe", "--stages-per-rank", "2"], "gpipe runs one stage per rank"),
    ],
)
def test_contradictory_options_are_refused_before_any_world(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        pp.main(args)  # no world is joined: the config refuses itself
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_schedule_this_torch_lacks_is_one_line(monkeypatch):
    # torch 2.11 may lack a schedule: simulate it by removing the class from this torch
    monkeypatch.delattr(pp.torch_schedules, "ScheduleDualPipeV")
    with pytest.raises(
        ValueError,
        match=r"--schedule dualpipev needs torch.distributed.pipelining"
        r"\.ScheduleDualPipeV, which torch \S+ lacks",
    ):
        pp.check_schedule_runs_here("dualpipev", "gloo")


# Slow: a torchrun launch (torchrun and its workers each import torch: ~10 s of CPU).
# The same code runs in a spawned world in the default run; test_ddp_torchrun, test_elastic
# and test_multinode cover the launch path itself there.
@pytest.mark.slow
@pytest.mark.timeout(270)  # after run_cli's own 240 s
def test_torchrun_launch_compares_every_schedule_and_equals_single_process():
    # through the harness (the recipe's own lines first, then the result's JSON)
    launched = run_cli(
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "recipes.core.prove",
            "pipeline_parallel",
            "--compare",
            "--n-layers",
            "4",
            "--steps",
            "2",
        ],
        timeout_s=240,
    )
    assert launched.returncode == 0, launched.stderr[-2000:]
    result = last_json(launched.stdout)
    assert result["world_size"] == 2 and result["extras"]["schedule"] == "1f1b"
    expected = unsplit_reference(with_fields(CFG, steps=2))[0]
    assert_losses_close(result["losses"], expected, atol=1e-5)
    # One row per schedule: measured, or refused with the reason where this torch cannot run it.
    table = {row["schedule"]: row for row in result["extras"]["schedule_table"]}
    assert list(table) == list(pp.SCHEDULES)
    for schedule, row in table.items():
        assert ("refused" in row) == (not runs_here(with_fields(CFG, schedule=schedule), "gloo"))
        if "refused" not in row:
            assert len(row["idle_fraction_measured_per_rank"]) == 2, schedule
            assert len(row["timeline_per_rank"]) == 2 and all(row["timeline_per_rank"]), schedule
    assert table["interleaved_1f1b"]["stages_per_rank"] == 2
    runs = sum("refused" not in row for row in table.values())
    assert launched.stdout.count("\nstep ") == 2 * runs and "[rank1]" not in launched.stdout


@pytest.mark.skipif(
    pp.torch_version() >= pp.SELF_SEND_FREE_TORCH,
    reason=f"torch {torch.__version__} runs the V schedules on gloo: the parity test covers them",
)
def test_zbv_on_gloo_is_refused_where_torch_would_send_to_itself():
    cfg = with_fields(CFG, schedule="zbv_zero_bubble", backend="gloo")
    with pytest.raises(ValueError, match="zbv_zero_bubble on gloo needs torch >= 2.13"):
        spawn_world(pp.train, 2, cfg, deadline_s=60)


# --- Models the cookbook did not write: tiny Hugging Face GPT-2 and Llama, built from config ----

HF_STEPS, HF_BATCH, HF_MICROBATCHES, HF_LR = 3, 8, 2, 0.1
# SGD, not AdamW: AdamW divides each gradient element by its own magnitude, so an element near zero
# turns last-bit differences (a micro-batch sums in another order) into ~1e-5 weight differences
# on GPT-2 (measured: 1.01e-5 after 3 steps). The gradients themselves are compared at 1e-5.


def hf_model(name: str):
    """Tiny GPT-2 (lm_head tied to wte) or Llama (tests/third_party.py) and its stage wiring; sdpa:
    causal without a mask, which a stage does not pass."""
    from tests import third_party

    return third_party.build(name, attn_implementation="sdpa"), {"gpt2": GPT2, "llama": LLAMA}[name]


def hf_batches():
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (HF_STEPS, HF_BATCH, 17), generator=generator)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def hf_pipeline_world(names):
    """Per model: 1F1B over 2 stages (one per rank); losses, first-step gradients, final state.
    Rank 0 also trains the unsplit model in one process, the reference."""
    out = {}
    with join_world("gloo", timeout_s=120) as world:
        for name in names:
            model, wiring = hf_model(name)
            # --8<-- [start:your_model]
            # model: e.g. LlamaForCausalLM(config); wiring: LLAMA (GPT2 for GPT-2)
            split = even_split(model, wiring, 2)  # ["model.layers.1"]: stage 1 starts there
            stages = pp.manual_stages(
                model, split, [world.rank], 2, wiring=wiring, device=world.device
            )
            schedule = pp.build_schedule("1f1b", stages, HF_MICROBATCHES)
            optimizer = torch.optim.SGD(stages[0].submod.parameters(), lr=HF_LR)
            losses, grads = [], None
            for inputs, targets in hf_batches():
                optimizer.zero_grad()
                losses.append(pp.pipeline_step(schedule, stages, inputs, targets))
                grads = grads or {n: p.grad.clone() for n, p in stages[0].submod.named_parameters()}
                optimizer.step()
            # --8<-- [end:your_model]
            grads = {n: g for piece in all_ranks(grads) for n, g in piece.items()}
            out[name] = dict(
                split=split,
                tied=stages[0].submod.tied,
                losses=losses,
                grads=grads,
                state=full_state_of_stages(stages[0].submod),
            )
        if world.rank == 0:
            for name in names:
                out[name]["reference"] = hf_reference(name)
    return out


def full_state_of_stages(submod) -> dict:
    """The whole model's state on every rank: each rank's one stage, in rank (= stage) order."""
    local = {n: t.detach().cpu().clone() for n, t in submod.state_dict().items()}
    return {n: t for piece in all_ranks(local) for n, t in piece.items()}


def hf_reference(name: str):
    model, _ = hf_model(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=HF_LR)
    losses, grads = [], None
    for inputs, targets in hf_batches():
        optimizer.zero_grad()
        loss = lm_loss(model(inputs).logits, targets)
        loss.backward()
        losses.append(loss.item())
        # get_parameter: a tied name (lm_head.weight) gives the one shared tensor
        grads = grads or {
            n: model.get_parameter(n).grad.clone()
            for n, _ in model.named_parameters(remove_duplicate=False)
        }
        optimizer.step()
    state = {
        n: model.get_parameter(n).detach().clone()
        for n, _ in model.named_parameters(remove_duplicate=False)
    }
    return losses, grads, state


@pytest.mark.timeout(270)  # after the world's own 240 s; each rank imports transformers
def test_gpt2_and_llama_in_a_two_stage_pipeline_equal_one_process():
    runs = spawn_world(hf_pipeline_world, 2, ["gpt2", "llama"], deadline_s=240)
    assert runs["gpt2"]["split"] == ["transformer.h.1"]
    assert runs["llama"]["split"] == ["model.layers.1"]
    for name, run in runs.items():
        losses, grads, state = run["reference"]
        assert_losses_close(run["losses"], losses, atol=1e-5)
        assert grads.keys() == run["grads"].keys(), f"{name}: every parameter, under its own name"
        assert_states_close(run["grads"], grads, atol=1e-5)
        assert_states_close({n: run["state"][n] for n in state}, state, atol=1e-5)
    # GPT-2's lm_head (last stage) is tied to wte (first stage): a copy on each end stage, whose
    # gradients are summed every step, so the two copies stay equal, as in one process.
    assert runs["gpt2"]["tied"][0][0] == ["transformer.wte.weight", "lm_head.weight"]
    gpt2 = runs["gpt2"]["state"]
    assert torch.equal(gpt2["lm_head.weight"], gpt2["transformer.wte.weight"])
    assert runs["llama"]["tied"] == []


def test_a_split_naming_a_missing_module_names_the_modules_found():
    model = build_model(pp.model_config("tiny", 4))
    with pytest.raises(
        PipelineSplitError,
        match=r"'layers\.9', which is not a module of TransformerLM; "
        r"its modules there: layers\.0, layers\.1, layers\.2",
    ):
        stage_modules(model, ["layers.9"], TRANSFORMER_LM)
    with pytest.raises(
        PipelineSplitError,
        match=r"'blocks\.1'.* its modules there: tok_embeddings, "
        r"pos_embeddings, layers, norm, output",
    ):
        stage_modules(model, ["blocks.1"], TRANSFORMER_LM)
    with pytest.raises(PipelineSplitError, match=r"no stage owns the parameters of norm, output"):
        stage_modules(model, [["tok_embeddings", "pos_embeddings", "layers"]], TRANSFORMER_LM)
    with pytest.raises(PipelineSplitError, match=r"layers\.3 named in more than one stage"):
        stage_modules(
            model,
            [
                [
                    "tok_embeddings",
                    "pos_embeddings",
                    "layers.0",
                    "layers.1",
                    "layers.2",
                    "layers.3",
                ],
                ["layers.3", "norm", "output"],
            ],
            TRANSFORMER_LM,
        )
    with pytest.raises(PipelineSplitError, match=r"must be distinct, in the model's order"):
        stage_modules(model, ["layers.3", "layers.1"], TRANSFORMER_LM)
    with pytest.raises(
        PipelineSplitError, match=r"the split gives 2 stages, the schedule places 4"
    ):
        pp.manual_stages(model, ["layers.2"], [0], 4, wiring=TRANSFORMER_LM, device="cpu")


def test_per_stage_lists_equal_split_points():
    model = build_model(pp.model_config("tiny", 4))
    by_points = stage_modules(model, ["layers.2"], TRANSFORMER_LM)
    assert by_points == [
        ["tok_embeddings", "pos_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "norm", "output"],
    ]
    assert stage_modules(model, by_points, TRANSFORMER_LM) == by_points
    # No split point: one stage of every module, the blocks opened (a ModuleDict has no forward).
    assert stage_modules(model, [], TRANSFORMER_LM) == [by_points[0] + by_points[1]]
    # A stage's forward is the model's: stage 0 then stage 1 computes the model's logits.
    tokens = torch.randint(0, 64, (2, 16))
    first, last = (StageModule(model, by_points, s, TRANSFORMER_LM) for s in (0, 1))
    torch.testing.assert_close(last(first(tokens)), model(tokens), atol=0, rtol=0)
    assert first.norm is None and last.tok_embeddings is None  # other stages' parts read as None


def test_eager_attention_is_refused_it_would_not_be_causal_in_a_stage():
    # Hugging Face models say their attention in config._attn_implementation; a stand-in with that
    # attribute keeps transformers' import (seconds) out of this test.
    model = build_model(pp.model_config("tiny", 4))
    model.config = types.SimpleNamespace(_attn_implementation="eager")
    split = stage_modules(model, ["layers.2"], TRANSFORMER_LM)
    with pytest.raises(PipelineSplitError, match=r"attn_implementation='eager'.*use 'sdpa'"):
        StageModule(model, split, 1, TRANSFORMER_LM)
