"""collectives: every op's result matches the value computed from the rank numbers, on worlds of 1,
2 and 3; the checks can fail; a rank that skips a collective makes the others time out naming it,
never hang."""

import time

import pytest
import torch

from recipes import collectives
from recipes.core.observe import prove
from recipes.core.world import RankError
from tests.helpers import (
    BACKENDS,
    last_json,
    run_alone,
    run_cli,
    run_world,
    spawn_world,
    with_fields,
)

CFG = collectives.CollectivesConfig(timeout_s=60)
FALLBACK_OPS = {"all_reduce_avg", "reduce_scatter_single", "all_to_all_single"}
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def collectives_result(cfg):
    """recipes.collectives.run(cfg) measured by the harness (recipes.core.observe's probe): its
    report in extras["ops"], each op's time in extras["op_ms"], and param_checksum: the sum of every
    tensor the rank received. Module-level: spawn_world can pickle it."""
    return prove(collectives.run, cfg, name="collectives")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_collective_matches_its_expected_value(world_size, backend):
    native, portable = run_world(
        collectives_result, world_size, [CFG, with_fields(CFG, portable_only=True)], backend=backend
    )
    assert (native.world_size, native.backend) == (world_size, backend)
    assert list(native.extras["ops"]) == list(
        collectives.OPS
    )  # every op ran, in order (the recipe raises on a mismatch)
    assert list(native.extras["op_ms"]) == list(collectives.OPS)  # each op timed from outside
    if backend == "nccl" or TORCH_VERSION >= (
        2,
        13,
    ):  # torch 2.13's gloo has AVG, reduce_scatter and all_to_all
        assert set(native.extras["ops"].values()) == {"ok"}, native.extras["ops"]
    else:
        assert all(
            note == "ok" or note.startswith("fallback: ") for note in native.extras["ops"].values()
        )
    # The portable fallbacks ran instead, and produced the same values.
    for name, note in portable.extras["ops"].items():
        assert (
            note.startswith("fallback: portable_only requested")
            if name in FALLBACK_OPS
            else note == "ok"
        ), (name, note)
    assert portable.param_checksum == pytest.approx(native.param_checksum, abs=1e-3)
    assert native.losses == [] and native.seconds_per_step > 0


def test_a_world_of_one_skips_only_point_to_point():
    result = run_alone(collectives_result, CFG)
    skipped = {name for name, note in result.extras["ops"].items() if note != "ok"}
    assert skipped == {"send_recv_ring", "isend_irecv_ring"}
    assert result.extras["ops"]["send_recv_ring"] == "skipped: a world of 1 has no peer"


def _break(op):
    """A Ctx.check whose expected value for ``op`` is wrong on purpose: a check must be able to
    fail (the fault the recipe's --break-check option injected, now the test's own)."""
    check = collectives.Ctx.check

    def broken(ctx, actual, expected):
        if ctx.op == op:
            expected = (
                expected + 1
                if isinstance(expected, torch.Tensor)
                else [expected, "deliberately wrong"]
            )
        check(ctx, actual, expected)

    return broken


@pytest.mark.parametrize(
    "op, shown",
    [
        ("all_reduce_sum", "expected ["),
        ("barrier", "expected [1, 'deliberately wrong']"),
        ("scatter_object_list", "expected ['work item 0', 'deliberately wrong']"),
    ],
)
def test_a_wrong_expectation_is_caught(op, shown, monkeypatch):
    monkeypatch.setattr(collectives.Ctx, "check", _break(op))
    with pytest.raises(collectives.CollectiveMismatch, match=rf"^{op} on rank 0 of 1: ") as caught:
        run_alone(collectives.run, CFG)
    assert shown in str(caught.value)


def test_a_rank_that_skips_a_collective_makes_the_others_time_out_naming_it():
    # 8 s: short enough for a quick test, long enough that the ranks' start-up skew (the same
    # timeout bounds the rendezvous) cannot fail the world before the collective does.
    # gloo raises the timeout in the waiting call; NCCL's watchdog aborts the process instead.
    cfg = with_fields(CFG, skip_on_rank=1, timeout_s=8, backend="gloo")
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        spawn_world(collectives.run, 2, cfg, deadline_s=120)
    assert caught.value.rank == 0 and caught.value.operation == "all_reduce"
    assert "rank 0 failed in all_reduce" in str(caught.value) and "Timed out" in str(caught.value)
    assert time.monotonic() - start < 60  # the timeout fired, nothing waited for the 120 s deadline


def test_bad_options_are_one_line_and_exit_2(capsys):
    # (the unknown --break-check value is gone with the option: its fault injection is _break's)
    with pytest.raises(
        ValueError, match="skip_on_rank=3 needs a world of at least 2 with that rank in it"
    ):
        run_alone(collectives.run, with_fields(CFG, skip_on_rank=3))
    for argv, message in (
        (["--skip-on-rank", "3"], "error: skip_on_rank=3 needs a world of at least 2 "),
        (["--skip-on-rank", "-2"], "skip_on_rank must be a whole number >= -1, got -2"),
        (["--numel", "0"], "numel must be a whole number >= 1, got 0"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            collectives.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert message in err[-1], err


# Slow: a torchrun launch (torchrun and its workers each import torch: ~10 s of CPU).
# The same code runs in a spawned world in the default run; test_ddp_torchrun, test_elastic
# and test_multinode cover the launch path itself there.
@pytest.mark.slow
def test_torchrun_launch_with_three_ranks():
    proc = run_cli(
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node=3",
            "-m",
            "recipes.core.prove",
            "collectives",
        ],
        timeout_s=150,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = last_json(proc.stdout)
    assert result["world_size"] == 3 and set(result["extras"]["ops"]) == set(collectives.OPS)
    assert all(
        note == "ok" or note.startswith("fallback: ") for note in result["extras"]["ops"].values()
    )
    # One line per op, from rank 0 only (rank 0 prints; the others print nothing).
    assert sum(
        line.split()[:1] == [name] for name in collectives.OPS for line in proc.stdout.splitlines()
    ) == len(collectives.OPS)
