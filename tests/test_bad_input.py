"""Bad input that recipes let through, refused before any work in one line that names the option and
the fix: path options (each recipe checks its own, before any rank diverges from the others) and
numbers that are accepted but would do nothing."""

import importlib.util
import os

import pytest


@pytest.fixture
def places(tmp_path):
    a_file, a_dir = tmp_path / "a_file", tmp_path / "a_dir"
    a_file.write_text("x")
    a_dir.mkdir()
    return a_file, a_dir


def test_each_recipes_path_options_fail_before_any_work(places, tmp_path):
    """The recipes whose output path failed only when written (after training, or in makedirs, in
    a traceback): each is refused up front, in the line that names the option."""
    from recipes import ddp_spawn, hang_diagnosis, meta_init

    a_file, a_dir = places
    # each refuses where it can: in its config (built in code or from the command line) or at the
    # top of its train(), before any work; the line names the option and the path
    cases = [
        (
            lambda: ddp_spawn.train(ddp_spawn.DDPSpawnConfig(nprocs=1, checkpoint_path=str(a_dir))),
            "checkpoint_path",
            a_dir,
        ),
        (
            lambda: ddp_spawn.train(
                ddp_spawn.DDPSpawnConfig(nprocs=1, checkpoint_path=str(a_file / "c.pt"))
            ),
            "checkpoint_path",
            a_file / "c.pt",
        ),
        (
            lambda: meta_init.create_seed_checkpoint(
                meta_init.MetaInitConfig(
                    create_seed_checkpoint=True, seed_checkpoint_dir=str(a_file)
                )
            ),
            "seed_checkpoint_dir",
            a_file,
        ),
        (
            lambda: hang_diagnosis.train(hang_diagnosis.HangConfig(trace_dir=str(a_file))),
            "trace_dir",
            a_file,
        ),
    ]
    if importlib.util.find_spec("lightning") is not None:  # an optional dependency
        from recipes import lightning_fabric, lightning_trainer

        cases += [
            (
                lambda: lightning_fabric.train(
                    lightning_fabric.FabricConfig(resume_from=str(a_dir))
                ),
                "resume_from",
                a_dir,
            ),
            (
                lambda: lightning_fabric.train(
                    lightning_fabric.FabricConfig(
                        checkpoint_every_n_steps=1, checkpoint_dir=str(a_file)
                    )
                ),
                "checkpoint_dir",
                a_file,
            ),
            (
                lambda: lightning_trainer.train(
                    lightning_trainer.LightningConfig(
                        output_dir=str(a_file), resume_from=str(a_dir / "gone.ckpt")
                    )
                ),
                "output_dir",
                a_file,
            ),
            (
                lambda: lightning_trainer.train(
                    lightning_trainer.LightningConfig(
                        output_dir=str(a_dir), resume_from=str(a_dir / "gone.ckpt")
                    )
                ),
                "resume_from",
                a_dir / "gone.ckpt",
            ),
        ]
    for run, name, path in cases:
        # every recipe here is copyable: a plain ValueError (it imports nothing of ours)
        with pytest.raises(ValueError) as caught:
            run()
        assert_names(str(caught.value), name, path)
    assert sorted(os.listdir(tmp_path)) == ["a_dir", "a_file"] and not os.listdir(a_dir)


def assert_names(message: str, name: str, path) -> None:
    """One line that names the option (as a field or as a flag) and the path it was given."""
    assert "\n" not in message, message
    assert name in message or "--" + name.replace("_", "-") in message, (name, message)
    assert str(path) in message, (path, message)


def test_the_round_three_recipes_refuse_each_class_of_bad_input_from_code(places, tmp_path):
    """Issue 31's classes in job, data, evaluation, loss_compare, comm_bench, hang_diagnosis and
    memory_estimate: a path of the wrong kind, a file that does not parse, values that contradict
    each other, an input folder with nothing usable. Refused by the config itself, so a config
    built in code is refused exactly like the command line (each recipe's tests check the
    command line's exit 2 and what train() refuses once it knows the data)."""
    from recipes import comm_bench, data, evaluation, job, loss_compare, memory_estimate

    a_file, a_dir = places
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken.yaml"
    broken.write_text("steps: [1, 2\n")
    for make, words in [
        (lambda: job.JobConfig(out_dir=str(a_file)), f"out_dir {a_file} is a file"),
        (lambda: job.JobConfig(data_dir=str(a_file)), f"data_dir {a_file} is a file"),
        (lambda: job.JobConfig(corpus=str(a_file)), f"corpus {a_file}: not a folder"),
        (lambda: job.JobConfig(corpus=str(empty)), f"corpus {empty}: holds no files"),
        (lambda: job.JobConfig(min_lr=0.1, lr=0.01), "min_lr=0.1 is above lr=0.01"),
        (lambda: job.JobConfig(warmup_steps=20, steps=10), "warmup_steps=20 > steps=10"),
        (lambda: job.load_config(str(broken), {}), f"config {broken}: not valid YAML"),
        (lambda: job.load_config(str(a_dir), {}), f"config {a_dir}: not a file"),
        (lambda: job.load_config(None, {"lr_max": 1.0}), "unknown key 'lr_max'; valid keys:"),
        (lambda: data.DataConfig(data_dir=str(a_file)), f"data_dir {a_file} is a file"),
        (lambda: data.DataConfig(checkpoint=str(a_file)), f"checkpoint {a_file} is a file"),
        (lambda: data.DataConfig(corpus=str(empty)), f"corpus {empty}: holds no files"),
        (lambda: data.DataConfig(val_fraction=1.0), "val_fraction=1.0 leaves no training"),
        (lambda: data.DataConfig(seq_len=64, shard_tokens=64), "shard_tokens=64 holds no window"),
        (lambda: evaluation.EvalConfig(data_dir=str(a_file)), f"data_dir {a_file} is a file"),
        (
            lambda: loss_compare.CompareConfig(baseline=str(a_dir), test=str(a_file)),
            f"baseline {a_dir} is a folder",
        ),
        (
            lambda: comm_bench.CommBenchConfig(json_path=str(a_dir)),
            f"json_path {a_dir} is a folder",
        ),
        (
            lambda: comm_bench.CommBenchConfig(min_bytes=8192, max_bytes=1024),
            "min_bytes 8192 must be at most max_bytes 1024",
        ),
        (lambda: memory_estimate.EstimateConfig(tp=3), "heads=32 must divide by tp=3"),
    ]:
        with pytest.raises(ValueError) as caught:
            make()
        message = str(caught.value)
        assert "\n" not in message and words in message, (words, message)
    assert sorted(os.listdir(tmp_path)) == ["a_dir", "a_file", "broken.yaml", "empty"]


def test_a_step_option_past_the_last_step_is_refused():
    """A fault injected, or an all_reduce skipped, at a step the run never reaches: the run passed
    as a clean one, and looked like the demonstration it was not."""
    # (amp's --overflow-at-step and fsdp's --inject-inf-step/--inject-inf-rank are gone: their
    # fault injection lives in tests/test_amp.py and tests/test_fsdp.py now, as fsdp2's does)
    from recipes import hang_diagnosis

    # hang_diagnosis is copyable: a plain ValueError (it cannot import RecipeError)
    cases = [
        (
            lambda: hang_diagnosis.HangConfig(steps=4, skip_rank=1, skip_step=4),
            "skip_step=4 is never reached: the steps are 0 to 3; use --skip-step 3 or less",
            ValueError,
        ),
    ]
    for make, message, error in cases:
        with pytest.raises(error) as caught:
            make()
        assert str(caught.value).startswith(message), str(caught.value)
    hang_diagnosis.HangConfig(steps=4, skip_step=9)  # no --skip-rank: --skip-step is not used


def test_the_command_line_says_it_in_one_line_and_exits_2(capsys):
    # (it was amp's --overflow-at-step, an option amp no longer has: the fault injection moved
    # into tests/test_amp.py; hang_diagnosis's --skip-step is checked by the same function)
    # (hang_diagnosis is copyable now: its own main() says it, as ddp_torchrun's does)
    from recipes import hang_diagnosis

    with pytest.raises(SystemExit) as exit_info:
        hang_diagnosis.main(["--steps", "6", "--skip-rank", "1", "--skip-step", "6"])
    assert exit_info.value.code == 2
    # refused by its config: argparse's usage, then one line
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m recipes.hang_diagnosis: error: skip_step=6 is never reached: the steps are 0 "
        "to 5; use --skip-step 5 or less, or --steps 7 or more"
    )


def test_a_checkpoint_interval_longer_than_the_run_is_refused():
    lightning = pytest.importorskip("recipes.lightning_fabric", reason="needs lightning")
    from recipes import lightning_trainer

    # both are copyable: a plain ValueError (they cannot import RecipeError)
    for config in (lightning.FabricConfig, lightning_trainer.LightningConfig):
        with pytest.raises(
            ValueError,
            match=r"^checkpoint_every_n_steps=7 > steps=6: no "
            r"checkpoint would be written; use "
            r"--checkpoint-every-n-steps 6 or less \(0 = none\)$",
        ):
            config(steps=6, checkpoint_every_n_steps=7)
        config(steps=6, checkpoint_every_n_steps=6)  # saves once, at the end
