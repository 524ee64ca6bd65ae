"""loss_compare: every input format is recognised, both outcomes of --assert-equal, bad input."""

import json
import subprocess
import sys

import pytest

from recipes import loss_compare
from tests.deadlines import scaled
from tests.helpers import REPO_ROOT

LOSSES = [4.3398470878601074, 4.2211, 4.1002, 3.9876]


def write_formats(folder, losses=LOSSES) -> dict[str, str]:
    """The same losses in every format loss_compare reads; path by format name."""
    files = {
        "results file": ("run.json", json.dumps({"recipe": "x", "result": {"losses": losses}})),
        "recipe output": (
            "stdout.txt",
            "[rank0] step 0 loss 4.3398 time 3.1 ms\n"
            "[rank0] done: 4 steps on 2 rank(s): loss 4.3398 -> 3.9876\n"
            + json.dumps({"recipe": "x", "losses": losses})
            + "\n",
        ),
        "log": (
            "train.log",
            "".join(
                f"\x1b[32m[rank0] step {s} loss {v} time 3.0 ms\x1b[0m\n"
                for s, v in enumerate(losses)
            )
            + "[rank0] done: 4 steps on 2 rank(s): loss 4.33 -> 3.98\n",
        ),
        "torchtitan log": (
            "titan.log",
            "".join(f"[titan] step: {s}  loss: {v}  memory: 1GiB\n" for s, v in enumerate(losses)),
        ),
        "CSV": ("losses.csv", "step,loss\n" + "".join(f"{s},{v}\n" for s, v in enumerate(losses))),
        "JSON lines": (
            "losses.jsonl",
            "".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in enumerate(losses)),
        ),
    }
    paths = {}
    for name, (filename, text) in files.items():
        (folder / filename).write_text(text)
        paths[name] = str(folder / filename)
    return paths


def test_every_format_is_detected_and_read(tmp_path):
    detected = {
        "results file": "JSON",
        "recipe output": "recipe output",
        "log": "log",
        "torchtitan log": "log",
        "CSV": "CSV",
        "JSON lines": "JSON lines",
    }
    for name, path in write_formats(tmp_path).items():
        losses, found = loss_compare.read_losses(path)
        assert found == detected[name], name
        assert losses == dict(enumerate(LOSSES)), name  # full precision, steps from 0


def test_equal_runs_pass_assert_equal_in_any_pair_of_formats(tmp_path, capsys):
    paths = list(write_formats(tmp_path).values())
    for a, b in zip(paths, paths[1:]):
        result = loss_compare.main([a, b, "--assert-equal"])
        assert result["equal"] and result["max_abs_diff"] == 0 and result["common_steps"] == 4
    out = capsys.readouterr().out
    assert "first step that parts (atol=0, rtol=0): none, on 4 common steps" in out


def test_runs_that_part_exit_1_naming_the_first_step_and_the_largest_difference(tmp_path, capsys):
    a = write_formats(tmp_path)["CSV"]
    other = [LOSSES[0], LOSSES[1] + 1e-6, LOSSES[2] + 3e-3, LOSSES[3], 3.5]  # and one more step
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in enumerate(other)))
    with pytest.raises(SystemExit) as exit_info:
        loss_compare.main([a, str(b), "--assert-equal", "--atol", "1e-5"])
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert "first step that parts (atol=1e-05, rtol=0): step 2" in captured.out
    assert "largest absolute difference: 0.003 at step 2" in captured.out
    assert "steps only in B: 4" in captured.out
    assert captured.err.splitlines() == [
        "loss_compare: the runs differ: they part at step 2; their steps differ"
    ]
    result = json.loads(captured.out.splitlines()[-1])
    assert (result["first_parted_step"], result["only_in_b"], result["equal"]) == (2, [4], False)
    assert result["max_rel_diff"] == pytest.approx(3e-3 / LOSSES[2])
    # a tolerance that covers the difference: they no longer part (the extra step still differs)
    result = loss_compare.main([a, str(b), "--rtol", "1e-3"])
    assert result["first_parted_step"] is None and not result["equal"]
    # without --assert-equal the same comparison is a report: exit 0
    assert loss_compare.main([a, str(b)])["first_parted_step"] == 1


def test_a_nan_parts_unless_both_runs_have_it():
    nan = float("nan")
    assert loss_compare.compare({0: 1.0, 1: nan}, {0: 1.0, 1: nan}, atol=0, rtol=0)["equal"]
    result = loss_compare.compare({0: 1.0, 1: 2.0}, {0: 1.0, 1: nan}, atol=1.0, rtol=0)
    assert result["first_parted_step"] == 1 and result["max_abs_diff"] == float("inf")


@pytest.mark.parametrize(
    "content, message",
    [
        (
            None,
            "error: {path}: no such file; give the path of a log, results JSON, CSV or JSONL file",
        ),
        (
            "nothing to see here\n",
            "error: {path}: no losses found; expected a recipe's JSON result "
            "(\"losses\"), log lines like 'step 3 loss 2.3456', a CSV with columns step,loss, "
            'or JSON lines {{"step", "loss"}}',
        ),
        (
            "step,loss\n0,4.3\n1,oops\n",
            "error: {path}: line 3 of the CSV has no number in step or "
            "loss: {{'step': '1', 'loss': 'oops'}}",
        ),
        (  # a results JSON cut short: no format reads it, so it is said, never half-read
            '{"result": {"losses": [4.3, 4.1',
            "error: {path}: no losses found; expected a recipe's JSON result "
            "(\"losses\"), log lines like 'step 3 loss 2.3456', a CSV with columns step,loss, "
            'or JSON lines {{"step", "loss"}}',
        ),
        (
            b"\xff\xfe\x00binary",
            "error: {path}: cannot read it as text (UnicodeDecodeError); give a "
            "log, results JSON, CSV or JSONL file",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    good = write_formats(tmp_path)["CSV"]
    path = tmp_path / "bad.txt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        loss_compare.main([good, str(path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [message.format(path=path)]


def test_a_negative_tolerance_and_a_folder_for_a_file_are_refused(tmp_path, capsys):
    good = write_formats(tmp_path)["CSV"]
    for argv, message in (
        ([good, good, "--atol", "-1"], "atol must be a finite number >= 0, got -1.0"),
        ([good, good, "--rtol", "nan"], "rtol must be a finite number >= 0, got nan"),
        (
            [good, str(tmp_path)],
            f"test {tmp_path} is a folder; name a log, results JSON, CSV or JSONL file",
        ),
    ):
        with pytest.raises(SystemExit) as exit_info:
            loss_compare.main(argv)
        assert exit_info.value.code == 2
        # argparse's usage, then one line
        last = capsys.readouterr().err.splitlines()[-1]
        assert last == f"python -m recipes.loss_compare: error: {message}", last


def test_the_command_line_compares_two_committed_results_files():
    """The real entry point, on two committed results: ZeRO-1 trains the DDP baseline's model and
    data, so its losses match DDP's within 1e-5 (tests/test_zero.py asserts the same)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes.loss_compare",
            "results/ddp_torchrun.json",
            "results/zero.json",
            "--assert-equal",
            "--atol",
            "1e-5",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["common_steps"] >= 2


def test_a_copy_runs_alone_outside_the_package(tmp_path):
    """Its docstring says: copy it with recipes/options.py. A copy in a folder of its own, where
    the cookbook's package is not on the path (-E: no PYTHONPATH), reads and compares as the
    module does, without torch."""
    import shutil

    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "__init__.py").write_text("")
    for name in ("loss_compare.py", "options.py"):
        shutil.copy(f"{REPO_ROOT}/recipes/{name}", tmp_path / "recipes" / name)
    paths = write_formats(tmp_path)
    script = (
        "import sys, runpy; sys.modules['torch'] = None; "  # importing torch would fail
        "runpy.run_module('recipes.loss_compare', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-E", "-s", "-c", script, paths["CSV"], paths["log"], "--assert-equal"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["equal"] is True
