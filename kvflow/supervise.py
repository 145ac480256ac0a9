"""Processes kvflow starts: kept running, reported when they die, and never left behind.

Parent side: :class:`Supervisor` starts children (``python -m kvflow.cli …``, :func:`kvflow_argv`),
each in a process group of its own, with its output in a log file. A watch thread notices a child that exits, says
which one and why (its exit code or signal, the last lines of its log) and restarts it with
backoff (1 s, doubling to 30 s; back to 1 s once it has run for a minute). :meth:`Supervisor.stop`
ends every group (SIGTERM, then SIGKILL after a grace).

Child side: a child learns its parent's pid from ``KVFLOW_PARENT_PID`` and
:func:`follow_parent` makes it leave when that parent is gone — on Linux the kernel sends it
SIGTERM the moment the parent dies (``PR_SET_PDEATHSIG``), elsewhere a thread polls the parent.
So a parent killed with SIGKILL leaves nothing behind either.

Signals: within :func:`signals_stop`, SIGTERM, SIGHUP and SIGINT raise :class:`Stopped` (a
``KeyboardInterrupt``), so that ``finally`` blocks stop the children, also when SIGINT was
inherited as ignored (a job started in the background by a script).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

log = logging.getLogger("kvflow.supervise")

#: Set by a supervisor in its children's environment: the pid they must not outlive.
PARENT_PID_ENV = "KVFLOW_PARENT_PID"
_PR_SET_PDEATHSIG = 1
#: The signals that stop a supervising command.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Stopped(KeyboardInterrupt):
    """A stop signal arrived (SIGTERM, SIGHUP or SIGINT): stop what was started, then exit."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def follow_parent() -> None:
    """Leave when the parent named by ``KVFLOW_PARENT_PID`` is gone (a no-op without it).

    The variable is removed from this process's environment (its own children are not told to
    follow its parent). If the parent is gone already, this process exits at once.
    """
    value = os.environ.pop(PARENT_PID_ENV, None)
    if not value:
        return
    parent = int(value)
    if _set_pdeathsig(signal.SIGTERM):
        if os.getppid() != parent:  # it died before the kernel was told
            os._exit(1)
        return

    def watch() -> None:  # NOTE: where prctl is missing (not Linux): poll
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, name="follow-parent", daemon=True).start()


def die_with_parent() -> None:
    """Have the kernel send this process SIGTERM when its parent dies (Linux; elsewhere a no-op).
    For ``preexec_fn`` of a helper command (it survives ``exec``, not a change of user)."""
    _set_pdeathsig(signal.SIGTERM)


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return bool(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0)


def exit_status(returncode: int) -> str:
    """``exit code 3`` or ``killed by SIGKILL`` (Popen's negative return codes are signals)."""
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def tail(path: Path, lines: int = 10) -> list[str]:
    """The last ``lines`` lines of a log file (none if it cannot be read)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            return [ln.decode(errors="replace") for ln in deque(f.read().splitlines(), maxlen=lines)]
    except OSError:
        return []


@dataclass
class Child:
    """One supervised process: what it runs, where it logs, and its history."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 1.0
    restart_at: float | None = None
    exits: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Starts ``kvflow`` commands as children and keeps them running (see the module docstring).

    Args:
        say: where reports go (a child died, is restarted).
        restart: restart children that exit (False: only report).
        max_backoff_s: the longest wait before a restart.
        stable_s: a child that ran this long restarts after the shortest wait again.
        grace_s: how long :meth:`stop` waits after SIGTERM before SIGKILL.
    """

    def __init__(self, say: Callable[[str], None] = log.warning, *, restart: bool = True,
                 max_backoff_s: float = 30.0, stable_s: float = 60.0, grace_s: float = 20.0) -> None:
        self.say = say
        self.restart = restart
        self.max_backoff_s = max_backoff_s
        self.stable_s = stable_s
        self.grace_s = grace_s
        self.children: dict[str, Child] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def spawn(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> Child:
        """Start ``argv`` (e.g. :func:`kvflow_argv`) as child ``name``, logging to ``log``."""
        child = Child(name, argv, {**os.environ, **(env or {})}, log)
        with self._lock:
            self.children[name] = child
            self._start(child)
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="supervisor", daemon=True)
            self._watcher.start()
        return child

    def _start(self, child: Child) -> None:
        # NOTE: Linux's parent-death signal fires when the *thread* that started a child ends: a
        # child restarted by the watch thread is signalled when that thread ends, in stop().
        child.proc = spawn_child(child.argv, child.log, child.env)
        child.started_at = time.monotonic()
        child.restart_at = None

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            with self._lock:
                for child in self.children.values():
                    self._check(child)

    def _check(self, child: Child) -> None:
        now = time.monotonic()
        if child.restart_at is not None:
            if now >= child.restart_at and not self._stopping.is_set():
                child.restarts += 1
                self.say(f"restarting {child.name} (restart {child.restarts})")
                self._start(child)
            return
        if child.proc is None or child.proc.poll() is None:
            return
        status = exit_status(child.proc.returncode)
        child.exits.append(status)
        lines = tail(child.log)
        report = f"{child.name} (pid {child.proc.pid}) exited: {status}; last lines of {child.log}:"
        self.say("\n    ".join([report, *lines]) if lines else f"{report} (empty)")
        if not self.restart:
            return
        if now - child.started_at >= self.stable_s:
            child.backoff_s = 1.0
        child.restart_at = now + child.backoff_s
        self.say(f"{child.name} restarts in {child.backoff_s:.0f} s")
        child.backoff_s = min(self.max_backoff_s, child.backoff_s * 2)

    def first_exit(self) -> Child | None:
        """A child that has exited and is not restarted (``restart=False``), if any."""
        with self._lock:
            for child in self.children.values():
                if child.proc is not None and child.proc.poll() is not None and child.restart_at is None:
                    return child
        return None

    def stop(self) -> None:
        """End every child's process group: SIGTERM, then SIGKILL after ``grace_s``."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(5)
        with self._lock:
            stop_groups([c.proc for c in reversed(self.children.values()) if c.proc is not None], self.grace_s,
                        self.say)
            self.children.clear()


def kvflow_argv(*args: str) -> list[str]:
    """The command line of ``kvflow <args>`` in this Python."""
    return [sys.executable, "-m", "kvflow.cli", *args]


def spawn_child(argv: list[str], log: Path, env: dict[str, str] | None = None,
                cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``argv`` as a child that this process stops and that does not outlive it: in a
    process group of its own (:func:`stop_groups` ends it whole), stdin closed, output appended to
    ``log``, and ``KVFLOW_PARENT_PID`` set (kvflow commands call :func:`follow_parent`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**(os.environ if env is None else env), PARENT_PID_ENV: str(os.getpid())}
    with log.open("ab") as out:  # the child keeps its own handle
        return subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def stop_groups(procs: list[subprocess.Popen[bytes]], grace_s: float = 20.0,
                say: Callable[[str], None] = log.warning) -> None:
    """End each child's process group (started by :func:`spawn_child`): SIGTERM to all, then
    SIGKILL to what is left of each group once its leader exits or ``grace_s`` has passed."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            say(f"pid {p.pid} did not stop within {grace_s:.0f} s: killed")
        _signal_group(p, signal.SIGKILL)  # what is left of its group
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)
        _wait_group_gone(p.pid, 5.0)  # a signal is delivered asynchronously: wait until it took


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies do not count); Linux's /proc, else
    whether the group can be signalled."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)


@contextlib.contextmanager
def signals_stop() -> Iterator[None]:
    """Within the block, SIGTERM, SIGHUP and SIGINT raise :class:`Stopped` in the main thread
    (whatever the process inherited for them); the handlers before are restored after it."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        for sig in STOP_SIGNALS:  # once: a second signal must not interrupt the stopping
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)


# ---------------------------------------------------------------------- `kvflow router --workers N`


def router_worker_app() -> Any:
    """One worker of ``kvflow router --workers N`` (uvicorn's app factory): the router's app, in a
    process that stops when the router's main process is gone."""
    follow_parent()
    from routing_api.app import create_app

    return create_app()


def run_router_workers(config: Any) -> None:
    """Serve ``config`` (a ``uvicorn.Config`` with ``workers`` > 1 and the factory
    :func:`router_worker_app`) until SIGTERM, SIGINT or SIGHUP, then stop every worker.

    NOTE: uvicorn's process manager (uvicorn 0.54, ``supervisors.multiprocess``) restarts its
    workers on SIGHUP; here SIGHUP stops them, as it stops every kvflow command that starts
    processes. The workers learn this process's pid (``KVFLOW_PARENT_PID``) and follow it.
    """
    from uvicorn.supervisors.multiprocess import Multiprocess

    class Workers(Multiprocess):
        def handle_hup(self) -> None:
            log.info("Received SIGHUP, exiting.")
            self.should_exit.set()

    os.environ[PARENT_PID_ENV] = str(os.getpid())
    sock = config.bind_socket()
    try:
        Workers(config, sockets=[sock]).run()
    finally:
        sock.close()
