"""recipes/core/paths.py: a path option that cannot work is named, with the fix, before any work;
under a world every rank stops on the problem any rank found (no rank left waiting)."""

import os
import sys

import pytest

from recipes.core.config import RecipeError
from recipes.core.paths import (input_dir_problem, input_file_problem, output_dir_problem,
                                output_file_problem, refuse)
from recipes.core.spawn import spawn_world
from recipes.core.world import join_world


@pytest.fixture
def places(tmp_path):
    a_file, a_dir = tmp_path / "a_file", tmp_path / "a_dir"
    a_file.write_text("x")
    a_dir.mkdir()
    return a_file, a_dir


def test_output_folders_and_files(places):
    a_file, a_dir = places
    assert output_dir_problem(str(a_dir), "--out") is None
    assert output_dir_problem(str(a_dir / "new" / "deeper"), "--out") is None  # created later
    assert not (a_dir / "new").exists()  # looking creates nothing
    assert output_dir_problem(str(a_file), "--out") == (
        f"--out {a_file} is a file, not a folder; name a folder (created if missing)")
    assert output_dir_problem(str(a_file / "run"), "--out") == (
        f"--out {a_file}/run: {a_file} is a file, so nothing can be created under it; name a "
        "folder you can write to")
    assert output_file_problem(str(a_dir / "model.pt"), "--to") is None
    assert output_file_problem(str(a_dir), "--to") == (
        f"--to {a_dir} is a folder; name a file, e.g. {a_dir}/model.pt")
    assert output_file_problem(str(a_file / "model.pt"), "--to").startswith(
        f"--to {a_file}/model.pt: {a_file} is a file")


@pytest.mark.skipif(sys.platform != "linux", reason="/proc is Linux's read-only filesystem")
def test_a_folder_that_cannot_be_written_is_tried_not_guessed():
    # Writing is tried: mode bits would say yes to root, and /proc refuses even root.
    problem = output_dir_problem("/proc/recipes-run", "--out")
    assert problem.startswith("--out /proc/recipes-run: cannot write in /proc (")
    assert problem.endswith("); name a folder you can write to")


def test_input_folders_and_files(places):
    a_file, a_dir = places
    what = "the folder save_pretrained wrote"
    assert input_dir_problem(str(a_dir), "--in", what) is None
    assert input_dir_problem(str(a_file), "--in", what) == (
        f"--in {a_file} is a file, not a folder; pass {what}")
    assert input_dir_problem(str(a_dir / "gone"), "--in", what) == (
        f"--in {a_dir}/gone does not exist; pass {what}")
    assert input_file_problem(str(a_file), "--ckpt", "a .ckpt file") is None
    assert input_file_problem(str(a_dir), "--ckpt", "a .ckpt file") == (
        f"--ckpt {a_dir} is a folder, not a file; pass a .ckpt file")
    assert input_file_problem(str(a_dir / "gone.ckpt"), "--ckpt", "a .ckpt file") == (
        f"--ckpt {a_dir}/gone.ckpt does not exist; pass a .ckpt file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file whatever its mode bits")
def test_an_unreadable_input_is_named(places):
    a_file, _ = places
    a_file.chmod(0)
    assert input_file_problem(str(a_file), "--ckpt", "a .ckpt file") == (
        f"--ckpt {a_file} cannot be read by this user; pass a .ckpt file that you can read")


def one_rank_sees_a_problem():
    """Only rank 1 finds a problem (a file on its node where rank 0 has none): both must stop."""
    with join_world("gloo", timeout_s=30) as world:
        try:
            refuse(None, "only rank 1 sees this" if world.rank == 1 else None)
        except RecipeError as exc:
            return world.rank, str(exc)
        return world.rank, None


def test_every_rank_stops_on_a_problem_any_rank_found():
    assert spawn_world(one_rank_sees_a_problem, 2, deadline_s=60) == (0, "only rank 1 sees this")
    with pytest.raises(RecipeError, match="^first$"):  # no world: this process's first problem
        refuse(None, "first", "second")
    refuse(None, None)
