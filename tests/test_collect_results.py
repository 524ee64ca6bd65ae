"""scripts/collect_results.py: what it writes is what a docs page's Measured section renders.

These need no mkdocs (the hooks module is plain Python), so they run where the site cannot be built.
"""

import json
import subprocess

from tests.helpers import PYTHON, docs_hooks, run_cli


def collect(command: str, out_dir, timeout_s: float) -> subprocess.CompletedProcess:
    """Measure ddp_torchrun with ``command`` into ``out_dir``, as a user runs the script."""
    return run_cli(
        [
            PYTHON,
            "scripts/collect_results.py",
            "ddp_torchrun",
            "--command",
            command,
            "--out-dir",
            str(out_dir),
        ],
        timeout_s=timeout_s,
    )


def test_collect_results_writes_what_the_measured_section_renders(tmp_path):
    # ddp_torchrun prints one line per step and no result: the script measures it through the
    # harness (recipes.core.prove), and stores the command it ran.
    command = "python -m recipes.ddp_torchrun --steps 3"
    proc = collect(command, tmp_path, timeout_s=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "ddp_torchrun.json").read_text())
    result = data["result"]
    command = "python -m recipes.core.prove ddp_torchrun --steps 3"
    assert data["command"] == command and result["world_size"] == 1 and len(result["losses"]) == 3
    assert len(result["extras"]["memory_per_rank"]) == 1 and result["tokens_per_second"] > 0
    assert data["machine"]["cpu_cores"] >= 1 and data["torch"] and data["python"]
    table = docs_hooks().results_markdown(data, "ddp_torchrun")
    # gloo on CPU here; NCCL on cuda:0 where a GPU is
    assert (
        f"| World | 1 rank(s), backend `{result['backend']}`, device `{result['device']}` |"
        in table
    )
    assert f"`{command}`" in table and "Time per step" in table


def test_collect_results_reports_a_failing_recipe_and_keeps_the_old_file(tmp_path):
    (tmp_path / "ddp_torchrun.json").write_text("{}")
    # A command that fails without importing torch: the failure path is what is tested, quickly.
    proc = collect("python -c 'import sys; sys.exit(\"error: no such option\")'", tmp_path, 120)
    assert proc.returncode == 1
    assert "FAILED: exited with code 1" in proc.stdout and "error: no such option" in proc.stdout
    assert (tmp_path / "ddp_torchrun.json").read_text() == "{}"
