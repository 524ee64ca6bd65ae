"""recipes/evaluation.py: on 2 ranks with uneven shards, the validation loss equals one process's
(all-reduced sums and counts, no padded repeats), also under fully_shard with different numbers of
batches per rank (no hang); the naive way (mean of means, DistributedSampler's padding) is off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

from recipes import data, evaluation
from recipes.toy import ModelConfig, build_model
from tests.helpers import last_json, run_cli, small_shards, spawn_world

WINDOWS = 37  # 2 ranks: 19 and 18 windows; DistributedSampler pads rank 1 with window 0
BATCH = 3  # 7 batches on rank 0, 6 on rank 1
SEQ_LEN = 16


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> str:
    return small_shards(tmp_path_factory)


def model_and_windows(data_dir: str):
    windows = Subset(data.TokenWindows(data_dir, "val", SEQ_LEN), range(WINDOWS))
    model = build_model(
        ModelConfig(vocab_size=300, seq_len=SEQ_LEN, dim=32, n_layers=1, n_heads=2), seed=1
    )
    return model, windows


def eval_world(data_dir: str, with_torchmetrics: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from recipes.dist_setup import cleanup_distributed, setup_distributed

    world = setup_distributed()
    try:
        model, windows = model_and_windows(data_dir)
        shard = evaluation.eval_shard(windows, world.rank, world.world_size)
        loader = DataLoader(shard, batch_size=BATCH)
        out = {
            "right": evaluation.evaluate(model, loader, world.device),
            "naive": evaluation.evaluate_naively(
                model, windows, world.rank, world.world_size, BATCH, world.device
            ),
            "batches": len(loader),
        }
        if with_torchmetrics:  # its import costs ~2.4 s of CPU per rank: in the slow run only
            out["torchmetrics"] = evaluation.evaluate_with_torchmetrics(model, loader, world.device)
        # the world's device: a GPU host's default mesh would be CUDA under these gloo ranks
        mesh = init_device_mesh(world.device.type, (world.world_size,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)  # from here every forward all-gathers: ranks step together
        out["sharded"] = evaluation.evaluate(model, loader, world.device, lockstep=True)
        per_rank = [None] * world.world_size
        torch.distributed.all_gather_object(per_rank, out)
        return per_rank
    finally:
        cleanup_distributed()


def single_process_loss(data_dir: str) -> float:
    model, windows = model_and_windows(data_dir)
    inputs = torch.stack([windows[i][0] for i in range(WINDOWS)])
    targets = torch.stack([windows[i][1] for i in range(WINDOWS)])
    with torch.no_grad():  # one process, one batch: the mean over every token
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).item()


def test_the_validation_loss_on_2_uneven_ranks_equals_one_process_and_the_naive_one_does_not(
    shards,
):
    reference = single_process_loss(shards)
    per_rank = spawn_world(eval_world, 2, shards, deadline_s=90)
    assert [r["batches"] for r in per_rank] == [7, 6]  # different numbers of batches, no hang
    for result in per_rank:
        assert result["right"] == pytest.approx(reference, abs=1e-6)
        assert result["sharded"] == pytest.approx(reference, abs=1e-6)
    # The naive way: window 0 counted twice, short batches and the ranks' means weighed as equals
    naive_error = abs(per_rank[0]["naive"] - reference)
    assert naive_error > 1e-4 and naive_error > 100 * abs(per_rank[0]["right"] - reference)


@pytest.mark.slow
def test_torchmetrics_mean_metric_weighted_by_tokens_equals_one_process(shards):
    reference = single_process_loss(shards)
    per_rank = spawn_world(eval_world, 2, shards, True, deadline_s=120)
    assert [r["torchmetrics"] for r in per_rank] == pytest.approx([reference] * 2, abs=1e-6)


def test_the_padding_and_the_mean_of_means_each_move_the_number(shards):
    """The two mistakes apart, in one process: the padded duplicate alone, the mean of batch
    means alone (what each rank of the naive way computes)."""
    model, windows = model_and_windows(shards)
    with torch.no_grad():
        losses = torch.stack(
            [
                F.cross_entropy(model(x[None]).flatten(0, 1), y)
                for x, y in (windows[i] for i in range(WINDOWS))
            ]
        )
    right = losses.mean()  # every window has SEQ_LEN tokens: the mean of windows is the token mean
    with_duplicate = torch.cat([losses, losses[:1]]).mean()  # DistributedSampler's pad
    ranks = [losses[0::2], losses[1::2]]  # 19 and 18 windows
    mean_of_rank_means = torch.stack([r.mean() for r in ranks]).mean()
    assert with_duplicate != pytest.approx(right.item(), abs=1e-6)
    assert mean_of_rank_means != pytest.approx(right.item(), abs=1e-6)
    sums_and_counts = sum(r.sum() for r in ranks) / sum(len(r) for r in ranks)
    assert sums_and_counts.item() == pytest.approx(right.item(), abs=1e-6)


def test_the_recipe_runs_alone_and_refuses_bad_input(shards, tmp_path, capsys, monkeypatch):
    result = evaluation.run(
        evaluation.EvalConfig(data_dir=shards, vocab_size=300, seq_len=SEQ_LEN, max_windows=WINDOWS)
    )
    assert result["windows_per_rank"] == [WINDOWS]
    model = build_model(
        ModelConfig(vocab_size=300, seq_len=SEQ_LEN, dim=64, n_layers=2, n_heads=4)
    )  # the recipe's model
    windows = data.TokenWindows(shards, "val", SEQ_LEN)
    inputs, targets = (torch.stack(t) for t in zip(*(windows[i] for i in range(WINDOWS))))
    with torch.no_grad():
        reference = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).item()
    assert result["val_loss"] == pytest.approx(reference, abs=1e-6)
    assert abs(result["naive_val_loss"] - reference) > 1e-5  # 37 = 12 batches of 3 + 1
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):  # a world of 1, in this process
        monkeypatch.delenv(var, raising=False)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    usage = "python -m recipes.evaluation: error: "
    for argv, message in (
        (["--batch-size", "0"], usage + "batch_size must be a whole number >= 1, got 0"),
        (["--data-dir", str(a_file)], usage + f"data_dir {a_file} is a file; name the folder"),
        (  # longer than the val split: refused on every rank, one line from rank 0
            ["--data-dir", shards, "--vocab-size", "300", "--seq-len", "100000"],
            "error: the val split holds 0 windows of seq_len=100000; 1 rank(s) need one each",
        ),
    ):
        with pytest.raises(SystemExit) as exit_info:
            evaluation.main(argv)
        assert exit_info.value.code == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith(message), line


# Slow: a torchrun launch (torchrun and its workers each import torch: ~10 s of CPU).
@pytest.mark.slow
def test_torchrun_launch_under_fully_shard_equals_one_process(shards):
    cfg = evaluation.EvalConfig(data_dir=shards, seq_len=SEQ_LEN, max_windows=WINDOWS)
    alone = evaluation.run(cfg)
    launched = run_cli(
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "recipes.evaluation",
            "--data-dir",
            shards,
            "--seq-len",
            str(SEQ_LEN),
            "--max-windows",
            str(WINDOWS),
            "--sharded",
        ],
        timeout_s=180,
    )
    assert launched.returncode == 0, launched.stderr[-2000:]
    result = last_json(launched.stdout)
    assert result["windows_per_rank"] == [19, 18]
    assert result["val_loss"] == pytest.approx(alone["val_loss"], abs=1e-6)
