"""vLLM 0.33.0's real KV cache and KV event publisher, driven step by step: the bridge's test engine.

Run as a subprocess (``tests/bridge/engines.py``'s ``VllmEngine`` starts it)::

    python tests/bridge/vllm_engine.py --endpoint tcp://*:PORT --replay tcp://*:PORT2 \\
        [--block-size 16] [--num-blocks 64] [--hash-algo sha256] [--int-hashes 1]

It builds what vLLM's engine core builds for a model with one full-attention layer and no GPU:
the v1 ``KVCacheManager`` (prefix caching on, KV events on, ``--num-blocks`` GPU blocks, of
which block 0 is vLLM's null block) and the publisher that ``EventPublisherFactory.create``
makes from a ``KVEventsConfig`` (``ZmqEventPublisher``: PUB on ``--endpoint``, ROUTER replay on
``--replay``). Commands are JSON lines on stdin, each answered by one JSON line on stdout (the
protocol is in ``engines.py``); the model's forward pass is the only part that is not vLLM's.
Each scheduler step ends as ``Scheduler.update_from_output`` ends it: the manager's events, if
any, published as one ``KVEventBatch(ts=time.time(), events=...)``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bridge.engines import bind_with_retry, serve


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", required=True, help="PUB endpoint (tcp://*:P binds; tcp://HOST:P connects)")
    p.add_argument("--replay", default=None, help="ROUTER replay endpoint (always binds)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=64, help="GPU blocks, vLLM's null block included")
    p.add_argument("--hash-algo", default="sha256", choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
    p.add_argument("--int-hashes", type=int, default=1, choices=[0, 1],
                   help="VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: 1 = uint64 on the wire, 0 = the digest's bytes")
    p.add_argument("--buffer-steps", type=int, default=10_000, help="batches kept for replay")
    p.add_argument("--topic", default="")
    p.add_argument("--max-model-len", type=int, default=8192)
    return p.parse_args(argv)


class VllmHarness:
    """One vLLM engine's KV side: ``op_*`` methods are the commands."""

    def __init__(self, args: argparse.Namespace) -> None:
        # vLLM reads its environment on first use of each variable (vllm.envs): before anything runs.
        os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = str(args.int_hashes)
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        self.args = args
        self.bs = args.block_size
        hash_fn = get_hash_fn_by_name(args.hash_algo)
        init_none_hash(hash_fn)  # as EngineCore.__init__ does
        self.block_hasher = get_request_block_hasher(self.bs, hash_fn)
        self._start()

    # ------------------------------------------------------------------ construction

    def _start(self) -> None:
        """A fresh engine: an empty KV cache and a publisher whose seq starts at 0."""
        import torch
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        spec = FullAttentionSpec(block_size=self.bs, num_kv_heads=1, head_size=64, dtype=torch.float16)
        config = KVCacheConfig(num_blocks=self.args.num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
        self.mgr = KVCacheManager(config, max_model_len=self.args.max_model_len, scheduler_block_size=self.bs,
                                  hash_block_size=self.bs, enable_caching=True, enable_kv_cache_events=True)
        self.publisher = bind_with_retry(self._make_publisher)
        self.seq = 0  # the seq the publisher gives its next batch
        # Every block hash any request had: hash bytes -> what the block is (for ``state``).
        self.known: dict[bytes, dict[str, Any]] = {}
        self.live: dict[str, Any] = {}  # requests run with "free": false, still holding blocks

    def _make_publisher(self) -> Any:
        from vllm.config.kv_events import KVEventsConfig
        from vllm.distributed.kv_events import EventPublisherFactory

        return EventPublisherFactory.create(KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=self.args.endpoint,
            replay_endpoint=self.args.replay, buffer_steps=self.args.buffer_steps, topic=self.args.topic))

    def describe(self) -> dict[str, Any]:
        import vllm

        return {"engine": "vllm", "version": vllm.__version__, "block_size": self.bs,
                "num_gpu_blocks": self.args.num_blocks, "hash_algo": self.args.hash_algo,
                "int_hashes": bool(self.args.int_hashes), "pid": os.getpid()}

    # ------------------------------------------------------------------ steps

    def _end_step(self, seqs: list[int]) -> None:
        """The end of a scheduler step: the step's events as one batch, if there are any."""
        from vllm.distributed.kv_events import KVEventBatch

        events = self.mgr.take_events()
        if events:
            self._publish(KVEventBatch(ts=time.time(), events=events))  # type: ignore[arg-type]
            seqs.append(self.seq - 1)

    def _publish(self, batch: Any) -> None:
        self.publisher.publish(batch)
        self.seq += 1
        # NOTE: wait until the publisher thread has sent it, so the answer means "on the socket".
        self.publisher._event_queue.join()

    def _wire_hash(self, h: bytes) -> int | str:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        v = maybe_convert_block_hash(h)  # type: ignore[arg-type]  # what the events carry
        return v if isinstance(v, int) else bytes(v).hex()

    def _remember(self, req: Any, lora: dict[str, Any] | None, cache_salt: str | None) -> None:
        tokens = list(req.all_token_ids)
        for i, h in enumerate(req.block_hashes):
            self.known[bytes(h)] = {"prefix_tokens": tokens[: (i + 1) * self.bs],
                                    "lora_id": lora["id"] if lora else None,
                                    "lora_name": lora["name"] if lora else None, "cache_salt": cache_salt}

    def _new_request(self, cmd: dict[str, Any]) -> Any:
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        lora = cmd.get("lora")
        lora_request = (LoRARequest(lora_name=lora["name"], lora_int_id=int(lora["id"]),
                                    lora_path=lora.get("path", f"/adapters/{lora['name']}")) if lora else None)
        extra = {"kv_cache_report_mode": cmd["report_mode"]} if cmd.get("report_mode") else None
        params = SamplingParams(max_tokens=max(1, int(cmd.get("decode", 0))), extra_args=extra)
        return Request(str(cmd["id"]), [int(t) for t in cmd["tokens"]], params, None, lora_request=lora_request,
                       cache_salt=cmd.get("cache_salt"), session_id=cmd.get("session_id"),
                       block_hasher=self.block_hasher)

    # ------------------------------------------------------------------ commands

    def op_request(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """One request through vLLM's scheduler path: a prefill step, then a step per decode token."""
        from vllm.v1.request import RequestStatus

        rid = str(cmd["id"])
        if rid in self.live:
            return {"ok": False, "error": f"request {rid!r} is still live (free it first)"}
        n_decode = int(cmd.get("decode", 0))
        outputs = [int(t) for t in cmd.get("decode_tokens") or []]
        rng = random.Random(f"vllm-decode:{rid}")
        outputs += [rng.randrange(1, 32_000) for _ in range(n_decode - len(outputs))]
        free = bool(cmd.get("free", True))
        req = self._new_request(cmd)
        seqs: list[int] = []
        # Step 1, prefill: the cache lookup (get_computed_blocks) and the prompt's slots.
        self.mgr.new_step_starts()
        computed, n_hit, _ = self.mgr.get_computed_blocks(req)
        if self.mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, computed) is None:
            self._end_step(seqs)
            return {"ok": False, "error": "out of KV blocks (vLLM would keep it waiting)", "seqs": seqs,
                    "published": seqs[-1] if seqs else None}
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = req.num_tokens
        for step in range(max(1, n_decode)):
            if step > 0:  # a decode step: the last sampled token's slot (caches a block it fills)
                self.mgr.new_step_starts()
                if self.mgr.allocate_slots(req, 1) is None:
                    self._remember(req, cmd.get("lora"), cmd.get("cache_salt"))
                    self.mgr.free(req)  # preempted: vLLM frees its blocks
                    self._end_step(seqs)
                    return {"ok": False, "error": f"out of KV blocks at decode step {step} (preempted)",
                            "seqs": seqs, "published": seqs[-1] if seqs else None}
                req.num_computed_tokens += 1
            if n_decode:
                req.append_output_token_ids(outputs[step])  # the model's sampled token
            if step == max(1, n_decode) - 1:
                self._remember(req, cmd.get("lora"), cmd.get("cache_salt"))
                if free:
                    self.mgr.free(req)  # finished: vLLM frees it in the same step
                else:
                    self.live[rid] = req
            self._end_step(seqs)
        return {"ok": True, "num_computed_tokens": n_hit, "num_tokens": req.num_tokens,
                "output_tokens": outputs[:n_decode], "block_hashes": [self._wire_hash(h) for h in req.block_hashes],
                "seqs": seqs, "published": seqs[-1] if seqs else None}

    def op_free(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Finish a request that ran with "free": false (its blocks become eviction candidates)."""
        req = self.live.pop(str(cmd["id"]), None)
        if req is None:
            return {"ok": False, "error": f"no live request {cmd['id']!r}"}
        self.mgr.free(req)
        seqs: list[int] = []
        self._end_step(seqs)
        return {"ok": True, "seqs": seqs, "published": seqs[-1] if seqs else None}

    def op_reset(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``Scheduler.reset_prefix_cache()``, as POST /reset_prefix_cache: refused while requests
        hold blocks, unless ``"running": true`` (``reset_running_requests``: they are preempted;
        here, dropped). vLLM publishes nothing then: its AllBlocksCleared goes out with the next
        step's batch (the engine core steps only when it has requests). ``"publish_now": true``
        publishes it at once, as a step that had nothing else to report would."""
        if cmd.get("running"):
            for req in self.live.values():
                self.mgr.free(req)
            self.live.clear()
        done = self.mgr.reset_prefix_cache()
        seqs: list[int] = []
        if cmd.get("publish_now"):
            self._end_step(seqs)
        reply: dict[str, Any] = {"ok": done, "seqs": seqs, "published": seqs[-1] if seqs else None,
                                 "pending": bool(self.mgr.block_pool.kv_event_queue)}
        if not done:
            reply["error"] = f"vLLM refused: requests {sorted(self.live)} still hold blocks"
        return reply

    def op_state(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The ground truth: every hash in the block pool's prefix cache map, with its token prefix."""
        from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_block_hash

        pool = self.mgr.block_pool
        blocks = []
        for key, held in pool.cached_block_hash_to_block._cache.items():
            h = bytes(get_block_hash(key))
            if h not in self.known:
                raise RuntimeError(f"cached hash {h.hex()} is no request's block (harness bookkeeping bug)")
            copies = 1 if isinstance(held, KVCacheBlock) else len(held)
            blocks.append({"engine_hash": self._wire_hash(h), **self.known[h], "copies": copies})
        return {"ok": True, "blocks": blocks, "block_size": self.bs, "num_gpu_blocks": self.args.num_blocks,
                "free_blocks": pool.get_num_free_blocks(), "live": sorted(self.live), "next_seq": self.seq}

    def op_restart(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """An engine restart: the publisher shut down, then a new cache and publisher (seq from 0)."""
        self.publisher.shutdown()
        self._start()
        return {"ok": True}

    def op_garbage(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Junk on the stream. ``kind``: "frames" (two frames on the PUB socket, no seq used),
        "payload" (a batch of bytes that are not msgpack) or "batch" (valid msgpack, not a
        KVEventBatch); the last two go through the publisher: they take a seq and are replayed."""
        import msgspec

        kind = cmd.get("kind", "frames")
        if kind == "frames":
            self.publisher._event_queue.join()  # the publisher thread is idle: the socket is ours
            self.publisher._pub.send_multipart([self.args.topic.encode(), b"kvflow-garbage"])
            return {"ok": True, "published": None}

        class NotMsgpack(msgspec.Struct, array_like=True):
            raw: msgspec.Raw = msgspec.Raw(b"\xc1\xc1")  # 0xc1: a byte msgpack never uses
            data_parallel_rank: int | None = None

        class NotABatch(msgspec.Struct, array_like=True):
            ts: str = "not-a-timestamp"
            events: int = 42
            data_parallel_rank: int | None = None

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
    sys.exit(serve(lambda: VllmHarness(parse_args())))
