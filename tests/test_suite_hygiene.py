"""The suite leaves nothing behind: after a representative set of tests (a torchrun launch, a
command forked from the suite's preloaded server), the temporary folder holds nothing new.

The set runs in a pytest of its own with a TMPDIR of its own (an empty folder, which every
tempfile call of its processes uses), so that what it would leave is told apart from what the
rest of this run, or anything else on the machine, is doing."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.deadlines import scaled
from tests.helpers import PYTHON, REPO_ROOT

REPRESENTATIVE = [
    # torchrun: its torchelastic_ log folder and the workers' error files. (A default-run test:
    # the slow profiling launch this used to be cost 22 CPU s here against 14.)
    "tests/test_preflight.py::test_a_healthy_world_under_torchrun_passes_and_prints_the_table",
    # a command forked from the preloaded server, as a user runs it
    "tests/test_ddp_spawn.py::test_bad_input_is_rejected_in_the_parent_before_spawning",
]


def test_a_representative_set_of_tests_leaves_no_temporary_file(tmp_path):
    # A short path: multiprocessing's fork server listens on a socket in TMPDIR, and a socket's
    # path must stay under 108 bytes (tmp_path is too deep for it). Removed below.
    temp, basetemp = Path(tempfile.mkdtemp(prefix="h", dir="/tmp")), tmp_path / "basetemp"
    try:
        check_leaves_nothing(temp, basetemp)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def check_leaves_nothing(temp: Path, basetemp: Path) -> None:
    env = {**os.environ, "TMPDIR": str(temp), "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [
            PYTHON,
            "-m",
            "pytest",
            "-p",
            "no:xdist",
            "-o",
            "addopts=-p no:cacheprovider",
            "-q",
            "--basetemp",
            str(basetemp),
            *REPRESENTATIVE,
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(240),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert f"{len(REPRESENTATIVE)} passed" in proc.stdout, proc.stdout[-2000:]
    assert os.listdir(temp) == [], f"left in TMPDIR: {sorted(os.listdir(temp))}"
