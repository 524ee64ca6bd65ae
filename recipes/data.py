"""Real data for distributed training: token shards on disk, memory-mapped, with a loader whose
position is part of the checkpoint.

    torchrun --standalone --nproc_per_node=2 -m recipes.data                   # map-style windows
    torchrun --standalone --nproc_per_node=2 -m recipes.data --loader stream   # streaming
    python -m recipes.data --corpus ~/my_texts --vocab-size 1024 --steps 50

Copy with it: recipes/toy.py (the model you replace), recipes/dist_setup.py (the world) and
recipes/options.py (the command line, from the config). It needs
``tokenizers`` (a byte-level BPE trained here, on your text) and ``torchdata`` (StatefulDataLoader).

- Prepare (``prepare_shards``): text files -> a BPE tokenizer -> np.uint16 token shards
  (``train_0000.bin``, ``val_0000.bin``) and ``index.json``, as nanoGPT and llm.c store them. The
  default corpus is the Python standard library's sources: real text on every machine, no download.
- Load: ``TokenWindows`` (map-style, fixed-length windows over the memmaps) with
  ``DistributedSampler``; ``TokenStream`` (an ``IterableDataset`` split by rank, then by DataLoader
  worker). Both through ``StatefulDataLoader``: ``num_workers > 0``, persistent workers, pinned
  memory on CUDA.
- State: ``{"epoch", "loader": loader.state_dict()}`` goes into each rank's checkpoint; a resume in
  the middle of an epoch, with workers, continues with exactly the next batch.
- Uneven inputs: DDP's ``Join``, or (what works under fully_shard too) ``all_ranks_have``: every
  step the ranks agree, with an all-reduce MIN, whether each has a batch, and stop together.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import sysconfig
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import ModelConfig, build_model, lm_loss


@dataclass
class DataConfig:
    corpus: str | None = option(None, "folder of text files (default: Python's stdlib sources)")
    data_dir: str = option("data/shards", "where the shards and index.json go")
    # of text read from the corpus, in a deterministic file order
    max_bytes: int = option(2_000_000, "text read from the corpus", at_least=1)
    # 65535 is np.uint16's largest value: half the disk of int32, and every vocab here fits
    vocab_size: int = option(
        512, "BPE vocabulary (256 = plain bytes, no tokenizer)", at_least=256, at_most=65536
    )
    val_fraction: float = option(0.05, "tokens held out (below 1)", above=0)
    shard_tokens: int = option(1 << 20, "tokens per .bin shard", at_least=2)
    loader: str = option(
        "map",
        "map: windows + DistributedSampler; stream: IterableDataset split by rank and worker",
        choices=["map", "stream"],
    )
    seq_len: int = option(64, "tokens per training window", at_least=1)
    batch_size: int = option(8, "windows per rank per step", at_least=1)
    num_workers: int = option(2, "DataLoader worker processes", at_least=0)
    steps: int = option(
        20,
        "optimizer steps in all, counting those before a resume; 0: prepare the shards only",
        at_least=0,
    )
    lr: float = option(1e-3, "AdamW learning rate", above=0)
    seed: int = option(0, "model init and shuffle seed", at_least=0)
    checkpoint: str | None = option(None, "folder: resume from it if it holds one, save at end")

    def __post_init__(self) -> None:
        check_options(self)  # the ranges and choices above: one line each
        if self.corpus is not None and not Path(self.corpus).is_dir():
            raise ValueError(f"corpus {self.corpus}: not a folder; name a folder of text files")
        if self.corpus is not None and not any(p.is_file() for p in Path(self.corpus).rglob("*")):
            raise ValueError(f"corpus {self.corpus}: holds no files; name a folder of text files")
        for name in ("data_dir", "checkpoint"):
            path = getattr(self, name)
            if path is not None and Path(path).exists() and not Path(path).is_dir():
                raise ValueError(f"{name} {path} is a file; name a folder (created if missing)")
        if self.val_fraction >= 1:
            raise ValueError(
                f"val_fraction={self.val_fraction} leaves no training tokens; use less than 1"
            )
        if self.shard_tokens <= self.seq_len:  # a window never crosses a shard's end
            raise ValueError(
                f"shard_tokens={self.shard_tokens} holds no window of seq_len={self.seq_len}; "
                f"use shard_tokens above {self.seq_len}"
            )


# --8<-- [start:prepare]
def corpus_files(corpus: str | None, *, max_bytes: int) -> list[Path]:
    """Text files in a deterministic order (sorted paths), until ``max_bytes`` are reached."""
    if corpus is None:  # the standard library's top-level sources: present wherever Python is
        paths = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    else:
        paths = sorted(p for p in Path(corpus).rglob("*") if p.is_file())
    chosen, total = [], 0
    for path in paths:
        if total >= max_bytes:
            break
        chosen.append(path)
        total += path.stat().st_size
    return chosen


def read_texts(paths: list[Path]) -> list[str]:
    texts = []
    for path in paths:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # a binary file in the corpus folder: not text
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2's scheme): every byte a token, then merges up to ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def prepare_shards(cfg: DataConfig) -> dict:
    """Tokenize the corpus into ``cfg.data_dir``; returns the index. Reused when its settings match.

    Call it on one rank, then ``dist.barrier()``: every rank reads the same files."""
    out = Path(cfg.data_dir)
    settings = {
        k: getattr(cfg, k)
        for k in ("corpus", "max_bytes", "vocab_size", "val_fraction", "shard_tokens")
    }
    if (out / "index.json").exists():
        index = json.loads((out / "index.json").read_text())
        if index["settings"] == settings:
            return index
    texts = read_texts(corpus_files(cfg.corpus, max_bytes=cfg.max_bytes))
    if not texts:
        raise ValueError(f"corpus {cfg.corpus}: no UTF-8 text files found; name a folder of text")
    out.mkdir(parents=True, exist_ok=True)
    if cfg.vocab_size == 256:  # plain bytes; NUL (absent from text) separates documents
        eot, docs = 0, [list(text.encode("utf-8")) for text in texts]
    else:
        tokenizer = train_tokenizer(texts, cfg.vocab_size)
        tokenizer.save(str(out / "tokenizer.json"))
        eot = tokenizer.token_to_id("<|endoftext|>")
        docs = [encoding.ids for encoding in tokenizer.encode_batch(texts)]
    tokens = np.fromiter((t for doc in docs for t in (*doc, eot)), dtype=np.uint16)
    split_at = len(tokens) - int(len(tokens) * cfg.val_fraction)  # the last tokens are held out
    index = {"settings": settings, "vocab_size": cfg.vocab_size, "eot": eot, "dtype": "uint16"}
    for split, part in (("train", tokens[:split_at]), ("val", tokens[split_at:])):
        index[split] = []
        for i, start in enumerate(range(0, len(part), cfg.shard_tokens)):
            shard, name = part[start : start + cfg.shard_tokens], f"{split}_{i:04d}.bin"
            shard.tofile(out / name)
            index[split].append({"file": name, "tokens": len(shard)})
    # written last, by rename: a run killed halfway leaves no index that looks complete
    (out / "index.json.tmp").write_text(json.dumps(index, indent=1))
    os.replace(out / "index.json.tmp", out / "index.json")
    return index


# --8<-- [end:prepare]


# --8<-- [start:datasets]
class TokenWindows(Dataset):
    """Map-style: window ``i`` is ``seq_len + 1`` consecutive tokens of one shard (no overlap),
    returned as (inputs, next-token targets)."""

    def __init__(self, data_dir: str, split: str, seq_len: int):
        index = json.loads((Path(data_dir) / "index.json").read_text())
        self.paths = [str(Path(data_dir) / s["file"]) for s in index[split]]
        self.seq_len = seq_len
        counts = [(s["tokens"] - 1) // seq_len for s in index[split]]
        self.starts = [sum(counts[:i]) for i in range(len(counts))]
        self.length = sum(counts)
        self.maps: dict[int, np.memmap] = {}

    def __getstate__(self):
        # Pitfall: a pickled np.memmap is a full in-memory copy. Workers open their own maps.
        return {**self.__dict__, "maps": {}}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard = bisect.bisect_right(self.starts, i) - 1
        if shard not in self.maps:  # opened once per process, read lazily by the OS's page cache
            self.maps[shard] = np.memmap(self.paths[shard], dtype=np.uint16, mode="r")
        offset = (i - self.starts[shard]) * self.seq_len
        # int64: embeddings take long indices (uint16 tensors have few ops)
        window = torch.from_numpy(
            self.maps[shard][offset : offset + self.seq_len + 1].astype(np.int64)
        )
        return window[:-1], window[1:]


class TokenStream(IterableDataset):
    """Streaming: the windows of ``TokenWindows`` in order, this rank's and this worker's share.

    Stateful (``state_dict``): StatefulDataLoader saves each worker's count of windows yielded.
    """

    def __init__(self, windows: Dataset, *, rank: int, world_size: int):
        self.windows, self.rank, self.world_size = windows, rank, world_size
        self.yielded, self.skip = 0, 0  # in this worker: this pass, and what a resume skips

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        # Pitfall: split by rank only and each of a rank's workers yields the same windows
        part, parts = self.rank * workers + worker, self.world_size * workers
        mine = range(part, len(self.windows), parts)
        skip, self.skip = self.skip, 0  # only the first pass after load_state_dict skips
        for n in range(skip, len(mine)):
            self.yielded = n + 1
            yield self.windows[mine[n]]

    def state_dict(self) -> dict:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        self.skip = state["yielded"]


# --8<-- [end:datasets]


# --8<-- [start:loaders]
def build_loader(
    windows: Dataset,
    *,
    kind: str,
    rank: int,
    world_size: int,
    batch_size: int,
    num_workers: int,
    seed: int = 0,
    device: torch.device | None = None,
):
    """(loader, sampler or None). ``kind="map"``: ``DistributedSampler`` with ``drop_last=True``:
    without it the sampler pads with repeated samples so that every rank gets as many."""
    if kind == "map":
        sampler = DistributedSampler(
            windows, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        dataset = windows
    else:
        sampler, dataset = None, TokenStream(windows, rank=rank, world_size=world_size)
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in 2.13
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        loader = StatefulDataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=kind == "map",
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            pin_memory=device is not None and device.type == "cuda",
        )  # pinned: async host->GPU
    return loader, sampler


def loader_state(loader, epoch: int) -> dict:
    """What goes into this rank's checkpoint: the epoch (the sampler's shuffle) and the position
    inside it (StatefulDataLoader's state: the samples yielded, each worker's dataset state)."""
    return {"epoch": epoch, "loader": loader.state_dict()}


def restore_loader(loader, sampler, state: dict) -> int:
    """Before the first ``iter(loader)`` after a restart; returns the epoch to continue."""
    if sampler is not None:
        sampler.set_epoch(state["epoch"])  # not in the loader's state: set it first
    loader.load_state_dict(state["loader"])
    return state["epoch"]


# --8<-- [end:loaders]


# --8<-- [start:uneven]
def all_ranks_have(batch, device: torch.device) -> bool:
    """Every rank, every step: does every rank have a batch? All stop at the first that has none.
    Works under any wrapper (fully_shard, TP): no rank enters a collective the others skip."""
    flag = torch.tensor([0 if batch is None else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def train_until_one_runs_out(model, optimizer, batches, device: torch.device) -> int:
    """Pattern 2: the steps all ranks took together (the batches left on some ranks are dropped)."""
    steps, batches = 0, iter(batches)
    while all_ranks_have(batch := next(batches, None), device):
        inputs, targets = (t.to(device, non_blocking=True) for t in batch)
        optimizer.zero_grad(set_to_none=True)
        lm_loss(model(inputs), targets).backward()
        optimizer.step()
        steps += 1
    return steps


def train_with_join(ddp_model: DDP, optimizer, batches, device: torch.device) -> int:
    """Pattern 1, DDP only: a rank that runs out shadows the others' all-reduces with zeros until
    every rank is done. Each rank uses all its batches; returns this rank's steps. The average
    still divides by the whole world (``divide_by_initial_world_size``): a joined rank counts 0."""
    steps = 0
    with Join([ddp_model]):
        for inputs, targets in batches:
            optimizer.zero_grad(set_to_none=True)
            lm_loss(ddp_model(inputs.to(device)), targets.to(device)).backward()
            optimizer.step()
            steps += 1
    return steps


# --8<-- [end:uneven]


# --8<-- [start:run]
def run(cfg: DataConfig) -> dict:
    """Prepare the shards (rank 0), then train the toy model under DDP for ``cfg.steps`` steps
    from the loader, resuming from and saving to ``cfg.checkpoint``. Returns plain values."""
    world = setup_distributed()
    try:
        refused = [None]
        if world.rank == 0:
            try:
                prepare_shards(cfg)
            except ValueError as exc:  # a corpus of no text: every rank refuses, not only rank 0
                refused = [str(exc)]
        dist.broadcast_object_list(refused, src=0)  # and a barrier: the others read the files
        if refused[0]:
            raise ValueError(refused[0])
        index = json.loads((Path(cfg.data_dir) / "index.json").read_text())
        windows = TokenWindows(cfg.data_dir, "train", cfg.seq_len)
        # a rank without one batch would stop every rank's epoch at once, and start the next
        # forever: too little data is refused on every rank alike
        needed = world.world_size * (
            cfg.batch_size if cfg.loader == "map" else max(cfg.num_workers, 1)
        )
        if cfg.steps and len(windows) < needed:
            raise ValueError(
                f"the train split holds {len(windows)} windows of seq_len={cfg.seq_len}; the "
                f"{cfg.loader} loader needs {needed} on {world.world_size} rank(s): lower "
                "seq_len or batch_size, or read more text (max_bytes)"
            )
        loader, sampler = build_loader(
            windows,
            kind=cfg.loader,
            rank=world.rank,
            world_size=world.world_size,
            batch_size=cfg.batch_size,
            num_workers=cfg.num_workers,
            seed=cfg.seed,
            device=world.device,
        )
        model_cfg = ModelConfig(
            vocab_size=index["vocab_size"], seq_len=cfg.seq_len, dim=64, n_layers=2, n_heads=4
        )
        model = DDP(build_model(model_cfg, seed=cfg.seed, device=world.device))
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        step, epoch = 0, 0
        saved = Path(cfg.checkpoint or "", f"rank{world.rank}.pt")
        if cfg.checkpoint and saved.exists():
            state = torch.load(saved, weights_only=True)
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step, epoch = state["step"], restore_loader(loader, sampler, state["data"])
        losses = []
        while step < cfg.steps:
            if sampler is not None:
                sampler.set_epoch(epoch)  # Pitfall: without it every epoch has the same order
            batches = iter(loader)
            # map: every rank has as many batches (drop_last); stream: they may not
            while step < cfg.steps and all_ranks_have(batch := next(batches, None), world.device):
                inputs, targets = (t.to(world.device, non_blocking=True) for t in batch)
                optimizer.zero_grad(set_to_none=True)
                loss = lm_loss(model(inputs), targets)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                step += 1
                if world.rank == 0:
                    print(f"step {step} loss {losses[-1]:.4f}", file=sys.stderr)
            if step < cfg.steps:
                epoch += 1  # the next iter(loader) starts the data from its beginning
        if cfg.checkpoint:
            Path(cfg.checkpoint).mkdir(parents=True, exist_ok=True)
            torch.save(
                {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "data": loader_state(loader, epoch),
                },
                saved,
            )
        return {
            "losses": losses,
            "steps": step,
            "epoch": epoch,
            "vocab_size": index["vocab_size"],
            "windows": len(windows),
            "train_tokens": sum(s["tokens"] for s in index["train"]),
            "val_tokens": sum(s["tokens"] for s in index["val"]),
            "world_size": world.world_size,
        }
    finally:
        cleanup_distributed()


# --8<-- [end:run]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(DataConfig, prog="python -m recipes.data", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), DataConfig, argv)
    with exit_on_bad_input():  # a corpus of no text, too little data: one line from rank 0
        result = run(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"config": asdict(cfg), **result}))


if __name__ == "__main__":
    main()
