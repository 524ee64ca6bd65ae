"""Bad input that recipes let through, refused before any work in one line that names the option and
the fix: path options (each recipe checks its own, before any rank diverges from the others) and
numbers that are accepted but would do nothing."""

import importlib.util
import os

import pytest

from recipes.core.config import RecipeError, check_step_reached


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
    # ddp_spawn is copyable: it refuses with a plain ValueError (it cannot import RecipeError)
    for cfg, message in [
        (
            ddp_spawn.DDPSpawnConfig(nprocs=1, checkpoint_path=str(a_dir)),
            f"--checkpoint-path {a_dir} is a directory; name a file, e.g. {a_dir}/model.pt",
        ),
        (
            ddp_spawn.DDPSpawnConfig(nprocs=1, checkpoint_path=str(a_file / "c.pt")),
            f"--checkpoint-path {a_file}/c.pt: {a_file} is a file, so nothing can be created",
        ),
    ]:
        with pytest.raises(ValueError) as caught:
            ddp_spawn.train(cfg)
        assert str(caught.value).startswith(message), str(caught.value)
    cases = [
        (
            hang_diagnosis.train,
            hang_diagnosis.HangConfig(trace_dir=str(a_file)),
            f"--trace-dir {a_file} is a file; name a directory (created if missing)",
        ),
        (
            meta_init.create_seed_checkpoint,
            meta_init.MetaInitConfig(create_seed_checkpoint=True, seed_checkpoint_dir=str(a_file)),
            f"--seed-checkpoint-dir {a_file} is a file; name a directory (created if missing)",
        ),
    ]
    if importlib.util.find_spec("lightning") is not None:  # an optional dependency
        from recipes import lightning_fabric, lightning_trainer

        cases += [
            (
                lightning_fabric.train,
                lightning_fabric.FabricConfig(resume_from=str(a_dir)),
                f"--resume-from {a_dir} is a directory, not a file; pass a step-N.ckpt file",
            ),
            (
                lightning_fabric.train,
                lightning_fabric.FabricConfig(
                    checkpoint_every_n_steps=1, checkpoint_dir=str(a_file)
                ),
                f"--checkpoint-dir {a_file} is a file; name a directory",
            ),
            (
                lightning_trainer.train,
                lightning_trainer.LightningConfig(
                    output_dir=str(a_file), resume_from=str(a_dir / "gone.ckpt")
                ),
                f"--output-dir {a_file} is a file; name a directory",
            ),
            (
                lightning_trainer.train,
                lightning_trainer.LightningConfig(
                    output_dir=str(a_dir), resume_from=str(a_dir / "gone.ckpt")
                ),
                f"--resume-from {a_dir}/gone.ckpt does not exist; pass a .ckpt file",
            ),
        ]
    for run, cfg, message in cases:
        # a copyable recipe (meta_init, hang_diagnosis, the Lightning ones) raises a plain
        # ValueError: it imports nothing of ours
        copyable = run in (
            meta_init.create_seed_checkpoint,
            hang_diagnosis.train,
        ) or run.__module__.startswith("recipes.lightning")
        with pytest.raises(ValueError if copyable else RecipeError) as caught:
            run(cfg)
        assert str(caught.value).startswith(message), str(caught.value)
    assert sorted(os.listdir(tmp_path)) == ["a_dir", "a_file"] and not os.listdir(a_dir)


def test_a_step_option_past_the_last_step_is_refused():
    """A fault injected, or an all_reduce skipped, at a step the run never reaches: the run passed
    as a clean one, and looked like the demonstration it was not."""
    # (amp's --overflow-at-step and fsdp's --inject-inf-step/--inject-inf-rank are gone: their
    # fault injection lives in tests/test_amp.py and tests/test_fsdp.py now, as fsdp2's does)
    from recipes import hang_diagnosis

    check_step_reached("skip_step", 3, 4)  # the last step is fine
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
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: skip_step=6 is never reached: the steps are 0 to 5; use --skip-step "
        "5 or less, or --steps 7 or more"
    ]


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
