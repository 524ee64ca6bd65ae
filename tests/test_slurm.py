"""Slurm for real: Debian's slurmctld and two slurmd "nodes", the sbatch scripts of configs/.

Each node is a network namespace (``ip netns``) with a hostname of its own (``unshare --uts``)
and one end of a veth pair; ``ip netns exec`` gives each its own /etc/hosts (from
/etc/netns/<namespace>/hosts) naming both nodes, as a cluster's DNS would. slurmctld runs on
node1, munged (one key, one socket file) authenticates all of them. Every script is submitted
with ``sbatch`` as a user would (2 nodes x 1 task, CPU, gloo) and must train exactly like one
process; a bad option on node 2 must end the job at once with the recipe's one-line error in
the job's output.

Needs root, iproute2, util-linux's unshare and Debian's packages (``apt-get install slurmctld
slurmd slurm-client munge``: .ci/run installs them); it skips with the reason where they are
absent. The daemons, the jobs' processes and the namespaces go away in the fixture's teardown.

The Slurm variables without a cluster (a batch script is no task, uneven nodes) are checked at
the bottom with a fake environment, everywhere.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from recipes import dist_setup
from tests.deadlines import scaled
from tests.helpers import REPO_ROOT, assert_losses_close, single_process_reference

STEPS = 6  # configs/lightning/ddp.yaml's max_steps; its global batch is the recipes' default 12
DAEMONS = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "munged")
# sbatch's command line overrides the scripts' #SBATCH lines: 2 nodes x 1 task, no GPUs
SMALL_JOB = ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1"]
# each node accepts one recipe job at a time (CPUs=1): 2 cores run 2 ranks, not 6
SLURM_CONF = """\
ClusterName=recipes
SlurmctldHost=node1({addr1})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/spool/%n/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
# the node's CPUs as written here, whatever the machine has
SlurmdParameters=config_overrides
# no cgroups (a container may mount none): processes are tracked by their parent pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=600
NodeName=node1 NodeAddr={addr1} CPUs=1 State=UNKNOWN
NodeName=node2 NodeAddr={addr2} CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
"""
# Node 2 gets a bad option: what a typo in a per-node setting does. Loaded by every Python
# process the jobs start (PYTHONPATH); it changes only a recipe's command line, not torchrun's.
INJECT = """\
import os, sys
argv = sys.orig_argv[1:]
if (os.environ.get("SLURM_NODEID") == "1" and "-m" in argv[:2]
        and argv[argv.index("-m") + 1].startswith("recipes.")):
    sys.argv += ["--steps", "0"]
"""
pytestmark = [
    pytest.mark.xdist_group("slurm"),  # one cluster per run: its tests share one worker
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and slurmd need root"),
    pytest.mark.skipif(
        shutil.which("ip") is None or shutil.which("unshare") is None,
        reason="needs iproute2's `ip` and util-linux's `unshare`",
    ),
]


def run(*command: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=scaled(60), **kwargs)


class Cluster:
    """slurmctld + slurmd on node1, slurmd on node2; ``submit`` runs sbatch on node1."""

    def __init__(self, root: str):
        self.root, self.tag = root, uuid.uuid4().hex[:6]
        self.namespaces = [f"slurm-{self.tag}-{n}" for n in (1, 2)]
        subnet = int(self.tag[:2], 16)
        self.addresses = [f"10.214.{subnet}.{n}" for n in (1, 2)]
        self.daemons: list[subprocess.Popen] = []
        self.env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(
                (
                    "SLURM_",
                    "RANK",
                    "WORLD_SIZE",
                    "LOCAL_",
                    "MASTER_",
                    "GROUP_",
                    "ROLE_",
                    "TORCHELASTIC_",
                    "PYTEST_",
                )
            )
        }
        self.env.update(
            SLURM_CONF=f"{root}/slurm.conf",
            OMP_NUM_THREADS="1",
            # python3 and torchrun of this interpreter, on every node
            PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        )

    def start(self) -> None:
        root = self.root
        for sub in ("munge", "state", "log", "spool/node1", "spool/node2"):
            os.makedirs(f"{root}/{sub}", exist_ok=True)
        os.chmod(root, 0o755)
        os.chmod(f"{root}/munge", 0o700)
        with open(f"{root}/munge/munge.key", "wb") as f:
            f.write(os.urandom(128))
        os.chmod(f"{root}/munge/munge.key", 0o400)
        self._daemon(
            [
                "munged",
                "-F",
                "-f",
                f"--socket={root}/munge/munge.socket",
                f"--key-file={root}/munge/munge.key",
                f"--log-file={root}/log/munged.log",
                f"--pid-file={root}/munge/munged.pid",
                f"--seed-file={root}/munge/munged.seed",
            ],
            "munged",
        )
        with open(f"{root}/slurm.conf", "w") as f:
            f.write(SLURM_CONF.format(root=root, addr1=self.addresses[0], addr2=self.addresses[1]))
        with open(f"{root}/cgroup.conf", "w") as f:
            f.write("CgroupPlugin=cgroup/v1\n")  # read at start-up even with no cgroup plugin
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{address} node{n}\n" for n, address in enumerate(self.addresses, 1)
        )
        for namespace in self.namespaces:
            run("ip", "netns", "add", namespace, check=True)
            run("ip", "-n", namespace, "link", "set", "lo", "up", check=True)
            os.makedirs(f"/etc/netns/{namespace}", exist_ok=True)
            with open(f"/etc/netns/{namespace}/hosts", "w") as f:
                f.write(hosts)
        ends = [f"sl{self.tag}{n}" for n in (1, 2)]
        run("ip", "link", "add", ends[0], "type", "veth", "peer", "name", ends[1], check=True)
        for namespace, end, address in zip(self.namespaces, ends, self.addresses):
            run("ip", "link", "set", end, "netns", namespace, check=True)
            run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", end, check=True)
            run("ip", "-n", namespace, "link", "set", end, "up", check=True)
        self._on_node(1, ["slurmctld", "-D", "-i"], "slurmctld")
        for n in (1, 2):
            self._on_node(n, ["slurmd", "-D", "-N", f"node{n}"], f"slurmd-node{n}")
        deadline = time.monotonic() + scaled(60)
        while time.monotonic() < deadline:
            states = self.on_node1("sinfo", "-h", "-N", "-o", "%N %t").stdout.split()
            if states.count("idle") == 2:
                return
            if any(daemon.poll() is not None for daemon in self.daemons):
                break
            time.sleep(0.5)
        raise RuntimeError(f"the nodes did not come up: sinfo says {states}\n{self.logs()}")

    def _daemon(self, command: list[str], name: str) -> None:
        log = open(f"{self.root}/log/{name}.stderr", "w")
        self.daemons.append(
            subprocess.Popen(command, env=self.env, stdout=log, stderr=log, start_new_session=True)
        )
        log.close()

    def _on_node(self, n: int, command: list[str], name: str) -> None:
        """``command`` on node n: in its namespace, with hostname node<n> (slurmctld checks it
        against SlurmctldHost; torchrun and gloo resolve it to the node's address)."""
        self._daemon(
            [
                "ip",
                "netns",
                "exec",
                self.namespaces[n - 1],
                "unshare",
                "--uts",
                "sh",
                "-c",
                f'hostname node{n} && exec "$@"',
                "sh",
                *command,
            ],
            name,
        )

    def on_node1(self, *command: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return run(
            "ip", "netns", "exec", self.namespaces[0], *command, env=env or self.env, cwd=REPO_ROOT
        )

    def submit(self, script: str, *args: str, env: dict | None = None) -> str:
        """sbatch ``script`` from the repository root; returns the job id."""
        output = f"{self.root}/job-%j.out"
        done = self.on_node1(
            "sbatch",
            "--parsable",
            *SMALL_JOB,
            f"--output={output}",
            script,
            *args,
            env={**self.env, **(env or {})},
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def wait(self, job: str, timeout_s: float) -> dict:
        """The job's fields once it ended (scontrol keeps ended jobs for MinJobAge)."""
        deadline = time.monotonic() + scaled(timeout_s)
        while True:
            shown = self.on_node1("scontrol", "show", "job", "-o", job).stdout
            fields = dict(re.findall(r"(\w+)=(\S*)", shown))
            if fields.get("JobState") in (
                "COMPLETED",
                "FAILED",
                "CANCELLED",
                "TIMEOUT",
                "NODE_FAIL",
                "OUT_OF_MEMORY",
            ):
                return fields
            if time.monotonic() > deadline:
                self.on_node1("scancel", job)
                pytest.fail(
                    f"job {job} did not end within {timeout_s:g}s "
                    f"({fields.get('JobState')})\n{self.output(job)[-3000:]}\n"
                    f"{self.logs()}"
                )
            time.sleep(1)

    def output(self, job: str) -> str:
        with open(f"{self.root}/job-{job}.out") as f:
            return f.read()

    def logs(self) -> str:
        return "\n".join(
            f"--- {path}:\n{open(path).read()[-1500:]}"
            for path in sorted(glob.glob(f"{self.root}/log/*"))
        )

    def stop(self) -> None:
        """Cancel the jobs, stop the daemons, kill what is left in the namespaces, remove them."""
        with contextlib.suppress(Exception):
            self.on_node1("scancel", "--full", "--user=root")
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(daemon.pid, signal.SIGTERM)
        for daemon in reversed(self.daemons):
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait(timeout=15)
        for namespace in self.namespaces:
            # job steps (slurmstepd and its tasks) live on in the namespace, outside any session
            listing = run("ip", "netns", "pids", namespace)
            for pid in listing.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            run("ip", "netns", "del", namespace)  # takes the veth pair with it
            shutil.rmtree(f"/etc/netns/{namespace}", ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        pytest.skip(
            f"Slurm is not installed (no {', '.join(missing)}): apt-get install slurmctld "
            "slurmd slurm-client munge"
        )
    cluster = Cluster(str(tmp_path_factory.mktemp("slurm")))
    try:
        try:
            cluster.start()
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
            pytest.skip(f"Slurm could not start here: {str(detail)[-1500:]}")
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def inject_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inject")
    (folder / "sitecustomize.py").write_text(INJECT)
    return str(folder)


def result_line(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith('{"recipe"')]
    assert len(lines) == 1, f"{len(lines)} result lines (one per world):\n{output[-4000:]}"
    return json.loads(lines[0])


# Each sbatch job costs 10-30 s on 2 cores (8-13 s of CPU, and the cluster's start): every job
# is in the slow set, which CI runs after the default run (issue 23: "the Slurm test may be slow
# if it is long, but runs in CI"). The default run keeps the tests of Slurm's variables below.
SLOW_JOB = pytest.mark.slow


@pytest.mark.timeout(300)
@SLOW_JOB
@pytest.mark.parametrize(
    "script", ["configs/slurm/task_per_gpu.sh", "configs/slurm/torchrun_per_node.sh"]
)
def test_sbatch_script_trains_on_two_nodes_like_one_process(cluster, script):
    # the scripts' default recipe, ddp_torchrun, measured by the harness: its JSON result line
    job = cluster.submit(
        script,
        "--backend",
        "gloo",
        "--precision",
        "fp32",
        "--steps",
        str(STEPS),
        env={"PYTHONPATH": REPO_ROOT, "RECIPE": "recipes.core.prove ddp_torchrun"},
    )
    fields = cluster.wait(job, 240)
    output = cluster.output(job)
    assert fields["JobState"] == "COMPLETED", output[-4000:]
    assert fields["NodeList"] == "node[1-2]"
    # one result: one world of 2 over both nodes (without the Slurm variables each task would
    # be a world of 1 and print its own)
    result = result_line(output)
    assert result["world_size"] == 2
    assert_losses_close(result["losses"], single_process_reference(steps=STEPS).losses, atol=1e-5)


@SLOW_JOB
@pytest.mark.timeout(300)
def test_lightning_slurm_script_trains_on_two_nodes_like_one_process(cluster, tmp_path):
    pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse")
    job = cluster.submit(
        "configs/lightning/slurm_multinode.sh",
        "--trainer.enable_progress_bar",
        "false",
        env={"PYTHONPATH": REPO_ROOT, "ACCELERATOR": "cpu", "LOG_DIR": str(tmp_path)},
    )
    fields = cluster.wait(job, 240)
    output = cluster.output(job)
    assert fields["JobState"] == "COMPLETED", output[-4000:]
    # Lightning's SLURMEnvironment found both tasks, one per node
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in output, output[-4000:]
    (metrics,) = glob.glob(f"{tmp_path}/lightning_trainer_cli/version_*/metrics.csv")
    with open(metrics) as f:
        losses = [float(row["train_loss"]) for row in csv.DictReader(f) if row["train_loss"]]
    assert_losses_close(losses, single_process_reference(steps=STEPS).losses, atol=1e-5)


@pytest.mark.timeout(300)
@SLOW_JOB
@pytest.mark.parametrize(
    "script", ["configs/slurm/task_per_gpu.sh", "configs/slurm/torchrun_per_node.sh"]
)
def test_a_bad_option_on_one_node_ends_the_job_with_its_one_line_error(cluster, inject_dir, script):
    timeout_s = 200  # what node 1's ranks would wait for the missing peer without -K
    # a recipe run by the harness runner (its argparse check: one line, exit 2, and torchrun's
    # error file where torchrun runs it)
    job = cluster.submit(
        script,
        "--backend",
        "gloo",
        "--timeout-s",
        str(timeout_s),
        env={
            "PYTHONPATH": f"{inject_dir}:{REPO_ROOT}",
            "RECIPE": "recipes.core.prove grad_accumulation",
        },
    )
    started = time.monotonic()
    fields = cluster.wait(job, 240)
    took = time.monotonic() - started
    output = cluster.output(job)
    assert fields["JobState"] == "FAILED", output[-4000:]
    # node 2's error, one line, in the job's output; the job ended without waiting it out
    line = "error: steps must be a whole number >= 1, got 0"
    assert output.splitlines().count(line) == 1, output[-4000:]
    assert took < timeout_s / 2, f"the job took {took:.0f}s: srun --kill-on-bad-exit missing?"
    assert '{"recipe"' not in output


# -- Slurm's variables without a cluster ------------------------------------------------------


def slurm_env(**changes) -> dict:
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_TASKS_PER_NODE": "2(x2)",
    }
    env.update(changes)
    return {key: value for key, value in env.items() if value is not None}


def test_a_task_srun_started_joins_the_world_slurm_describes(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        # set, then deleted: monkeypatch then restores it (absent included) after the test.
        # delenv alone records nothing for an absent key, and the RANK=3 that
        # _world_from_environment sets would stay in this process for the tests after it.
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    for key, value in slurm_env().items():
        monkeypatch.setenv(key, value)
    assert dist_setup._world_from_environment() == (3, 4, 1, 2)
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("gpu07", "24242")
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == (
        "3",
        "4",
        "1",
    )


def test_the_batch_script_itself_is_a_world_of_one(monkeypatch):
    """sbatch's script has SLURM_PROCID=0 and SLURM_NTASKS=N too, but no SLURM_STEP_ID."""
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.setenv(key, "")  # restored after the test (see above)
        monkeypatch.delenv(key)
    for key, value in slurm_env(SLURM_PROCID="0", SLURM_STEP_ID=None).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    assert dist_setup._world_from_environment() == (0, 1, 0, 1)
    assert "MASTER_ADDR" not in os.environ


@pytest.mark.parametrize(
    "per_node, node, count",
    [("8", 0, 8), ("2(x3),1", 0, 2), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("1,3", 1, 3)],
)
def test_tasks_on_this_node_come_from_the_per_node_list(per_node, node, count):
    assert dist_setup.tasks_on_node(per_node, node) == count


@pytest.mark.parametrize(
    "nodelist, first",
    [("node[1-2]", "node1"), ("gpu[03-05,9],cpu1", "gpu03"), ("a1", "a1"), ("b[7],c", "b7")],
)
def test_the_rendezvous_host_is_the_first_of_the_node_list(nodelist, first):
    assert dist_setup.first_slurm_host(nodelist) == first


def test_a_master_addr_the_user_set_wins_without_a_node_list(monkeypatch):
    """MASTER_ADDR set by hand (a site whose node names do not resolve): no node list needed."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # restored after the test (see above)
        monkeypatch.delenv(key)
    for key, value in slurm_env(SLURM_JOB_NODELIST=None).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.delenv("SLURM_NODELIST", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    assert dist_setup._world_from_environment() == (3, 4, 1, 2)
    assert os.environ["MASTER_ADDR"] == "10.0.0.7"
