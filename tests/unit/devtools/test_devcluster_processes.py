"""Daemon start/stop by identity (real `sleep` processes; no cluster binaries needed)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from pd_devcluster.processes import is_running, spawn_daemon, stop_process

SLEEP = shutil.which("sleep") or "/bin/sleep"


def test_spawned_daemon_runs_in_its_own_session_and_stops(tmp_path: Path) -> None:
    """Guards against daemons dying with the CLI's terminal session (no setsid)."""
    record = spawn_daemon("sleeper", [SLEEP, "60"], tmp_path / "sleeper.log")
    try:
        assert is_running(record)
        assert os.getsid(record.pid) == record.pid != os.getsid(0)
    finally:
        outcome = stop_process(record, grace_s=5)
    assert outcome == f"stopped sleeper (pid {record.pid})"
    assert not is_running(record)


def test_a_daemon_spawned_nicer_runs_and_starts_children_at_that_niceness(
        tmp_path: Path) -> None:
    """Guards the dev kubelet's engines running behind the control plane: the niceness
    is the daemon's from its start, and the processes it starts later inherit it."""
    child = tmp_path / "child"
    code = (f"import pathlib, subprocess, time; time.sleep(0.3); "
            f"p = subprocess.Popen([{SLEEP!r}, '60']); "
            f"pathlib.Path({str(child)!r}).write_text(str(p.pid)); p.wait()")
    record = spawn_daemon("parent", [sys.executable, "-c", code], tmp_path / "parent.log",
                          niceness=7)
    try:
        deadline = time.monotonic() + 10
        while not child.exists() or not child.read_text().strip():
            assert time.monotonic() < deadline, "the daemon started no child"
            time.sleep(0.05)
        for pid in (record.pid, int(child.read_text())):
            assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0) + 7
    finally:
        stop_process(record, grace_s=5)


def test_stop_leaves_a_recycled_pid_alone(tmp_path: Path) -> None:
    """Guards against killing an unrelated process that got a recorded PID after a crash."""
    mine = spawn_daemon("sleeper", [SLEEP, "61"], tmp_path / "sleeper.log")
    stop_process(mine, grace_s=5)
    time.sleep(0.05)  # start times have clock-tick (10 ms) resolution
    unrelated = subprocess.Popen([SLEEP, "60"])
    try:
        # same PID as the unrelated process, but another start time or command line
        for forged in (dataclasses.replace(mine, pid=unrelated.pid),
                       dataclasses.replace(mine, pid=unrelated.pid, argv=(SLEEP, "60"))):
            assert not is_running(forged)
            assert "was not running" in stop_process(forged, grace_s=1)
        assert unrelated.poll() is None
    finally:
        unrelated.send_signal(signal.SIGKILL)
        unrelated.wait()


def test_sigkill_after_grace_for_a_daemon_ignoring_sigterm(tmp_path: Path) -> None:
    shell = shutil.which("sh") or "/bin/sh"
    log = tmp_path / "stubborn.log"
    record = spawn_daemon("stubborn",
                          [shell, "-c", "trap '' TERM; echo armed; while :; do sleep 0.1; done"],
                          log)
    deadline = time.monotonic() + 5
    while "armed" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.01)
    outcome = stop_process(record, grace_s=0.5)
    assert outcome.startswith("killed stubborn")
    assert not is_running(record)


def test_stopping_a_daemon_ends_its_whole_process_group(tmp_path: Path) -> None:
    """Guards against a stopped engine leaving its worker processes behind (seen: vLLM
    engine cores orphaned by their killed API server, holding ports and 1.7 GB each):
    the leader exits on SIGTERM, a child that ignores it is killed with the group."""
    shell = shutil.which("sh") or "/bin/sh"
    log = tmp_path / "parent.log"
    record = spawn_daemon("parent", [
        shell, "-c", f"sh -c \"trap '' TERM; echo \\$\\$ > {tmp_path / 'child'}; "
                     f"while :; do sleep 0.1; done\" & wait"], log)
    child_file = tmp_path / "child"
    deadline = time.monotonic() + 5
    while not child_file.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    child = int(child_file.read_text())
    assert child != record.pid and os.getpgid(child) == record.pid
    stop_process(record, grace_s=2)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, os.WNOHANG)
        time.sleep(0.05)
    else:
        raise AssertionError(f"the child {child} outlived its stopped daemon")
