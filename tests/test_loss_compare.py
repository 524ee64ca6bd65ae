"""loss_compare: every input format is recognised (the frameworks' own files: written by the
framework where it is installed, else line for line as its source prints them), --key, the lines
it skipped, both outcomes of --assert-equal, bad input."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

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


NO_LOSSES = (
    "error: {path}: no losses found; expected a recipe's JSON result, a log (ours, torchtitan's, "
    "Megatron-LM's, nanoGPT's), CSV or JSON lines with a step, a trainer_state.json, or "
    "TensorBoard events (events.out.tfevents.*)"
)


@pytest.mark.parametrize(
    "content, message",
    [
        (
            None,
            "error: {path}: no such file; give the path of a log, results JSON, CSV or JSONL file",
        ),
        (
            "nothing to see here\n",
            NO_LOSSES,
        ),
        (
            "step,loss\n0,4.3\n1,oops\n",
            "error: {path}: line 3 of the CSV has no number in step or "
            "loss: {{'step': '1', 'loss': 'oops'}}",
        ),
        (  # a results JSON cut short: no format reads it, so it is said, never half-read
            '{"result": {"losses": [4.3, 4.1',
            NO_LOSSES,
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
            f"test {tmp_path} is a folder with no TensorBoard event file; name a log, results "
            "JSON, CSV or JSONL file",
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


def test_a_copy_runs_alone_outside_the_package(tmp_path, framework_files):
    """Its docstring says: copy it with recipes/options.py. A copy in a folder of its own, where
    the cookbook's package is not on the path (-E: no PYTHONPATH), reads and compares as the
    module does, without torch; TensorBoard events with tensorboard alone."""
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
    # TensorBoard keeps float32: within 1e-6 of the trainer_state.json's float64
    events, state = (
        framework_files["TensorBoard events"],
        framework_files["Hugging Face trainer_state"],
    )
    for argv in (
        [paths["CSV"], paths["log"], "--assert-equal"],
        [events, state, "--key", "val_loss", "--assert-equal", "--atol", "1e-6"],
    ):
        proc = subprocess.run(
            [sys.executable, "-E", "-s", "-c", script, *argv],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=scaled(60),
        )
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout.splitlines()[-1])["equal"] is True


def test_the_job_s_files_agree_on_its_step_numbers(tmp_path):
    """The job's result starts its losses at "first_step" (past 1 in a resumed run), as its
    metrics.jsonl numbers them; its "val_losses" are [step, loss] pairs."""
    result = {"first_step": 3, "losses": [2.0, 1.5], "val_losses": [[2, 2.2], [4, 1.4]]}
    (tmp_path / "job.json").write_text(json.dumps({"recipe": "job", "result": result}))
    (tmp_path / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "mfu": None})
            + "\n"
            for step, loss in ((3, 2.0), (4, 1.5))
        )
    )
    job, metrics = str(tmp_path / "job.json"), str(tmp_path / "metrics.jsonl")
    assert loss_compare.read_losses(job) == ({3: 2.0, 4: 1.5}, "JSON")
    assert loss_compare.read_losses(job, "val_loss") == ({2: 2.2, 4: 1.4}, "JSON")
    assert loss_compare.read_losses(metrics, "grad_norm") == ({3: 0.5, 4: 0.5}, "JSON lines")
    assert loss_compare.main([job, metrics, "--assert-equal"])["equal"]


# --- the frameworks' own files ------------------------------------------------------------------

# A run of 4 steps as each framework logs it: train losses, grad norms, validation losses.
TRAIN = LOSSES
GRAD_NORMS = [1.25, 0.98, 0.87, 0.8]
VAL = {2: 4.1501, 4: 3.9912}


def megatron_log() -> str:
    """A Megatron-LM log: the lines training_log and evaluate_and_print_results print, built with
    their format strings (NVIDIA/Megatron-LM d98e8a6, megatron/training/training.py, lines
    3567-3641 and 5370-5400). fp16: iteration 1 is skipped (a loss-scale overflow) and logs a
    loss of 0; iterations 2-5 are the run's 4 steps."""
    lines = ["using world size: 1, data-parallel size: 1, tensor-model-parallel size: 1", ""]

    def iteration(number, loss, grad_norm, skipped):
        line = " [2026-11-27 10:00:00.000000]"
        line += f" iteration {number:8d}/{5:8d} |"
        line += f" consumed samples: {number * 8:12d} |"
        line += f" elapsed time per iteration (ms): {812.3:.1f} |"
        line += f" learning rate: {1e-4:.6E} |"
        line += f" global batch size: {8:5d} |"
        line += " {}: {:.6E} |".format("lm loss", loss)
        line += f" loss scale: {4096.0:.1f} |"
        if grad_norm is not None:
            line += f" grad norm: {grad_norm:.3f} |"
        line += f" number of skipped iterations: {skipped:3d} |"
        line += f" number of nan iterations: {0:3d} |"
        return line

    def validation(prefix, loss):
        string = f" validation loss at {prefix} | "
        string += "{} value: {:.6E} | ".format("lm loss", loss)
        string += "{} PPL: {:.6E} | ".format("lm loss", math.exp(min(20, loss)))
        return ["-" * (len(string) + 1), string, "-" * (len(string) + 1)]

    lines.append(iteration(1, 0.0, None, 1))
    for step, (loss, grad_norm) in enumerate(zip(TRAIN, GRAD_NORMS), start=2):
        lines.append(iteration(step, loss, grad_norm, 0))
        if step - 1 in VAL:
            lines += validation(f"iteration {step}", VAL[step - 1])
    lines += validation("iteration 5 on validation set", VAL[4])
    lines += validation("iteration 5 on test set", 9.99)  # a test set: not a validation loss
    return "\n".join(lines) + "\n"


def nanogpt_log() -> str:
    """nanoGPT's train.py output (karpathy/nanoGPT 3adf61e): its print lines 265 and 327."""
    lines = [
        "tokens per iteration will be: 16,384",
        "number of parameters: 10.65M",
        "step 0: train loss 4.3912, val loss 4.3950",  # before training: an evaluation
    ]
    for iter_num, lossf in enumerate(TRAIN):
        dt, running_mfu = 0.0321, -1.0
        lines.append(
            f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, "
            f"mfu {running_mfu * 100:.2f}%"
        )
        if iter_num + 1 in VAL:
            losses = {"train": 4.0, "val": VAL[iter_num + 1]}
            lines.append(
                f"step {iter_num + 1}: train loss {losses['train']:.4f}, "
                f"val loss {losses['val']:.4f}"
            )
    return "\n".join(lines) + "\n"


def lightning_metrics_csv() -> str:
    """Lightning's CSVLogger metrics.csv for ``self.log("train_loss", loss)`` in training_step and
    ``self.log("val_loss", loss)`` in validation_step (log_every_n_steps=1): steps from 0, a
    validation row of its own, the other cells empty (as test_lightning_writes_it checks)."""
    rows = ["epoch,step,train_loss,val_loss"]
    for step, loss in enumerate(TRAIN):
        rows.append(f"0,{step},{loss},")
        if step + 1 in VAL:
            rows.append(f"0,{step},,{VAL[step + 1]}")
    return "\n".join(rows) + "\n"


def trainer_log_history() -> list[dict]:
    """What transformers' Trainer appends to log_history with logging_steps=1, eval_steps=2 (as
    test_the_trainer_writes_it checks): steps from 1, an evaluation entry, the run's summary."""
    history = []
    for step, (loss, grad_norm) in enumerate(zip(TRAIN, GRAD_NORMS), start=1):
        history.append(
            {
                "epoch": step / 4,
                "grad_norm": grad_norm,
                "learning_rate": 5e-05,
                "loss": loss,
                "step": step,
            }
        )
        if step in VAL:
            history.append(
                {
                    "epoch": step / 4,
                    "eval_loss": VAL[step],
                    "eval_runtime": 0.0119,
                    "eval_samples_per_second": 168.7,
                    "eval_steps_per_second": 84.4,
                    "step": step,
                }
            )
    history.append(
        {
            "epoch": 1.0,
            "step": 4,
            "total_flos": 255744.0,
            "train_loss": sum(TRAIN) / 4,
            "train_runtime": 1.35,
            "train_samples_per_second": 4.45,
            "train_steps_per_second": 2.2,
        }
    )
    return history


def write_framework_formats(folder: Path) -> dict[str, str]:
    """Each framework's file, path by format name: by the framework itself where it is cheap
    (transformers' TrainerState writer, torch's SummaryWriter), else as its source prints it."""
    from torch.utils.tensorboard import SummaryWriter
    from transformers import TrainerState

    (folder / "megatron.log").write_text(megatron_log())
    (folder / "nanogpt.log").write_text(nanogpt_log())
    (folder / "metrics.csv").write_text(lightning_metrics_csv())
    state = TrainerState(global_step=4, max_steps=4, log_history=trainer_log_history())
    state.save_to_json(str(folder / "trainer_state.json"))
    # the job's tags (recipes/job.py; test_tensorboard_reads_the_job_s_tags checks them)
    with SummaryWriter(str(folder / "tensorboard")) as writer:
        for step, (loss, grad_norm) in enumerate(zip(TRAIN, GRAD_NORMS), start=1):
            writer.add_scalar("train/loss", loss, step)
            writer.add_scalar("train/grad_norm", grad_norm, step)
            if step in VAL:
                writer.add_scalar("val/loss", VAL[step], step)
    return {
        "Megatron-LM log": str(folder / "megatron.log"),
        "nanoGPT log": str(folder / "nanogpt.log"),
        "CSV": str(folder / "metrics.csv"),
        "Hugging Face trainer_state": str(folder / "trainer_state.json"),
        "TensorBoard events": str(folder / "tensorboard"),
    }


def f32(value: float) -> float:
    """TensorBoard keeps a scalar as float32."""
    import struct

    return struct.unpack("f", struct.pack("f", value))[0]


# What each format holds of the run, at the precision and with the step numbers it logs them.
EXPECTED = {
    "Megatron-LM log": {
        "train_loss": {s: float(f"{v:.6E}") for s, v in enumerate(TRAIN, start=2)},
        "grad_norm": {s: float(f"{v:.3f}") for s, v in enumerate(GRAD_NORMS, start=2)},
        "val_loss": {s + 1: float(f"{v:.6E}") for s, v in VAL.items()},
    },
    "nanoGPT log": {
        "train_loss": {s: float(f"{v:.4f}") for s, v in enumerate(TRAIN)},
        "val_loss": {0: 4.395, **{s: float(f"{v:.4f}") for s, v in VAL.items()}},
    },
    "CSV": {
        "train_loss": dict(enumerate(TRAIN)),
        "val_loss": {s - 1: v for s, v in VAL.items()},
    },
    "Hugging Face trainer_state": {
        "train_loss": dict(enumerate(TRAIN, start=1)),
        "grad_norm": dict(enumerate(GRAD_NORMS, start=1)),
        "val_loss": VAL,
    },
    "TensorBoard events": {
        "train_loss": {s: f32(v) for s, v in enumerate(TRAIN, start=1)},
        "grad_norm": {s: f32(v) for s, v in enumerate(GRAD_NORMS, start=1)},
        "val_loss": {s: f32(v) for s, v in VAL.items()},
    },
}


@pytest.fixture(scope="module")
def framework_files(tmp_path_factory) -> dict[str, str]:
    return write_framework_formats(tmp_path_factory.mktemp("frameworks"))


def test_each_framework_s_file_is_detected_and_every_key_read(framework_files):
    """Megatron-LM's and nanoGPT's logs, Lightning's metrics.csv, the Trainer's
    trainer_state.json and TensorBoard events: each key at the steps and precision it was logged,
    the evaluations under val_loss only, Megatron's skipped iteration and test set left out."""
    for name, path in framework_files.items():
        for key in EXPECTED[name]:
            values, found = loss_compare.read_losses(path, key)
            assert found == name, (path, found)
            assert values == EXPECTED[name][key], (name, key, values)


def titan_line(step: int, loss: float, grad_norm: float) -> str:
    """torchtitan's training line (pytorch/torchtitan b5bcd76, torchtitan/components/metrics.py,
    lines 527-536), colours and all."""
    red, green, orange, reset = "\033[31m", "\033[32m", "\033[33m", "\033[39m"
    return (
        f"[titan] {red}step: {step:2}  {green}loss: {loss:8.5f}  {orange}grad_norm: "
        f"{grad_norm:7.4f}  memory:  1.20GiB(3.05%)  tps: 1,234  tflops: 0.12  mfu: N/A{reset}"
    )


def titan_validation_line(step: int, loss: float) -> str:
    """torchtitan's validator line (the same file, lines 570-576)."""
    yellow, green, reset = "\033[33m", "\033[32m", "\033[39m"
    return (
        f"[titan] {yellow}validate step: {step:2}  {green}loss: {loss:7.4f}  "
        f"memory:  1.20GiB(3.05%)  tps: 2,345{reset}"
    )


def test_an_evaluation_line_is_never_a_training_step(tmp_path):
    """Each of these lines holds a step and a loss, and each was read as a training step: the
    issue's nanoGPT evaluation ("step 0: train loss 10.9, val loss 10.9"), torchtitan's validator
    and the job's val_loss line. They are the val_loss of their step, never its train_loss."""
    job = (  # recipes/job.py's two lines, on stderr
        f"step 1/2 loss {2.345:.4f} lr {1e-3:.2e} grad_norm {1.2:.3f} {1234.0:,.0f} tok/s "
        f"data_wait {0.03:.0%}\nstep 1 val_loss {2.4:.4f}\n"
    )
    for text, name in (
        (
            "step 0: train loss 10.9000, val loss 10.9000\n"
            "iter 1: loss 2.3450, time 12.00ms, mfu -100.00%\n",
            "nanoGPT log",
        ),
        (titan_line(1, 2.345, 1.2) + "\n" + titan_validation_line(1, 2.4) + "\n", "log"),
        (job, "log"),
        # recipes/grad_clipping.py's line: "grad norm", a space
        (f"step 1 loss {2.345:.4f} grad norm {1.2:.4f}\n" + "step 1 val_loss 2.4\n", "log"),
    ):
        path = tmp_path / "run.log"
        path.write_text(text)
        found, found_name = loss_compare.read_file(str(path))
        assert found_name == name, text
        assert found.series["train_loss"] == {1: 2.345}, text  # not step 0, nor 2.4 at step 1
        validation = {0: 10.9} if name == "nanoGPT log" else {1: 2.4}
        assert found.series["val_loss"] == validation, text
        assert found.series.get("grad_norm", {1: 1.2}) == {1: 1.2}, text


def test_the_report_says_which_lines_were_skipped_and_why(framework_files, capsys):
    nanogpt, megatron = framework_files["nanoGPT log"], framework_files["Megatron-LM log"]
    result = loss_compare.main([nanogpt, megatron])
    assert capsys.readouterr().out.splitlines()[:4] == [
        f"A: {nanogpt} (nanoGPT log, 4 steps of train_loss)",
        "   skipped 5 lines: 1-2 (not a step line), 3, 6, 9 (val_loss only)",
        f"B: {megatron} (Megatron-LM log, 4 steps of train_loss)",
        "   skipped 6 lines: 1, 18 (not an iteration or validation line), 3 (a skipped "
        "iteration: no loss), 7, 12, 15 (val_loss only)",
    ]
    assert result["key"] == "train_loss" and result["only_in_a"] == [0, 1]
    # the validation loss: the training lines are the ones skipped now
    loss_compare.main([nanogpt, nanogpt, "--key", "val_loss", "--assert-equal"])
    assert capsys.readouterr().out.splitlines()[:2] == [
        f"A: {nanogpt} (nanoGPT log, 3 steps of val_loss)",
        "   skipped 6 lines: 1-2 (not a step line), 4-5, 7-8 (train_loss only)",
    ]
    # a trainer_state.json counts its log_history entries; the run's summary is one of them
    state = framework_files["Hugging Face trainer_state"]
    loss_compare.main([state, state])
    assert capsys.readouterr().out.splitlines()[:2] == [
        f"A: {state} (Hugging Face trainer_state, 4 steps of train_loss)",
        "   skipped 3 log_history entries: 7 (the run's summary), 3, 6 (val_loss only)",
    ]
    # a file read whole skips nothing, and says nothing of it
    loss_compare.main([framework_files["TensorBoard events"]] * 2)
    assert capsys.readouterr().out.splitlines()[1].startswith("B: ")


def test_a_key_the_file_lacks_is_one_line_naming_the_keys_it_has(framework_files, tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter

    nanogpt = framework_files["nanoGPT log"]
    with SummaryWriter(str(tmp_path)) as writer:
        writer.add_scalar("accuracy", 0.5, 1)
    for argv, message in (
        (
            [nanogpt, nanogpt, "--key", "grad_norm"],
            f"error: {nanogpt} (nanoGPT log) has no grad_norm; it has train_loss, val_loss "
            "(choose with --key)",
        ),
        (
            [nanogpt, str(tmp_path)],
            f"error: {tmp_path}: no TensorBoard scalar of a loss or grad norm; its scalars: "
            "accuracy",
        ),
    ):
        with pytest.raises(SystemExit) as exit_info:
            loss_compare.main(argv)
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == message
    with pytest.raises(SystemExit) as exit_info:  # a key that is none: argparse names the valid
        loss_compare.main([nanogpt, nanogpt, "--key", "lr"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert "--key" in last and "train_loss" in last and "grad_norm" in last, last


def test_tensorboard_reads_the_job_s_tags_and_a_resumed_run_s_folder(tmp_path):
    """The tags the job writes are the defaults read; a folder reads every event file in it, so a
    run resumed from step 2 (purge_step=3, as the job does) has its redone steps, once."""
    from torch.utils.tensorboard import SummaryWriter

    job = Path(REPO_ROOT, "recipes", "job.py").read_text()
    assert re.search(r'for key in \([^)]*"loss"[^)]*"grad_norm"', job)  # train/loss, train/...
    assert 'add_scalar(f"train/{key}"' in job and 'add_scalar("val/loss"' in job
    with SummaryWriter(str(tmp_path), purge_step=1) as writer:
        for step in (1, 2, 3):  # it crashed after step 3, its checkpoint was at step 2
            writer.add_scalar("train/loss", 4.0 - step / 4, step)
    first_file = next(tmp_path.iterdir())
    with SummaryWriter(str(tmp_path), purge_step=3) as writer:
        for step in (3, 4):
            writer.add_scalar("train/loss", 3.0 - step / 8, step)
    assert loss_compare.read_losses(str(first_file)) == (
        {1: 3.75, 2: 3.5, 3: 3.25},
        "TensorBoard events",
    )
    assert loss_compare.read_losses(str(tmp_path))[0] == {1: 3.75, 2: 3.5, 3: 2.625, 4: 2.5}


def test_without_tensorboard_an_event_file_is_one_line(framework_files, monkeypatch, capsys):
    events = framework_files["TensorBoard events"]
    name = "tensorboard.backend.event_processing.event_accumulator"
    monkeypatch.setitem(sys.modules, name, None)  # as if tensorboard were not installed
    with pytest.raises(SystemExit) as exit_info:
        loss_compare.main([events, events])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {events}: TensorBoard events; reading them needs tensorboard: "
        "pip install tensorboard"
    ]


# importing lightning costs ~9 CPU s: the default run reads a file of the same shape, by hand
@pytest.mark.slow
def test_lightning_writes_it(tmp_path):
    """A LightningModule trained 3 steps with CSVLogger writes the metrics.csv the default run
    reads (lightning_metrics_csv): its train_loss column, steps from 0, a validation row of its
    own that is no training step."""
    import lightning as L
    import torch
    from lightning.pytorch.loggers import CSVLogger

    logged = []

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_index):
            loss = torch.nn.functional.mse_loss(self.linear(batch[0]), batch[1])
            self.log("train_loss", loss)
            logged.append(loss.item())
            return loss

        def validation_step(self, batch, batch_index):
            self.log("val_loss", torch.nn.functional.mse_loss(self.linear(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(6, 2), torch.randn(6, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    trainer = L.Trainer(
        max_steps=3,
        logger=CSVLogger(str(tmp_path), name="run"),
        log_every_n_steps=1,
        val_check_interval=2,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), loader, loader)
    path = tmp_path / "run" / "version_0" / "metrics.csv"
    lines = path.read_text().splitlines()
    assert lines[0] == "epoch,step,train_loss,val_loss"
    assert lines[3].startswith("0,1,,"), lines  # the validation after step 2: its own row
    assert loss_compare.read_losses(str(path)) == (dict(enumerate(logged)), "CSV")
    assert list(loss_compare.read_losses(str(path), "val_loss")[0]) == [1]


@pytest.mark.slow  # importing the Trainer and its run cost ~5 CPU s; the default run writes the
# same file with TrainerState's own writer (write_framework_formats)
def test_the_trainer_writes_it(tmp_path):
    """A Trainer run of 3 steps on a tiny GPT-2 (logging_steps=1, an evaluation every 2 steps)
    saves the trainer_state.json the default run reads: each entry as trainer_log_history
    writes it, the losses per step, the evaluations and the run's summary none of them."""
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    ids = torch.randint(0, 16, (6, 8))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=3,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    Trainer(GPT2LMHeadModel(config), args, train_dataset=data, eval_dataset=data[:2]).train()
    path = tmp_path / "checkpoint-3" / "trainer_state.json"
    history = json.loads(path.read_text())["log_history"]
    # the same kinds of entry, with the same fields, as the default run's file
    assert [sorted(entry) for entry in history[:3]] == [
        sorted(entry) for entry in trainer_log_history()[:3]
    ]
    losses, name = loss_compare.read_losses(str(path))
    assert name == "Hugging Face trainer_state"
    assert losses == {entry["step"]: entry["loss"] for entry in history if "loss" in entry}
    assert list(losses) == [1, 2, 3]
    assert list(loss_compare.read_losses(str(path), "val_loss")[0]) == [2, 3]
