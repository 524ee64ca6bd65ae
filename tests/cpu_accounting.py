"""CPU seconds per test file, printed at the end of the run: where the suite's time goes.

Wall time per test says little on a loaded 2-core machine (a test waits for the CPU its
neighbours hold); CPU seconds do not depend on the load. Each test is charged what its own
process tree spent during its set-up, call and tear-down: the test process and every process
below it (spawned ranks, torchrun agents and their workers, a browser), read from /proc.
A process that has exited is counted once its parent reaps it (its time moves into the
parent's ``cutime``), which every launcher here does.

Under pytest-xdist each worker sends its totals to the controller in ``workeroutput``; the
controller adds them up and prints the 10 most expensive files (``--cpu-top N`` for more), the
most expensive tests with ``--cpu-top-tests N``, and the CPU seconds the whole machine spent
during the run (from /proc/stat: every process, the workers' start-up included).

It also asserts that expensive set-up runs once per run: a module- or session-scoped fixture
that cost more than ``ONCE_CPU_S`` of CPU and was set up twice in the run (by two workers, or by
one worker that went back to its module after other tests) fails the run, and so does a
``tests/once.py`` build recorded twice.
"""

from __future__ import annotations

import collections
import json
import os
import time

import pytest

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_TOTALS_KEY = "cpu_seconds_per_file"
_TESTS_KEY = "cpu_seconds_per_test"
_FIXTURES_KEY = "expensive_fixture_setups"
ONCE_CPU_S = 10.0  # a fixture above this many CPU seconds must be set up once per run


def _children(pid: int) -> list[int]:
    kids = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(child) for child in f.read().split()]
        except OSError:
            continue
    return kids


def _own_and_reaped_ticks(pid: int) -> int:
    """utime + stime + cutime + cstime of one process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    # after the ")": state is field 3, so utime (14) .. cstime (17) are [11:15]
    return sum(int(value) for value in fields[11:15])


def machine_cpu_seconds() -> float:
    """CPU seconds every core of the machine has been busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(value) for value in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    steal_guest = sum(fields[7:])  # steal, guest, guest_nice: not this machine's work
    return (sum(fields) - idle - steal_guest) / _TICKS_PER_S


def tree_cpu_seconds(root: int | None = None) -> float:
    """CPU seconds the process ``root`` (default: this one) and its live descendants have spent,
    with the descendants they have reaped."""
    root = os.getpid() if root is None else root
    ticks, stack, seen = 0, [root], set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        ticks += _own_and_reaped_ticks(pid)
        stack += _children(pid)
    return ticks / _TICKS_PER_S


_AVAILABLE = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


class CpuAccounting:
    def __init__(self, config):
        self.config = config
        self.per_file = collections.Counter()
        self.tests_per_file = collections.Counter()
        self.per_test = {}
        self.fixture_setups = []  # [fixture id, cpu seconds], expensive ones only
        self.started = time.monotonic()
        self.machine_started = machine_cpu_seconds()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before = tree_cpu_seconds()
        yield
        path = item.nodeid.split("::", 1)[0]
        spent = tree_cpu_seconds() - before
        self.per_file[path] += spent
        self.tests_per_file[path] += 1
        self.per_test[item.nodeid] = spent

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        if fixturedef.scope == "function":
            yield
            return
        before = tree_cpu_seconds()  # after its dependencies, which are set up first
        yield
        spent = tree_cpu_seconds() - before
        if spent > ONCE_CPU_S:
            where = fixturedef.baseid or "conftest"
            self.fixture_setups.append([f"{where}::{fixturedef.argname}", round(spent, 1)])

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        output = getattr(node, "workeroutput", {})
        for path, (seconds, tests) in json.loads(output.get(_TOTALS_KEY, "{}")).items():
            self.per_file[path] += seconds
            self.tests_per_file[path] += tests
        self.per_test.update(json.loads(output.get(_TESTS_KEY, "{}")))
        self.fixture_setups += json.loads(output.get(_FIXTURES_KEY, "[]"))

    def twice_built(self, session) -> list[str]:
        """What the run built more than once, each in a line."""
        from tests.once import builds, shared_root

        counts = collections.defaultdict(list)
        for fixture_id, spent in self.fixture_setups:
            counts[fixture_id].append(spent)
        problems = [
            f"fixture {fixture_id} was set up {len(spent)} times ({spent} CPU s): "
            "build it once with tests/once.py:once_per_run"
            for fixture_id, spent in counts.items()
            if len(spent) > 1
        ]
        factory = getattr(session.config, "_tmp_path_factory", None)
        if factory is not None:
            named = collections.Counter(build["name"] for build in builds(shared_root(factory)))
            problems += [
                f"once_per_run built {name!r} {count} times"
                for name, count in named.items()
                if count > 1
            ]
        return problems

    def pytest_sessionfinish(self, session, exitstatus):
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: hand the totals to the controller
            workeroutput[_TOTALS_KEY] = json.dumps(
                {
                    path: [seconds, self.tests_per_file[path]]
                    for path, seconds in self.per_file.items()
                }
            )
            workeroutput[_TESTS_KEY] = json.dumps(self.per_test)
            workeroutput[_FIXTURES_KEY] = json.dumps(self.fixture_setups)
            return
        self.problems = self.twice_built(session)
        if self.problems and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if getattr(self.config, "workeroutput", None) is not None or not self.per_file:
            return
        top = self.config.getoption("cpu_top")
        total = sum(self.per_file.values())
        wall = time.monotonic() - self.started
        machine = machine_cpu_seconds() - self.machine_started
        for problem in getattr(self, "problems", []):
            terminalreporter.write_line(f"expensive set-up built twice: {problem}", red=True)
        terminalreporter.write_sep("-", f"CPU seconds per test file (top {top})")
        for path, seconds in self.per_file.most_common(top):
            terminalreporter.write_line(
                f"{seconds:8.1f} s  {self.tests_per_file[path]:4d} tests  {path}"
            )
        terminalreporter.write_line(
            f"{total:8.1f} s  in all tests' process trees; the machine: {machine:.1f} CPU s "
            f"in {wall:.1f} s of wall time"
        )
        top_tests = self.config.getoption("cpu_top_tests")
        if top_tests:
            terminalreporter.write_sep("-", f"CPU seconds per test (top {top_tests})")
            ranked = sorted(self.per_test.items(), key=lambda item: -item[1])[:top_tests]
            for nodeid, seconds in ranked:
                terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}")


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-top",
        type=int,
        default=10,
        dest="cpu_top",
        help="how many test files to list by CPU seconds at the end (default 10)",
    )
    parser.addoption(
        "--cpu-top-tests",
        type=int,
        default=0,
        dest="cpu_top_tests",
        help="how many tests to list by CPU seconds at the end (default none)",
    )


def pytest_configure(config):
    if _AVAILABLE:
        config.pluginmanager.register(CpuAccounting(config), "cpu_accounting")
