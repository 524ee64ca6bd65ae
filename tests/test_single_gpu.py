"""recipes/single_gpu.py: the loop before torch.distributed, equal to ddp_torchrun bit for bit.

ddp_torchrun's own tests assert that its losses are the same on 1, 2 and 3 ranks; here the
single-GPU loop equals ddp_torchrun on one process, so it is the start of the same line.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

from recipes import ddp_torchrun, single_gpu
from recipes.options import parse_config
from recipes.toy import build_model
from tests.helpers import PYTHON, run_cli


def quietly(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


def test_equal_to_ddp_on_one_process_bit_for_bit_across_epochs(tmp_path):
    # 25 steps of 12 over 96 samples: four epochs, so the reshuffle every epoch is compared too
    alone = quietly(
        single_gpu.train,
        single_gpu.SingleGPUConfig(
            steps=25, precision="fp32", save_path=str(tmp_path / "single.pt")
        ),
    )
    ddp = quietly(
        ddp_torchrun.train,
        ddp_torchrun.DDPConfig(steps=25, precision="fp32", save_path=str(tmp_path / "ddp.pt")),
    )
    assert alone == ddp
    # and the saved weights: a plain state_dict, the same as DDP's .module
    saved, expected = (torch.load(tmp_path / f"{n}.pt") for n in ("single", "ddp"))
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in saved)
    build_model("tiny").load_state_dict(saved)


def test_it_uses_no_torch_distributed():
    tree = ast.parse(Path(single_gpu.__file__).read_text())
    names = [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    ]
    names += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [name for name in names if "distributed" in name], names


def test_the_command_prints_one_line_per_step_and_bad_input_is_one_line():
    done = run_cli([PYTHON, "-m", "recipes.single_gpu", "--steps", "3"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line.split()[:2] for line in done.stdout.splitlines()] == [
        ["step", str(step)] for step in range(3)
    ]
    bad = run_cli([PYTHON, "-m", "recipes.single_gpu", "--batch-size", "0"])
    assert bad.returncode == 2
    last = bad.stderr.strip().splitlines()[-1]
    assert re.search(r"error: batch_size must be .*>= 1, got 0$", last), last
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    "argv, names",
    [(["--lr", "nan"], "lr"), (["--model", "huge"], "--model"), (["--steps", "x"], "--steps")],
)
def test_other_bad_values_are_refused_by_the_parser(argv, names, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_config(single_gpu.make_parser(), single_gpu.SingleGPUConfig, argv)
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("python -m recipes.single_gpu: error: ") and names in last, last
    # and from code: the same value is one ValueError line naming the field
    if argv[0] == "--lr":
        with pytest.raises(ValueError, match=r"^lr must be a finite number.*, got nan$"):
            single_gpu.SingleGPUConfig(lr=float("nan"))


def test_the_harness_measures_it_from_outside():
    from recipes.core.observe import prove

    result = prove(
        single_gpu.train, single_gpu.SingleGPUConfig(precision="fp32"), name="single_gpu"
    )
    assert result.world_size == 1 and result.backend == "none"
    assert result.losses == quietly(single_gpu.train, single_gpu.SingleGPUConfig(precision="fp32"))
    (held,) = result.extras["memory_per_rank"]
    assert held["optimizer_bytes"] > held["param_bytes"] == held["grad_bytes"] > 0
