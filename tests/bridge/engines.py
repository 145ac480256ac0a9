"""Real engines for the bridge's tests: vLLM's KV cache and KV event publisher, and SGLang's
KV event code, each in a subprocess that a test drives one command at a time.

    with VllmEngine(block_size=16, num_blocks=64) as eng:
        events_url, replay_url = eng.endpoints            # a SUB / a DEALER connects here
        eng.request("r1", list(range(40)), decode=5)      # blocks stored: a batch on the PUB socket
        eng.request("r2", list(range(40)), lora={"name": "adapterA", "id": 7})
        truth = eng.state()                               # what the engine has cached, exactly
        expected_kvflow_hashes(truth, 16)                 # ... as kvflow's wire hashes

The engine scripts (``vllm_engine.py``, ``sglang_engine.py``) read JSON lines on stdin and
answer one JSON line each on stdout (their library output goes to stderr, kept in a log):

* ``{"op": "request", "id": ID, "tokens": [...], "decode": N, "lora": {"name", "id"[, "path"]} | null,
  "free": true, ["decode_tokens": [...], "report_mode": "full", "cache_salt": S]}`` — one request,
  scheduled as the engine's scheduler does it: a prefill step, then one step per further output
  token; each step that produced events ends with one published batch. Answer: ``ok``,
  ``num_computed_tokens`` (the prefix cache hit), ``num_tokens``, ``output_tokens``, ``seqs``
  (every batch published), ``published`` (the last one, or null); vLLM's also ``block_hashes``.
* ``{"op": "free", "id": ID}`` — finish a request that ran with ``"free": false``.
* ``{"op": "reset"[, "publish_now": true, "running": true]}`` — clear the prefix cache (refused,
  ``ok: false``, while requests hold blocks; vLLM: ``"running": true`` preempts them first). vLLM
  publishes its AllBlocksCleared only with the next step's batch (``pending: true`` until then)
  unless ``publish_now``; SGLang publishes it at once (its idle loop publishes).
* ``{"op": "state"}`` — ``{"blocks": [{"engine_hash", "prefix_tokens", "lora_id", "lora_name",
  "cache_salt", "copies"}], "block_size", "num_gpu_blocks", "free_blocks", "live", "next_seq"}``.
* ``{"op": "restart"}`` — an engine restart: empty cache, a new publisher on the same endpoints, seq 0.
* ``{"op": "garbage", "kind": "frames" | "payload" | "batch"}`` — junk on the stream.
* ``{"op": "quit"}``.

An error answers ``{"ok": false, "error": ...}``; the engine goes on.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
END_SEQ = (-1).to_bytes(8, "big", signed=True)

T = TypeVar("T")


# ---------------------------------------------------------------------- the engine side


def serve(make_engine: Callable[[], Any]) -> int:
    """The command loop of an engine script: a ``ready`` line, then one answer per command."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's logger and any print() go to stderr: stdout is the protocol's
    sys.stdout = sys.stderr

    def answer(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    try:
        engine = make_engine()
    except Exception as exc:
        answer({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    answer({"ready": True, **engine.describe()})
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            op = None
            try:
                cmd = json.loads(line)
                op = cmd.get("op")
                method = getattr(engine, f"op_{op}", None)
                reply = method(cmd) if method else {"ok": False, "error": f"unknown op {op!r}"}
            except Exception as exc:
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            answer(reply)
            if op == "quit":
                break
    finally:
        engine.close()
    return 0


def bind_with_retry(make: Callable[[], T], timeout: float = 10.0) -> T:
    """``make()`` again while its socket's address is still held by the one just closed."""
    import zmq

    deadline = time.monotonic() + timeout
    while True:
        try:
            return make()
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# ---------------------------------------------------------------------- the test side


class EngineError(RuntimeError):
    pass


def engine_missing(engine: str) -> str | None:
    """Why the engine cannot run in this venv (None: it can); checked without importing it."""
    if importlib.util.find_spec(engine) is None:
        return f"{engine} is not installed in this venv (make engines)"
    return None


def require(engine: str) -> None:
    """Skip a test without ``engine`` — a failure where ``KVFLOW_REQUIRE_ENGINES=1`` (``make test``)."""
    import pytest

    why = engine_missing(engine)
    if why:
        if os.environ.get("KVFLOW_REQUIRE_ENGINES") == "1":
            pytest.fail(f"{why}; make test installs it")
        pytest.skip(why)


class EngineProcess:
    """An engine script as a subprocess; its commands as methods. A context manager."""

    script: ClassVar[str]
    name: ClassVar[str]

    def __init__(self, *, block_size: int = 16, num_blocks: int = 64, endpoint: str | None = None,
                 replay: str | None = None, buffer_steps: int = 10_000, topic: str = "",
                 extra_args: tuple[str, ...] = (), log_path: Path | None = None,
                 start_timeout: float = 180.0, command_timeout: float = 60.0) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._endpoint, self._replay = endpoint, replay
        self.args = ["--block-size", str(block_size), "--num-blocks", str(num_blocks),
                     "--buffer-steps", str(buffer_steps), "--topic", topic, *extra_args]
        self.log_path = log_path
        self._own_log = log_path is None  # a temporary log, removed on close
        self.start_timeout = start_timeout
        self.command_timeout = command_timeout
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}
        self._lines: queue.Queue[str | None] = queue.Queue()

    # ---------------------------------------------------------------- process

    def start(self) -> EngineProcess:
        from kvflow.stack import free_port  # tests.support's, without its imports

        for attempt in range(3):
            pub_port, replay_port = free_port(), free_port()
            self.endpoint = self._endpoint or f"tcp://*:{pub_port}"
            self.replay_endpoint = self._replay or f"tcp://*:{replay_port}"
            try:
                self._spawn()
                return self
            except EngineError as exc:
                self.close()
                if "Address already in use" not in str(exc) or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"kvflow-{self.name}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log = self.log_path.open("ab")
        cmd = [sys.executable, str(HERE / self.script), "--endpoint", self.endpoint,
               "--replay", self.replay_endpoint, *self.args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     cwd=ROOT, text=True, bufsize=1)
        self._lines = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(self.proc, self._lines), daemon=True)
        self._reader.start()
        ready = self._next_line(self.start_timeout, "its start")
        if not ready.get("ready"):
            raise EngineError(f"{self.name} engine failed to start: {ready.get('error')}\n{self.log_tail()}")
        self.info = ready

    @staticmethod
    def _read(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
        assert proc.stdout is not None
        with proc.stdout:
            for line in proc.stdout:
                lines.put(line)
        lines.put(None)

    def _next_line(self, timeout: float, what: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(f"{self.name} engine: no answer to {what} in {timeout:.0f} s\n"
                              f"{self.log_tail()}") from None
        if line is None:
            raise EngineError(f"{self.name} engine exited (waiting for {what})\n{self.log_tail()}")
        return json.loads(line)  # type: ignore[no-any-return]

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])  # type: ignore[union-attr]
        except OSError:
            return ""

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(Exception):
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                proc.stdin.flush()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()  # our own child, by its handle
                proc.wait(timeout=15)
        with contextlib.suppress(Exception):
            assert proc.stdin is not None
            proc.stdin.close()
        self._reader.join(timeout=15)  # it closes stdout at its end
        self._log.close()
        if self._own_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *_exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- commands

    @property
    def endpoints(self) -> tuple[str, str]:
        """(events, replay) URLs for a SUB and a DEALER to connect to (the engine binds both)."""
        return _connect_url(self.endpoint), _connect_url(self.replay_endpoint)

    def command(self, op: str, *, check: bool = True, **fields: Any) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            raise EngineError(f"{self.name} engine is not running\n{self.log_tail()}")
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        reply = self._next_line(self.command_timeout, f"{op!r}")
        if check and not reply.get("ok"):
            raise EngineError(f"{self.name} engine: {op} failed: {reply.get('error')}")
        return reply

    def request(self, id: str, tokens: list[int], *, decode: int = 0, lora: dict[str, Any] | None = None,
                free: bool = True, check: bool = True, **extra: Any) -> dict[str, Any]:
        """``extra``: ``decode_tokens``, ``report_mode`` ("full"), ``cache_salt``, ``session_id``."""
        return self.command("request", check=check, id=id, tokens=list(tokens), decode=decode, lora=lora,
                            free=free, **extra)

    def free(self, id: str, *, check: bool = True) -> dict[str, Any]:
        return self.command("free", check=check, id=id)

    def reset(self, *, publish_now: bool = False, running: bool = False, check: bool = True) -> dict[str, Any]:
        return self.command("reset", check=check, publish_now=publish_now, running=running)

    def state(self) -> dict[str, Any]:
        return self.command("state")

    def restart(self) -> dict[str, Any]:
        return self.command("restart")

    def garbage(self, kind: str = "frames") -> dict[str, Any]:
        return self.command("garbage", kind=kind)


class VllmEngine(EngineProcess):
    """vLLM 0.33.0's KVCacheManager + ZmqEventPublisher (``vllm_engine.py``).

    ``hash_algo``: vLLM's ``--prefix-caching-hash-algo``; ``int_hashes``:
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (True: uint64 hashes, False: 32-byte digests)."""

    script = "vllm_engine.py"
    name = "vllm"

    def __init__(self, *, hash_algo: str = "sha256", int_hashes: bool = True, **kw: Any) -> None:
        extra = ("--hash-algo", hash_algo, "--int-hashes", "1" if int_hashes else "0")
        super().__init__(extra_args=extra + tuple(kw.pop("extra_args", ())), **kw)


class SglangEngine(EngineProcess):
    """SGLang 0.5.23's kv_events publisher and event recorder over a paged radix cache
    (``sglang_engine.py``); ``block_size`` is SGLang's ``--page-size``."""

    script = "sglang_engine.py"
    name = "sglang"


def _connect_url(endpoint: str) -> str:
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint[len(wildcard):]
    return endpoint


def expected_kvflow_hashes(state: dict[str, Any], block_size: int, *, with_salt: bool = True) -> set[int]:
    """kvflow's wire hashes of the blocks the engine has cached (``state()``): each block's digest
    chained over its token prefix, with the block's LoRA id (and the request's cache salt)."""
    from eventbus.hashing import block_hash, chain_digests

    return {block_hash(chain_digests(b["prefix_tokens"], block_size, lora_id=b["lora_id"],
                                     cache_salt=b.get("cache_salt") if with_salt else None)[-1])
            for b in state["blocks"]}


def engine_hashes(state: dict[str, Any]) -> set[Any]:
    """The hashes (as the engine's events carry them) of the blocks the engine has cached."""
    return {b["engine_hash"] for b in state["blocks"]}


# ---------------------------------------------------------------------- plain pyzmq on the wire


def subscribe(url: str, topic: bytes = b"", timeout: float = 10.0) -> Any:
    """A SUB socket connected to ``url`` once its connection is up (a PUB drops what it sends
    before a subscriber has joined)."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    sub: Any = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.connect(url)
        if not monitor.poll(int(timeout * 1000)):
            sub.close()
            raise TimeoutError(f"no ZMTP handshake with {url} in {timeout} s")
        recv_monitor_message(monitor)
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)
    time.sleep(0.2)  # the subscription itself follows the handshake
    return sub


def receive(sub: Any, count: int | None = None, timeout: float = 10.0, idle: float = 0.5) -> list[list[bytes]]:
    """Multipart messages from ``sub``: ``count`` of them (within ``timeout``), or, with no
    count, all until none has come for ``idle`` seconds."""
    out: list[list[bytes]] = []
    deadline = time.monotonic() + timeout
    while count is None or len(out) < count:
        wait = deadline - time.monotonic() if count is not None else idle
        if wait <= 0 or not sub.poll(int(wait * 1000)):
            break
        out.append(sub.recv_multipart())
    if count is not None and len(out) < count:
        raise TimeoutError(f"{len(out)} of {count} messages in {timeout} s")
    return out


def replay(url: str, start_seq: int = 0, timeout: float = 10.0) -> list[list[bytes]]:
    """Ask the engine's ROUTER for every buffered batch from ``start_seq``, as a DEALER does:
    ``[b"", seq]`` out; ``[b"", topic, seq, payload]`` back until the end marker (seq -1)."""
    import zmq

    dealer: Any = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(url)
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[list[bytes]] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not dealer.poll(int(left * 1000)):
                raise TimeoutError(f"replay from {start_seq}: no end marker in {timeout} s (got {len(out)})")
            frames = dealer.recv_multipart()
            if frames[1:3] == [b"", END_SEQ]:
                return out
            out.append(frames[1:])
    finally:
        dealer.close()


def check() -> int:
    """``python -m tests.bridge.engines --check``: the engines' code imports (``make engines``)."""
    import vllm
    import vllm.distributed.kv_events
    import vllm.v1.core.kv_cache_manager

    from tests.bridge.sglang_engine import load_sglang, sglang_version

    load_sglang()
    print(f"engines: vllm {vllm.__version__}, sglang {sglang_version()} (kv_events by path)")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--check"]:
        sys.exit("usage: python -m tests.bridge.engines --check")
    sys.exit(check())
