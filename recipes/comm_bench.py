"""Communication benchmark: all-reduce, all-gather, reduce-scatter and all-to-all over a sweep of
sizes, each result checked, with time, algbw and busbw as nccl-tests define them.

    torchrun --standalone --nproc_per_node=2 -m recipes.comm_bench
    torchrun --standalone --nproc_per_node=8 -m recipes.comm_bench --min-bytes 1M --max-bytes 1G

Copy with it: recipes/dist_setup.py (setup_distributed/cleanup_distributed) and recipes/options.py
(the command line, from the config). It imports torch and nothing else of ours.

Run it on a new machine before training on it: busbw of a large all-reduce should be near the
link's published bandwidth (the docs page lists them); far below means a misconfigured link (NCCL
falling back to PCIe or TCP, a missing InfiniBand driver) that no training-side change will fix.
Rank 0 prints one row per op and size; ``--json PATH`` writes the rows; the last line is the result
as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass
class CommBenchConfig:
    # --ops all_reduce,all_gather (comma-separated, as before) or --ops all_reduce all_gather
    ops: tuple[str, ...] = option(OPS, "collectives to run, of " + ", ".join(OPS))
    # 1 KiB .. 4 MiB: a few seconds on CPU gloo; use up to 1G+ on GPUs
    min_bytes: int = option(
        1024, "smallest buffer (the nccl-tests size: the whole buffer), e.g. 1K", at_least=1
    )
    max_bytes: int = option(
        4 * 2**20, "largest buffer, e.g. 4M; 1G or more to reach a GPU link's peak", at_least=1
    )
    factor: int = option(2, "size multiplier between rows (nccl-tests' -f)", at_least=2)
    dtype: str = option("float32", "element type of the buffers", choices=sorted(DTYPES))
    warmup_iters: int = option(5, "untimed calls per op and size (connection set-up)", at_least=0)
    iters: int = option(20, "timed calls per op and size", at_least=1)
    backend: str = option(
        "auto",
        "auto: NCCL with a GPU per local rank, else gloo",
        choices=["auto", "gloo", "nccl"],
    )
    json_path: str | None = option(None, "write the rows to this JSON file (rank 0)")

    def __post_init__(self) -> None:
        check_options(self)  # the ranges and choices above: one line each
        names = [self.ops] if isinstance(self.ops, str) else self.ops
        self.ops = tuple(op.strip() for name in names for op in name.split(",") if op.strip())
        unknown = [op for op in self.ops if op not in OPS]
        if unknown or not self.ops:
            raise ValueError(
                f"ops: unknown op(s) {', '.join(unknown) or '(none given)'}; "
                f"use any of {','.join(OPS)}"
            )
        if self.min_bytes > self.max_bytes:
            raise ValueError(
                f"min_bytes {self.min_bytes} must be at most max_bytes {self.max_bytes}; "
                "raise --max-bytes or lower --min-bytes"
            )
        if self.json_path is not None and os.path.isdir(self.json_path):
            raise ValueError(
                f"json_path {self.json_path} is a folder; name a file, e.g. "
                f"{os.path.join(self.json_path, 'comm_bench.json')}"
            )
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if self.backend == "nccl" and gpus < local_ranks:
            raise ValueError(
                f"backend nccl needs a GPU per rank: {local_ranks} rank(s) on this node, "
                f"{gpus} GPU(s); use --backend gloo (or auto)"
            )


# --8<-- [start:bandwidth]
# Bandwidths as nccl-tests define them (NVIDIA/nccl-tests, doc/PERFORMANCE.md, and getBw in
# src/*.cu): algbw = S / t, with S the size of the *whole* buffer, not one rank's chunk: the
# all-reduce buffer, all-gather's output (sendcount * n), reduce-scatter's input (recvcount * n),
# all-to-all's send buffer. busbw = algbw * factor, the factor chosen so that busbw is comparable
# with the hardware's per-GPU link bandwidth whatever the number of ranks n:
BUSBW_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,  # a reduce-scatter then an all-gather
    "all_gather": lambda n: (n - 1) / n,  # each rank receives the n-1 chunks it lacks
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


def bandwidths_gb_per_s(
    op: str, size_bytes: int, seconds: float, world_size: int
) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10^9 bytes per second, as nccl-tests prints them)."""
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * BUSBW_FACTOR[op](world_size)


# --8<-- [end:bandwidth]


def sizes_bytes(
    min_bytes: int, max_bytes: int, factor: int, world_size: int, element_size: int
) -> list[int]:
    """min, min*factor, ... up to max, each rounded down to whole elements split evenly over the
    ranks (nccl-tests rounds the count to a multiple of n the same way); duplicates dropped."""
    step = world_size * element_size
    sizes, size = [], min_bytes
    while size <= max_bytes:
        rounded = max(step, size // step * step)
        if rounded not in sizes:
            sizes.append(rounded)
        size *= factor
    return sizes


# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor to *_single (the old names
# still work, with a warning); older torch has only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

PERIOD = 251  # a prime: no power-of-two chunk is a whole number of periods


def sent_values(rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What rank `rank` sends at positions 0..PERIOD-1 (repeated after): its rank in the integer
    part (who sent it), the position in the fraction (where it was), so that a chunk from the
    wrong rank or the wrong place differs from the expected value."""
    return ((rank + 1) + torch.arange(PERIOD, device=device) / 256).to(dtype)


# --8<-- [start:collectives]
def collective(
    op: str, numel: int, world: int, rank: int, dtype: torch.dtype, device: torch.device
):
    """(run, output, expected_at): one call of `op` on a buffer of `numel` elements in all (the
    nccl-tests size), the tensor it writes, and the value each output position must hold."""
    chunk = numel // world
    # sent[r, q]: rank r's value at positions q, q + PERIOD, ... as it is in `dtype`, in float64
    sent = torch.stack([sent_values(r, dtype, device) for r in range(world)]).double()
    total = sent.sum(0)  # a sum over the ranks, which an exact reduction must equal
    mine = sent_values(rank, dtype, device).repeat(numel // PERIOD + 1)[:numel]
    if op == "all_reduce":  # in place: the buffer is both input and output
        # (each timed call then sums the previous result: the values grow, the time does not)
        out = mine.clone()
        return (lambda: dist.all_reduce(out)), out, lambda i: total[i % PERIOD]
    if op == "all_gather":  # each rank sends one chunk (its first), every rank receives all n
        send, out = mine[:chunk].clone(), torch.empty(numel, dtype=dtype, device=device)
        return (
            (lambda: all_gather_single(out, send)),
            out,
            lambda i: sent[i // chunk, i % chunk % PERIOD],
        )
    if op == "reduce_scatter":  # rank k keeps chunk k, summed over the ranks
        out = torch.empty(chunk, dtype=dtype, device=device)
        return (
            (lambda: reduce_scatter_single(out, mine)),
            out,
            lambda i: total[(rank * chunk + i) % PERIOD],
        )
    if op == "all_to_all":  # chunk k of rank j lands on rank k, at position j
        out = torch.empty(numel, dtype=dtype, device=device)
        return (
            (lambda: dist.all_to_all_single(out, mine)),
            out,
            lambda i: sent[i // chunk, (rank * chunk + i % chunk) % PERIOD],
        )
    raise ValueError(f"unknown op {op!r}; one of {', '.join(OPS)}")


def count_wrong(out: torch.Tensor, expected_at, rtol: float, piece: int = 2**22) -> int:
    """Output elements that differ from the expected value, checked a piece at a time so that a
    1 GB buffer needs no 1 GB of indices. NaN counts as wrong."""
    wrong = 0
    for start in range(0, out.numel(), piece):
        index = torch.arange(start, min(start + piece, out.numel()), device=out.device)
        expected = expected_at(index)
        close = (out[index].double() - expected).abs() <= rtol * expected.abs()
        wrong += int((~close).sum())
    return wrong


# --8<-- [end:collectives]


def synchronize(device: torch.device) -> None:
    # Pitfall: NCCL calls return once queued on the GPU; without this the timer measures the
    # launch, not the transfer, and the bandwidth comes out impossibly high.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --8<-- [start:measure]
def measure(op: str, size_bytes: int, cfg: CommBenchConfig, device: torch.device) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[cfg.dtype]
    numel = size_bytes // dtype.itemsize
    run_op, out, expected_at = collective(op, numel, world, rank, dtype, device)
    # Check once per size, before timing: a benchmark that times a wrong result is worthless.
    run_op()
    synchronize(device)
    # Sums of n values in a low precision round differently from the float64 reference.
    rtol = 0.0 if op in ("all_gather", "all_to_all") else world * torch.finfo(dtype).eps
    wrong = torch.tensor([count_wrong(out, expected_at, rtol)], dtype=torch.float64, device=device)
    for _ in range(cfg.warmup_iters):  # first calls set up connections and buffers
        run_op()
    synchronize(device)
    dist.barrier()  # every rank starts the clock together
    start = time.perf_counter()
    for _ in range(cfg.iters):
        run_op()
    synchronize(device)
    seconds = torch.tensor(
        [(time.perf_counter() - start) / cfg.iters], dtype=torch.float64, device=device
    )
    # nccl-tests averages each rank's mean time over the ranks (Allreduce(..., average))
    stats = torch.cat([seconds, wrong])
    dist.all_reduce(stats)
    seconds_mean, wrong_total = stats[0].item() / world, int(stats[1].item())
    algbw, busbw = bandwidths_gb_per_s(op, size_bytes, seconds_mean, world)
    return {
        "op": op,
        "size_bytes": size_bytes,
        "count": numel,
        "dtype": cfg.dtype,
        "time_us": seconds_mean * 1e6,
        "algbw_gb_per_s": algbw,
        "busbw_gb_per_s": busbw,
        "wrong_elements": wrong_total,
    }


# --8<-- [end:measure]


def run(cfg: CommBenchConfig) -> dict:
    """Every op at every size on the current world; returns the rows and the world they ran on."""
    info = setup_distributed(cfg.backend)
    try:
        sizes = sizes_bytes(
            cfg.min_bytes, cfg.max_bytes, cfg.factor, info.world_size, DTYPES[cfg.dtype].itemsize
        )
        if info.is_main:
            print(
                f"# {info.world_size} rank(s), {info.backend} on {info.device.type}, "
                f"{cfg.dtype}, {cfg.warmup_iters} warm-up + {cfg.iters} timed iterations"
            )
            print(
                f"# {'op':<15}{'size (B)':>12}{'count':>11}{'time (us)':>12}"
                f"{'algbw GB/s':>12}{'busbw GB/s':>12}{'wrong':>7}"
            )
        rows = []
        for op in cfg.ops:
            for size in sizes:
                row = measure(op, size, cfg, info.device)
                rows.append(row)
                if info.is_main:
                    print(
                        f"  {row['op']:<15}{size:>12}{row['count']:>11}{row['time_us']:>12.1f}"
                        f"{row['algbw_gb_per_s']:>12.3f}{row['busbw_gb_per_s']:>12.3f}"
                        f"{row['wrong_elements']:>7}",
                        flush=True,
                    )
        result = {
            "recipe": "comm_bench",
            "world_size": info.world_size,
            "backend": info.backend,
            "device": info.device.type,
            "dtype": cfg.dtype,
            "torch": torch.__version__,
            "rows": rows,
        }
        if info.is_main and cfg.json_path:
            with open(cfg.json_path, "w") as f:
                json.dump(result, f, indent=2)
        return result
    finally:
        cleanup_distributed()


def parse_bytes(text: str) -> int:
    """'4096', '64K', '4M', '1G' (powers of 1024, as nccl-tests' -b/-e) -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)i?[bB]?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 4096, 64K, 4M, 1G")
    return int(match[1]) * 1024 ** " kmg".index(match[2].lower() or " ")


def make_parser() -> argparse.ArgumentParser:
    parser = config_parser(CommBenchConfig, prog="python -m recipes.comm_bench", doc=__doc__)
    for flag in ("--min-bytes", "--max-bytes"):  # 1K, 4M, 1G: nccl-tests' sizes
        parser._option_string_actions[flag].type = parse_bytes
    parser.add_argument(
        "--json", dest="json_path", default=argparse.SUPPRESS, help="the same as --json-path"
    )
    return parser


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(make_parser(), CommBenchConfig, argv)
    with exit_on_bad_input():  # bad input every rank sees: one line from rank 0, exit 2
        result = run(cfg)
    if os.environ.get("RANK", "0") == "0":  # the result as the last line, as recipes print it
        print(json.dumps({**result, "config": asdict(cfg)}), flush=True)
    wrong = [f"{r['op']} {r['size_bytes']} B" for r in result["rows"] if r["wrong_elements"]]
    if wrong:
        print(
            f"error: wrong results for {', '.join(wrong)}: the collective returned values "
            "that differ from the expected ones; do not trust this link",
            file=sys.stderr,
        )
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
