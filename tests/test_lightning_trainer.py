"""lightning_trainer: Lightning's Trainer (DDP, ddp_spawn, FSDP, ModelParallel) equals the raw DDP
recipe.

One spawned world of 2 runs every in-world phase (Lightning imports cost seconds per process): the
module fixture ``world`` returns rank 0's results by name, and each test asserts one claim about
them.

The recipe is copyable and returns its losses, its last step, its checkpoints and its CSV file; the
harness (``prove``, through ``tests.helpers.recipe_result``) measures the rest from outside, through
a Lightning Callback it adds to the Trainer
(``recipes.core.observe.lightning.LightningObserver``): the final weights gathered to rank 0 and
the fraction of them each rank holds.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader

from recipes import ddp_torchrun, fsdp
from recipes.toy import build_model
from tests.helpers import (
    CUDA_DEVICES,
    NEEDS_LIGHTNING,
    PYTHON,
    REPO_ROOT,
    LazyModule,
    assert_losses_close,
    assert_states_close,
    ddp_result,
    in_one_world,
    last_json,
    recipe_result,
    run_alone,
    run_cli,
    spawn_world,
)
from tests.once import once_per_run

lightning_fabric = LazyModule("recipes.lightning_fabric")  # imported when first used
lightning_trainer = LazyModule("recipes.lightning_trainer")  # imported when first used

# Its tests share module fixtures that run whole worlds: one worker runs them all (pyproject:
# --dist loadgroup), so the fixtures run once rather than once per worker.
pytestmark = [NEEDS_LIGHTNING, pytest.mark.xdist_group("lightning_trainer")]

STEPS = 6
TENSORBOARD = any(importlib.util.find_spec(name) for name in ("tensorboard", "tensorboardX"))
# LightningCLI needs jsonargparse, which lightning's base install does not bring.
needs_jsonargparse = pytest.mark.skipif(
    importlib.util.find_spec("jsonargparse") is None,
    reason=(
        "LightningCLI needs jsonargparse: pip install 'jsonargparse[signatures]' "
        "(or lightning[pytorch-extra])"
    ),
)
REFERENCE = ddp_torchrun.DDPConfig(steps=STEPS, precision="fp32", timeout_s=120)


def lightning_cfg(out: str, **changes) -> lightning_trainer.LightningConfig:
    fields = {
        "steps": STEPS,
        "timeout_s": 120,
        "output_dir": out,
        "logger": "none",
        "precision": "32-true",
    }
    return lightning_trainer.LightningConfig(**(fields | changes))


def _train_with_plain_loader(cfg):
    """The pitfall: the same resume with a plain DataLoader, which Lightning cannot resume
    mid-epoch."""
    # by name: lightning_trainer here is a LazyModule, and patching it would miss the module
    with mock.patch("recipes.lightning_trainer.ResumableLoader", DataLoader):
        return recipe_result(cfg)


def as_nodes(ranks_per_node: int) -> None:
    """Make this spawned world look like nodes of ``ranks_per_node`` ranks (the torchrun variables
    a multi-node launch sets), for the recipe and for Lightning's cluster environment alike."""
    rank = int(os.environ["RANK"])
    node = str(rank // ranks_per_node)
    os.environ.update(
        LOCAL_RANK=str(rank % ranks_per_node),
        LOCAL_WORLD_SIZE=str(ranks_per_node),
        GROUP_RANK=node,
        NODE_RANK=node,
    )


def torch_hybrid_shard_grads(_cfg):
    """The upstream reproduction, torch alone: FSDP1 HYBRID_SHARD on a (ranks, 1) mesh, one
    Linear, a different input per rank. Returns every rank's gradient (equal if it were reduced)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(4, 1)),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        device_mesh=init_device_mesh("cpu", (world_size, 1)),
        device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
        use_orig_params=True,
    )
    model(torch.full((1, 4), float(rank + 1))).sum().backward()
    grad = next(model.parameters()).grad.clone()
    grads = [torch.zeros_like(grad) for _ in range(world_size)]
    dist.all_gather(grads, grad)
    return {"strategy": model.sharding_strategy.name, "grads": grads}


def _run_phase(phase):
    name, cfg = phase
    if name.endswith("one_rank_per_node"):
        with mock.patch.dict(os.environ):  # Lightning's teardown even deletes WORLD_SIZE
            as_nodes(1)
            return (
                torch_hybrid_shard_grads(cfg)
                if name.startswith("torch")
                else _run_phase((name.removesuffix("_one_rank_per_node"), cfg))
            )
    if name == "classic_fsdp":  # copyable: the harness measures it (and keeps its final state)
        return recipe_result(cfg)
    if name == "raw_ddp":
        return ddp_result(cfg)
    if name.startswith("plain_loader"):
        return _train_with_plain_loader(cfg)
    return recipe_result(cfg)  # lightning_trainer's phases, and fabric_clip


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """Rank 0's results of every phase, run in order in one gloo world of 2."""

    def build(folder: Path):
        out = str(folder)
        ckpt = os.path.join(out, "ddp", "checkpoints", "step=3.ckpt")
        fsdp_ckpt = os.path.join(out, "fsdp", "checkpoints", "step=3.ckpt")
        phases = [
            ("raw_ddp", REFERENCE),
            ("ddp", lightning_cfg(f"{out}/ddp", logger="csv", checkpoint_every_n_steps=3)),
            # The resumed runs keep the ModelCheckpoint callback, as Lightning asks when resuming.
            (
                "ddp_resumed",
                lightning_cfg(f"{out}/ddp_resumed", resume_from=ckpt, checkpoint_every_n_steps=3),
            ),
            # A plain DataLoader's checkpoint has no loader state (Lightning refuses to mix the
            # two): its own run.
            ("plain_loader", lightning_cfg(f"{out}/plain", checkpoint_every_n_steps=3)),
            (
                "plain_loader_resumed",
                lightning_cfg(
                    f"{out}/plain_resumed",
                    checkpoint_every_n_steps=3,
                    resume_from=os.path.join(out, "plain", "checkpoints", "step=3.ckpt"),
                ),
            ),
            ("ddp_accumulate", lightning_cfg(f"{out}/acc", accumulate_grad_batches=3)),
            (
                "ddp_clip",
                lightning_cfg(
                    f"{out}/clip",
                    gradient_clip_val=0.05,
                    logger="tensorboard" if TENSORBOARD else "none",
                ),
            ),
            (
                "fabric_clip",
                lightning_fabric.FabricConfig(steps=STEPS, timeout_s=120, gradient_clip_val=0.05),
            ),
            ("fsdp", lightning_cfg(f"{out}/fsdp", strategy="fsdp", checkpoint_every_n_steps=3)),
            (
                "fsdp_resumed",
                lightning_cfg(
                    f"{out}/fsdp_resumed",
                    strategy="fsdp",
                    resume_from=fsdp_ckpt,
                    checkpoint_every_n_steps=3,
                ),
            ),
            ("model_parallel", lightning_cfg(f"{out}/tp", strategy="model_parallel")),
            # Two "nodes" of one rank each: HYBRID_SHARD is replication there, and must equal DDP.
            (
                "fsdp_hybrid_one_rank_per_node",
                lightning_cfg(f"{out}/hybrid1", strategy="fsdp", sharding_strategy="HYBRID_SHARD"),
            ),
            ("torch_hybrid_one_rank_per_node", None),
            ("bf16", lightning_cfg(f"{out}/bf16", precision="bf16-mixed")),
        ]
        results = spawn_world(in_one_world, 2, _run_phase, phases, "gloo", 120, deadline_s=400)
        return {name: result for (name, _), result in zip(phases, results)} | {"out": out}

    return once_per_run(tmp_path_factory, "lightning-trainer-world", build)


def test_lightning_ddp_equals_raw_ddp(world):
    raw, lit = world["raw_ddp"], world["ddp"]
    assert (lit.world_size, lit.backend, lit.extras["global_step"]) == (2, "gloo", STEPS)
    assert_losses_close(lit.losses, raw.losses, atol=1e-5)
    assert_states_close(lit.final_state, raw.final_state, atol=1e-5)
    assert lit.losses[-1] < lit.losses[0], "the model should learn the synthetic sequences"
    assert lit.extras["param_fraction_per_rank"] == 1.0  # DDP: every rank holds every weight


def test_logged_loss_is_synced_over_ranks(world):
    """self.log(sync_dist=True): the CSV holds the global batch's loss at every step, not rank 0's
    own."""
    import csv

    with open(world["ddp"].extras["metrics_file"]) as f:
        rows = [row for row in csv.DictReader(f) if row.get("train_loss")]
    assert [int(row["step"]) for row in rows] == list(range(STEPS))
    assert_losses_close(
        [float(row["train_loss"]) for row in rows], world["raw_ddp"].losses, atol=1e-6
    )


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="reading the event file needs the tensorboard package",
)
def test_tensorboard_logger_writes_each_steps_global_loss(world):
    """What TensorBoard will plot: one train_loss per optimizer step, the mean over the ranks."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(
        os.path.join(world["out"], "clip", "lightning_trainer", "*", "events.out.tfevents.*")
    )
    accumulator = EventAccumulator(os.path.dirname(events))
    accumulator.Reload()
    scalars = accumulator.Scalars("train_loss")
    assert [event.step for event in scalars] == list(range(STEPS))
    assert_losses_close([event.value for event in scalars], world["ddp_clip"].losses, atol=1e-6)


def test_resume_from_mid_epoch_checkpoint_equals_uninterrupted_run(world):
    full, resumed = world["ddp"], world["ddp_resumed"]
    assert [os.path.basename(p) for p in full.extras["checkpoints"]] == [
        "step=3.ckpt",
        "step=6.ckpt",
    ]
    assert_losses_close(resumed.losses, full.losses[3:], atol=1e-6)
    assert_states_close(resumed.final_state, full.final_state, atol=1e-6)
    # The loader's position is in the checkpoint: epoch 0, 3 of its 8 batches done.
    checkpoint = torch.load(full.extras["checkpoints"][0], weights_only=False)
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [
        {"epoch": 0, "batches_done": 3}
    ]


def test_plain_dataloader_repeats_batches_after_mid_epoch_resume(world):
    """The pitfall ResumableLoader guards against: resumed at step 3, a plain DataLoader starts its
    epoch over."""
    full, plain = world["plain_loader"], world["plain_loader_resumed"]
    assert_losses_close(
        full.losses, world["raw_ddp"].losses, atol=1e-5
    )  # uninterrupted, it is fine
    # Same weights at step 3, different batches (0, 1, 2 again): every resumed loss is off.
    assert all(abs(p - f) > 1e-3 for p, f in zip(plain.losses, full.losses[3:])), (
        plain.losses,
        full.losses,
    )


def test_gradient_accumulation_equals_one_big_batch(world):
    assert_losses_close(world["ddp_accumulate"].losses, world["raw_ddp"].losses, atol=1e-5)
    assert_states_close(
        world["ddp_accumulate"].final_state, world["raw_ddp"].final_state, atol=1e-5
    )


def test_gradient_clipping_clips_the_global_norm_like_fabric(world):
    clipped, fabric, raw = world["ddp_clip"], world["fabric_clip"], world["raw_ddp"]
    assert_states_close(clipped.final_state, fabric.final_state, atol=1e-6)
    worst = max(
        (clipped.final_state[k] - raw.final_state[k]).abs().max().item() for k in raw.final_state
    )
    assert worst > 1e-5, "a clip value far below the gradient norm must change training"


def test_fsdp_trains_like_ddp_and_shards_the_weights(world):
    fsdp = world["fsdp"]
    assert fsdp.losses[-1] < fsdp.losses[0]
    assert_losses_close(fsdp.losses, world["raw_ddp"].losses, atol=1e-5)
    assert_states_close(fsdp.final_state, world["raw_ddp"].final_state, atol=1e-5)
    assert fsdp.extras["param_fraction_per_rank"] == pytest.approx(
        0.5, abs=0.01
    )  # FULL_SHARD over 2 ranks


def test_hybrid_shard_with_one_rank_per_node_equals_ddp(world):
    """Once refused on CPU ("drifts from DDP by 7e-3"): FSDP1 dropped the cross-node all-reduce."""
    hybrid = world["fsdp_hybrid_one_rank_per_node"]
    assert_losses_close(hybrid.losses, world["raw_ddp"].losses, atol=1e-5)
    assert_states_close(hybrid.final_state, world["raw_ddp"].final_state, atol=1e-5)
    assert hybrid.extras["param_fraction_per_rank"] == 1.0  # replicated: every rank holds it all


def test_torch_fsdp1_hybrid_shard_with_one_rank_per_node_does_not_reduce_across_nodes(world):
    """The upstream bug the recipe works around (torch 2.13). If this fails, torch fixed it:
    drop the NO_SHARD switch in lightning_trainer.hybrid_shard_layout."""
    repro = world["torch_hybrid_one_rank_per_node"]
    assert repro["strategy"] == "NO_SHARD"  # clamped: the shard group has one rank
    rank0, rank1 = (g.flatten().tolist() for g in repro["grads"])
    # Each rank keeps its own gradient, divided by the world size (inputs 1 and 2: 1/2 and 2/2);
    # reduced, both would be the mean, 0.75.
    assert (rank0, rank1) == ([0.5] * 4, [1.0] * 4)


@pytest.mark.slow  # 4 ranks that each import Lightning: about a minute on 2 cores
@pytest.mark.timeout(600)
def test_hybrid_shard_on_two_nodes_of_two_equals_ddp(tmp_path):
    """2 nodes x 2 ranks (torchrun's variables set per rank): Lightning's HYBRID_SHARD and the
    classic fsdp recipe's hybrid mode both equal DDP, and shard each weight over a node's 2
    ranks."""
    phases = [
        ("raw_ddp", REFERENCE),
        ("fsdp", lightning_cfg(str(tmp_path), strategy="fsdp", sharding_strategy="HYBRID_SHARD")),
        (
            "classic_fsdp",
            fsdp.FSDPConfig(
                steps=STEPS, timeout_s=120, precision="fp32", sharding_strategy="hybrid"
            ),
        ),
    ]
    raw, lightning_hybrid, classic = spawn_world(_as_two_nodes_of_two, 4, phases, deadline_s=500)
    for result in (lightning_hybrid, classic):
        assert_losses_close(result.losses, raw.losses, atol=1e-5)
        assert_states_close(result.final_state, raw.final_state, atol=1e-5)
    assert lightning_hybrid.extras["param_fraction_per_rank"] == pytest.approx(0.5, abs=0.01)


def _as_two_nodes_of_two(phases):
    as_nodes(2)
    return in_one_world(_run_phase, phases, "gloo", 120)


def test_fsdp_sharded_checkpoint_is_a_folder_of_shards_and_reloads(world):
    folder = world["fsdp"].extras["checkpoints"][0]
    assert os.path.isdir(folder)
    assert {"__0_0.distcp", "__1_0.distcp", "meta.pt"} <= set(os.listdir(folder)), (
        "one shard file per rank"
    )
    resumed = world["fsdp_resumed"]
    assert_losses_close(resumed.losses, world["fsdp"].losses[3:], atol=1e-6)
    assert_states_close(resumed.final_state, world["fsdp"].final_state, atol=1e-6)


def test_model_parallel_strategy_runs_tensor_parallel_on_cpu(world):
    """ModelParallelStrategy needs no CUDA: TP over 2 gloo ranks equals DDP up to float summation
    order."""
    tp = world["model_parallel"]
    assert_losses_close(tp.losses, world["raw_ddp"].losses, atol=1e-5)
    assert_states_close(tp.final_state, world["raw_ddp"].final_state, atol=1e-5)
    # Each rank holds half of every Block linear (w_out's bias stays whole under RowwiseParallel).
    model = build_model("tiny")
    total = sum(p.numel() for p in model.parameters())
    split = sum(
        p.numel()
        for name, p in model.named_parameters()
        if name.startswith("layers.")
        and (".attn.w" in name or ".mlp.w" in name)
        and not name.endswith("w_out.bias")
    )
    assert tp.extras["param_fraction_per_rank"] == pytest.approx((total - split / 2) / total)


def test_bf16_mixed_trains_close_to_fp32(world):
    bf16, fp32 = world["bf16"], world["raw_ddp"]
    assert bf16.losses[-1] < bf16.losses[0]
    assert_losses_close(bf16.losses, fp32.losses, atol=1e-2)  # bf16 matmuls: ~3 significant digits
    worst = max(
        (bf16.final_state[k] - fp32.final_state[k]).abs().max().item() for k in fp32.final_state
    )
    assert 1e-6 < worst < 1e-2, "bf16 autocast must really run, and stay close"


# Slow: Lightning's ddp_spawn strategy starts fresh interpreters that import lightning (~20 s
# on 2 cores). This one checks that spawn returns rank 0's weights.
@pytest.mark.slow
def test_ddp_spawn_starts_its_own_processes_and_equals_raw_ddp(tmp_path):
    reference = run_alone(ddp_result, REFERENCE)
    # ddp_spawn sets MASTER_PORT & co. in this process: restore the environment for the tests after
    # it.
    with mock.patch.dict(os.environ):
        result = recipe_result(lightning_cfg(str(tmp_path), strategy="ddp_spawn", devices=2))
    assert (result.world_size, result.extras["strategy"]) == (2, "ddp_spawn")
    assert_losses_close(result.losses, reference.losses, atol=1e-5)
    assert_states_close(
        result.final_state, reference.final_state, atol=1e-5
    )  # rank 0's weights came back


# Slow: a torchrun launch (torchrun and its workers each import torch: ~10 s of CPU).
# The same code runs in a spawned world in the default run; test_ddp_torchrun, test_elastic
# and test_multinode cover the launch path itself there.
@pytest.mark.slow
def test_torchrun_launch_prints_readable_logs_and_the_result(tmp_path):
    proc = run_cli(
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "recipes.core.prove",
            "lightning_trainer",
            "--output-dir",
            str(tmp_path),
        ],
        timeout_s=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    assert_losses_close(result["losses"], run_alone(ddp_result, REFERENCE).losses, atol=1e-5)
    # One log line per step, from rank 0 only; no progress-bar carriage returns in a non-terminal
    # log.
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == STEPS and "[rank1]" not in proc.stdout and "\r" not in proc.stdout
    # No warnings: the known-harmless ones are filtered in the recipe, each with its reason.
    assert "Warning" not in proc.stderr and "warn" not in proc.stderr.lower(), proc.stderr[-3000:]
    assert "Tip:" not in proc.stdout + proc.stderr


# Slow (issue 30, the default run's budget): Lightning's launcher re-runs the command as a fresh
# interpreter for rank 1, and both processes import Lightning (torchmetrics pulls in transformers
# and scipy: ~3.3 s each), ~20 CPU s, 5% of the default run. The default run keeps the Trainer's
# parity with raw DDP in a spawned world (test_lightning_ddp_equals_raw_ddp), and parses both
# YAML files with the recipe's LightningCLI in this process (the tests below); CI runs this one.
@needs_jsonargparse
@pytest.mark.slow
def test_lightning_cli_yaml_config_runs_ddp_with_lightnings_launcher(tmp_path):
    """``fit --config configs/lightning/ddp.yaml``: Lightning starts the 2nd process; same losses as
    raw DDP."""
    import csv

    proc = run_cli(
        [
            PYTHON,
            "-m",
            "recipes.lightning_trainer",
            "fit",
            "--config",
            "configs/lightning/ddp.yaml",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
        ],
        timeout_s=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Starting with 2 processes" in proc.stdout + proc.stderr
    (version,) = glob.glob(os.path.join(tmp_path, "lightning_trainer_cli", "version_*"))
    with open(os.path.join(version, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    train_losses = [float(row["train_loss"]) for row in rows if row.get("train_loss")]
    assert_losses_close(train_losses, run_alone(ddp_result, REFERENCE).losses, atol=1e-5)
    assert any(row.get("val_loss") for row in rows), "validation ran (val_check_interval: 3)"
    assert sorted(os.listdir(os.path.join(version, "checkpoints"))) == [
        "step=3.ckpt",
        "step=6.ckpt",
    ]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]


@needs_jsonargparse
def test_wrong_key_in_yaml_config_is_named_by_lightning_cli(tmp_path, capsys):
    """In this process, as the bad-value tests below: a fresh one spends ~5 s importing Lightning
    (the slow YAML launcher test above covers ``python -m ... fit --config``)."""
    with open(os.path.join(REPO_ROOT, "configs", "lightning", "ddp.yaml")) as f:
        bad = f.read().replace("max_steps:", "max_stepz:")
    config = tmp_path / "bad.yaml"
    config.write_text(bad)
    with pytest.raises(SystemExit) as exit_info, mock.patch.object(sys, "argv", ["x.py"]):
        lightning_trainer.lightning_cli(["fit", "--config", str(config)])
    assert exit_info.value.code not in (0, None)
    err = capsys.readouterr().err
    assert "error:" in err and "trainer.max_stepz" in err, err


# Each config file, parsed by the recipe's LightningCLI into the classes it names, in this
# process: a key Lightning no longer knows, or a class path that moved, fails here.
@needs_jsonargparse
@pytest.mark.parametrize(
    "config, expected",
    [
        ("ddp.yaml", ["strategy: ddp", "devices: 2", "lightning.pytorch.loggers.CSVLogger"]),
        ("fsdp.yaml", ["FSDPStrategy", "recipes.toy.Block", "state_dict_type: sharded"]),
    ],
)
def test_each_yaml_config_is_valid(capsys, config, expected):
    with (
        pytest.raises(SystemExit) as exit_info,
        mock.patch.object(sys, "argv", ["lightning_trainer.py"]),
    ):
        lightning_trainer.lightning_cli(
            [
                "fit",
                "--config",
                os.path.join(REPO_ROOT, "configs", "lightning", config),
                "--print_config",
            ]
        )
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    for text in expected:
        assert text in printed, f"{text!r} not in the printed {config} config"


@needs_jsonargparse
@pytest.mark.slow
def test_fsdp_yaml_config_trains_on_cpu_with_the_cpu_strategy(tmp_path):
    proc = run_cli(
        [
            PYTHON,
            "-m",
            "recipes.lightning_trainer",
            "fit",
            "--config",
            "configs/lightning/fsdp.yaml",
            "--trainer.accelerator",
            "cpu",
            "--trainer.precision",
            "32-true",
            "--trainer.strategy.class_path",
            "recipes.lightning_trainer.FSDPOnCPUStrategy",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
        ],
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (version,) = glob.glob(os.path.join(tmp_path, "lightning_trainer_fsdp", "version_*"))
    assert sorted(os.listdir(os.path.join(version, "checkpoints"))) == [
        "step=3.ckpt",
        "step=6.ckpt",
    ]


@pytest.mark.skipif(CUDA_DEVICES > 0, reason="on a GPU machine 16-mixed is valid")
def test_fp16_mixed_on_cpu_is_an_error_not_a_silent_bf16_run(tmp_path):
    with pytest.raises(
        ValueError, match="precision '16-mixed' needs CUDA.*use --precision bf16-mixed"
    ):
        lightning_trainer.train(lightning_cfg(str(tmp_path), precision="16-mixed"))


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"devices": 3},
            (
                r"the launcher started 1 node\(s\) x 1 process\(es\); "
                r"--devices 3 --num-nodes 0 disagree"
            ),
        ),
        (
            {"strategy": "model_parallel", "tensor_parallel_size": 2},
            "tensor_parallel_size=2 does not divide the world of 1",
        ),
        # FSDP features that torch 2.13 only gets right on GPUs (each found by running it on CPU):
        # refused up front.
        ({"strategy": "fsdp", "cpu_offload": True}, "on a CPU world they are there already"),
        ({"strategy": "fsdp", "state_dict_type": "full"}, "use --state-dict-type sharded on CPU"),
    ],
)
def test_settings_that_do_not_fit_the_world_are_rejected(tmp_path, changes, message):
    if "strategy" in changes and changes["strategy"] == "fsdp" and CUDA_DEVICES:
        pytest.skip("these FSDP settings are valid on GPUs")
    with pytest.raises(ValueError, match=message):
        lightning_trainer.train(lightning_cfg(str(tmp_path), **changes))


def test_ddp_spawn_inside_a_launched_world_is_rejected(tmp_path):
    with mock.patch.dict(os.environ, {"RANK": "0"}):
        with pytest.raises(ValueError, match="ddp_spawn' starts its own processes"):
            lightning_trainer.train(lightning_cfg(str(tmp_path), strategy="ddp_spawn", devices=2))


def test_help_names_both_command_lines(capsys):
    try:
        lightning_trainer.main(["--help"])
    except SystemExit as exit_info:  # torch's @record turns argparse's exit 0 into a return
        assert exit_info.code == 0
    printed = capsys.readouterr().out
    assert "--strategy {ddp,ddp_spawn,fsdp,model_parallel}" in printed and "LightningCLI" in printed


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"global_batch_size": 9},
            r"global_batch_size=9 does not divide across 2 ranks; use a multiple of 2",
        ),
        (
            {"accumulate_grad_batches": 2, "global_batch_size": 6},
            (
                r"global_batch_size=6 does not divide across 2 ranks x 2 micro-batches; "
                r"use a multiple of 4"
            ),
        ),
    ],
)
def test_ddp_spawn_checks_the_batch_in_the_parent_before_spawning(tmp_path, changes, message):
    # Once a 70-line ProcessRaisedException from every spawned process; now one line, no spawn.
    cfg = lightning_cfg(str(tmp_path), strategy="ddp_spawn", devices=2, **changes)
    with mock.patch("recipes.lightning_trainer._fit", side_effect=AssertionError("spawned")):
        with pytest.raises(ValueError, match=message):
            lightning_trainer.train(cfg)


@needs_jsonargparse
@pytest.mark.parametrize(
    "old, new, message",
    [
        (
            "model:\n  model: tiny",
            "model:\n  model: huge",
            "error: unknown model.model='huge'; valid values: tiny, small, 100m",
        ),
        (
            "global_batch_size: 12",
            "global_batch_size: 9",
            "error: data.global_batch_size=9 does not divide across 2 ranks; use a multiple of 2",
        ),
    ],
)
def test_bad_yaml_values_are_one_line_and_exit_2(tmp_path, capsys, old, new, message):
    """Once a KeyError traceback, and the right message 108 lines deep: now one line, exit 2,
    before Lightning starts any process."""
    with open(os.path.join(REPO_ROOT, "configs", "lightning", "ddp.yaml")) as f:
        text = f.read()
    assert old in text
    config = tmp_path / "bad.yaml"
    config.write_text(text.replace(old, new, 1))
    with pytest.raises(SystemExit) as exit_info, mock.patch.object(sys, "argv", ["x.py"]):
        lightning_trainer.lightning_cli(
            ["fit", "--config", str(config), "--trainer.logger.init_args.save_dir", str(tmp_path)]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(message), err


def test_ddp_spawn_batch_from_the_command_line_is_one_line_and_exit_2(capsys):
    argv = ["--strategy", "ddp_spawn", "--devices", "2", "--global-batch-size", "9"]
    with mock.patch("recipes.lightning_trainer._fit", side_effect=AssertionError("spawned")):
        with pytest.raises(SystemExit) as exit_info:
            lightning_trainer.main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: global_batch_size=9 does not divide across 2 ranks; use a multiple of 2, "
        "e.g. 8 or 10"
    ]


def test_a_bad_number_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        lightning_trainer.main(["--gradient-clip-val", "nan"])
    assert exit_info.value.code == 2
    # argparse's own refusal, as every copyable recipe's: the usage line, then the one error line
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith("error: gradient_clip_val must be a finite number >= 0, got nan")
    )


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"accumulate_grad_batches": 0},
            r"accumulate_grad_batches must be a whole number >= 1, got 0",
        ),
        ({"tensor_parallel_size": -2}, r"tensor_parallel_size must be a whole number >= 0, got -2"),
        (
            {"strategy": "deepspeed"},
            r"strategy must be one of ddp, ddp_spawn, fsdp, model_parallel, got 'deepspeed'",
        ),
    ],
)
def test_a_config_built_in_code_is_checked_like_the_command_line(tmp_path, changes, message):
    # not a ZeroDivisionError from the batch check, or Lightning's traceback: one line
    with pytest.raises(ValueError, match=f"^{message}$"):
        lightning_cfg(str(tmp_path), **changes)
