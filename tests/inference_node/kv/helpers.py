"""Small builders for KV core tests (block size 4 keeps token lists readable)."""

from __future__ import annotations

from eventbus.hashing import block_hash
from eventbus.protocol import Event
from inference_node.kv.clock import ManualClock
from inference_node.kv.manager import KvCacheConfig, KVCacheManager
from inference_node.kv.prompt import Prompt
from inference_node.kv.retention import KvCacheRetentionConfig, TokenRange

BS = 4


def toks(*starts: int, n: int = BS) -> list[int]:
    """Tokens made of blocks starting at each of ``starts`` (e.g. toks(0, 100) = 0..3, 100..103)."""
    out: list[int] = []
    for s in starts:
        out.extend(range(s, s + n))
    return out


def prompt(tokens: list[int], **kw) -> Prompt:
    return Prompt.from_tokens(tokens, BS, **kw)


def hashes(p: Prompt) -> list[int]:
    return [block_hash(d) for d in p.digests]


def cache(gpu: int, host: int = 0, clock: ManualClock | None = None, **kw) -> tuple[KVCacheManager, ManualClock]:
    clock = clock or ManualClock()
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=gpu, num_host_blocks=host, block_size=BS, window_size=64, **kw),
                         clock=clock)
    mgr.drain_events()  # created + empty snapshot
    return mgr, clock


def prio(p: int, dur: float | None = None, start: int = 0, end: int | None = None) -> KvCacheRetentionConfig:
    return KvCacheRetentionConfig(token_ranges=(TokenRange(start, end, p, dur),))


def kinds(events: list[Event]) -> list[str]:
    return [type(e.data).__name__.lower() for e in events]
