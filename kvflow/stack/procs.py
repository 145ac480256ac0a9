"""Process helpers of the local stack: ports, pids, waiting, and running a helper command whose
failure is told in one line (:class:`~kvflow.stack.settings.StackError`)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvflow.stack.settings import StackError
from kvflow.supervise import die_with_parent


def is_root() -> bool:
    return os.geteuid() == 0


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not reaped) counts as dead.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def pid_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return check()


def run(cmd: Sequence[str], *, log: Path | None = None, timeout: float = 600,
        env: dict[str, str] | None = None, what: str) -> subprocess.CompletedProcess[str]:
    """Run a helper command; on failure raise StackError with the tail of its output."""
    try:
        proc = subprocess.run(  # (the helper dies with this process, even killed with SIGKILL)
            list(cmd), capture_output=True, text=True, timeout=timeout, env=env, check=False,
            preexec_fn=die_with_parent,
        )
    except FileNotFoundError as exc:
        raise StackError(f"{what}: {cmd[0]} not found") from exc
    except subprocess.TimeoutExpired as exc:
        raise StackError(f"{what}: timed out after {timeout:.0f} s") from exc
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise StackError(f"{what} failed (exit {proc.returncode}): {' | '.join(detail)}")
    return proc
