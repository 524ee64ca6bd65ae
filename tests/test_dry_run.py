"""dry_run: a pp x dp x tp layout checked in one CPU process on the fake backend.

The bytes each rank holds (read off its DTensor shards) must equal memory_estimate's ZeRO-3
arithmetic on the stage's tensor-parallel share; that share must add up to the whole model; the
collectives must be the ones fully_shard and tensor parallel promise. The 512-rank run of the
7b preset (the CLI default) and the check of every rank are marked slow.
"""

import pytest
import torch

from recipes import dry_run
from recipes.memory_estimate import model_state_per_rank
from recipes.toy import TransformerLM
from tests.helpers import PYTHON, last_json, run_cli


def _run(**changes):
    return dry_run.run(dry_run.DryRunConfig(**changes))


@pytest.mark.timeout(240)
def test_a_2x2x2_layout_matches_memory_estimate_stage_by_stage():
    extras = _run(model="tiny", world_size=8, pp=2, dp=2, tp=2)
    cfg = dry_run.PRESETS["tiny"]
    assert extras["ranks_checked"] == 0
    assert [(r["pp"], r["dp"], r["tp"]) for r in extras["ranks"][:3]] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
    ]
    for stage in extras["stages"]:
        psi = dry_run.stage_params_per_tp_rank(cfg, stage["pp"], 2, 2)
        figures = model_state_per_rank(psi, 2, "zero3", dry_run.FP32)["device"]
        assert stage["param_bytes"] == figures["param_bytes"] == 4 * psi / 2
        assert stage["optimizer_bytes"] == figures["optimizer_bytes"] == 8 * psi / 2  # AdamW m, v
        assert stage["grad_bytes"] == figures["grad_bytes"]
        assert stage["matches_estimate"]
        assert stage["layers"] == [stage["pp"]]
        comms = stage["collectives"]
        # fully_shard: one reduce-scatter per group (the stage's Block + the root, which holds
        # the embeddings on the first stage and the head on the last) per backward.
        assert comms["reduce_scatter"] == len(stage["layers"]) + 1
        assert comms["all_gather"] >= len(stage["layers"]) + 1
        assert comms["all_reduce"] > 0  # tensor parallel's row-wise outputs and column-wise grads
        assert comms["send"] == comms["recv"] == 1  # two stages: one neighbour each
    assert extras["all_match_estimate"]
    assert extras["max_model_state_bytes"] == max(s["total_bytes"] for s in extras["stages"])


@pytest.mark.parametrize("preset", ["tiny", "7b", "70b"])
def test_the_share_formula_adds_up_to_the_whole_model(preset):
    # Independent of the sharding: with tp = 1 the stages' parameters are the model's.
    cfg = dry_run.PRESETS[preset]
    with torch.device("meta"):
        whole = sum(p.numel() for p in TransformerLM(cfg).parameters())
    pp = 2 if cfg.n_layers % 2 == 0 else 1
    assert sum(dry_run.stage_params_per_tp_rank(cfg, s, pp, 1) for s in range(pp)) == whole


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"pp": 8, "dp": 8, "tp": 4}, "pp 8 x dp 8 x tp 4 = 256, not world_size 512"),
        (
            {"model": "tiny", "world_size": 3, "pp": 3, "dp": 1, "tp": 1},
            "2 layers do not split into pp=3 equal stages; use pp in 1, 2",
        ),
        (
            {"model": "tiny", "world_size": 3, "pp": 1, "dp": 1, "tp": 3},
            "tensor parallel over 3 ranks cannot split n_heads=4",
        ),
    ],
)
def test_bad_layouts_get_one_line(changes, message):
    # LayoutError, or tensor parallel's own TPPlanError: both ValueErrors of one line
    with pytest.raises(ValueError, match=message) as caught:
        dry_run.DryRunConfig(**changes)
    assert "\n" not in str(caught.value)


def test_cli_refuses_a_mesh_that_is_not_the_world():
    done = run_cli([PYTHON, "-m", "recipes.dry_run", "--world-size", "500"], timeout_s=120)
    assert done.returncode == 2
    # argparse's usage, then one line: "python -m recipes.dry_run: error: pp 8 x dp 8 ..."
    assert "Traceback" not in done.stderr
    assert "error: pp 8 x dp 8 x tp 8 = 512" in done.stderr.strip().splitlines()[-1]


@pytest.mark.slow  # eight more forked probes (~10 s of CPU): the stage probes stand for them
@pytest.mark.timeout(300)
def test_every_rank_equals_its_stage_probe():
    extras = _run(model="tiny", world_size=8, pp=2, dp=2, tp=2, check_every_rank=True)
    assert extras["ranks_checked"] == 8 and extras["all_match_estimate"]


@pytest.mark.slow  # three probes of 7b stages: ~25 s of CPU (2 min at load 15)
@pytest.mark.timeout(900)
def test_512_ranks_of_7b():
    done = run_cli([PYTHON, "-m", "recipes.dry_run"], timeout_s=850)
    assert done.returncode == 0, done.stderr[-2000:]
    extras = last_json(done.stdout)
    assert len(extras["ranks"]) == 512 and len(extras["stages"]) == 8
    assert extras["all_match_estimate"]
    first, middle, last = (extras["stages"][i] for i in (0, 1, 7))
    assert [s["layers"] for s in extras["stages"]][1] == [4, 5, 6, 7]
    # A middle stage's root holds no parameters: one reduce-scatter per Block only; two
    # neighbours, so two sends and two receives (activation forward, gradient back).
    assert middle["collectives"]["reduce_scatter"] == 4
    assert middle["collectives"]["send"] == middle["collectives"]["recv"] == 2
    assert first["collectives"]["reduce_scatter"] == last["collectives"]["reduce_scatter"] == 5
    # 7b shape, 4 layers a stage, fp32 AdamW over 64 ranks: under 1 GiB of model state a rank.
    assert extras["max_model_state_bytes"] < 2**30
