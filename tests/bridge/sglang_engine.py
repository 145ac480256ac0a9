"""SGLang 0.5.23's real KV event code over a paged radix cache of our own: the bridge's SGLang engine.

Run as a subprocess (``tests/bridge/engines.py``'s ``SglangEngine`` starts it)::

    python tests/bridge/sglang_engine.py --endpoint tcp://*:PORT --replay tcp://*:PORT2 \\
        [--block-size 16] [--num-blocks 64]

SGLang's own code, loaded by file path from the installed wheel (``import sglang`` needs the
whole serving stack): ``srt/disaggregation/kv_events.py`` (the event structs, ``KVEventBatch``,
``EventPublisherFactory`` → ``ZmqEventPublisher``), ``srt/mem_cache/events.py`` (the
``KVCacheEventRecorder`` that RadixCache calls: per-page ``BlockStored`` coalesced into chains,
``BlockRemoved`` per node, LoRA namespacing) and ``srt/utils/network.py``; the hash helpers of
``srt/mem_cache/utils.py`` (``compute_node_hash_values``, ``hash_str_to_int64``, ...) are taken
from that file's source. Ours: the tree (one node per page, LRU eviction of unlocked leaves, as
``RadixCache.evict`` does by node), the pool of ``--num-blocks`` pages, the step loop, and a
Python port of SGLang's C++ page hash (``mem_cache/cpp_utils/hash_binding.cpp``: SHA-256 over
the previous page's digest and the page's token ids as u32 little-endian).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import itertools
import json
import os
import random
import sys
import time
import types
import uuid
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bridge.engines import bind_with_retry, serve

# The functions of sglang/srt/mem_cache/utils.py that the event recorder calls, used as they are.
_UTILS_FUNCTIONS = ("get_hash_str", "storage_namespace_seed", "get_storage_hash_str", "hash_str_to_int64",
                    "compute_node_hash_values", "compute_node_event_hash_values")


def get_native_hash(token_ids: Any, prior_digest: bytes | None, page_size: int | None = None) -> str | list[str]:
    """``sglang.srt.mem_cache.cpp_utils.native_hash.get_native_hash`` (hash_binding.cpp) in Python:
    each page is SHA-256(previous digest, if any; the page's token ids as u32 LE), chained; a page
    with a token id above u32 is hashed as u64 LE behind a 0xff byte. Hex digests."""
    if getattr(token_ids, "is_bigram", False):
        raise NotImplementedError("bigram keys")
    tokens = list(getattr(token_ids, "token_ids", token_ids))[: len(token_ids)]
    prior = prior_digest

    def page(chunk: list[int]) -> str:
        nonlocal prior
        h = hashlib.sha256(prior or b"")
        if any(t > 0xFFFFFFFF for t in chunk):
            h.update(b"\xff" + array("Q", chunk).tobytes())
        else:
            h.update(array("I", chunk).tobytes())
        prior = h.digest()
        return h.hexdigest()

    if page_size is None:
        return page(tokens)
    return [page(tokens[i : i + page_size]) for i in range(0, len(tokens), page_size)]


def _package(name: str, path: Path | None = None) -> types.ModuleType:
    mod = sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)] if path else []
        sys.modules[name] = mod
    return mod


def _load_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_sglang() -> tuple[types.ModuleType, types.ModuleType]:
    """SGLang's ``kv_events`` and ``mem_cache.events`` modules, from the installed wheel's files."""
    if "sglang.srt.mem_cache.events" in sys.modules:
        return sys.modules["sglang.srt.disaggregation.kv_events"], sys.modules["sglang.srt.mem_cache.events"]
    spec = importlib.util.find_spec("sglang")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("sglang is not installed (make engines)")
    srt = Path(next(iter(spec.submodule_search_locations))) / "srt"
    for name in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation", "sglang.srt.mem_cache"):
        _package(name)
    runtime_context = types.ModuleType("sglang.srt.runtime_context")

    def get_parallel() -> Any:
        raise RuntimeError("no SGLang runtime here (is_kv_publisher_rank is not used)")

    runtime_context.get_parallel = get_parallel  # type: ignore[attr-defined]
    sys.modules["sglang.srt.runtime_context"] = runtime_context
    _load_file("sglang.srt.utils.network", srt / "utils" / "network.py")
    kv_events = _load_file("sglang.srt.disaggregation.kv_events", srt / "disaggregation" / "kv_events.py")
    utils = types.ModuleType("sglang.srt.mem_cache.utils")
    utils.__dict__.update({"hashlib": hashlib, "Any": Any, "List": list, "Optional": Any,
                           "get_native_hash": get_native_hash})
    tree = ast.parse((srt / "mem_cache" / "utils.py").read_text())
    funcs: list[ast.stmt] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in _UTILS_FUNCTIONS]
    missing = set(_UTILS_FUNCTIONS) - {f.name for f in funcs if isinstance(f, ast.FunctionDef)}
    if missing:
        raise ImportError(f"sglang/srt/mem_cache/utils.py has no {sorted(missing)}")
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(srt / "mem_cache" / "utils.py"), "exec"), utils.__dict__)
    sys.modules["sglang.srt.mem_cache.utils"] = utils
    events = _load_file("sglang.srt.mem_cache.events", srt / "mem_cache" / "events.py")
    return kv_events, events


def sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", required=True, help="PUB endpoint (tcp://*:P binds; tcp://HOST:P connects)")
    p.add_argument("--replay", default=None, help="ROUTER replay endpoint (always binds)")
    p.add_argument("--block-size", type=int, default=16, help="--page-size")
    p.add_argument("--num-blocks", type=int, default=64, help="pages in the KV pool")
    p.add_argument("--buffer-steps", type=int, default=10_000)
    p.add_argument("--topic", default="")
    return p.parse_args(argv)


class PageKey:
    """A ``RadixKey`` of one page: what the recorder and the hash helpers read."""

    is_bigram = False

    def __init__(self, tokens: list[int], extra_key: str | None, cache_salt: str | None) -> None:
        self.token_ids = tokens
        self.extra_key = extra_key
        self.cache_salt = cache_salt

    def __len__(self) -> int:
        return len(self.token_ids)


class Node:
    """A radix tree node of one page (SGLang's TreeNode has the same fields the recorder reads)."""

    def __init__(self, parent: Node | None, key: PageKey, prefix: list[int], lora: dict[str, Any] | None) -> None:
        self.parent = parent
        self.key = key
        self.children: dict[tuple[Any, ...], Node] = {}
        self.hash_value: list[str] | None = [] if parent is None else None
        self.event_hash_value: list[str] | None = None
        self.lock_ref = 0
        self.last_access = 0
        self.prefix = prefix
        self.lora = lora


class Req:
    def __init__(self, rid: str, tokens: list[int], ns: tuple[str | None, str | None], lora: Any) -> None:
        self.rid, self.tokens, self.ns, self.lora = rid, tokens, ns, lora
        self.path: list[Node] = []  # the tree nodes it holds (locked)
        self.private = 0  # pages it holds outside the tree


class SglangHarness:
    """One SGLang scheduler's KV side: ``op_*`` methods are the commands."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.page = args.block_size
        self.kv_events, self.events_mod = load_sglang()
        self.clock = itertools.count(1)
        self._start()

    def _start(self) -> None:
        self.recorder = self.events_mod.KVCacheEventRecorder(enabled=True, page_size=self.page)
        self.root = Node(None, PageKey([], None, None), [], None)
        self.nodes: set[Node] = set()
        self.live: dict[str, Req] = {}
        self.publisher = bind_with_retry(lambda: self.kv_events.EventPublisherFactory.create(json.dumps({
            "publisher": "zmq", "endpoint": self.args.endpoint, "replay_endpoint": self.args.replay,
            "buffer_steps": self.args.buffer_steps, "topic": self.args.topic})))
        self.seq = 0

    def describe(self) -> dict[str, Any]:
        return {"engine": "sglang", "version": sglang_version(), "block_size": self.page,
                "num_gpu_blocks": self.args.num_blocks, "pid": os.getpid()}

    # ------------------------------------------------------------------ the pool and the tree

    def _free_pages(self) -> int:
        return int(self.args.num_blocks) - len(self.nodes) - sum(r.private for r in self.live.values())

    def _alloc(self, req: Req, n: int) -> bool:
        """``n`` pages for ``req``, evicting unlocked leaves (least recently used first) as needed."""
        while self._free_pages() < n:
            leaves = [x for x in self.nodes if not x.children and x.lock_ref == 0]
            if not leaves:
                return False
            victim = min(leaves, key=lambda x: x.last_access)
            assert victim.parent is not None
            del victim.parent.children[self._child_key(victim.key)]
            self.nodes.discard(victim)
            self.recorder.record_remove(victim)
        req.private += n
        return True

    @staticmethod
    def _child_key(key: PageKey) -> tuple[Any, ...]:
        return (key.extra_key, key.cache_salt, *key.token_ids)

    def _pages(self, req: Req, length: int) -> list[PageKey]:
        n = length // self.page * self.page
        return [PageKey(req.tokens[i : i + self.page], *req.ns) for i in range(0, n, self.page)]

    def _match(self, req: Req) -> list[Node]:
        """The cached prefix, in whole pages of at most len - 1 tokens (``_compute_max_prefix_len``)."""
        node, path = self.root, []
        for key in self._pages(req, len(req.tokens) - 1):
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def _lock(self, req: Req, nodes: list[Node]) -> None:
        now = next(self.clock)
        for x in nodes:
            x.lock_ref += 1
            x.last_access = now
        req.path.extend(nodes)

    def _insert(self, req: Req, length: int) -> None:
        """``cache_(un)finished_req``: the request's full pages into the tree; new nodes recorded
        (``record_store``), pages another request cached meanwhile given back to the pool."""
        node = self.root
        for i, key in enumerate(self._pages(req, length)):
            child = node.children.get(self._child_key(key))
            if child is None:
                child = Node(node, key, req.tokens[: (i + 1) * self.page], req.lora)
                node.children[self._child_key(key)] = child
                self.nodes.add(child)
                self.recorder.record_store(child)
            if i >= len(req.path):
                self._lock(req, [child])
                req.private -= 1
            node = child

    def _release(self, req: Req) -> None:
        for x in req.path:
            x.lock_ref -= 1
        req.path, req.private = [], 0
        self.live.pop(req.rid, None)

    # ------------------------------------------------------------------ steps

    def _end_step(self, seqs: list[int]) -> None:
        """``publish_kv_events``: the step's events as one ``KVEventBatch``, if there are any."""
        events = self.recorder.take()
        if events:
            self._publish(self.kv_events.KVEventBatch(ts=time.time(), events=events))
            seqs.append(self.seq - 1)

    def _publish(self, batch: Any) -> None:
        self.publisher.publish(batch)
        self.seq += 1
        self.publisher._event_queue.join()  # sent when we answer

    def _event_hash(self, node: Node) -> int:
        values = self.recorder._node_event_hash_values(node)
        return int(self.kv_events.namespaced_block_hash(
            self.events_mod.hash_str_to_int64(values[0]), namespace_seed=self.recorder._namespace_seed(node)))

    def _new_req(self, cmd: dict[str, Any]) -> Req:
        lora = cmd.get("lora")
        extra_key = None
        if lora:
            # Req appends its LoRARef's lora_id (a uuid hex) to extra_key; the scheduler registers the name.
            lora_uuid = uuid.uuid5(uuid.NAMESPACE_URL, f"sglang-lora:{lora['name']}").hex
            extra_key = lora_uuid
            self.recorder.lora_names.register(types.SimpleNamespace(lora_id=lora_uuid, extra_key=extra_key),
                                              lora_name=lora["name"])
        return Req(str(cmd["id"]), [int(t) for t in cmd["tokens"]], (extra_key, cmd.get("cache_salt")), lora)

    # ------------------------------------------------------------------ commands

    def op_request(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """One request through SGLang's scheduler path: prefill (match, allocate, evict,
        ``cache_unfinished_req``), a step per decode token, ``cache_finished_req`` at the end."""
        rid = str(cmd["id"])
        if rid in self.live:
            return {"ok": False, "error": f"request {rid!r} is still live (free it first)"}
        n_decode = int(cmd.get("decode", 0))
        outputs = [int(t) for t in cmd.get("decode_tokens") or []]
        rng = random.Random(f"sglang-decode:{rid}")
        outputs += [rng.randrange(1, 32_000) for _ in range(n_decode - len(outputs))]
        req = self._new_req(cmd)
        self.live[rid] = req
        self._lock(req, self._match(req))
        n_hit = len(req.path) * self.page
        kv_len = len(req.tokens)
        seqs: list[int] = []
        steps = max(1, n_decode)
        for step in range(steps):
            if step > 0:
                kv_len += 1  # the KV of the token sampled last step
            need = -(-kv_len // self.page) - len(req.path) - req.private
            if need > 0 and not self._alloc(req, need):
                self._release(req)  # retracted (decode) or never admitted (prefill)
                self._end_step(seqs)
                return {"ok": False, "error": f"out of KV pages at step {step}", "seqs": seqs,
                        "published": seqs[-1] if seqs else None}
            if step == 0:
                self._insert(req, kv_len)  # cache_unfinished_req after the prefill
            if n_decode:
                req.tokens.append(outputs[step])
            if step == steps - 1:
                self._insert(req, kv_len)  # cache_finished_req: the tokens that have KV
                if cmd.get("free", True):
                    self._release(req)
            self._end_step(seqs)
        return {"ok": True, "num_computed_tokens": n_hit, "num_tokens": len(req.tokens),
                "output_tokens": outputs[:n_decode], "seqs": seqs, "published": seqs[-1] if seqs else None}

    def op_free(self, cmd: dict[str, Any]) -> dict[str, Any]:
        req = self.live.get(str(cmd["id"]))
        if req is None:
            return {"ok": False, "error": f"no live request {cmd['id']!r}"}
        self._release(req)
        seqs: list[int] = []
        self._end_step(seqs)
        return {"ok": True, "seqs": seqs, "published": seqs[-1] if seqs else None}

    def op_reset(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``flush_cache``: refused while requests run; else the tree reset, its ``AllBlocksCleared``
        published at once (the scheduler's idle loop publishes)."""
        seqs: list[int] = []
        if self.live:
            return {"ok": False, "error": f"SGLang refuses to flush: requests {sorted(self.live)} are running",
                    "seqs": seqs, "published": None}
        self.root = Node(None, PageKey([], None, None), [], None)
        self.nodes = set()
        self.recorder.record_all_cleared()
        self._end_step(seqs)
        return {"ok": True, "seqs": seqs, "published": seqs[-1] if seqs else None}

    def op_state(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The ground truth: every page in the tree, with the hash its events carry."""
        blocks = [{"engine_hash": self._event_hash(x), "prefix_tokens": x.prefix,
                   "lora_id": x.lora["id"] if x.lora else None, "lora_name": x.lora["name"] if x.lora else None,
                   "cache_salt": x.key.cache_salt, "copies": 1} for x in self.nodes]
        return {"ok": True, "blocks": blocks, "block_size": self.page, "num_gpu_blocks": self.args.num_blocks,
                "free_blocks": self._free_pages(), "live": sorted(self.live), "next_seq": self.seq}

    def op_restart(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.publisher.shutdown()
        self._start()
        return {"ok": True}

    def op_garbage(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """As ``vllm_engine.py``'s: "frames", "payload" (not msgpack) or "batch" (not a batch)."""
        import msgspec

        kind = cmd.get("kind", "frames")
        if kind == "frames":
            self.publisher._event_queue.join()
            self.publisher._pub.send_multipart([self.args.topic.encode(), b"kvflow-garbage"])
            return {"ok": True, "published": None}

        class NotMsgpack(msgspec.Struct, array_like=True):
            raw: msgspec.Raw = msgspec.Raw(b"\xc1\xc1")
            attn_dp_rank: int | None = None

        class NotABatch(msgspec.Struct, array_like=True):
            ts: str = "not-a-timestamp"
            events: int = 42
            attn_dp_rank: int | None = None

        if kind not in ("payload", "batch"):
            return {"ok": False, "error": f"unknown garbage kind {kind!r}"}
        self._publish(NotMsgpack() if kind == "payload" else NotABatch())
        return {"ok": True, "published": self.seq - 1}

    def op_quit(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.close()
        return {"ok": True}

    def close(self) -> None:
        if getattr(self, "publisher", None) is not None:
            self.publisher.shutdown()
            self.publisher = None


if __name__ == "__main__":
    sys.exit(serve(lambda: SglangHarness(parse_args())))
