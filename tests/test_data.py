"""recipes/data.py: token shards from real text, every sample once per epoch across ranks and
workers, an exact mid-epoch resume with workers, uneven inputs that finish without a hang (DDP's
Join and the all-reduce-MIN pattern under fully_shard), and DistributedSampler's padding."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from recipes import data
from tests.helpers import (
    SMALL_SHARDS,
    last_json,
    run_cli,
    run_world,
    small_shards,
    spawn_world,
)

# A corpus of a few hundred KB (the stdlib's first sources), a small vocab, small shards: several
# shards per split, prepared in well under a second.
TINY = dict(**SMALL_SHARDS, seq_len=16, batch_size=4)

# Two loader workers on purpose (each sample once across workers): on a machine with one core
# for the test, torch's DataLoader adds that it suggests one.
pytestmark = pytest.mark.filterwarnings(
    "ignore:This DataLoader will create \\d+ worker processes in total:UserWarning"
)


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> data.DataConfig:
    return data.DataConfig(data_dir=small_shards(tmp_path_factory), **TINY)


class Indexed(Dataset):
    """A dataset whose sample is its index: which samples a loader yields, by number."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def test_prepare_writes_uint16_shards_that_decode_to_the_corpus(shards):
    from tokenizers import Tokenizer

    out = Path(shards.data_dir)
    index = json.loads((out / "index.json").read_text())
    assert index["vocab_size"] == 300 and len(index["train"]) > 1 and index["val"]
    for entry in index["train"] + index["val"]:  # 2 bytes a token, nothing else in the file
        assert (out / entry["file"]).stat().st_size == 2 * entry["tokens"]
    tokens = np.memmap(out / "train_0000.bin", dtype=np.uint16, mode="r")
    assert int(tokens.max()) < 300
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    first_file = data.corpus_files(None, max_bytes=1)[0].read_text()
    text = tokenizer.decode(tokens[:200].tolist())
    assert first_file.startswith(text) and len(text) > 250  # BPE merges: > 1.25 bytes a token
    held_out = sum(e["tokens"] for e in index["val"]) / sum(
        e["tokens"] for e in index["train"] + index["val"]
    )
    assert held_out == pytest.approx(shards.val_fraction, abs=1e-3)
    # Windows never straddle two shards: each shard holds (tokens - 1) // seq_len of them
    windows = data.TokenWindows(shards.data_dir, "train", shards.seq_len)
    assert len(windows) == sum((e["tokens"] - 1) // 16 for e in index["train"])
    inputs, targets = windows[len(windows) - 1]
    assert inputs.dtype == torch.int64 and torch.equal(inputs[1:], targets[:-1])
    # The same settings reuse the shards (no rewrite); a memmap is not pickled into workers
    mtime = (out / "train_0000.bin").stat().st_mtime_ns
    data.prepare_shards(shards)
    assert (out / "train_0000.bin").stat().st_mtime_ns == mtime
    assert windows.maps and not windows.__getstate__()["maps"]


def test_plain_bytes_need_no_tokenizer(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("héllo world\n" * 50)
    (corpus / "b.bin").write_bytes(b"\xff\xfe\x00binary")  # skipped: not UTF-8 text
    cfg = data.DataConfig(
        corpus=str(corpus), data_dir=str(tmp_path / "out"), vocab_size=256, val_fraction=0.1
    )
    index = data.prepare_shards(cfg)
    tokens = np.concatenate(
        [
            np.fromfile(tmp_path / "out" / e["file"], dtype=np.uint16)
            for e in index["train"] + index["val"]
        ]
    )
    assert bytes(tokens.astype(np.uint8)) == ("héllo world\n" * 50).encode() + b"\x00"


def epoch_indices(
    kind: str, n: int, rank: int, epoch: int, *, workers: int = 2, batch: int = 4
) -> list[int]:
    loader, sampler = data.build_loader(
        Indexed(n), kind=kind, rank=rank, world_size=2, batch_size=batch, num_workers=workers
    )
    if sampler is not None:
        sampler.set_epoch(epoch)
    return [i for b in loader for i in b.tolist()]


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_every_sample_once_per_epoch_across_2_ranks_and_2_workers(kind):
    """``rank`` is all DistributedSampler and TokenStream read of the world: two ranks here are
    two loaders, rank=0 and rank=1, each with 2 worker processes."""
    n = 64  # divisible by ranks x workers x batch: nothing is dropped
    epochs = [[epoch_indices(kind, n, rank, epoch) for rank in (0, 1)] for epoch in (0, 1)]
    for per_rank in epochs:
        seen = per_rank[0] + per_rank[1]
        assert sorted(seen) == list(range(n)), "each sample exactly once per epoch"
        assert len(per_rank[0]) == len(per_rank[1]) == n // 2
    if kind == "map":  # set_epoch: a new shuffle each epoch
        assert epochs[0][0] != epochs[1][0]


def test_the_stream_without_the_worker_split_repeats_samples(monkeypatch):
    """The pitfall the worker split prevents: with the split by rank only, 2 workers yield each of
    the rank's samples twice."""
    monkeypatch.setattr(data, "get_worker_info", lambda: None)  # as if the split were missing
    seen = epoch_indices("stream", 64, 0, 0)
    assert len(seen) == 64 and len(set(seen)) == 32


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_a_mid_epoch_resume_with_2_workers_yields_exactly_the_next_batches(kind, shards):
    windows = data.TokenWindows(shards.data_dir, "train", shards.seq_len)

    def loader():
        return data.build_loader(
            windows, kind=kind, rank=1, world_size=2, batch_size=4, num_workers=2, seed=3
        )

    first, sampler = loader()
    if sampler is not None:
        sampler.set_epoch(1)
    batches = iter(first)
    taken = [next(batches)[0] for _ in range(5)]  # an odd count: worker 0 is next
    state = data.loader_state(first, epoch=1)
    state = torch.load(_saved(state), weights_only=True)  # as it comes back from a checkpoint
    expected = [next(batches)[0] for _ in range(6)]

    resumed, resumed_sampler = loader()
    assert data.restore_loader(resumed, resumed_sampler, state) == 1
    got = [b[0] for _, b in zip(range(6), resumed)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected)), "not the next batches"
    assert not any(torch.equal(got[0], t) for t in taken)
    fresh = next(iter(loader()[0]))[0]  # without the state: the epoch's start again
    assert not torch.equal(fresh, expected[0])


def _saved(state):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_distributed_sampler_pads_with_repeats_unless_drop_last():
    """7 samples on 2 ranks: drop_last=False gives each rank 4, sample 0 twice (8 seen for 7);
    drop_last=True gives each 3 and never shows sample 6 this epoch."""
    from torch.utils.data import DistributedSampler

    def split(drop_last: bool) -> list[list[int]]:
        return [
            list(
                DistributedSampler(
                    Indexed(7), num_replicas=2, rank=r, shuffle=False, drop_last=drop_last
                )
            )
            for r in (0, 1)
        ]

    assert split(False) == [[0, 2, 4, 6], [1, 3, 5, 0]]
    assert split(True) == [[0, 2, 4], [1, 3, 5]]


# --------------------------------------------------------------------------------------------------
# Uneven inputs in a real 2-rank world: rank 0 has 3 batches, rank 1 has 5.


def uneven_world(seq_len: int) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from recipes.dist_setup import cleanup_distributed, setup_distributed
    from recipes.toy import ModelConfig, build_model

    world = setup_distributed()
    try:
        model_cfg = ModelConfig(vocab_size=64, seq_len=seq_len, dim=16, n_layers=1, n_heads=2)
        count = 3 + 2 * world.rank
        batches = [(torch.randint(0, 64, (2, seq_len)),) * 2 for _ in range(count)]
        ddp = DDP(build_model(model_cfg))
        join_steps = data.train_with_join(
            ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches, world.device
        )
        sharded = build_model(model_cfg)
        fully_shard(sharded, mesh=init_device_mesh(world.device.type, (world.world_size,)))
        min_steps = data.train_until_one_runs_out(
            sharded, torch.optim.SGD(sharded.parameters(), lr=0.1), batches, world.device
        )
        out = [None, None]
        torch.distributed.all_gather_object(out, {"join": join_steps, "min": min_steps})
        return out
    finally:
        cleanup_distributed()


def test_uneven_inputs_finish_without_a_hang_with_join_and_with_the_min_pattern():
    per_rank = spawn_world(uneven_world, 2, 8, deadline_s=90)
    assert [r["join"] for r in per_rank] == [3, 5]  # Join: each rank uses all its batches
    assert [r["min"] for r in per_rank] == [3, 3]  # MIN: all stop at the shortest


# --------------------------------------------------------------------------------------------------
# The recipe: training from the shards, a checkpoint with the loader's position, bad input.


def test_a_run_resumed_from_its_checkpoint_continues_exactly(shards, tmp_path):
    cfg = replace(shards, steps=6, num_workers=2)
    straight = data.run(cfg)
    halfway = replace(cfg, checkpoint=str(tmp_path / "ckpt"))
    first = data.run(replace(halfway, steps=3))
    second = data.run(halfway)  # resumes at step 3: model, optimizer and loader
    assert first["losses"] + second["losses"] == pytest.approx(straight["losses"], abs=1e-6)
    assert straight["vocab_size"] == 300 and second["steps"] == 6


def refused(capsys, argv: list[str]) -> str:
    """``python -m recipes.data ARGV`` in this process: exit 2 and its last stderr line."""
    with pytest.raises(SystemExit) as exit_info:
        data.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):  # a world of 1, in this process
        monkeypatch.delenv(var, raising=False)
    out = ["--data-dir", str(tmp_path / "out")]
    usage = "python -m recipes.data: error: "
    # refused by the config, before any data is read (nan once reached AdamW's message)
    missing, empty, a_file = tmp_path / "missing", tmp_path / "empty", tmp_path / "a_file"
    empty.mkdir()
    a_file.write_text("x")
    for argv, message in (
        (["--corpus", str(missing)], f"corpus {missing}: not a folder; name a folder of text"),
        (["--corpus", str(a_file)], f"corpus {a_file}: not a folder; name a folder of text"),
        (["--corpus", str(empty)], f"corpus {empty}: holds no files; name a folder of text"),
        (["--data-dir", str(a_file)], f"data_dir {a_file} is a file; name a folder"),
        (["--checkpoint", str(a_file)], f"checkpoint {a_file} is a file; name a folder"),
        (["--lr", "nan"], "lr must be a finite number > 0, got nan"),
        (["--val-fraction", "1"], "val_fraction=1.0 leaves no training tokens; use less than 1"),
        (["--vocab-size", "70000"], "vocab_size must be a whole number >= 256 and <= 65536"),
        (["--seq-len", "64", "--shard-tokens", "64"], "shard_tokens=64 holds no window of"),
    ):
        line = refused(capsys, argv + (out if "--data-dir" not in argv else []))
        assert line.startswith(usage + message), line
    assert not (tmp_path / "out").exists()
    # refused once the data is known, on every rank alike: one line from rank 0, no usage
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "blob.bin").write_bytes(b"\xff\xfe\x00" * 100)
    line = refused(capsys, ["--corpus", str(binary), *out])
    assert line == f"error: corpus {binary}: no UTF-8 text files found; name a folder of text"
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("a few words, " * 15)  # 195 bytes: 3 windows of 64
    small = ["--corpus", str(text), "--vocab-size", "256", "--num-workers", "0", *out]
    line = refused(capsys, [*small, "--seq-len", "64", "--batch-size", "4"])
    assert line == (
        "error: the train split holds 2 windows of seq_len=64; the map loader needs 4 on 1 "
        "rank(s): lower seq_len or batch_size, or read more text (max_bytes)"
    ), line


def test_two_ranks_train_past_an_epoch_with_both_loaders(tmp_path):
    """A corpus small enough that 10 steps cross an epoch boundary: the map loader reshuffles, the
    stream restarts, and on 2 ranks both run the steps asked for (one world for both)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = "".join(data.read_texts(data.corpus_files(None, max_bytes=20_000)))[:6000]
    assert len(text.encode()) == 6000
    (corpus / "a.txt").write_text(text)  # ASCII: 6,000 tokens as bytes, 178 training windows
    # num_workers=0: a spawned rank's default start method is forkserver, whose workers import
    # torch afresh (~6 s a rank here); the tests above cover the workers
    cfg = data.DataConfig(
        corpus=str(corpus),
        data_dir=str(tmp_path / "out"),
        vocab_size=256,
        seq_len=32,
        batch_size=16,
        steps=10,
        num_workers=0,
    )
    results = run_world(
        data.run, 2, [replace(cfg, loader=kind) for kind in ("map", "stream")], deadline_s=90
    )
    for result in results:  # an epoch: 5 steps (map, drop_last), 6 (stream, partial batches)
        assert result["windows"] == 178 and result["world_size"] == 2
        assert result["steps"] == 10 and len(result["losses"]) == 10 and result["epoch"] == 1


# Slow: torchrun launches (torchrun and its workers each import torch: ~10 s of CPU each). The same
# code runs in spawned worlds above.
@pytest.mark.slow
def test_torchrun_launch_resumed_from_its_checkpoint_equals_a_straight_run(shards, tmp_path):
    cfg = replace(shards, steps=6)
    straight = spawn_world(data.run, 2, cfg, deadline_s=90)
    args = [
        "torchrun",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "recipes.data",
        "--data-dir",
        cfg.data_dir,
        "--max-bytes",
        str(cfg.max_bytes),
        "--vocab-size",
        str(cfg.vocab_size),
        "--shard-tokens",
        str(cfg.shard_tokens),
        "--seq-len",
        str(cfg.seq_len),
        "--batch-size",
        str(cfg.batch_size),
        "--checkpoint",
        str(tmp_path / "ckpt"),
    ]
    losses = []
    for steps in (3, 6):
        launched = run_cli(args + ["--steps", str(steps)], timeout_s=180)
        assert launched.returncode == 0, launched.stderr[-2000:]
        result = last_json(launched.stdout)
        assert result["world_size"] == 2 and result["steps"] == steps
        losses += result["losses"]
    assert losses == pytest.approx(straight["losses"], abs=1e-6)
    assert "[rank1]" not in launched.stdout
