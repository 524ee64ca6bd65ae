"""A copyable recipe leaves the package: copied with the files its docstring names into a folder
where the cookbook cannot be imported, it runs from a user's own script under torchrun (2 gloo
ranks) and prints what it prints in the package (issue 21, item 4).

A recipe is copyable when it imports nothing of the proof harness (``recipes.core``); its
docstring then says what to copy with it, in one line: ``Copy with it: recipes/toy.py,
recipes/dist_setup.py`` (or ``Copy with it: nothing``). The copy keeps the ``recipes/`` folder
name, so the recipe's own ``from recipes.toy import ...`` lines work unchanged there.

The copies that run under torchrun share one launch (tests/copy_launcher.py): each still runs as
its own world of 2 gloo ranks with torchrun's variables, forked from the rank torchrun started.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from recipes.__main__ import recipe_modules
from tests.deadlines import scaled
from tests.helpers import (
    PYTHON,
    REPO_ROOT,
    _run_module_forked,
    assert_losses_close,
    single_process_reference,
)
from tests.once import once_per_run

RECIPES = Path(REPO_ROOT, "recipes")

# One worker runs this module, so that the torchrun launch all the copies share runs once.
pytestmark = pytest.mark.xdist_group("copy_recipes")


def is_copyable(name: str) -> bool:
    text = (RECIPES / f"{name}.py").read_text()
    if "recipes.core" not in text:  # no such import can be there: skip the parse (~10 ms a file,
        return True  # at collection, in every worker)
    return not any(name.startswith("recipes.core") for name in imported_modules(ast.parse(text)))


def imported_modules(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def copy_set(name: str) -> list[str]:
    """The files the docstring says to copy with recipe ``name``."""
    doc = ast.get_docstring(ast.parse((RECIPES / f"{name}.py").read_text())) or ""
    line = re.search(r"^Copy with it: (.*?)(?:\n\n|\Z)", doc, re.M | re.S)
    assert line, f"recipes/{name}.py: its docstring must say 'Copy with it: ...' (or 'nothing')"
    return re.findall(r"recipes/(\w+)\.py", line[1])


COPYABLE = [name for name in recipe_modules() if is_copyable(name)]


def test_every_copyable_recipe_names_its_copy_set_and_imports_only_it():
    """Static: every ``recipes.*`` module the recipe (or a file of its set) imports is in it."""
    assert {"comm_bench", "loss_compare"} <= set(COPYABLE), COPYABLE
    for name in COPYABLE:
        carried = copy_set(name)
        for module in [name, *carried]:
            tree = ast.parse((RECIPES / f"{module}.py").read_text())
            ours = {
                m.split(".")[1]
                for m in imported_modules(tree)
                if m.startswith("recipes.") and m.count(".") >= 1
            }
            missing = ours - set(carried) - {name}
            assert not missing, (
                f"recipes/{module}.py imports recipes.{sorted(missing)}: add them to "
                f"recipes/{name}.py's 'Copy with it:' line, or stop importing them"
            )
        assert name in COPIES, f"tests/test_copy_recipes.py: add how to run the copy of {name}"


def make_copy(name: str, where: Path) -> Path:
    """A user's project: recipes/ with the recipe and its set, and a script of the user's own."""
    project = where / "my_project"
    (project / "recipes").mkdir(parents=True)
    (project / "recipes" / "__init__.py").write_text("")
    for module in [name, *copy_set(name)]:
        shutil.copy(RECIPES / f"{module}.py", project / "recipes" / f"{module}.py")
    (project / "train_mine.py").write_text(
        f"from recipes.{name} import main\n\nif __name__ == '__main__':\n    main()\n"
    )
    return project


def users_environment(project: Path) -> dict[str, str]:
    """The user's environment: their project on the path, not ours; gloo on CPU.

    Where this cookbook is pip-installed in editable mode (the README's set-up), setuptools' import
    finder would still resolve ``recipes.core`` to this checkout, behind the copy's back. A
    ``sitecustomize`` in a folder of its own takes that finder out, as if the cookbook were not
    installed at all, which is the user's case."""
    hide = project.parent / "without_the_cookbook"
    hide.mkdir(exist_ok=True)
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'distributed_recipes' not in repr(f)]\n"
    )
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "RECIPES_BACKEND")
    }
    env.update(PYTHONPATH=os.pathsep.join([str(project), str(hide)]), OMP_NUM_THREADS="1")
    return env


# Copies run two at a time in each launch: one after the other, the launch was the run's longest
# chain (~280 s of wall time on 2 cores under load, for ~60-86 CPU s); a second launch on another
# worker cost ~25 CPU s more (a torchrun, ranks importing torch) where this costs none.
CONCURRENT = 2


def launch_copies(names: list[str], where: Path, *, torchrun: bool) -> dict:
    """Every copy in ``names``, each in its own project, from ONE launch: tests/copy_launcher.py
    forks each copy's process from the one the launcher started (under torchrun: each rank's), so
    torch is imported once per rank in all instead of once per copy and rank (each launch costs
    ~5 s of CPU on 2 cores under torchrun, ~2 s alone). Under torchrun each copy still meets its
    peers through ``env://`` with torchrun's variables, on a port of its own. {name: what its
    ranks printed, as the launcher would have shown it}."""
    if not names:  # e.g. -k selected only copies of the other launcher
        return {}
    with contextlib.ExitStack() as stack:
        lighthouse = None
        if any("{lighthouse}" in arg for name in names for arg in COPIES[name][1]):
            lighthouse = stack.enter_context(torchft_lighthouse())
        return _launch_copies(names, where, torchrun=torchrun, lighthouse=lighthouse)


@contextlib.contextmanager
def torchft_lighthouse():
    """torchft's coordination server, in this process on a free port, for the copy of
    recipes/fault_tolerance.py (one replica group: it needs no peer to commit)."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1)
    try:
        yield server.address()
    finally:
        server.shutdown()


# Each copy's run is bounded at 120 s (times the run's factor), except: ray_train starts a local
# Ray cluster (gcs, raylet, a controller and 2 worker actors: ~40 CPU s alone, 88 s of wall time
# beside 4 busy loops on 2 cores)
LONGER_DEADLINE_S = {"ray_train": 300}


def _launch_copies(names: list[str], where: Path, *, torchrun: bool, lighthouse) -> dict:
    copies = []
    for name in names:
        project = make_copy(name, where / name)
        args = [
            arg.format(repo=REPO_ROOT, project=project, lighthouse=lighthouse)
            for arg in COPIES[name][1]
        ]
        copies.append(
            {
                "name": name,
                "project": str(project),
                "args": args,
                "timeout_s": scaled(LONGER_DEADLINE_S.get(name, 120)),
            }
        )
    plan = where / "plan.json"
    # the Lightning recipes' copies import it: once per launched process, not once per copy
    preimport = ["lightning"] if any(name.startswith("lightning") for name in names) else []
    plan.write_text(
        json.dumps(
            {
                "copies": copies,
                "out": str(where / "out"),
                "preimport": preimport,
                "concurrent": CONCURRENT,
            }
        )
    )
    launcher = where / "copy_launcher.py"  # beside no cookbook: it imports none of it
    shutil.copy(Path(REPO_ROOT, "tests", "copy_launcher.py"), launcher)
    env = users_environment(where / "launcher")
    env["PYTHONPATH"] = str(where / "without_the_cookbook")
    timeout_s = sum(copy["timeout_s"] for copy in copies) / CONCURRENT + scaled(120)
    if torchrun:  # torchrun's agent forked with torch imported; the ranks start fresh, as users'
        argv = ["--standalone", "--nproc_per_node=2", str(launcher), str(plan)]
        proc = _run_module_forked(
            ["torchrun", *argv], ("module", "torch.distributed.run"), argv, timeout_s, env
        )
    else:  # a fresh interpreter: the copies fork from it, and it must not hold our package
        proc = subprocess.run(
            [PYTHON, str(launcher), str(plan)],
            cwd=where,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    ranks = (0, 1) if torchrun else (0,)
    results = {}
    for copy in copies:
        out = where / "out" / copy["name"]
        read = [
            (out / f"rank{rank}.{kind}").read_text(errors="replace")
            if (out / f"rank{rank}.{kind}").exists()
            else ""
            for rank in ranks
            for kind in ("stdout", "stderr", "json")
        ]
        exits = [json.loads(status)["exit"] if status else "never ran" for status in read[2::3]]
        code = 0 if set(exits) == {0} else 1
        results[copy["name"]] = subprocess.CompletedProcess(
            copy["name"],
            code,
            "".join(read[0::3]),
            "".join(read[1::3])
            + (
                f"\nexit codes of the ranks: {exits}; launcher: "
                f"{proc.returncode} {proc.stderr[-1500:]}"
                if code
                else ""
            ),
        )
    return results


@pytest.fixture(scope="session")
def launched_copies(request, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """The copies this run's tests ask for: those a user runs under torchrun (2 gloo ranks), from
    one torchrun launch, and those a user runs with plain python, from one python launch; once per
    run (tests/once.py)."""
    wanted = {
        item.callspec.params["name"]
        for item in request.session.items
        if item.originalname == "test_a_copy_runs_without_the_package_and_agrees"
    } - set(MISSING_PACKAGE)

    def launch(folder: Path) -> dict[str, subprocess.CompletedProcess]:
        torchrun = [name for name in TORCHRUN_COPIES if name in wanted]
        python = [name for name in PYTHON_COPIES if name in wanted]
        return {
            **launch_copies(torchrun, folder / "torchrun", torchrun=True),
            **launch_copies(python, folder / "python", torchrun=False),
        }

    return once_per_run(tmp_path_factory, "copies", launch)


# The first test to ask for ``launched_copies`` pays for the one launch of every copy (each its
# own world): 150-280 s of wall time on 2 cores shared with other work. Two launches on two
# workers were tried: on 2 saturated cores they cost ~25 s more CPU (a second torchrun, two more
# ranks importing torch) for no shorter run. Each copy's own run is bounded by the launcher
# (LONGER_DEADLINE_S above).
# The default run launches one copy of each kind: each launcher (torchrun, python), and each set
# of shared files a copy carries (the toy alone, dist_setup, parallelize, the pipeline's and the
# checkpoint's own modules, no torch at all). ddp_spawn's copy (the recipe's own mp.spawn: two
# fresh interpreters, ~9 CPU s) moved to the slow set (issue 30): it carries what ddp_torchrun's
# copy carries, and test_ddp_spawn runs its mp.spawn in the default run. The rest, the
# same kinds again, run in the slow set (CI runs it): launching all of them was the default run's
# largest cost (~75 CPU s of its ~660). The job's copy (the heaviest: shards, evaluation, a
# checkpoint) is among them; test_job runs the job in the default run (in spawned worlds). The
# static test above still checks every recipe's copy set in the default run.
DEFAULT_RUN_COPIES = {
    "single_gpu",
    "ddp_torchrun",
    "fsdp2",
    "tensor_parallel",
    "pipeline_parallel",
    "sharded_checkpoint",
    "loss_compare",
}


@pytest.mark.timeout(480)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=() if name in DEFAULT_RUN_COPIES else pytest.mark.slow)
        for name in COPYABLE
    ],
)
def test_a_copy_runs_without_the_package_and_agrees(name, tmp_path, launched_copies):
    if name in MISSING_PACKAGE:
        pytest.skip(MISSING_PACKAGE[name])
    project = make_copy(name, tmp_path)  # as the fixture made the one that ran
    proc = launched_copies[name]
    # The cookbook is not importable there: only what was copied is.
    probe = subprocess.run(
        [PYTHON, "-c", "import recipes.core"],
        cwd=project,
        env=users_environment(project),
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert probe.returncode != 0 and "No module named 'recipes.core'" in probe.stderr
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in RAYS_BENIGN_WARNING.sub("", proc.stderr), proc.stderr[-3000:]
    COPIES[name][2](proc.stdout)


# Ray Train's controller asks its autoscaling coordinator for the workers' CPUs with a 5 s
# timeout; where the CPU is overloaded the coordinator's start takes longer, and Ray logs this
# warning with its traceback ("safe to ignore" in its own words), then goes on
# (its header, the traceback's indented lines, the GetTimeoutError; nothing else is removed)
RAYS_BENIGN_WARNING = re.compile(
    r"Failed to send resource request for train-\w+\.[^\n]*\n"
    r"Traceback \(most recent call last\):\n(?:  [^\n]*\n)*"
    r"ray\.exceptions\.GetTimeoutError: Get timed out: some object\(s\) not ready\.\n?"
)


def _last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def check_comm_bench(stdout: str) -> None:
    result = _last_json(stdout)
    rows = result["rows"]
    assert {row["op"] for row in rows} == {"all_reduce", "all_gather"}
    assert all(row["wrong_elements"] == 0 and row["busbw_gb_per_s"] > 0 for row in rows), rows
    assert result["world_size"] == 2


def check_loss_compare(stdout: str) -> None:
    # the same verdict as in the package: DDP and fsdp2 agree on all 6 steps
    result = _last_json(stdout)
    assert result["equal"] is True and result["common_steps"] == 6, result


def check_data(stdout: str) -> None:
    # the same losses as the package's own run (results/data.json: the defaults, 20 steps)
    expected = json.loads(Path(REPO_ROOT, "results", "data.json").read_text())["result"]
    losses = _last_json(stdout)["losses"]
    assert losses == pytest.approx(expected["losses"][:3], abs=1e-6), (losses, expected)


def check_evaluation(stdout: str) -> None:
    expected = json.loads(Path(REPO_ROOT, "results", "evaluation.json").read_text())["result"]
    result = _last_json(stdout)
    assert result["val_loss"] == pytest.approx(expected["val_loss"], abs=1e-6)
    assert result["windows_per_rank"] == expected["windows_per_rank"]


def check_job(stdout: str) -> None:
    # the default layout (fully_shard over 2 ranks), 3 steps that learn, and their checkpoint
    result = _last_json(stdout)
    assert result["world_size"] == 2 and result["parameter_type"] == "DTensor", result
    assert len(result["losses"]) == 3 and result["losses"][-1] < result["losses"][0], result
    assert result["val_losses"][-1][0] == 3 and result["weights_sha256"], result


def check_preflight(stdout: str) -> None:
    assert "preflight: 2 rank(s) on 1 host(s), gloo: every check passed" in stdout, stdout


def check_ddp_torchrun(stdout: str) -> None:
    # one line per step from rank 0, each the loss the package's own run has at that step
    printed = re.findall(r"^step (\d+) loss (\d+\.\d{4})$", stdout, re.M)
    reference = single_process_reference()  # the package's recipe, one process, the defaults
    assert [int(step) for step, _ in printed] == list(range(len(reference.losses))), stdout
    assert_losses_close([float(loss) for _, loss in printed], reference.losses, atol=6e-5)


def check_single_gpu(stdout: str) -> None:
    # one line per step, each the loss of ddp_torchrun on one process (the same loop, bit for bit)
    printed = re.findall(r"^step (\d+) loss (\d+\.\d{4})$", stdout, re.M)
    reference = single_process_reference()
    assert [float(loss) for _, loss in printed] == [round(x, 4) for x in reference.losses], stdout


def check_tensor_parallel(stdout: str) -> None:
    # split over 2 ranks, the same losses as one process's unsplit training (its first 3 steps):
    # the package's recipe equals it (tests/test_tensor_parallel.py), so the copy must too
    losses = printed_losses(stdout)
    assert len(losses) == 3, stdout
    assert_losses_close(losses, single_process_reference().losses[:3], atol=6e-5)


def check_fsdp2(stdout: str) -> None:
    # sharded over both ranks, one line per step from rank 0, each the loss the package's own
    # run has (results/fsdp2.json: the defaults, 6 steps, 2 ranks)
    assert "fully_shard on mesh (2,), reshard_after_forward=True, fp32" in stdout, stdout
    printed = re.findall(r"^step (\d+) loss (\d+\.\d{4})$", stdout, re.M)
    expected = json.loads(Path(REPO_ROOT, "results", "fsdp2.json").read_text())["result"]
    assert [int(step) for step, _ in printed] == [0, 1, 2], stdout
    assert_losses_close([float(loss) for _, loss in printed], expected["losses"][:3], atol=6e-5)


def printed_losses(stdout: str) -> list[float]:
    """The losses of the ``step N loss X ...`` lines, checked to be steps 0, 1, 2, ... in order."""
    printed = re.findall(r"^step (\d+) loss (\d+\.\d{4})\b", stdout, re.M)
    assert [int(step) for step, _ in printed] == list(range(len(printed))) and printed, stdout
    return [float(loss) for _, loss in printed]


def committed_losses(name: str) -> list[float]:
    """The losses of the package's own measured run (results/NAME.json, the defaults)."""
    return json.loads(Path(REPO_ROOT, "results", f"{name}.json").read_text())["result"]["losses"]


def check_amp(stdout: str) -> None:
    # bf16 autocast on CPU (the default precision), no scaler: the package's losses, scale 1
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("amp")[: len(losses)], atol=6e-5)
    assert len(losses) == 3 and stdout.count(" scale 1\n") == 3, stdout


def check_data_parallel(stdout: str) -> None:
    # single-device training (on a GPU host, the batch split over its GPUs: fp32 rounding apart)
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("data_parallel")[: len(losses)], atol=6e-5)
    assert len(losses) == 3, stdout


def check_zero(stdout: str) -> None:
    # two ranks, rank 0 printing: the package's own 2-rank losses, one line per step
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("zero")[: len(losses)], atol=6e-5)
    assert len(losses) == 3, stdout


def check_process_groups(stdout: str) -> None:
    # 2 ranks: a 1 x 2 mesh, one row; each rank's mesh groups are its hand-built row and column
    assert "mesh dp x tp = 1 x 2" in stdout and "tp groups (rows): [0, 1]" in stdout, stdout
    report = _last_json(stdout)
    assert report["rank_grid"] == [[0, 1]] and report["world_size"] == 2, report
    assert [g["tp"]["ranks"] for g in report["groups_per_rank"]] == [[0, 1], [0, 1]], report
    assert [g["dp"]["ranks"] for g in report["groups_per_rank"]] == [[0], [1]], report
    assert [g["tp"]["all_reduce_sum"] for g in report["groups_per_rank"]] == [3.0, 3.0], report


def check_hybrid_parallel(stdout: str) -> None:
    # 2 ranks as dp 1 x tp 2 (TP, then fully_shard over a dp of one): one process's losses
    assert "mesh dp x tp = 1 x 2" in stdout, stdout
    losses = printed_losses(stdout)
    assert len(losses) == 3, stdout
    assert_losses_close(losses, single_process_reference().losses[:3], atol=6e-5)


def check_ddp_spawn(stdout: str) -> None:
    # the two processes it spawned trained like the package's own run (results/ddp_spawn.json:
    # the defaults on 2 processes), rank 0 printing one line per step
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("ddp_spawn")[: len(losses)], atol=6e-5)
    assert len(losses) == 3, stdout
    # rank 0 of the 2 saved the plain model (no DDP "module." prefix) where it says, once
    saved = re.findall(r"^rank 0 of 2 saved step 3 to (\S+)$", stdout, re.M)
    assert len(saved) == 1 and os.path.exists(saved[0]), stdout
    state = torch.load(saved[0], weights_only=True)
    assert state["step"] == 3 and not any(key.startswith("module.") for key in state["model"])


def check_context_parallel(stdout: str) -> None:
    # each sequence split over the 2 ranks (load-balanced), ring attention: the package's own
    # 2-rank losses (results/context_parallel.json), one line per step from rank 0
    assert (
        "context parallel (ring) over 2 rank(s): 8 of 16 positions each, load_balance=True"
        in stdout
    ), stdout
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("context_parallel")[: len(losses)], atol=6e-5)
    assert len(losses) == 3, stdout


def check_activation_checkpointing(stdout: str) -> None:
    # per_block on the "small" model, fp32 on CPU: the package's own losses (results/), and the
    # recipe's line naming the blocks it checkpointed
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("activation_checkpointing")[:3], atol=6e-5)
    assert len(losses) == 3 and "mode per_block (fp32): blocks [0, 1, 2, 3] checkpointed" in stdout


def check_meta_init(stdout: str) -> None:
    # each of the 2 ranks holds half of the parameters, and the initial model's loss is the
    # package's own (results/meta_init.json: the normal build's loss, tested in test_meta_init)
    full = json.loads(Path(REPO_ROOT, "results", "meta_init.json").read_text())["result"]
    full_bytes = full["extras"]["full_model_bytes"]
    assert f"replay: {full_bytes // 2} of {full_bytes} parameter bytes on rank 0" in stdout, stdout
    printed = re.findall(r"^initial loss (\d+\.\d{4})$", stdout, re.M)
    assert len(printed) == 1, stdout
    assert_losses_close([float(printed[0])], full["losses"], atol=6e-5)


def check_sharded_checkpoint(stdout: str) -> None:
    # the package's own 2-rank losses (results/sharded_checkpoint.json: 3 steps), and the save
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("sharded_checkpoint"), atol=6e-5)
    assert len(losses) == 3 and "checkpoint of step 3 published in " in stdout, stdout


def check_collectives(stdout: str) -> None:
    # every op, in order, with the verdict of the package's own run (results/collectives.json,
    # 4 ranks: "ok" for each), printed by rank 0 alone
    expected = json.loads(Path(REPO_ROOT, "results", "collectives.json").read_text())["result"]
    assert "17 collectives on 2 rank(s), backend gloo, device cpu" in stdout, stdout
    printed = re.findall(r"^(\w+) +(ok|fallback: .*|skipped: .*)$", stdout, re.M)
    assert printed == list(expected["extras"]["ops"].items()), stdout


def check_hang_diagnosis(stdout: str) -> None:
    # no rank skipped: nothing to diagnose, and the losses of one process's training (the
    # package's ddp_torchrun on one process has the same model, data, seed and lr)
    losses = printed_losses(stdout)
    assert len(losses) == 3 and "diagnosis:" not in stdout, stdout
    assert_losses_close(losses, single_process_reference().losses[:3], atol=6e-5)


def check_memory_estimate(stdout: str) -> None:
    # the same figures as the package's own run of the same command, every row and the per-GPU
    # figure, and the table before them (ZeRO-3 of mixed-precision Adam: 1.88 GB on the device)
    expected = json.loads(Path(REPO_ROOT, "results", "memory_estimate.json").read_text())["result"]
    assert _last_json(stdout) == expected
    assert re.search(r"^ZeRO-3 \(P_os\+g\+p\) +.* 1\.88 +0\.00$", stdout, re.M), stdout


def check_dry_run(stdout: str) -> None:
    # the stage's bytes read off its shards are the package's memory_estimate ZeRO-3 figures of
    # its tensor-parallel share; fully_shard's reduce-scatters: one per Block and one for the root
    from recipes import dry_run
    from recipes.memory_estimate import LAYOUTS, model_state_per_rank

    report = _last_json(stdout)
    (stage,) = report["stages"]
    psi = dry_run.stage_params_per_tp_rank(dry_run.PRESETS["tiny"], 0, 1, 2)
    expected = model_state_per_rank(psi, 2, "zero3", LAYOUTS["adam-fp32"])["device"]
    assert {k: stage[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")} == {
        k: expected[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")
    }, stage
    assert report["all_match_estimate"] and len(report["ranks"]) == 4, report
    assert stage["collectives"]["reduce_scatter"] == 3 and stage["collectives"]["all_reduce"] > 0
    assert "tiny on pp 1 x dp 2 x tp 2 = 4 ranks" in stdout, stdout


def check_profiling(stdout: str) -> None:
    # one line per step from rank 0 (its share); after the loop the losses averaged over the 2
    # ranks, the package's own (results/profiling.json); DDP's all-reduce, once per active step,
    # the only collective in the profile; both ranks' traces where rank 0 says
    assert len(printed_losses(stdout)) == 4 and "top 3 ops by self_cpu_time_total:" in stdout
    averaged = re.search(r"^losses \(mean over the ranks\): (.*)$", stdout, re.M)
    assert averaged, stdout
    losses = [float(x) for x in averaged[1].split()]
    assert_losses_close(losses, committed_losses("profiling")[:4], atol=6e-5)
    found = re.search(r"per profiled step: (\{.*\}); traces in (\S+)$", stdout, re.M)
    assert found and found[1] == "{'c10d::allreduce_': 2, 'gloo:all_reduce': 2}", stdout
    for rank in (0, 1):
        assert json.loads(Path(found[2], f"trace-rank{rank}.json").read_text())["traceEvents"]
    shutil.rmtree(found[2])  # the recipe's fresh temporary folder


def check_fsdp(stdout: str) -> None:
    # FULL_SHARD over both ranks: the package's own 2-rank losses (results/fsdp.json), one line
    # per step from rank 0
    assert "FSDP full on 2 rank(s), wrap=block, fp32, 6 sequences per rank" in stdout, stdout
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("fsdp")[: len(losses)], atol=6e-5)
    assert len(losses) == 3, stdout


def check_float8(stdout: str) -> None:
    # the copy imported torch, toy, dist_setup and parallelize alone, and its parser answered
    assert stdout.startswith("usage: python -m recipes.float8"), stdout
    assert "--loss-rtol" in stdout and "--compile" in stdout, stdout


def check_performance(stdout: str) -> None:
    # fp32 on cpu, the default switches: the package's own losses, and the kernel it named
    assert "fp32 on cpu, attention kernel: " in stdout, stdout
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("performance")[: len(losses)], atol=6e-5)
    assert len(losses) == 3, stdout


def check_expert_parallel(stdout: str) -> None:
    # the experts split over the 2 ranks: the package's own 2-rank losses (results/, aux loss
    # included), one line per step from rank 0, and no token dropped (no capacity by default)
    assert "expert parallel over 2 rank(s): 2 of 4 experts each, top_k=2" in stdout, stdout
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("expert_parallel")[: len(losses)], atol=6e-5)
    assert len(losses) == 3 and "dropped [0, 0]" in stdout, stdout


def check_pipeline_parallel(stdout: str) -> None:
    # a stage on each rank, the micro-batches through 1F1B: one process's losses (the pipeline
    # equals the unsplit model: tests/test_pipeline_parallel.py), one line per step from rank 0
    assert "pipeline: 2 rank(s), 1f1b, 2 stages, 4 micro-batches of 3" in stdout, stdout
    losses = printed_losses(stdout)
    assert len(losses) == 3, stdout
    assert_losses_close(losses, single_process_reference().losses[:3], atol=6e-5)


def check_local_sgd(stdout: str) -> None:
    # one line per step from rank 0, each the replicas' mean loss, printed at the synchronisations
    losses = printed_losses(stdout)
    assert len(losses) == 4 and all(0 < loss < 10 for loss in losses), stdout


def check_training_health(stdout: str) -> None:
    # DDP's loop with the checks, 4 steps, one check after step 3 (--check-every 4): DDP's own
    # losses (one process's), rank 0's table of both ranks' work times, no fault, no warning
    losses = printed_losses(stdout)
    assert len(losses) == 4, stdout
    assert_losses_close(losses, single_process_reference().losses[:4], atol=6e-5)
    table = re.findall(r"^step 3 work ms over 4 steps, min / median / max: .*$", stdout, re.M)
    assert len(table) == 1 and "rank 0" in table[0] and "rank 1" in table[0], stdout
    assert not re.search(r"non-finite|diverged|spike|is gone", stdout), stdout


def check_activation_offload(stdout: str) -> None:
    # gloo, so CPU: --offload auto trains without offloading and says so; with checkpointed
    # blocks, one process's losses (DDP's loop, bit for bit: tests/test_activation_offload.py)
    first = "offload none, checkpoint per_block (fp32) on 2 rank(s) of cpu: no GPU to offload from"
    assert first in stdout, stdout
    losses = printed_losses(stdout)
    assert len(losses) == 3, stdout
    assert_losses_close(losses, single_process_reference().losses[:3], atol=6e-5)


def check_comm_hooks(stdout: str) -> None:
    # PowerSGD at rank 2 (the defaults) from step 2: steps 0 and 1 are plain all-reduces, one
    # process's losses; then within tests/test_comm_hooks.py's bound of them; torch's own count
    # of what each compressed step sent is that test's arithmetic for the tiny model
    losses = printed_losses(stdout)
    assert len(losses) == 4, stdout
    reference = single_process_reference().losses[:4]
    assert_losses_close(losses[:2], reference[:2], atol=6e-5)
    assert_losses_close(losses, reference, atol=0.015)
    assert "PowerSGD rank 2 from step 2: each step sent 3424 of 29824 gradient elements" in stdout


def check_ulysses(stdout: str) -> None:
    # each sequence split over the 2 ranks, the heads exchanged by all_to_all: one process's
    # losses (the split equals the whole model: tests/test_ulysses.py), one line per step
    assert "ulysses over 2 rank(s): 8 of 16 positions and 2 of 4 heads each" in stdout, stdout
    losses = printed_losses(stdout)
    assert len(losses) == 3, stdout
    assert_losses_close(losses, single_process_reference().losses[:3], atol=6e-5)


def check_fault_tolerance(stdout: str) -> None:
    # one replica group of the 2 ranks, alone in its quorum: every step commits, one line per
    # step from rank 0 with the quorum's size; the losses are DDP's over 2 ranks (one process's)
    steps = re.findall(r"^step (\d+) loss (\S+) quorum (\d+)$", stdout, re.M)
    assert [int(step) for step, _, _ in steps] == [0, 1, 2], stdout
    assert {quorum for _, _, quorum in steps} == {"1"}, stdout
    losses = [float(loss) for _, loss, _ in steps]
    assert_losses_close(losses, single_process_reference().losses[:3], atol=6e-5)


def check_ray_train(stdout: str) -> None:
    # ddp_torchrun's train on 2 Ray workers: rank 0's lines come through as it prints them, the
    # losses of one process (DDP over 2 ranks); the driver's JSON line holds the same losses
    losses = printed_losses(stdout)
    assert len(losses) == 3, stdout
    assert_losses_close(losses, single_process_reference().losses[:3], atol=6e-5)
    assert_losses_close(_last_json(stdout)["result"], losses, atol=6e-5)


def check_grad_clipping(stdout: str) -> None:
    # the package's own 2-rank losses and clipped norms (results/grad_clipping.json: fully_shard,
    # 2 steps; the norm one process computes), one line per step from rank 0
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("grad_clipping"), atol=6e-5)
    norms = [
        float(n) for n in re.findall(r"^step \d+ loss \S+ grad norm (\d+\.\d{4})$", stdout, re.M)
    ]
    expected = json.loads(Path(REPO_ROOT, "results", "grad_clipping.json").read_text())
    assert_losses_close(norms, expected["result"]["extras"]["grad_norms"], atol=6e-5)


def check_sharded_accumulation(stdout: str) -> None:
    # the package's own 2-rank losses (results/sharded_accumulation.json: the defaults, 6 steps),
    # one line per step from rank 0
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("sharded_accumulation")[:3], atol=6e-5)
    assert len(losses) == 3, stdout


def check_grad_accumulation(stdout: str) -> None:
    # 2 ranks x 3 micro-batches, one line per step from rank 0: the package's own losses
    # (results/grad_accumulation.json: the same split, 6 steps)
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("grad_accumulation")[: len(losses)], atol=6e-5)
    assert len(losses) == 3, stdout


def check_hf_checkpoint(stdout: str) -> None:
    # the package's own 2-rank losses (results/hf_checkpoint.json), and an export that
    # from_pretrained loads with the trained model's logits
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("hf_checkpoint")[:2], atol=6e-5)
    assert len(losses) == 2, stdout
    difference = re.findall(
        r"^exported config.json, model.safetensors to checkpoints/"
        r"hf_checkpoint/hf; from_pretrained's logits differ from the trained "
        r"model's by at most (\S+)$",
        stdout,
        re.M,
    )
    assert len(difference) == 1 and float(difference[0]) <= 1e-6, stdout


def check_finetune(stdout: str) -> None:
    # the adapters alone train (2048 of the tiny model's 31872 parameters), with the package's
    # own 2-rank losses (results/finetune.json: the defaults), one line per step from rank 0
    assert (
        "lora fine-tuning with ddp on 2 rank(s): 2048 of 31872 parameters train (6.43%)" in stdout
    ), stdout
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("finetune")[:3], atol=6e-5)
    assert len(losses) == 3, stdout


def check_lightning_fabric(stdout: str) -> None:
    # Fabric's DDP over the 2 ranks, rank 0 printing: the package's own 2-rank losses
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("lightning_fabric")[: len(losses)], atol=6e-5)
    assert len(losses) == 3, stdout


def check_lightning_trainer(stdout: str) -> None:
    # the Trainer's DDP over the 2 ranks, rank 0 printing: the package's own 2-rank losses
    losses = printed_losses(stdout)
    assert_losses_close(losses, committed_losses("lightning_trainer")[: len(losses)], atol=6e-5)
    assert len(losses) == 3, stdout


# How each copyable recipe's copy runs, and what its output must show: (launcher, arguments,
# check). Small and fast: the point is that the copy runs and agrees, not how long it trains.
COPIES = {
    # H=2 over the 2 ranks: 4 steps, 2 synchronisations
    "local_sgd": (
        "torchrun",
        ["--steps", "4", "--sync-every", "2", "--backend", "gloo"],
        check_local_sgd,
    ),
    # 4 steps, the checks once (after step 3), no fault: the copy trains as DDP does
    "training_health": (
        "torchrun",
        ["--steps", "4", "--check-every", "4", "--backend", "gloo"],
        check_training_health,
    ),
    # gloo: CPU ranks on a GPU host too, so --offload auto is none; the composition still runs
    "activation_offload": (
        "torchrun",
        ["--steps", "3", "--checkpoint", "per_block", "--backend", "gloo"],
        check_activation_offload,
    ),
    # the defaults (PowerSGD, rank 2, from step 2), 4 steps; gloo and fp32 as the reference is
    "comm_hooks": (
        "torchrun",
        ["--steps", "4", "--backend", "gloo", "--precision", "fp32"],
        check_comm_hooks,
    ),
    # gloo on a GPU host too: 2 ranks need no 2 GPUs, and fp32 on CPU is the reference's
    "ulysses": ("torchrun", ["--steps", "3", "--backend", "gloo"], check_ulysses),
    # one replica group of the 2 ranks (torchrun's world), on a lighthouse the test starts
    "fault_tolerance": (
        "torchrun",
        ["--replica-groups", "1", "--lighthouse", "{lighthouse}", "--steps", "3"],
        check_fault_tolerance,
    ),
    # Ray Train's TorchTrainer on a local Ray cluster that the copy starts (a plain python run):
    # ddp_torchrun's train on 2 CPU workers, gloo and fp32 as its reference
    "ray_train": (
        "python",
        "--recipe ddp_torchrun --workers 2 -- --steps 3 --backend gloo --precision fp32".split(),
        check_ray_train,
    ),
    # one device, no process group: a plain python run; cpu, where results/ was measured
    "activation_checkpointing": (
        "python",
        ["--steps", "3", "--device", "cpu"],
        check_activation_checkpointing,
    ),
    # one device, no process group: a plain python run; cpu, the device results/amp.json has
    "amp": ("python", ["--device", "cpu", "--steps", "3"], check_amp),
    "comm_bench": (
        "torchrun",
        [
            "--ops",
            "all_reduce,all_gather",
            "--min-bytes",
            "1K",
            "--max-bytes",
            "4K",
            "--warmup-iters",
            "0",
            "--iters",
            "1",
        ],
        check_comm_bench,
    ),
    "data": ("torchrun", ["--steps", "3"], check_data),
    # nn.DataParallel is one process: a plain python run (on CPU a pass-through)
    "data_parallel": ("python", ["--steps", "3"], check_data_parallel),
    # gloo and fp32 on a GPU host too: 2 ranks need no 2 GPUs, and the reference is fp32
    "ddp_torchrun": ("torchrun", ["--backend", "gloo", "--precision", "fp32"], check_ddp_torchrun),
    # both options: every collective the split has (reduce-scatter, all-gather, the sharded loss)
    # 3 steps (the slowest copy with the default 6: DTensor's collectives on CPU)
    "tensor_parallel": (
        "torchrun",
        [
            "--steps",
            "3",
            "--backend",
            "gloo",
            "--precision",
            "fp32",
            "--sequence-parallel",
            "--loss-parallel",
        ],
        check_tensor_parallel,
    ),
    "evaluation": ("torchrun", [], check_evaluation),
    # gloo and fp32 on a GPU host too, as for ddp_torchrun
    "fsdp2": (
        "torchrun",
        ["--steps", "3", "--backend", "gloo", "--precision", "fp32"],
        check_fsdp2,
    ),
    "preflight": ("torchrun", ["--timeout-s", "60"], check_preflight),
    "process_groups": ("torchrun", [], check_process_groups),
    "hybrid_parallel": (
        "torchrun",
        ["--steps", "3", "--backend", "gloo", "--precision", "fp32"],
        check_hybrid_parallel,
    ),
    # replay over 2 ranks: built on meta, never whole, initialised shard by shard
    "meta_init": ("torchrun", ["--backend", "gloo"], check_meta_init),
    "job": (
        "torchrun",
        ["--steps", "3", "--eval-every", "3", "--checkpoint-every", "3", "--tensorboard", "false"],
        check_job,
    ),
    "single_gpu": ("python", ["--precision", "fp32"], check_single_gpu),
    # gloo and fp32 on a GPU host too, as for ddp_torchrun: the ring over 2 CPU ranks
    "context_parallel": (
        "torchrun",
        ["--steps", "3", "--backend", "gloo", "--precision", "fp32"],
        check_context_parallel,
    ),
    # the recipe starts its own 2 processes (mp.spawn): a plain python run
    # the checkpoint kept in the copy's project folder: without the option the recipe saves to
    # a temporary folder and removes it when it ends
    "ddp_spawn": (
        "python",
        ["--nprocs", "2", "--steps", "3", "--checkpoint-path", "{project}/checkpoint.pt"],
        check_ddp_spawn,
    ),
    # 3 steps under fully_shard, saved into the copy's own project folder (the launcher runs each
    # copy there); gloo and fp32, as results/sharded_checkpoint.json was measured
    "sharded_checkpoint": (
        "torchrun",
        ["--steps", "3", "--backend", "gloo", "--precision", "fp32"],
        check_sharded_checkpoint,
    ),
    # gloo and fp32 on a GPU host too, as for ddp_torchrun: results/zero.json is CPU fp32
    "zero": ("torchrun", ["--steps", "3", "--backend", "gloo", "--precision", "fp32"], check_zero),
    "loss_compare": (
        "python",
        [
            "{repo}/results/ddp_torchrun.json",
            "{repo}/results/fsdp2.json",
            "--assert-equal",
            "--atol",
            "1e-5",
        ],
        check_loss_compare,
    ),
    # every op over 2 gloo ranks (the defaults): one line per op from rank 0
    "collectives": ("torchrun", ["--backend", "gloo"], check_collectives),
    # a clean run (no --skip-rank): the hand-written data parallelism over 2 gloo ranks
    "hang_diagnosis": ("torchrun", ["--steps", "3", "--backend", "gloo"], check_hang_diagnosis),
    # the default layout (fully_shard over both ranks, SGD with clipping), its 2 steps; gloo and
    # fp32, as results/grad_clipping.json was measured
    "grad_clipping": (
        "torchrun",
        ["--backend", "gloo", "--precision", "fp32"],
        check_grad_clipping,
    ),
    # sync_last under fully_shard over both ranks, 2 micro-batches of ragged samples; gloo and
    # fp32, as results/sharded_accumulation.json was measured
    "sharded_accumulation": (
        "torchrun",
        ["--steps", "3", "--backend", "gloo", "--precision", "fp32"],
        check_sharded_accumulation,
    ),
    # pure arithmetic: the command results/memory_estimate.json was made with
    "memory_estimate": (
        "python",
        ["--params", "7.5e9", "--world-size", "64"],
        check_memory_estimate,
    ),
    # one probe (pp 1) of a fake world of 4: tensor parallel and fully_shard, each over 2 ranks
    "dry_run": (
        "python",
        ["--model", "tiny", "--world-size", "4", "--pp", "1", "--dp", "2", "--tp", "2"],
        check_dry_run,
    ),
    # the smallest default window (wait 1, warmup 1, active 2); traces in a fresh temporary folder
    "profiling": (
        "torchrun",
        ["--steps", "4", "--backend", "gloo", "--precision", "fp32", "--top-ops", "3"],
        check_profiling,
    ),
    # gloo and fp32 on a GPU host too, as for ddp_torchrun: results/fsdp.json is CPU fp32
    "fsdp": ("torchrun", ["--steps", "3", "--backend", "gloo", "--precision", "fp32"], check_fsdp),
    # float8 trains only on a GPU of capability 8.9+ with torchao (tests/test_float8.py runs it
    # there); everywhere the copy must import alone and parse its command line
    "float8": ("python", ["--help"], check_float8),
    # one device, no process group: a plain python run; cpu, where results/performance.json was
    "performance": ("python", ["--steps", "3", "--device", "cpu"], check_performance),
    # 2 experts a rank, the all-to-alls over 2 CPU ranks; fp32, as results/ was measured
    "expert_parallel": (
        "torchrun",
        ["--steps", "3", "--backend", "gloo", "--precision", "fp32"],
        check_expert_parallel,
    ),
    # 1F1B over 2 stages (a stage per rank), the tiny model's 2 blocks: the smallest pipeline
    "pipeline_parallel": (
        "torchrun",
        ["--steps", "3", "--backend", "gloo", "--precision", "fp32"],
        check_pipeline_parallel,
    ),
    # 3 micro-batches of 2 on each of the 2 ranks, as results/grad_accumulation.json was measured
    "grad_accumulation": (
        "torchrun",
        ["--steps", "3", "--micro-batches", "3", "--backend", "gloo", "--precision", "fp32"],
        check_grad_accumulation,
    ),
    # the tiny GPT-2 written, loaded sharded, 2 steps, exported into the copy's project folder
    "hf_checkpoint": ("torchrun", ["--steps", "2", "--backend", "gloo"], check_hf_checkpoint),
    # LoRA under DDP, the defaults, 3 steps; gloo and fp32 as results/finetune.json was measured
    "finetune": (
        "torchrun",
        ["--steps", "3", "--backend", "gloo", "--precision", "fp32"],
        check_finetune,
    ),
    # gloo and 32-true on a GPU host too: results/lightning_fabric.json is CPU fp32, 2 ranks
    "lightning_fabric": (
        "torchrun",
        ["--steps", "3", "--backend", "gloo", "--precision", "32-true"],
        check_lightning_fabric,
    ),
    # the Trainer's DDP over the 2 ranks; no logger: nothing but the lines per step
    "lightning_trainer": (
        "torchrun",
        ["--steps", "3", "--backend", "gloo", "--precision", "32-true", "--logger", "none"],
        check_lightning_trainer,
    ),
}
TORCHRUN_COPIES = [name for name in COPYABLE if COPIES[name][0] == "torchrun"]
# A recipe whose library is an optional extra: its copy cannot run without it (and says so).
MISSING_PACKAGE = {
    name: f"the {name} copy needs {package}: pip install -e .[{extra}]"
    for name, package, module, extra in (
        ("fault_tolerance", "torchft", "torchft", "ft"),
        ("ray_train", "Ray Train", "ray", "ray"),
    )
    if importlib.util.find_spec(module) is None
}
PYTHON_COPIES = [name for name in COPYABLE if COPIES[name][0] == "python"]
