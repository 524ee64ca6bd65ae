"""Which peer died: every rank of a world the harness guards keeps a heartbeat in the store.

``recipes.core.world.recipe_world`` starts a ``Liveness`` once a recipe's process group exists
(a world of two or more); when a collective breaks, ``name_the_lost_peer`` attaches to the
exception the rank that died (``exc.peer_report``), which ``python -m recipes.core.prove`` prints
in one line before the process ends without tearing the broken group down.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import torch.distributed as dist

from recipes.core.errors import first_line, report_and_exit

__all__ = ["Liveness", "deadline", "liveness_store", "name_the_lost_peer", "store_address"]


def name_the_lost_peer(liveness: Liveness, rank: int, exc: BaseException) -> None:
    """``exc.peer_report``: which peer died (``Liveness.explain``), for the prove command to
    print; a store that stops answering meanwhile ends the process with what is known."""
    unnamed = (
        f"rank {rank}: a collective failed ({first_line(str(exc))[:160]}) and the store "
        f"at {store_address()} stopped answering while naming the lost rank: a host is "
        "unreachable (network down, or the node of rank 0 / of torchrun's agent is gone)"
    )
    with (
        deadline(12.0, lambda: report_and_exit(unnamed, 1, echo=True)),
        contextlib.suppress(AttributeError, TypeError),
    ):
        exc.peer_report = liveness.explain()


@contextlib.contextmanager
def deadline(seconds: float, give_up: Callable[[], None]) -> Iterator[None]:
    """``give_up()`` from a timer thread if the block is still running after ``seconds``: a call
    blocked in C++ cannot be interrupted from Python."""
    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def store_address() -> str:
    return f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"


def liveness_store(world_size: int) -> dist.Store:
    """The launcher's store, in the namespace ``Liveness`` keeps its own connection in."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=30),
    )
    return dist.PrefixStore(f"recipes/attempt{attempt}/world{world_size}", client)


class Liveness:
    """Which peer died: every rank keeps a heartbeat in the store and notes how it exits.

    A survivor's collective only says that a connection broke. What names the peer: a key a rank
    writes when it fails with an error of its own (``exit/R``); for ranks on this host, whether
    their process still runs (``/proc``); for other hosts, a heartbeat that stopped advancing.
    The first survivor to know publishes its verdict, and every rank's heartbeat thread keeps a
    copy: a survivor whose collective breaks later (when rank 0, the store's host in a world
    started without torchrun's agent, has already left) still names the rank that died first.
    The heartbeat thread has its own store connection, so it never waits behind the main thread.
    """

    PERIOD_S = 1.0

    def __init__(self, store: dist.Store, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.store = dist.PrefixStore("liveness", store)
        self.host = socket.gethostname()
        self.store.set(f"proc/{rank}", json.dumps({"host": self.host, "pid": os.getpid()}))
        self.procs: dict[int, dict] = {}  # every rank's host and pid, once all have registered
        self.verdict = ""  # the first survivor's verdict, copied by the heartbeat thread
        self._stop = threading.Event()
        self._beat_store = self._own_connection()
        self._thread = threading.Thread(target=self._beat, name="recipes-heartbeat", daemon=True)
        self._thread.start()

    def _own_connection(self) -> dist.Store | None:
        try:
            client = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=datetime.timedelta(seconds=5),
            )
        except (KeyError, ValueError, RuntimeError):
            return None  # no heartbeat; the other signs still work
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"recipes/attempt{attempt}/world{self.world_size}"
        return dist.PrefixStore("liveness", dist.PrefixStore(prefix, client))

    def _beat(self) -> None:
        store = self._beat_store
        while store is not None and not self._stop.wait(self.PERIOD_S):
            try:
                store.add(f"beat/{self.rank}", 1)
                keys = [f"proc/{r}" for r in range(self.world_size)]
                if not self.procs and store.check(keys):
                    self.procs = {r: json.loads(store.get(key)) for r, key in enumerate(keys)}
                if store.check(["verdict"]):
                    self.verdict = store.get("verdict").decode()
            except Exception:  # noqa: BLE001 - the store's host is gone: nothing left to tell
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.PERIOD_S)

    def record_exit(self, line: str) -> None:
        with contextlib.suppress(Exception):
            self.store.set(f"exit/{self.rank}", line)

    def explain(self) -> str:
        """One phrase naming the dead or failed peers, or what is known when none can be named."""
        probe = self._beat_store or self.store
        verdict = self._explain(probe)
        try:
            if not probe.check(["verdict"]):
                probe.set("verdict", verdict)
            if self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
                # This process hosts the store: stay long enough for every heartbeat thread to
                # copy the verdict before the store goes with it.
                time.sleep(2.5 * self.PERIOD_S)
        except Exception:  # noqa: BLE001 - the store is gone; the verdict is still this rank's
            pass
        return verdict

    def _dead_here(self, procs: dict[int, dict], wait_s: float = 1.0) -> list[int]:
        """Peers on this host whose process is gone (polled briefly: a killed process takes a
        moment to leave, and its sockets close before it does)."""
        deadline = time.monotonic() + wait_s
        while True:
            gone = [
                r
                for r, p in procs.items()
                if r != self.rank and p["host"] == self.host and not _running(p["pid"])
            ]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.1)

    def _explain(self, probe: dist.Store, wait_s: float = 3.0) -> str:
        peers = [r for r in range(self.world_size) if r != self.rank]
        try:
            failed = {
                r: probe.get(f"exit/{r}").decode() for r in peers if probe.check([f"exit/{r}"])
            }
            if failed:
                return "; ".join(f"rank {r} failed first: {line}" for r, line in failed.items())
            procs = self.procs or {
                r: json.loads(probe.get(f"proc/{r}")) for r in peers if probe.check([f"proc/{r}"])
            }
            gone = self._dead_here(procs)
            # The first survivor's verdict wins over /proc, read AFTER it: a survivor publishes,
            # then exits, so one that exited before the look above has published by now, and
            # must not be counted among the dead (two survivors that fail in the same collective
            # look at the same moment).
            if probe.check(["verdict"]):
                return probe.get("verdict").decode()
            if gone:
                return _no_longer_running(gone, procs)
            beats = {r: _count(probe, r) for r in peers}
            time.sleep(wait_s)  # a live peer beats every PERIOD_S: several times in wait_s
            stale = [r for r in peers if _count(probe, r) == beats[r]]
            if stale:
                named = ", ".join(f"rank {r} ({procs.get(r, {}).get('host', '?')})" for r in stale)
                whose = " stopped its" if len(stale) == 1 else " stopped their"
                return named + whose + " heartbeat (dead, or unreachable)"
            return "every other rank is still alive: one of them is stuck or failed differently"
        except Exception:  # noqa: BLE001 - the store itself is unreachable
            if self.verdict:
                return self.verdict
            gone = self._dead_here(self.procs, wait_s=0)
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            return (
                _no_longer_running(gone, self.procs) + f" and the store at {where} is gone"
                if gone
                else f"the store at {where} is unreachable too: the host of rank 0 "
                "(or of torchrun's agent) is gone"
            )


def _no_longer_running(ranks: list[int], procs: dict[int, dict]) -> str:
    named = ", ".join(f"rank {r} (pid {procs[r]['pid']})" for r in ranks)
    return (
        named
        + (" is" if len(ranks) == 1 else " are")
        + " no longer running (killed, or exited without an error)"
    )


def _count(store: dist.Store, rank: int) -> int:
    return int(store.add(f"beat/{rank}", 0))


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie is dead
    except OSError:
        return False
