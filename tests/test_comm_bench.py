"""comm_bench: nccl-tests' algbw and busbw, every op at every size checked, bad input refused."""

import pytest
import torch

from recipes import comm_bench
from tests.helpers import last_json, run_cli, spawn_world


def test_algbw_and_busbw_follow_nccl_tests():
    # 1e9 bytes in 0.1 s: algbw 10 GB/s; busbw = algbw * 2(n-1)/n for all-reduce, (n-1)/n else
    # (NVIDIA/nccl-tests doc/PERFORMANCE.md), computed by hand:
    expected = {
        ("all_reduce", 2): 10.0,
        ("all_reduce", 4): 15.0,
        ("all_reduce", 8): 17.5,
        ("all_gather", 2): 5.0,
        ("all_gather", 8): 8.75,
        ("reduce_scatter", 4): 7.5,
        ("all_to_all", 4): 7.5,
        ("all_to_all", 2): 5.0,
    }
    for (op, n), busbw in expected.items():
        algbw, got = comm_bench.bandwidths_gb_per_s(op, 10**9, 0.1, n)
        assert algbw == pytest.approx(10.0) and got == pytest.approx(busbw), (op, n)
    # a world of one moves nothing over a link: busbw 0 for every op
    assert all(comm_bench.bandwidths_gb_per_s(op, 10**9, 0.1, 1)[1] == 0 for op in comm_bench.OPS)


def test_sizes_are_whole_elements_split_evenly_over_the_ranks():
    # 3 ranks of 4-byte elements: every size a multiple of 12 bytes, as nccl-tests rounds counts
    assert comm_bench.sizes_bytes(1000, 4096, 2, 3, 4) == [996, 1992, 3996]
    assert comm_bench.sizes_bytes(1, 8, 2, 2, 4) == [8]  # at least one element per rank, once
    assert comm_bench.sizes_bytes(1024, 4 * 2**20, 2, 2, 4)[-1] == 4 * 2**20
    assert comm_bench.parse_bytes("4M") == 4 * 2**20 and comm_bench.parse_bytes("64KiB") == 65536


def simulated_outputs(op: str, numel: int, world: int, rank: int):
    """What `op` must leave on `rank`, computed here from every rank's input, and a wrong answer
    that a careless implementation could give (chunks swapped or a rank left out)."""
    chunk = numel // world
    inputs = [
        comm_bench.sent_values(r, torch.float32, torch.device("cpu")).repeat(numel)[:numel]
        for r in range(world)
    ]
    own = slice(rank * chunk, (rank + 1) * chunk)
    if op == "all_reduce":
        return sum(inputs), inputs[0] * world
    if op == "all_gather":
        right = torch.cat([x[:chunk] for x in inputs])
        return right, torch.cat([x[:chunk] for x in reversed(inputs)])
    other = slice(0, chunk) if rank else slice(chunk, 2 * chunk)  # another rank's chunk
    if op == "reduce_scatter":
        return sum(x[own] for x in inputs), sum(x[other] for x in inputs)
    return torch.cat([x[own] for x in inputs]), torch.cat([x[other] for x in inputs])


@pytest.mark.parametrize("op", comm_bench.OPS)
def test_the_value_check_accepts_the_right_result_and_counts_a_wrong_one(op):
    """The check each size runs (before timing): no error on what the collective must return, and
    errors on a plausible wrong answer, on both ranks of a 3-rank world (chunks of 300 elements: a
    chunk is not a whole number of the input's 251-element period)."""
    world, numel = 3, 900
    for rank in range(world):
        _, out, expected_at = comm_bench.collective(
            op, numel, world, rank, torch.float32, torch.device("cpu")
        )
        right, wrong = simulated_outputs(op, numel, world, rank)
        assert out.shape == right.shape
        assert comm_bench.count_wrong(right, expected_at, 1e-6, piece=128) == 0, (op, rank)
        assert comm_bench.count_wrong(wrong, expected_at, 1e-6, piece=128) > 0, (op, rank)
        nan = right.clone()
        nan[5] = float("nan")
        assert comm_bench.count_wrong(nan, expected_at, 1e-6) == 1


def bench_world(cfg):
    return comm_bench.run(cfg)


def test_two_rank_gloo_run_returns_a_checked_row_per_op_and_size(tmp_path):
    cfg = comm_bench.CommBenchConfig(
        min_bytes=1024,
        max_bytes=4096,
        warmup_iters=1,
        iters=2,
        backend="gloo",
        json_path=str(tmp_path / "rows.json"),
    )
    result = spawn_world(bench_world, 2, cfg, deadline_s=120)
    assert (result["world_size"], result["backend"]) == (2, "gloo")
    rows = result["rows"]
    assert [(r["op"], r["size_bytes"]) for r in rows] == [
        (op, size) for op in comm_bench.OPS for size in (1024, 2048, 4096)
    ]
    for row in rows:
        assert row["wrong_elements"] == 0, row  # every rank's output equals the expected values
        assert row["time_us"] > 0 and row["count"] == row["size_bytes"] // 4
        algbw = row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9
        factor = 1.0 if row["op"] == "all_reduce" else 0.5  # 2(n-1)/n and (n-1)/n for n = 2
        assert row["algbw_gb_per_s"] == pytest.approx(algbw)
        assert row["busbw_gb_per_s"] == pytest.approx(algbw * factor)
    import json

    assert json.loads((tmp_path / "rows.json").read_text())["rows"] == rows


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--min-bytes", "8K", "--max-bytes", "1K"],
            "error: min_bytes 8192 must be at most max_bytes 1024; raise --max-bytes or lower "
            "--min-bytes",
        ),
        (
            ["--ops", "all_reduce,broadcast"],
            "error: ops: unknown op(s) broadcast; use any of "
            "all_reduce,all_gather,reduce_scatter,all_to_all",
        ),
        (["--iters", "0"], "error: iters must be a whole number >= 1, got 0"),
        (["--warmup-iters", "-1"], "error: warmup_iters must be a whole number >= 0, got -1"),
        (
            ["--max-bytes", "lots"],
            "error: argument --max-bytes: 'lots' is not a size; write e.g. 4096, 64K, 4M, 1G",
        ),
        (["--json", "."], "error: json_path . is a folder; name a file, e.g. ./comm_bench.json"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        comm_bench.main(argv)
    assert exit_info.value.code == 2
    # argparse's usage, then the one line that names the option and the fix
    assert capsys.readouterr().err.splitlines()[-1] == f"python -m recipes.comm_bench: {message}"


def test_ops_and_sizes_keep_their_command_line_forms():
    """--ops takes a comma-separated list (as before) or a space-separated one; sizes take K/M/G;
    --json is the short form of --json-path."""
    parse = comm_bench.make_parser().parse_args
    cfg = comm_bench.CommBenchConfig(**vars(parse(["--ops", "all_reduce,all_gather"])))
    assert cfg.ops == ("all_reduce", "all_gather")
    cfg = comm_bench.CommBenchConfig(**vars(parse(["--ops", "all_to_all", "all_reduce"])))
    assert cfg.ops == ("all_to_all", "all_reduce")
    args = parse(["--min-bytes", "2K", "--max-bytes", "1M", "--json", "rows.json"])
    assert (args.min_bytes, args.max_bytes, args.json_path) == (2048, 2**20, "rows.json")


# Slow: a torchrun launch (torchrun and its workers each import torch: ~10 s of CPU); the same
# run() runs in a spawned world above.
@pytest.mark.slow
def test_torchrun_launch_prints_one_table_and_the_json_result():
    launched = run_cli(
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "recipes.comm_bench",
            "--max-bytes",
            "2K",
            "--iters",
            "1",
            "--warmup-iters",
            "0",
        ],
        timeout_s=120,
    )
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert launched.stdout.count("# 2 rank(s), gloo on cpu") == 1  # rank 0 only
    result = last_json(launched.stdout)
    assert len(result["rows"]) == 8 and not any(r["wrong_elements"] for r in result["rows"])


def test_nccl_without_a_gpu_per_rank_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4096")  # more ranks than any node has GPUs
    with pytest.raises(SystemExit) as exit_info:
        comm_bench.main(["--backend", "nccl"])
    assert exit_info.value.code == 2
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m recipes.comm_bench: error: backend nccl needs a GPU per rank: 4096 rank(s) "
        f"on this node, {gpus} GPU(s); use --backend gloo (or auto)"
    )
