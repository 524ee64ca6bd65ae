"""sharded_checkpoint: a resumed run equals an uninterrupted one (DDP, FSDP, fully_shard), also
resharded from 2 ranks to 1, 3 and 4; full state-dict export and import; async save; a save killed
part-way never damages the last good checkpoint; a damaged checkpoint is skipped in one line on
--resume-from latest (the one before resumes exactly) and refused by name when named."""

import contextlib
import glob
import json
import os
import pickle
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from recipes import _checkpoint_store, sharded_checkpoint
from recipes._checkpoint_store import (
    CheckpointError,
    file_entry,
    find_checkpoint,
    load_checkpoint,
    published_steps,
    resume_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from recipes.core.state import full_state_on_rank0
from recipes.core.workload import build_model, lm_loss, make_dataset
from recipes.core.world import RankError, join_world
from recipes.options import parse_config
from recipes.sharded_checkpoint import AppState, CheckpointConfig, ResumableSampler
from tests.helpers import (
    CUDA_DEVICES,
    PYTHON,
    assert_losses_close,
    assert_states_close,
    in_one_world,
    last_json,
    recipe_result,
    run_alone,
    run_cli,
    run_world,
    spawn_world,
    with_fields,
)
from tests.once import once_per_run

# Its tests share module fixtures that run whole worlds: one worker runs them all (pyproject:
# --dist loadgroup), so the fixtures run once rather than once per worker.
pytestmark = pytest.mark.xdist_group("sharded_checkpoint")

STRATEGIES = ["ddp", "fsdp", "fsdp2"]
# resume_from="": the recipe's default ("latest") would pick up whatever the default directory
# holds.
# Every run goes through the harness (recipe_result: prove, with the final state gathered to rank 0
# by recipes.core.observe.CheckpointObserver); the recipe itself returns losses and save figures.
BASE = CheckpointConfig(steps=6, save_every=0, resume_from="", timeout_s=120, precision="fp32")
# Same world, same strategy: the resumed run repeats the same arithmetic (observed: bit-identical).
# Another world size sums the gradients in another order: equal to float32 rounding.
SAME_WORLD_ATOL, RESHARDED_ATOL = 1e-6, 1e-5


def read_latest(root) -> str:
    with open(os.path.join(root, "latest")) as f:
        return f.read().strip()


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """One world of 2: per strategy, 6 uninterrupted steps, and 3 steps that save and export; one
    async run."""

    def build(folder: Path):
        root = folder
        configs = []
        for strategy in STRATEGIES:
            configs += [
                with_fields(BASE, strategy=strategy),
                with_fields(
                    BASE,
                    strategy=strategy,
                    steps=3,
                    save_every=3,
                    checkpoint_dir=str(root / strategy),
                    export_to=str(root / f"{strategy}.pt"),
                ),
            ]
        configs.append(
            with_fields(
                BASE,
                strategy="fsdp2",
                save_every=2,
                async_save=True,
                keep_last=2,
                checkpoint_dir=str(root / "async"),
            )
        )
        results = run_world(recipe_result, 2, configs, deadline_s=240)
        return SimpleNamespace(
            root=root,
            async_run=results[-1],
            straight={s: results[2 * i] for i, s in enumerate(STRATEGIES)},
            first_half={s: results[2 * i + 1] for i, s in enumerate(STRATEGIES)},
        )

    return once_per_run(tmp_path_factory, "sharded-checkpoint-saved", build)


def resume_import_and_rng(configs, exported_file, rng_dir):
    """In a FRESH world: resume each config; load a full file into each strategy's model; RNG round
    trip."""
    with join_world("gloo", timeout_s=120) as world:
        results = [recipe_result(cfg) for cfg in configs]
        imported = {}
        for strategy in STRATEGIES:
            # Another seed: the file must overwrite every weight of the sharded model.
            model = sharded_checkpoint.parallelize(build_model("tiny", seed=1), strategy, world)
            sharded_checkpoint.load_full_state_dict(model, exported_file)
            imported[strategy] = full_state_on_rank0(model)[0]
        # RNG: each rank saves its own stream, then draws; after reseeding and loading it must draw
        # the same.
        group = dist.new_group(backend="gloo")
        model = sharded_checkpoint.parallelize(build_model("tiny"), "ddp", world)
        app = AppState(
            model,
            torch.optim.AdamW(model.parameters()),
            global_batch_size=12,
            batches_per_epoch=4,
            group=group,
        )
        torch.manual_seed(100 + world.rank)
        torch.rand(5)
        save_checkpoint(rng_dir, {"app": app}, 1, group=group).finish()
        expected = torch.rand(3)
        torch.manual_seed(0)
        load_checkpoint(os.path.join(rng_dir, "step_00000001"), {"app": app}, group=group)
        draws = [None] * world.world_size
        dist.all_gather_object(draws, (expected.tolist(), torch.rand(3).tolist()))
        dist.destroy_process_group(group)
        return results, imported, draws


@pytest.fixture(scope="session")
def resumed(saved, tmp_path_factory):
    """A new world of 2 resumes each strategy's step-3 checkpoint, and the async run's step 4:
    named, and as 'latest' of a copy whose step 6 has a shard cut to half (issue 32)."""

    def build(folder: Path):
        damaged = shutil.copytree(saved.root / "async", folder / "damaged")
        shard = damaged / "step_00000006" / "__1_0.distcp"
        os.truncate(shard, os.path.getsize(shard) // 2)
        configs = [
            with_fields(BASE, strategy=s, resume_from="latest", checkpoint_dir=str(saved.root / s))
            for s in STRATEGIES
        ]
        configs.append(
            with_fields(
                BASE, strategy="fsdp2", resume_from=str(saved.root / "async" / "step_00000004")
            )
        )
        configs.append(
            with_fields(BASE, strategy="fsdp", steps=1, init_from=str(saved.root / "ddp.pt"))
        )
        configs.append(
            with_fields(BASE, strategy="fsdp2", resume_from="latest", checkpoint_dir=str(damaged))
        )
        results, imported, draws = spawn_world(
            resume_import_and_rng,
            2,
            configs,
            str(saved.root / "ddp.pt"),
            str(folder),
            deadline_s=240,
        )
        return SimpleNamespace(
            by_strategy=dict(zip(STRATEGIES, results)),
            async_resume=results[3],
            init_from=results[4],
            past_damage=results[5],
            damaged=damaged,
            imported=imported,
            draws=draws,
        )

    return once_per_run(tmp_path_factory, "sharded-checkpoint-resumed", build)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resumed_run_in_a_new_world_equals_the_uninterrupted_run(saved, resumed, strategy):
    straight, first, second = (
        saved.straight[strategy],
        saved.first_half[strategy],
        resumed.by_strategy[strategy],
    )
    assert first.losses == straight.losses[:3]
    assert (
        first.extras["saved_steps"] == [3] and read_latest(saved.root / strategy) == "step_00000003"
    )
    assert (second.extras["start_step"], second.extras["saved_by_world_size"]) == (3, 2)
    # 6 steps with batches_per_epoch=4: the resumed part crosses an epoch: the epoch was restored.
    assert_losses_close(second.losses, straight.losses[3:], atol=SAME_WORLD_ATOL)
    assert_states_close(second.final_state, straight.final_state, atol=SAME_WORLD_ATOL)
    assert straight.losses[-1] < straight.losses[0], "the model should learn"


# 4 ranks on a 2-core CI machine is the slowest world here: 1 and 3 cover resharding by default.
@pytest.mark.parametrize("world_size", [1, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_checkpoint_of_2_ranks_resumes_on_1_3_and_4_ranks(saved, world_size):
    # fully_shard -> fully_shard (DTensor shards re-cut), and across strategies: FSDP's
    # ShardedTensors into DDP, DDP's replicated tensors into fully_shard. Optimizer state included:
    # Adam's moments decide the next steps, so wrong or missing moments show in losses and weights.
    pairs = [("fsdp2", "fsdp2"), ("fsdp", "ddp"), ("ddp", "fsdp2")]
    configs = [
        with_fields(
            BASE,
            strategy=loaded_as,
            resume_from="latest",
            checkpoint_dir=str(saved.root / saved_by),
        )
        for saved_by, loaded_as in pairs
    ]
    if world_size == 1:
        results = [run_alone(recipe_result, cfg) for cfg in configs]
    else:
        results = run_world(recipe_result, world_size, configs, deadline_s=240)
    for (saved_by, _loaded_as), result in zip(pairs, results):
        straight = saved.straight[saved_by]
        assert (result.world_size, result.extras["saved_by_world_size"]) == (world_size, 2)
        assert_losses_close(result.losses, straight.losses[3:], atol=RESHARDED_ATOL)
        assert_states_close(result.final_state, straight.final_state, atol=RESHARDED_ATOL)


def test_async_save_trains_the_same_and_its_snapshot_resumes_exactly(saved, resumed):
    run = saved.async_run
    assert run.losses == saved.straight["fsdp2"].losses  # saving in the background changed nothing
    assert run.extras["saved_steps"] == [2, 4, 6]
    assert published_steps(saved.root / "async") == [4, 6]  # keep_last=2 deleted step 2
    assert read_latest(saved.root / "async") == "step_00000006"
    assert not [n for n in os.listdir(saved.root / "async") if n.startswith(".tmp-")]
    # The step-4 snapshot was taken while steps 5 and 6 updated the parameters: it holds step 4's.
    assert_losses_close(
        resumed.async_resume.losses, saved.straight["fsdp2"].losses[4:], atol=SAME_WORLD_ATOL
    )
    assert_states_close(
        resumed.async_resume.final_state, saved.straight["fsdp2"].final_state, atol=SAME_WORLD_ATOL
    )


def test_latest_skips_a_damaged_checkpoint_and_resumes_exactly_from_the_one_before(saved, resumed):
    # Issue 32: the newest checkpoint's shard cut to half by a crash once ended the relaunch in a
    # CheckpointException traceback on every rank. In a world of 2, 'latest' skips step 6, sets it
    # aside, repoints 'latest', and resumes from step 4 exactly as the named step 4 does.
    run, damaged = resumed.past_damage, resumed.damaged
    assert run.extras["resumed_from"] == str(damaged / "step_00000004")
    assert run.extras["start_step"] == 4
    assert run.losses == resumed.async_resume.losses  # the same checkpoint: the same arithmetic
    assert_states_close(run.final_state, resumed.async_resume.final_state, atol=0.0)
    assert_losses_close(run.losses, saved.straight["fsdp2"].losses[4:], atol=SAME_WORLD_ATOL)
    assert published_steps(damaged) == [4] and read_latest(damaged) == "step_00000004"
    assert (damaged / ".skipped-step_00000006" / "__1_0.distcp").exists()


def damage_file(path: Path, how: str) -> str:
    """Damage one file from outside; returns what the store must say about it."""
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
        return (
            f"{path.name} is truncated or overwritten: {len(data) // 2} bytes, "
            f"the manifest says {len(data)}"
        )
    if how == "garbage":  # the manifest itself: no longer JSON
        path.write_bytes(data[: len(data) // 2])
        return f"{path.name} is unreadable (JSONDecodeError: "
    if how == "remove":
        path.unlink()
        if path.name != "MANIFEST.json":
            return f"{path.name} is missing"
        return (  # what a folder never published looks like, or a checkpoint from before manifests
            f"{path.name} is missing (a folder never published, or one written before "
            "checkpoints were verified)"
        )
    middle = len(data) // 2  # flip: the same size, one byte changed: only the sha256 sees it
    path.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :])
    return f"{path.name} is corrupt: its sha256 differs from the manifest's"


@pytest.mark.parametrize(
    "name, how",
    [
        ("__1_0.distcp", "truncate"),
        ("__0_0.distcp", "flip"),
        (".metadata", "flip"),
        (".metadata", "remove"),
        ("MANIFEST.json", "garbage"),
        ("MANIFEST.json", "remove"),
    ],
)
def test_latest_skips_each_kind_of_damage_in_one_line(saved, tmp_path, capsys, name, how):
    # No world: the choice alone (the world above proves the resume). Every file of step 6.
    root = shutil.copytree(saved.root / "async", tmp_path / "async")  # steps 4 and 6
    said = damage_file(root / "step_00000006" / name, how)
    capsys.readouterr()
    path, manifest = resume_checkpoint("latest", str(root))
    assert (path, manifest["step"]) == (str(root / "step_00000004"), 4)
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "skipped" in line]
    assert line.startswith(f"skipped checkpoint step_00000006 in {root}: {said}"), line
    assert line.endswith("; set aside as .skipped-step_00000006; resuming from step_00000004")
    assert published_steps(root) == [4] and read_latest(root) == "step_00000004"
    assert os.path.isdir(root / ".skipped-step_00000006")


def test_no_checkpoint_that_verifies_is_one_line_naming_the_folder(saved, tmp_path):
    root = shutil.copytree(saved.root / "async", tmp_path / "async")
    said = damage_file(root / "step_00000006" / "__1_0.distcp", "truncate")
    damage_file(root / "step_00000004" / ".metadata", "flip")
    with pytest.raises(CheckpointError) as raised:
        resume_checkpoint("latest", str(root))
    assert str(raised.value) == (
        f"no checkpoint in {root} verifies: step_00000006: {said} (1 older one(s) too); restore "
        f"a good step_* folder there, or move {root} away to start fresh"
    )
    # nothing moved: every relaunch refuses alike, and none starts fresh over the run
    assert published_steps(root) == [4, 6] and read_latest(root) == "step_00000006"
    assert not [name for name in os.listdir(root) if name.startswith(".skipped-")]


def test_rng_state_of_every_rank_is_restored(resumed):
    for rank, (expected, drawn) in enumerate(resumed.draws):
        assert drawn == expected, f"rank {rank} did not get its own RNG stream back"
    assert resumed.draws[0][0] != resumed.draws[1][0], "ranks had distinct streams to restore"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_export_is_a_plain_state_dict_for_single_device_inference(saved, strategy):
    exported = torch.load(saved.root / f"{strategy}.pt", weights_only=True)
    plain = build_model("tiny", seed=1)
    plain.load_state_dict(
        exported
    )  # strict: no "module." / "_fsdp_wrapped_module." prefixes, nothing missing
    assert_states_close(
        dict(plain.named_parameters()), saved.first_half[strategy].final_state, atol=0.0
    )


def test_full_file_loads_into_every_sharded_model(saved, resumed):
    exported = torch.load(saved.root / "ddp.pt", weights_only=True)
    for strategy in STRATEGIES:
        assert_states_close(resumed.imported[strategy], exported, atol=0.0)


def test_init_from_a_full_file_starts_training_from_its_weights(saved, resumed):
    # The first loss of a run started with --init-from is the file's model on global batch 0.
    model = build_model("tiny", seed=1)
    model.load_state_dict(torch.load(saved.root / "ddp.pt", weights_only=True))
    dataset = make_dataset("tiny", 12, batches_per_epoch=BASE.batches_per_epoch)
    first_batch = list(ResumableSampler(dataset, per_rank_batch_size=12, num_replicas=1, rank=0))[
        :12
    ]
    inputs, targets = dataset.tokens[first_batch][:, :-1], dataset.tokens[first_batch][:, 1:]
    with torch.no_grad():
        expected = lm_loss(model(inputs), targets).item()
    assert resumed.init_from.extras["start_step"] == 0
    assert_losses_close(resumed.init_from.losses, [expected], atol=1e-5)


def test_the_same_command_again_has_nothing_left_to_train(saved):
    cfg = with_fields(
        BASE, strategy="ddp", steps=3, resume_from="latest", checkpoint_dir=str(saved.root / "ddp")
    )
    result = run_alone(recipe_result, cfg)
    assert (result.extras["start_step"], result.losses, result.extras["saved_steps"]) == (3, [], [])


def test_whole_checkpoint_converts_offline_to_one_torch_save_file(saved, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(saved.root / "ddp" / "step_00000003", tmp_path / "all.pt")  # no world needed
    converted = torch.load(tmp_path / "all.pt", weights_only=True)["app"]
    assert_states_close(
        converted["model"], torch.load(saved.root / "ddp.pt", weights_only=True), atol=0.0
    )
    assert converted["progress"]["step"] == 3 and "state" in converted["optim"]


def train_and_die_in_a_save(cfg, fatal_save):
    """Runs on every rank: rank 1 dies while writing its shard of save number ``fatal_save``."""
    from torch.distributed.checkpoint import filesystem

    original, saves = filesystem.FileSystemWriter.write_data, []

    def write_data_then_die(self, plan, planner):
        saves.append(plan)
        if len(saves) == fatal_save and dist.get_rank() == 1:
            with open(os.path.join(str(self.path), "__1_0.distcp"), "wb") as f:
                f.write(
                    b"\0" * 100
                )  # half a shard, then the process is gone: what a lost node leaves
            os._exit(1)
        return original(self, plan, planner)

    filesystem.FileSystemWriter.write_data = write_data_then_die  # in this rank's process only
    return in_one_world(recipe_result, [cfg], timeout_s=120)


def test_save_killed_part_way_leaves_the_last_checkpoint_loadable(saved, tmp_path):
    root = tmp_path / "crash"
    cfg = with_fields(BASE, strategy="fsdp2", save_every=3, checkpoint_dir=str(root))
    with pytest.raises(RankError, match="rank 1 exited with code 1"):
        spawn_world(train_and_die_in_a_save, 2, cfg, 2, deadline_s=240)  # dies in the step-6 save
    assert read_latest(root) == "step_00000003"
    assert published_steps(root) == [3]
    assert not (root / "step_00000006").exists() and (root / ".tmp-step_00000006").exists()
    verify_checkpoint(str(root / "step_00000003"))
    # The job is restarted (here on 1 rank) with the same command: it resumes from step 3, finishes.
    result = run_alone(recipe_result, with_fields(cfg, resume_from="latest"))
    assert result.extras["start_step"] == 3
    assert_losses_close(result.losses, saved.straight["fsdp2"].losses[3:], atol=RESHARDED_ATOL)
    assert read_latest(root) == "step_00000006" and published_steps(root) == [3, 6]
    assert not (root / ".tmp-step_00000006").exists(), "the wreck of the killed save was cleared"


@pytest.fixture
def checkpoint_copy(saved, tmp_path):
    """A copy of a published 2-rank checkpoint, to damage."""
    return shutil.copytree(saved.root / "ddp" / "step_00000003", tmp_path / "step_00000003")


def test_truncated_shard_is_refused_on_load_naming_the_file(checkpoint_copy):
    shard = os.path.join(checkpoint_copy, "__1_0.distcp")
    size = os.path.getsize(shard)
    os.truncate(shard, size // 2)
    cfg = with_fields(BASE, strategy="ddp", resume_from=str(checkpoint_copy))
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint file {shard} is truncated or overwritten: "
        rf"{size // 2} bytes, the manifest says {size}",
    ):
        run_alone(recipe_result, cfg)


def test_corrupt_missing_and_unpublished_files_are_refused(checkpoint_copy, tmp_path):
    shard = os.path.join(checkpoint_copy, "__0_0.distcp")
    with open(shard, "r+b") as f:  # same size, one byte flipped: only the checksum can tell
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(
        CheckpointError, match=rf"checkpoint file {shard} is corrupt: its sha256 differs"
    ):
        verify_checkpoint(checkpoint_copy)
    os.remove(os.path.join(checkpoint_copy, ".metadata"))
    with pytest.raises(
        CheckpointError, match=r"checkpoint file .*/\.metadata is missing \(1 more bad file\(s\)\)"
    ):
        verify_checkpoint(checkpoint_copy)
    os.remove(
        os.path.join(checkpoint_copy, "MANIFEST.json")
    )  # what an unpublished .tmp-* directory looks like
    with pytest.raises(CheckpointError, match=r"cannot be verified: MANIFEST.json is missing"):
        verify_checkpoint(checkpoint_copy)


def test_bad_resume_and_overwrite_requests_are_refused(saved, tmp_path, capsys):
    ddp_dir = str(saved.root / "ddp")
    with pytest.raises(
        CheckpointError, match=r"already holds checkpoints past step 0 \(up to step 3\)"
    ):
        run_alone(
            recipe_result,
            with_fields(BASE, strategy="ddp", save_every=3, checkpoint_dir=ddp_dir),
        )
    with pytest.raises(
        CheckpointError,
        match=r"was trained with global_batch_size=12; resume with the same "
        r"--global-batch-size, or the resumed run reads other data",
    ):
        run_alone(
            recipe_result,
            with_fields(
                BASE,
                strategy="ddp",
                global_batch_size=6,
                resume_from="latest",
                checkpoint_dir=ddp_dir,
            ),
        )
    with pytest.raises(
        CheckpointError, match=r"--resume-from .*nowhere: no such checkpoint directory"
    ):
        find_checkpoint(str(tmp_path / "nowhere"), ddp_dir)
    (tmp_path / "latest").write_text("step_00000009")
    with pytest.raises(CheckpointError, match=r"names .*step_00000009, which does not exist"):
        find_checkpoint("latest", str(tmp_path))
    assert (
        find_checkpoint("latest", str(tmp_path / "empty")) is None
    )  # first run of a requeued job: fresh
    # The command line refuses what the config would not run, in one line (argparse: exit 2).
    for args, message in [
        (
            ["--strategy", "zero"],
            "argument --strategy: invalid choice: 'zero' (choose from 'ddp', 'fsdp', 'fsdp2')",
        ),
        (["--save-every", "-1"], "save_every must be a whole number >= 0, got -1"),
    ]:
        with pytest.raises(SystemExit) as exited:
            parse_config(sharded_checkpoint.make_parser(), CheckpointConfig, args)
        assert exited.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.skipif(
    CUDA_DEVICES < 2, reason=f"NCCL with 2 ranks needs 2 CUDA devices, found {CUDA_DEVICES}"
)
def test_nccl_world_saves_async_and_a_cpu_world_resumes(saved, tmp_path):
    # GPU path: CUDA RNG state, cpu_offload of the full state, async staging from GPU memory; the
    # checkpoint I/O still runs on its own gloo group. The same checkpoint then resumes on CPU/gloo.
    cfg = with_fields(
        BASE,
        strategy="fsdp2",
        backend="nccl",
        save_every=3,
        async_save=True,
        checkpoint_dir=str(tmp_path / "nccl"),
    )
    (first,) = run_world(
        recipe_result, 2, [with_fields(cfg, steps=3)], backend="nccl", deadline_s=240
    )
    (second,) = run_world(
        recipe_result,
        2,
        [with_fields(cfg, resume_from="latest", save_every=0)],
        backend="nccl",
        deadline_s=240,
    )
    on_cpu = run_alone(
        recipe_result,
        with_fields(cfg, backend="gloo", resume_from="latest", save_every=0),
    )
    reference = saved.straight["fsdp2"].losses  # computed on CPU: GPU kernels differ in rounding
    assert_losses_close(first.losses + second.losses, reference, atol=1e-4)
    assert_losses_close(on_cpu.losses, second.losses, atol=1e-4)


# Slow: a torchrun launch (torchrun and its workers each import torch: ~10 s of CPU).
# The same code runs in a spawned world in the default run; test_ddp_torchrun, test_elastic
# and test_multinode cover the launch path itself there.
@pytest.mark.slow
def test_torchrun_saves_and_one_process_resumes_and_exports(saved, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    launched = run_cli(
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "recipes.core.prove",  # the recipe, measured: its JSON result line comes last
            "sharded_checkpoint",
            "--strategy",
            "fsdp2",
            "--steps",
            "3",
            "--checkpoint-dir",
            ckpt,
        ],
        timeout_s=180,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    first = last_json(launched.stdout)
    resumed = run_cli(
        [
            PYTHON,
            "-m",
            "recipes.core.prove",
            "sharded_checkpoint",
            "--strategy",
            "fsdp",
            "--steps",
            "6",
            "--precision",
            "fp32",
            "--resume-from",
            "latest",
            "--checkpoint-dir",
            ckpt,
            "--export-to",
            str(tmp_path / "m.pt"),
        ],
        timeout_s=180,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    second = last_json(resumed.stdout)
    assert (first["world_size"], second["world_size"], second["extras"]["saved_by_world_size"]) == (
        2,
        1,
        2,
    )
    assert_losses_close(
        first["losses"] + second["losses"], saved.straight["fsdp2"].losses, atol=RESHARDED_ATOL
    )
    assert "resumed from" in resumed.stdout and "[rank1]" not in launched.stdout
    build_model("tiny").load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    # No checkpoint that verifies ends the CLI with one line naming the folder, exit code 2, no
    # traceback (one damaged checkpoint is skipped: test_latest_skips_a_damaged_checkpoint_...).
    os.truncate(os.path.join(ckpt, "step_00000006", "__0_0.distcp"), 10)
    os.truncate(os.path.join(ckpt, "step_00000003", ".metadata"), 10)
    bad = run_cli(
        [
            PYTHON,
            "-m",
            "recipes.sharded_checkpoint",
            "--steps",
            "9",
            "--resume-from",
            "latest",
            "--checkpoint-dir",
            ckpt,
        ],
        timeout_s=120,
    )
    assert bad.returncode == 2
    assert f"error: no checkpoint in {ckpt} verifies: step_00000006: __0_0.distcp is " in (
        bad.stderr
    )
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    "paths, message",
    [
        ({"checkpoint_dir": "a_file"}, r"^--checkpoint-dir .*/a_file is a file; name a directory$"),
        (
            {"checkpoint_dir": "a_file/ckpt"},
            r"^--checkpoint-dir .*/a_file/ckpt: .*/a_file is a file, not a directory; "
            r"name a directory",
        ),
        (
            {"export_to": "a_file/model.pt"},
            r"^--export-to .*/a_file/model.pt: .*/a_file is a file, not a directory; "
            r"name a file in",
        ),
        ({"export_to": "."}, r"^--export-to .* is a directory; name a file, e.g. .*/model.pt$"),
        (
            {"init_from": "missing.pt"},
            r"^--init-from .*/missing.pt: no such file; name a full state_dict file",
        ),
    ],
)
def test_bad_paths_are_refused_before_training(tmp_path, paths, message):
    # Once all three trained first and then failed with a traceback. A file where a folder goes
    # (or a folder where a file goes) is refused by the config itself; the rest before training.
    (tmp_path / "a_file").write_text("")
    paths = {"checkpoint_dir": "ckpt", **paths}
    trained = AssertionError("trained")
    with mock.patch.object(sharded_checkpoint, "parallelize", side_effect=trained):
        with pytest.raises(CheckpointError, match=message):
            cfg = {name: str(tmp_path / p) for name, p in paths.items()}
            run_alone(recipe_result, with_fields(BASE, save_every=3, **cfg))
    assert sorted(os.listdir(tmp_path)) == ["a_file"]  # the check created nothing


def test_an_init_from_that_is_a_folder_or_does_not_parse_is_one_line(tmp_path):
    with pytest.raises(CheckpointError, match=r"^--init-from .* is a directory; name a full"):
        with_fields(BASE, init_from=str(tmp_path))  # a step_* folder given as the file
    not_a_state_dict = tmp_path / "model.pt"
    not_a_state_dict.write_text("not what torch.save writes")
    cfg = with_fields(BASE, steps=1, resume_from="", save_every=0, init_from=str(not_a_state_dict))
    with pytest.raises(
        CheckpointError,
        match=rf"^--init-from {not_a_state_dict} is not a state_dict file torch.load reads "
        r"\(\w+: .*\); name one that --export-to wrote$",
    ):
        run_alone(recipe_result, cfg)


def test_a_file_as_checkpoint_dir_is_one_line_from_the_command_line(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    proc = run_cli(
        [PYTHON, "-m", "recipes.sharded_checkpoint", "--checkpoint-dir", str(a_file)], timeout_s=60
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    *usage, line = proc.stderr.strip().splitlines()  # the config refuses it: argparse's usage
    assert line == (
        f"python -m recipes.sharded_checkpoint: error: --checkpoint-dir {a_file} is a file; "
        "name a directory"
    )
    # argparse's usage; runpy's warning where the harness forks a process that imported the recipe
    assert all(text.startswith(("usage:", " ", "<frozen runpy>")) for text in usage), usage
    assert "Traceback" not in proc.stderr


def test_a_crash_between_publishing_and_latest_resumes_from_the_newest_published(
    saved, tmp_path, capsys
):
    # publish() renames step_N into place, then replaces 'latest': a crash in between left step 6
    # published and 'latest' naming step 4 (or, on a first save, no 'latest' at all). The same
    # command must resume from step 6, not refuse with "already holds checkpoints past step 4".
    root = shutil.copytree(saved.root / "async", tmp_path / "async")
    cfg = with_fields(
        BASE, strategy="fsdp2", save_every=3, resume_from="latest", checkpoint_dir=str(root)
    )
    for pointer in ["step_00000004", None]:
        if pointer:
            (root / "latest").write_text(pointer)
        else:
            os.remove(root / "latest")
        capsys.readouterr()
        result = run_alone(recipe_result, cfg)  # find_checkpoint says why, on rank 0's stdout
        assert (result.extras["start_step"], result.losses) == (6, [])
        assert result.extras["resumed_from"] == str(root / "step_00000006")
        expected = "names step_00000004" if pointer else "latest does not exist"
        said = capsys.readouterr().out
        assert f"resuming from {root}/step_00000006, the newest published checkpoint" in said
        assert expected in said


def test_an_empty_or_foreign_latest_file_is_refused_naming_it(tmp_path):
    # Once reported as "MANIFEST.json is missing" in the checkpoint directory itself.
    for content, what in [("", "is empty"), ("../elsewhere", "holds '../elsewhere', not a step_")]:
        (tmp_path / "latest").write_text(content)
        with pytest.raises(
            CheckpointError,
            match=rf"^{tmp_path}/latest {what}.*; delete it to resume "
            r"from the newest published checkpoint, or pass ",
        ):
            find_checkpoint("latest", str(tmp_path))


def rewrite_with_manifest(directory, name: str, data: bytes) -> None:
    """Replace a checkpoint file and its manifest entry: the damage the sha256 check cannot see."""
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)
    manifest_path = os.path.join(directory, "MANIFEST.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["files"][name] = file_entry(os.path.join(directory, name))
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize(
    "metadata", [bytes(range(256)) * 4, pickle.dumps(None)], ids=["garbage", "pickled-none"]
)
def test_files_altered_together_with_the_manifest_fail_in_one_line(checkpoint_copy, metadata):
    # Once an 80-190-line traceback from inside DCP (UnicodeDecodeError, "metadata is None").
    rewrite_with_manifest(checkpoint_copy, ".metadata", metadata)
    cfg = with_fields(BASE, strategy="ddp", resume_from=str(checkpoint_copy))
    with pytest.raises(CheckpointError) as raised:
        run_alone(recipe_result, cfg)
    assert re.fullmatch(
        rf"{checkpoint_copy} matches its MANIFEST.json but cannot be loaded "
        r"\(\w+: .*\); resume from another checkpoint",
        str(raised.value),
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"model": "small"},
            r"was trained with model=tiny; resume with the same --model, or start "
            r"the new model in another --checkpoint-dir$",
        ),
        (
            {"seed": 1},
            r"was trained with seed=0; resume with the same --seed, or the resumed run "
            r"reads other data$",
        ),
        (
            {"batches_per_epoch": 5},
            r"was trained with batches_per_epoch=4; resume with the same "
            r"--batches-per-epoch",
        ),
    ],
    ids=["model", "seed", "batches-per-epoch"],
)
def test_a_resume_with_other_settings_is_refused_before_loading(checkpoint_copy, change, message):
    # --model small on a tiny checkpoint once died in DCP with size-mismatch tracebacks, or SIGABRT.
    cfg = with_fields(BASE, strategy="ddp", resume_from=str(checkpoint_copy), **change)
    store = _checkpoint_store
    with mock.patch.object(store.dcp, "load", side_effect=AssertionError("loaded")):
        with pytest.raises(CheckpointError, match=rf"^{checkpoint_copy} {message}"):
            run_alone(recipe_result, cfg)


def test_lr_given_on_resume_replaces_the_checkpoints_and_says_so(saved, capsys):
    # The loaded optimizer state carries lr=1e-3; --lr 0.5 once lost to it silently.
    cfg = with_fields(
        BASE,
        strategy="ddp",
        steps=5,
        lr=0.5,
        resume_from="latest",
        checkpoint_dir=str(saved.root / "ddp"),
    )
    capsys.readouterr()
    result = run_alone(recipe_result, cfg)
    straight = saved.straight["ddp"].losses
    assert_losses_close(result.losses[:1], straight[3:4], atol=SAME_WORLD_ATOL)  # before any step
    assert abs(result.losses[1] - straight[4]) > 1e-2, "step 4 should have used lr=0.5"
    assert "--lr 0.5 replaces the checkpoint's lr 0.001" in capsys.readouterr().out


def train_until_a_save_is_in_flight(cfg, marker_dir, in_flight_step):
    """Runs on every rank: trains with --async-save; once the save of ``in_flight_step`` has been
    started (shards staged, the background writer busy, nothing published), writes this rank's pid
    to ``marker_dir`` and waits there to be killed."""
    start_save = sharded_checkpoint.save_checkpoint

    def start_then_wait(root, app, step, **kwargs):
        pending = start_save(root, app, step, **kwargs)
        if step == in_flight_step:
            marker = os.path.join(marker_dir, f"rank{dist.get_rank()}")
            with open(marker + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(marker + ".tmp", marker)
            time.sleep(300)  # the test SIGKILLs this process (and its writer) long before
        return pending

    sharded_checkpoint.save_checkpoint = start_then_wait  # in this rank's process only
    return in_one_world(recipe_result, [cfg], timeout_s=240)


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (Linux /proc): a rank, its DCP writer process, helpers."""
    parents = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError), open(stat) as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "(command name)": state, ppid
            parents[int(stat.split("/")[2])] = int(fields[1])
    tree = [pid]
    for parent in tree:  # grows while it is walked: breadth first
        tree += [child for child, its_parent in parents.items() if its_parent == parent]
    return tree


# Slow: a world of 2 whose ranks each start a DCP writer process (a fresh interpreter importing
# torch), then a 1-rank resume: about 40 s of CPU time, well over the default run's budget.
@pytest.mark.slow
@pytest.mark.parametrize("async_mode", ["process"])
def test_trainer_killed_during_an_async_save_keeps_the_last_good_checkpoint(
    saved, tmp_path, async_mode
):
    if not sys.platform.startswith("linux"):
        pytest.skip("finds the writer processes to kill through /proc (Linux only)")
    root, markers = tmp_path / "killed", tmp_path / "markers"
    markers.mkdir()
    cfg = with_fields(
        BASE,
        strategy="fsdp2",
        save_every=3,
        async_save=True,
        async_mode=async_mode,
        checkpoint_dir=str(root),
    )
    outcome = {}

    def run():
        try:
            outcome["result"] = spawn_world(
                train_until_a_save_is_in_flight, 2, cfg, str(markers), 6, deadline_s=240
            )
        except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
            outcome["error"] = exc

    world = threading.Thread(target=run, daemon=True)
    world.start()
    deadline = time.monotonic() + 240
    while len(os.listdir(markers)) < 2 and world.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sorted(os.listdir(markers)) == ["rank0", "rank1"], f"no save in flight: {outcome}"
    # What a lost node does to a job: every process of it, the writers too, dies at once (SIGKILL:
    # no handler, no atexit, no flush), while the step-6 save is being written.
    ranks = [int((markers / name).read_text()) for name in ("rank0", "rank1")]
    doomed = [pid for rank in ranks for pid in process_tree(rank)]
    assert len(doomed) > 2, "each rank should have started a writer process"
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    world.join(timeout=60)
    assert isinstance(outcome.get("error"), RankError), outcome
    assert "was killed by signal 9" in str(outcome["error"])

    # The last published checkpoint survives, verifies and is what 'latest' names.
    assert published_steps(root) == [3] and read_latest(root) == "step_00000003"
    assert not (root / "step_00000006").exists()
    verify_checkpoint(str(root / "step_00000003"))
    # The job is restarted (here on 1 rank, thread mode: this test process must not keep a DCP
    # writer process for the other tests) and trains exactly as the run that was never killed.
    result = run_alone(recipe_result, with_fields(cfg, resume_from="latest", async_mode="thread"))
    assert result.extras["start_step"] == 3
    assert_losses_close(result.losses, saved.straight["fsdp2"].losses[3:], atol=RESHARDED_ATOL)
    assert published_steps(root) == [3, 6] and read_latest(root) == "step_00000006"
    assert not [name for name in os.listdir(root) if name.startswith(".tmp-")]


def test_async_mode_is_refused_where_it_cannot_work(tmp_path):
    from torch.distributed.checkpoint import state_dict_saver

    cfg = with_fields(BASE, save_every=3, async_save=True, checkpoint_dir=str(tmp_path))
    trained = AssertionError("trained")
    with mock.patch.object(sharded_checkpoint, "parallelize", side_effect=trained):
        with pytest.raises(
            CheckpointError,
            match=r"^--async-mode process chooses how --async-save "
            r"writes; add --async-save, or drop --async-mode$",
        ):  # contradictory options: refused by the config itself, from code too
            with_fields(cfg, async_save=False, async_mode="process")
        # torch 2.11 must say it in one line if its DCP lacks the process-based writer.
        with mock.patch.object(state_dict_saver, "AsyncCheckpointerType", None, create=True):
            with pytest.raises(
                CheckpointError,
                match=r"^--async-mode process needs dcp's "
                r"AsyncCheckpointerType.PROCESS, which torch "
                r".* lacks; use --async-mode thread$",
            ):
                run_alone(recipe_result, with_fields(cfg, async_mode="process"))
