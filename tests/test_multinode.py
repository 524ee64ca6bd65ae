"""Multi-node for real: two hosts on this machine, joined by a cable (issue 11).

Each "host" is a network namespace (``ip netns``) with one end of a veth pair and an address the
test assigns; nothing else is reachable from either, so no packet leaves these namespaces (and
each one's loopback). ``torchrun --nnodes=2 --nproc_per_node=2`` runs across them exactly as
across two machines, with static and with c10d rendezvous. Needs root and iproute2 (``ip``).

What two hosts need that one does not (also on docs/troubleshooting.md):
- gloo binds to the address the hostname resolves to unless told otherwise: GLOO_SOCKET_IFNAME
  names the interface that reaches the other node (NCCL_SOCKET_IFNAME for NCCL);
- c10d rendezvous: ``--local-addr`` is the address the other node reaches this one at (else the
  hostname, which the other node may resolve to something else); the node named by
  ``--rdzv-endpoint`` hosts the store (``--rdzv-conf is_host=1`` when its hostname does not
  resolve to that address).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid

import pytest

from recipes import ddp_torchrun
from tests.deadlines import scaled
from tests.helpers import REPO_ROOT, assert_losses_close, ddp_result

STEPS, GLOBAL_BATCH = 4, 8
PORT = 29511  # inside fresh namespaces every port is free
pytestmark = [
    pytest.mark.skipif(
        shutil.which("ip") is None, reason="needs iproute2's `ip` (apt-get install iproute2)"
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Two namespaces joined by a veth pair: [(namespace, interface, address), ...]."""
    tag = uuid.uuid4().hex[:6]
    hosts = [
        (f"recipes-{tag}-{n}", f"rcp{tag}{n}", f"10.213.{int(tag[:2], 16)}.{n + 1}")
        for n in range(2)
    ]
    try:
        for namespace, _, _ in hosts:
            ip("netns", "add", namespace)
        ip("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])
        for namespace, interface, address in hosts:
            ip("link", "set", interface, "netns", namespace)
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            ip("-n", namespace, "link", "set", interface, "up")
            ip("-n", namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        for namespace, _, _ in hosts:  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


# What the nodes run: the canonical recipe measured by the harness (its JSON result), or, for the
# failure tests, grad_accumulation under the same harness runner, whose heartbeat names a lost
# peer (recipes.core.world.recipe_world).
PROVE_DDP = ("recipes.core.prove", "ddp_torchrun")
HARNESS_DDP = ("recipes.core.prove", "grad_accumulation")


def launch_node(
    host,
    node_rank: int,
    master_address: str,
    rendezvous: str,
    tmp_path,
    *extra: str,
    module: tuple[str, ...] = HARNESS_DDP,
) -> subprocess.Popen:
    namespace, interface, address = host
    if rendezvous == "static":
        joining = [
            f"--node-rank={node_rank}",
            f"--master-addr={master_address}",
            f"--master-port={PORT}",
        ]
    else:
        joining = [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={master_address}:{PORT}",
            "--rdzv-id=two-hosts",
            f"--local-addr={address}",
        ]
        if node_rank == 0:
            joining.append("--rdzv-conf=is_host=1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": interface}
    env.pop("RANK", None)
    command = [
        "ip",
        "netns",
        "exec",
        namespace,
        "torchrun",
        "--nnodes=2",
        "--nproc_per_node=2",
        *joining,
        "-m",
        *module,
        "--backend",
        "gloo",
        "--global-batch-size",
        str(GLOBAL_BATCH),
        "--precision",
        "fp32",
        *extra,
    ]
    out = open(tmp_path / f"node{node_rank}.out", "w+")
    err = open(tmp_path / f"node{node_rank}.err", "w+")
    return subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=out, stderr=err, text=True, start_new_session=True
    )


def read(tmp_path, node_rank: int, stream: str) -> str:
    return (tmp_path / f"node{node_rank}.{stream}").read_text()


def pids_in(hosts) -> list[int]:
    """Every process in these hosts' namespaces (workers included: torchrun starts each worker
    in a session of its own, out of reach of its process group)."""
    pids = []
    for namespace, _, _ in hosts:
        listing = subprocess.run(
            ["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30
        )
        pids += [int(pid) for pid in listing.stdout.split()]
    return pids


def stop(nodes: list[subprocess.Popen], pids: list[int]) -> None:
    """Kill what is left: torchrun (its own session) and every process named in ``pids``."""
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for node in nodes:
        node.wait(timeout=30)


def wait_all(nodes: list[subprocess.Popen], tmp_path, timeout_s: float) -> None:
    """Wait for every node; on a hang, fail with what each one printed."""
    timeout_s = scaled(timeout_s)
    deadline = time.monotonic() + timeout_s
    try:
        for node in nodes:
            node.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        printed = "\n".join(
            f"--- node {n} {stream}:\n{read(tmp_path, n, stream)[-2000:]}"
            for n in range(len(nodes))
            for stream in ("out", "err")
        )
        pytest.fail(f"the nodes did not end within {timeout_s:g}s\n{printed}")


# In the slow set, which CI runs after the default one: each run costs ~16 s of CPU (six
# interpreters importing torch), and the 4-minute suite measured 231-240 s with one of them. The
# default run still trains across the two hosts (static rendezvous) in the vanishing-host test
# below, and names the lost node's ranks there.
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_two_hosts_train_like_one_process(two_hosts, rendezvous, tmp_path):
    master = two_hosts[0][2]
    nodes = [
        launch_node(host, n, master, rendezvous, tmp_path, "--steps", str(STEPS), module=PROVE_DDP)
        for n, host in enumerate(two_hosts)
    ]
    try:
        wait_all(nodes, tmp_path, 240)
    finally:
        stop(nodes, pids_in(two_hosts))
    for n, node in enumerate(nodes):
        assert node.returncode == 0, read(tmp_path, n, "err")[-4000:]
    result = json.loads(read(tmp_path, 0, "out").strip().splitlines()[-1])
    assert result["world_size"] == 4
    reference = ddp_result(
        ddp_torchrun.DDPConfig(steps=STEPS, global_batch_size=GLOBAL_BATCH, precision="fp32")
    )
    assert_losses_close(result["losses"], reference.losses, atol=1e-5)


# slow: two network-namespace hosts started and one torn down, 12 s of CPU and 25-42 s of wall on
# 2 cores; with every recipe run as a copy the default suite measured 240.9 s from a fresh clone,
# at its 4-minute budget. CI runs it (the slow set); the default run keeps a survivor naming the
# rank that died on one host (test_elastic.test_survivors_name_the_rank_that_died_and_exit_cleanly).
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_host_that_vanishes_ends_the_other_with_a_clear_error(two_hosts, tmp_path):
    timeout_s = 15
    master = two_hosts[0][2]
    nodes = [
        launch_node(
            host, n, master, "static", tmp_path, "--steps", "1000000", "--timeout-s", str(timeout_s)
        )
        for n, host in enumerate(two_hosts)
    ]
    vanished: list[int] = []
    try:
        deadline = time.monotonic() + scaled(180)
        while "step 0 loss" not in read(tmp_path, 0, "out"):  # the recipe's line, from rank 0
            assert time.monotonic() < deadline and nodes[0].poll() is None, read(
                tmp_path, 0, "err"
            )[-4000:]
            time.sleep(0.2)
        # Node 1 vanishes: its end of the cable goes down and its namespace is removed. (Deleting
        # the veth would also take node 0's end and address, which node 0's own ranks use to
        # reach its store; removing the name alone leaves the namespace up while processes
        # run in it.)
        namespace, interface, _ = two_hosts[1]
        vanished = pids_in(two_hosts[1:])  # to kill at the end: the name is about to go
        ip("-n", namespace, "link", "set", interface, "down")
        ip("netns", "del", namespace)
        cut = time.monotonic()
        nodes[0].wait(timeout=timeout_s + scaled(60))
        took = time.monotonic() - cut
    finally:
        stop(nodes, pids_in(two_hosts) + vanished)
    err = read(tmp_path, 0, "err")
    assert nodes[0].returncode not in (0, None)
    # Within the collective timeout, plus the time to name the lost ranks and stop.
    assert took < timeout_s + scaled(30), f"node 0 took {took:.0f}s to end"
    lines = [line for line in err.splitlines() if line.startswith("error: rank ")]
    assert lines, err[-4000:]
    for line in lines:  # each survivor names the ranks of the lost node
        assert re.search(r"rank 2 \(.*\), rank 3 \(.*\) stopped their heartbeat", line), line
    assert "terminate called" not in err
