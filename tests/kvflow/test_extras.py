"""Each service installable alone: the extras of pyproject.toml (README.md, "Installing one service").

Unit tests read pyproject.toml and the Dockerfile, and check what the router, the materializer and
the CLI import in this (full) venv. The integration tests install the checkout (its wheel, built
once) into fresh venvs from PyPI (the network; ~1 min in all with pip's cache): ``[router]`` holds no torch,
faust or matplotlib and its ``kvflow router`` answers ``GET /healthz`` (503 without a database,
200 with the stack's); ``[materializer]`` holds no torch or matplotlib and imports its faust app;
a command whose extra is missing names it instead of a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvflow.stack import free_port
from tests.conftest import service_missing

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
HEAVY = ("torch", "faust", "matplotlib")


def _name(requirement: str) -> str:
    """A requirement's normalized project name (PEP 503)."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def _requires(*extras: str) -> set[str]:
    """The projects `pip install 'kvflow[extras]'` asks for (kvflow's own extras followed)."""
    optional = PYPROJECT["project"]["optional-dependencies"]
    names = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in optional[extra]:
            if _name(req) == "kvflow":
                todo.extend(e.strip() for e in req[req.index("[") + 1:req.index("]")].split(","))
            else:
                names.add(_name(req))
    return names


# ------------------------------------------------------------------------------ unit: the files


def test_the_router_and_the_materializer_extras_ask_for_no_heavy_project():
    heavy = {"torch", "faust-streaming", "matplotlib"}
    assert not _requires() & (heavy | {"fastapi", "sqlalchemy", "confluent-kafka"}), "the base install"
    assert not _requires("router") & heavy
    assert not _requires("materializer") & {"torch", "matplotlib"}
    assert "torch" in _requires("node") and "faust-streaming" in _requires("materializer")


def test_the_test_extra_pulls_every_extra():
    optional = PYPROJECT["project"]["optional-dependencies"]
    everything = set().union(*(_requires(e) for e in optional))
    assert _requires("test") == everything
    assert _requires("all") == everything - {_name(r) for r in optional["test"]}


def test_the_dockerfile_installs_torch_for_exactly_the_extras_that_need_it():
    text = (ROOT / "Dockerfile").read_text()
    match = re.search(r'case "\$extra" in ([\w|]+)\) needs_torch=1', text)
    assert match, "the Dockerfile's torch switch"
    optional = PYPROJECT["project"]["optional-dependencies"]
    assert set(match.group(1).split("|")) == {e for e in optional if "torch" in _requires(e)}


def _imports(code: str) -> set[str]:
    """The top-level modules loaded after running code in a fresh interpreter of this venv."""
    proc = subprocess.run([sys.executable, "-c", f"{code}\nimport sys, json\n"
                           "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.splitlines()[-1]))


WALK = ("import importlib, pkgutil, {0}\n"
        "for m in pkgutil.walk_packages({0}.__path__, '{0}.'):\n"
        "    importlib.import_module(m.name)")


def test_the_router_and_the_materializer_import_nothing_heavy():
    """Every module of routing_api: no torch, faust or matplotlib; of state_store: no torch or matplotlib."""
    assert not _imports(WALK.format("routing_api")) & set(HEAVY)
    assert not _imports(WALK.format("state_store")) & {"torch", "matplotlib"}


def test_the_cli_imports_only_the_base_install():
    extras_only = {"torch", "faust", "matplotlib", "sqlalchemy", "asyncpg", "alembic", "confluent_kafka", "zmq",
                   "fastapi", "uvicorn", "httpx", "jinja2", "tokenizers", "prometheus_client", "numpy", "aiokafka"}
    assert not _imports("import kvflow.cli") & extras_only


def test_a_command_without_its_extra_names_the_extra():
    """torch made unimportable: `kvflow node` says which extra to install, in one line, exit 1."""
    code = "import sys; sys.modules['torch'] = None; sys.argv = ['kvflow', 'node']\nfrom kvflow.cli import main; main()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "KVFLOW_DEBUG"}, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("kvflow node needs the 'node' extra: pip install 'kvflow[node]' "
                                   "(no module named 'torch')")


# ------------------------------------------------------------------ integration: fresh venvs


def _env(**extra: str) -> dict[str, str]:
    """This environment without kvflow's settings or this venv (pip's own settings stay)."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_") and k not in drop}
    return {**env, **extra}


def _pypi_reachable() -> None:
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    try:
        urllib.request.urlopen(f"{index}/pip/", timeout=15).close()
    except OSError as exc:
        service_missing(f"the package index ({index})", exc)


def _wheel(tmp: Path) -> Path:
    """kvflow's wheel, built from a copy of the checkout (pip builds in the source tree; this
    checkout stays as it is)."""
    _pypi_reachable()
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        shutil.copytree(ROOT / package, src / package, ignore=ignore)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir",
                           str(tmp / "dist"), str(src)], capture_output=True, text=True, cwd=tmp, env=_env(),
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("kvflow-*.whl")
    return wheel


def _install(tmp: Path, wheel: Path, extra: str) -> Path:
    """A fresh venv with `pip install 'kvflow[extra]'` (the checkout's wheel); its bin folder."""
    venv = tmp / "venv"
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, env=_env())
    # --no-compile: the same packages, without writing their bytecode (a third of the install's time)
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile",
                           f"{wheel}[{extra}]"],
                          capture_output=True, text=True, cwd=tmp, env=_env(), timeout=480, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
                            capture_output=True, text=True, env=_env(), timeout=120, check=True)
    names = sorted(p["name"].lower() for p in json.loads(listed.stdout))
    print(f"[{extra}]: {len(names)} distributions in {time.monotonic() - started:.0f} s: {' '.join(names)}")
    return venv / "bin"


def _absent(bin_dir: Path, modules: tuple[str, ...]) -> dict[str, bool]:
    """Whether each module is missing from the venv (importlib's find_spec, nothing imported)."""
    code = (f"import importlib.util, json; print(json.dumps({{m: importlib.util.find_spec(m) is None "
            f"for m in {list(modules)!r}}}))")
    proc = subprocess.run([str(bin_dir / "python"), "-c", code], capture_output=True, text=True,
                          env=_env(), timeout=60, check=True)
    return dict(json.loads(proc.stdout))


def _missing_extra(bin_dir: Path, tmp: Path, command: str, extra: str) -> None:
    """`kvflow <command>` exits 1 with the line naming the extra, no traceback."""
    proc = subprocess.run([str(bin_dir / "kvflow"), command], capture_output=True, text=True, cwd=tmp,
                          env=_env(), timeout=120, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert f"kvflow {command} needs the '{extra}' extra: pip install 'kvflow[{extra}]'" in proc.stderr, out
    assert "Traceback" not in out


@pytest.fixture(scope="module")
def kvflow_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _wheel(tmp_path_factory.mktemp("kvflow-wheel"))


@pytest.fixture(scope="module")
def router_bin(tmp_path_factory: pytest.TempPathFactory, kvflow_wheel: Path) -> Path:
    return _install(tmp_path_factory.mktemp("extra-router"), kvflow_wheel, "router")


@pytest.fixture(scope="module")
def materializer_bin(tmp_path_factory: pytest.TempPathFactory, kvflow_wheel: Path) -> Path:
    return _install(tmp_path_factory.mktemp("extra-materializer"), kvflow_wheel, "materializer")


@contextlib.contextmanager
def _router(bin_dir: Path, tmp: Path, reader_url: str) -> Iterator[str]:
    """`kvflow router` on a free port of localhost, for the with block (then stopped, by its pid)."""
    port = free_port()
    log_path = tmp / "router.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([str(bin_dir / "kvflow"), "router", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
                                env=_env(KVFLOW_DATABASE_READER_URL=reader_url))
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, f"the router exited ({proc.returncode}):\n{log_path.read_text()}"
                assert time.monotonic() < deadline, f"no answer on {url}:\n{log_path.read_text()}"
                try:
                    httpx.get(f"{url}/healthz", timeout=5)
                    break
                except httpx.TransportError:
                    time.sleep(0.3)
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


@pytest.mark.integration
def test_the_router_extra_runs_the_router_alone(router_bin: Path, tmp_path: Path):
    """No torch, faust or matplotlib; `kvflow router` answers /healthz without its database (503,
    "database unreachable": it routes on, by load); `kvflow node` names the extra it needs."""
    assert _absent(router_bin, HEAVY) == dict.fromkeys(HEAVY, True)
    nowhere = f"postgresql+asyncpg://kvflow_reader:kvflow_reader@127.0.0.1:{free_port()}/kvflow"
    with _router(router_bin, tmp_path, nowhere) as url:
        reply = httpx.get(f"{url}/healthz", timeout=15)
        assert reply.status_code == 503, reply.text
        assert reply.json()["status"] == "database unreachable"
        assert httpx.get(f"{url}/metrics", timeout=5).status_code == 200
    _missing_extra(router_bin, tmp_path, "node", "node")
    _missing_extra(router_bin, tmp_path, "materializer", "materializer")


@pytest.mark.integration
def test_the_router_extra_serves_healthz_from_the_database(router_bin: Path, tmp_path: Path, reader_url: str):
    """With the stack's PostgreSQL (a fresh migrated database, the read-only role): 200, no nodes."""
    with _router(router_bin, tmp_path, reader_url) as url:
        reply = httpx.get(f"{url}/healthz", timeout=15)
        assert reply.status_code == 200, reply.text
        assert reply.json() == {"status": "ok", "nodes": 0, "live_nodes": 0}


@pytest.mark.integration
def test_the_materializer_extra_runs_the_materializer_alone(materializer_bin: Path, tmp_path: Path):
    """No torch or matplotlib; the faust app imports; `kvflow router` names the extra it needs."""
    assert _absent(materializer_bin, ("torch", "matplotlib")) == {"torch": True, "matplotlib": True}
    code = "import sys, state_store.faust_app; print(sorted({'torch', 'matplotlib'} & set(sys.modules)))"
    proc = subprocess.run([str(materializer_bin / "python"), "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env=_env(), timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert subprocess.run([str(materializer_bin / "kvflow"), "materializer", "--help"], capture_output=True,
                          cwd=tmp_path, env=_env(), timeout=60, check=False).returncode == 0
    _missing_extra(materializer_bin, tmp_path, "router", "router")
