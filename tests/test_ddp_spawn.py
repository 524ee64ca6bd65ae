"""ddp_spawn: mp.spawn launch, DDP options, rank-0 checkpoint loaded by every rank."""

import re
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from recipes import ddp_spawn, ddp_torchrun
from recipes.core.observe import prove
from recipes.core.result import param_checksum
from recipes.core.state import all_ranks
from tests.helpers import (
    BACKENDS,
    assert_losses_close,
    assert_states_close,
    run_world,
    single_process_reference,
)

REFERENCE = ddp_torchrun.DDPConfig(steps=4, precision="fp32")


def one_rank_with_its_loads(cfg):
    """ddp_spawn's per-rank training measured by the harness in the test's world (one world for
    several configs: no mp.spawn per config), and, measured from outside, what every rank loaded:
    ``extras["loaded_checksums"]``, the checksum of the model ``load_checkpoint`` returned on each
    rank, in rank order. Module-level: spawn_world can pickle it."""
    loaded, load = [], ddp_spawn.load_checkpoint

    def recording_load(*args, **kwargs):
        model = load(*args, **kwargs)
        loaded.append(param_checksum(model.parameters()))
        return model

    ddp_spawn.load_checkpoint = recording_load
    try:
        result = prove(ddp_spawn.train_one_rank, cfg, name="ddp_spawn", keep_final_state=True)
    finally:
        ddp_spawn.load_checkpoint = load
    result.extras["loaded_checksums"] = all_ranks(loaded[0] if loaded else None)
    return result


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_ddp_option_trains_like_one_process_and_checkpoint_loads_everywhere(
    backend, tmp_path
):
    reference = single_process_reference(steps=REFERENCE.steps)
    options = [
        dict(),
        dict(find_unused_parameters=True, gradient_as_bucket_view=False),
        dict(static_graph=True, bucket_cap_mb=0.01),  # tiny buckets: many all-reduces, same result
    ]
    configs = [
        ddp_spawn.DDPSpawnConfig(
            steps=4, precision="fp32", checkpoint_path=str(tmp_path / f"ckpt{i}.pt"), **o
        )
        for i, o in enumerate(options)
    ]
    results = run_world(one_rank_with_its_loads, 3, configs, backend=backend)
    for result, option in zip(results, options):
        assert_losses_close(result.losses, reference.losses, atol=1e-5)
        assert_states_close(result.final_state, reference.final_state, atol=1e-5)
        # Every one of the 3 ranks loaded exactly what rank 0 saved.
        assert result.extras["loaded_checksums"] == [result.param_checksum] * 3, option
    saved = torch.load(configs[0].checkpoint_path, weights_only=True)
    assert not any(key.startswith("module.") for key in saved["model"]), (
        "saved DDP's wrapper, not .module"
    )
    assert saved["step"] == 4


# The launch itself (python ..., mp.spawn, 2 processes, the per-step lines and the checkpoint file)
# runs once, as a user's copy: tests/test_copy_recipes.py's check_ddp_spawn.


def test_bad_input_is_rejected_in_the_parent_before_spawning(capsys):
    with pytest.raises(ValueError, match="does not divide across 5 ranks"):
        ddp_spawn.train(ddp_spawn.DDPSpawnConfig(nprocs=5))
    # a path of the wrong kind: refused by the config, before any training
    with pytest.raises(ValueError, match=r"^checkpoint_path .* is a directory; name a file"):
        ddp_spawn.DDPSpawnConfig(nprocs=1, checkpoint_path=str(Path(__file__).parent))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^backend nccl needs one CUDA device per process"):
            ddp_spawn.DDPSpawnConfig(backend="nccl")
    # a refusal found in the parent is one line, once: no child was started to print another
    with pytest.raises(SystemExit) as exit_info:
        ddp_spawn.main(["--nprocs", "5"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m recipes.ddp_spawn: error: global_batch_size=12 does")
    assert sum("error:" in line for line in err) == 1, err


def test_a_rank_that_raises_surfaces_in_the_parent_and_is_named(monkeypatch, capsys, tmp_path):
    # An unknown model preset fails inside every child with a KeyError (the config refuses it
    # when built; set after its checks, it reaches the children): mp.spawn stops the others and
    # raises ProcessRaisedException in the parent, naming the rank, with its traceback.
    cfg = ddp_spawn.DDPSpawnConfig(nprocs=2, checkpoint_path=str(tmp_path / "c.pt"))
    cfg.model = "no-such-model"
    with pytest.raises(mp.ProcessRaisedException, match=r"KeyError: 'no-such-model'") as raised:
        ddp_spawn.train(cfg)
    assert raised.value.error_index in (0, 1) and "Traceback" in raised.value.msg

    # main turns it into the child's traceback and one last line that names the rank (no spawn)
    def failing_train(cfg):
        raise raised.value

    monkeypatch.setattr(ddp_spawn, "train", failing_train)
    with pytest.raises(SystemExit) as exit_info:
        ddp_spawn.main([])
    assert exit_info.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(r"^error: rank \d+ failed: KeyError: 'no-such-model'$", last), last


def test_a_busy_master_port_is_refused_before_spawning(monkeypatch):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
        with pytest.raises(ValueError, match="is already in use"):
            ddp_spawn.train(ddp_spawn.DDPSpawnConfig(nprocs=2))


# The config refuses them, built in code or from the command line (argparse's usage, one line,
# exit 2): the same input, the same one line.
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nprocs", "0"], r"error: nprocs must be .*>= 1, got 0$"),
        (["--bucket-cap-mb", "0"], r"error: bucket_cap_mb must be .*> 0, got 0(\.0)?$"),
    ],
)
def test_bad_numbers_are_refused_by_the_command_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ddp_spawn.main(argv)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(message, last), last
