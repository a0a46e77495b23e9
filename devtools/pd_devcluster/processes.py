"""Start daemons in their own session and stop exactly those, never a recycled PID.

A daemon is started with `posix_spawn(setsid=True)`: it survives the CLI exiting, receives
no terminal signals, and no `Popen` object is left to warn at interpreter exit. Each start is
recorded as a `ProcessRecord` (PID, kernel start time, argv). Before signalling, `stop`
re-reads `/proc/<pid>` and only acts if both the start time and the command line still match,
so a PID reused by an unrelated process after a reboot or crash is left alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pd_devcluster.errors import DevClusterError

__all__ = ["ProcessRecord", "is_running", "spawn_daemon", "stop_process"]

_EXEC_SETTLE_S = 5.0


@dataclass(frozen=True)
class ProcessRecord:
    """Identity of a daemon this tool started: (pid, start_ticks) is unique per boot."""

    name: str
    pid: int
    start_ticks: int
    argv: tuple[str, ...]
    log_path: str

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["argv"] = list(self.argv)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProcessRecord:
        return cls(
            name=str(data["name"]),
            pid=int(data["pid"]),
            start_ticks=int(data["start_ticks"]),
            argv=tuple(str(arg) for arg in data["argv"]),
            log_path=str(data["log_path"]),
        )


def _read_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) from /proc/<pid>/stat, or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces and ')': split after the last ')'.
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[19])


def _read_cmdline(pid: int) -> tuple[str, ...] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return tuple(part.decode(errors="replace") for part in raw.split(b"\0") if part)


def _reap(pid: int) -> None:
    """Collect the exit status if the daemon is our own child (test sessions), else no-op."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def is_running(record: ProcessRecord) -> bool:
    """True if `record.pid` is alive and still the very process that was started."""
    _reap(record.pid)
    stat = _read_stat(record.pid)
    if stat is None or stat[0] in {"Z", "X"}:
        return False
    return stat[1] == record.start_ticks and _read_cmdline(record.pid) == record.argv


def spawn_daemon(name: str, argv: list[str], log_path: Path,
                 env: dict[str, str] | None = None, niceness: int = 0) -> ProcessRecord:
    """Start `argv` in a new session, stdout+stderr appended to `log_path`, stdin /dev/null,
    at `niceness` (inherited by the processes it starts later)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    file_actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, str(log_path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    try:
        pid = os.posix_spawn(argv[0], argv, dict(os.environ if env is None else env),
                             file_actions=file_actions, setsid=True)
    except OSError as exc:
        raise DevClusterError(f"could not start {name} ({argv[0]}): {exc}") from exc
    if niceness:
        with contextlib.suppress(ProcessLookupError):  # it exited at once: reported below
            os.setpriority(os.PRIO_PROCESS, pid, niceness)
    # Right after exec, /proc/<pid>/cmdline briefly reads empty: wait until it shows `argv`,
    # or the record would look like a recycled PID and the daemon could never be stopped.
    deadline = time.monotonic() + _EXEC_SETTLE_S
    while True:
        stat = _read_stat(pid)
        if stat is None or stat[0] in {"Z", "X"}:
            _reap(pid)
            raise DevClusterError(f"{name} exited immediately; see {log_path}")
        if _read_cmdline(pid) == tuple(argv):
            break
        if time.monotonic() > deadline:
            raise DevClusterError(f"{name} (pid {pid}) does not show its command line after "
                                  f"{_EXEC_SETTLE_S:.0f} s; stop it by hand: kill {pid}")
        time.sleep(0.005)
    return ProcessRecord(name=name, pid=pid, start_ticks=stat[1], argv=tuple(argv),
                         log_path=str(log_path))


def stop_process(record: ProcessRecord, grace_s: float = 10.0) -> str:
    """SIGTERM the recorded daemon, SIGKILL after `grace_s`; then SIGKILL whatever is left
    of its process group, as a container runtime ends every process of a container (a
    daemon starts its own session, so the group is its own: an engine's worker processes
    must not outlive it). Returns what happened, in words.

    Does nothing to a PID that no longer belongs to the recorded command.
    """
    if not is_running(record):
        return f"{record.name} (pid {record.pid}) was not running"
    try:
        os.kill(record.pid, signal.SIGTERM)
    except ProcessLookupError:
        return f"{record.name} (pid {record.pid}) had already exited"
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not is_running(record):
            _kill_group(record.pid)
            return f"stopped {record.name} (pid {record.pid})"
        time.sleep(0.05)
    if is_running(record):  # re-verified right before the hard kill
        try:
            os.kill(record.pid, signal.SIGKILL)
        except ProcessLookupError:
            _kill_group(record.pid)
            return f"stopped {record.name} (pid {record.pid})"
        kill_deadline = time.monotonic() + 10.0
        while is_running(record) and time.monotonic() < kill_deadline:
            time.sleep(0.05)
    _kill_group(record.pid)
    return f"killed {record.name} (pid {record.pid}) after {grace_s:.0f} s grace"


def _kill_group(pgid: int) -> None:
    """SIGKILL the rest of a daemon's process group (its session, started by spawn_daemon:
    Linux reuses no PID while a group of that number exists, so the group is still ours)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
