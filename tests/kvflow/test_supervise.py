"""Processes kvflow starts: a child that dies is reported and restarted, a stop signal stops every
child, and a parent killed outright leaves nothing behind. Real processes, found and killed by
pid (the demo and `router --workers` black-box; the supervisor's parts with small scripts)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from kvflow.supervise import Stopped, Supervisor, spawn_child, stop_groups
from tests.support import ROOT, free_port, kafka_env, wait_for


def children_of(pid: int) -> dict[int, str]:
    """pid → command line of every process whose parent is ``pid`` (from /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out[int(entry.name)] = cmdline
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def ignoring_sigint() -> None:
    """preexec_fn: the child starts with SIGINT ignored, as a job a script put in the background."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# ---------------------------------------------------------------------------------- the parts


def test_a_child_that_dies_is_reported_with_its_status_and_log_and_restarted_with_backoff(tmp_path):
    said: list[str] = []
    sup = Supervisor(said.append)
    child = sup.spawn("flaky", python("print('about to fail', flush=True); raise SystemExit(3)"),
                      tmp_path / "flaky.log")
    try:
        wait_for(lambda: child.restarts >= 2, 10, what="two restarts")
        first = next(m for m in said if "exited" in m)
        assert "flaky (pid" in first and "exit code 3" in first and "about to fail" in first
        assert [m for m in said if m.startswith("flaky restarts in")][:2] == ["flaky restarts in 1 s",
                                                                               "flaky restarts in 2 s"]
        assert child.exits[:2] == ["exit code 3", "exit code 3"]
    finally:
        sup.stop()
    assert sup.children == {}


def test_stop_ends_each_childs_whole_process_group(tmp_path):
    sup = Supervisor(restart=False)
    child = sup.spawn("parent", python("""
        import subprocess, sys, time
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(g.pid, flush=True)
        time.sleep(60)"""), tmp_path / "parent.log")
    grandchild = int(wait_for(lambda: (tmp_path / "parent.log").read_text().strip(), 10, what="the grandchild"))
    assert child.pid is not None and alive(child.pid) and alive(grandchild)
    sup.stop()
    assert not alive(child.pid) and not alive(grandchild)


def test_a_child_follows_its_parent_killed_with_sigkill(tmp_path):
    log = tmp_path / "child.log"
    parent = subprocess.Popen(python(f"""
        import sys, time
        from kvflow.supervise import spawn_child
        p = spawn_child([sys.executable, "-c",
                         "from kvflow.supervise import follow_parent; follow_parent(); import time; time.sleep(60)"],
                        __import__("pathlib").Path({str(log)!r}))
        print(p.pid, flush=True)
        time.sleep(60)"""), stdout=subprocess.PIPE, cwd=ROOT)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    time.sleep(1.0)  # the child has told the kernel to follow its parent
    assert alive(child)
    parent.kill()
    parent.wait(5)
    parent.stdout.close()
    wait_for(lambda: not alive(child), 5, what="the child to follow its parent")


def test_stop_signals_raise_stopped_even_when_sigint_was_inherited_ignored():
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        proc = subprocess.Popen(python("""
            import time
            from kvflow.supervise import Stopped, signals_stop
            try:
                with signals_stop():
                    print("ready", flush=True)
                    time.sleep(30)
            except Stopped as exc:
                print("stopped by", exc, flush=True)
                raise SystemExit(128 + exc.signum)"""), stdout=subprocess.PIPE, text=True, cwd=ROOT,
            preexec_fn=ignoring_sigint)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(sig)
        assert proc.wait(10) == 128 + sig
        with proc.stdout:
            assert proc.stdout.read() == f"stopped by {signal.Signals(sig).name}\n"
    assert issubclass(Stopped, KeyboardInterrupt)  # so every `except KeyboardInterrupt` cleanup runs


def test_stop_groups_kills_what_does_not_stop(tmp_path):
    stubborn = spawn_child(python("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)"""), tmp_path / "stubborn.log")
    wait_for(lambda: "ready" in (tmp_path / "stubborn.log").read_text(), 10, what="the child")
    said: list[str] = []
    t0 = time.monotonic()
    stop_groups([stubborn], grace_s=1.0, say=said.append)
    assert stubborn.returncode == -signal.SIGKILL and time.monotonic() - t0 < 5
    assert said == [f"pid {stubborn.pid} did not stop within 1 s: killed"]


# ---------------------------------------------------------------------------------- black-box


def _demo_env(kafka_settings, migrated_database_url: str, reader_url: str, tmp_path: Path) -> dict[str, str]:
    return {**os.environ, **kafka_env(kafka_settings), "KVFLOW_DATABASE_URL": migrated_database_url,
            "KVFLOW_DATABASE_READER_URL": reader_url, "KVFLOW_STACK_HOME": str(tmp_path / "stack")}


def _start_demo(env: dict[str, str], tmp_path: Path, name: str) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp_path / f"{name}.out"
    with out.open("wb") as f:
        demo = subprocess.Popen([sys.executable, "-m", "kvflow.cli", "demo", "--keep", "--external", "--requests",
                                 "4"], env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                preexec_fn=ignoring_sigint)

    def up() -> bool:
        assert demo.poll() is None, out.read_text()
        return "the services keep running" in out.read_text()

    wait_for(up, 180, interval=0.5, what="the demo to keep its services running")
    return demo, out


def _kill_all(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _answers(url: str, *ok: int) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code in ok
    except httpx.HTTPError:
        return False


@pytest.mark.integration
def test_the_demo_restarts_a_service_that_dies_and_a_stop_signal_stops_every_service(
        kafka_settings, migrated_database_url, reader_url, tmp_path):
    env = _demo_env(kafka_settings, migrated_database_url, reader_url, tmp_path)
    demo, out = _start_demo(env, tmp_path, "demo")
    seen: set[int] = set()
    try:
        services = children_of(demo.pid)
        seen |= set(services)
        assert len(services) == 4, services  # the materializer, two nodes, the router
        victim = next(pid for pid, cmd in services.items() if "--node-id demo-node-a" in cmd)
        os.kill(victim, signal.SIGTERM)

        def restarted() -> int | None:
            now = children_of(demo.pid)
            seen.update(now)
            return next((p for p, cmd in now.items() if "--node-id demo-node-a" in cmd and p != victim), None)

        replacement = wait_for(restarted, 30, what="demo-node-a to be restarted")
        text = out.read_text()
        assert f"demo-node-a (pid {victim}) exited" in text and "restarting demo-node-a (restart 1)" in text
        assert demo.poll() is None  # the demo goes on ...
        assert all(alive(p) for p in services if p != victim)  # ... and so does every other service
        port = int(services[victim].split("--port ")[1].split()[0])
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/healthz", 200), 60, what="the restarted node to answer")
        assert alive(replacement)

        demo.send_signal(signal.SIGINT)  # ignored by default in this process: the demo's handler stops it
        assert demo.wait(60) == 130
        assert "SIGINT: stopping what the demo started" in out.read_text()
        assert [p for p in seen if alive(p)] == []
    finally:
        _kill_all([demo.pid, *seen])
        demo.wait(10)


@pytest.mark.integration
def test_a_demo_killed_with_sigkill_leaves_no_process_behind(kafka_settings, migrated_database_url, reader_url,
                                                             tmp_path):
    env = _demo_env(kafka_settings, migrated_database_url, reader_url, tmp_path)
    demo, _ = _start_demo(env, tmp_path, "demo-kill")
    services = children_of(demo.pid)
    try:
        assert len(services) == 4
        demo.kill()
        demo.wait(10)
        wait_for(lambda: not any(alive(p) for p in services), 10, what="every service to follow the demo")
    finally:
        _kill_all([demo.pid, *services])
        demo.wait(10)


@pytest.mark.integration
@pytest.mark.parametrize("how", ["SIGHUP", "SIGKILL"])
def test_router_workers_stop_with_the_router(how, reader_url, tmp_path):
    port = free_port()
    with (tmp_path / "router.log").open("wb") as log:
        router = subprocess.Popen([sys.executable, "-m", "kvflow.cli", "router", "--port", str(port), "--workers",
                                   "2", "--log-level", "warning"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "KVFLOW_DATABASE_READER_URL": reader_url})
    workers: dict[int, str] = {}
    try:
        def started() -> dict[int, str] | None:
            found = {p: c for p, c in children_of(router.pid).items() if "spawn_main" in c}
            return found if len(found) == 2 else None

        workers = wait_for(started, 60, what="two router workers")
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/healthz", 200, 503), 60, what="the workers to answer")
        os.kill(router.pid, getattr(signal, how))
        router.wait(30)
        wait_for(lambda: not any(alive(p) for p in workers), 15, what="every worker to stop")
    finally:
        _kill_all([router.pid, *workers])
        router.wait(10)
