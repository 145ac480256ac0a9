"""``kvflow bench model``: what a cached prefix saves in prefill, and raw token rates (the model
path without HTTP; ``kvflow bench node`` measures the node as a server, beside vLLM).

The node's own path (the KV core allocates, the model computes only the uncached suffix over the
paged pool), without HTTP. In one run, interleaved:

* cold: a prompt of ``prompt_tokens`` tokens prefilled from nothing;
* cached: the same prompt with its first 90 % (whole blocks) already in the cache.

``ratios.prefill_speedup_cached_90pct`` = cold / cached prefill time (goal on the CPU: ≥ 5).
Also ``figures.prefill_tokens_per_s`` (cold) and ``figures.decode_tokens_per_s`` (a batch of
sequences decoding together). On a GPU when one is present (``--device auto``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from inference_node.kv.manager import KvCacheConfig, KVCacheManager
from inference_node.kv.prompt import Prompt
from inference_node.model.llama import KVPool, LlamaModel, SeqBatchItem
from inference_node.node import PRESETS, pick_device
from kvflow.bench.harness import BenchResult, interleaved


def bench_node(*, preset: str = "small", prompt_tokens: int = 2048, block_size: int = 32, decode_batch: int = 8,
               decode_steps: int = 32, repeats: int = 5, device: str = "auto",
               say: Callable[[str], None] = lambda _m: None) -> BenchResult:
    res = BenchResult("model")
    dev = pick_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = PRESETS[preset]
    model = LlamaModel.random(cfg, seed=0).to(device=dev, dtype=dtype)
    n_blocks = -(-prompt_tokens // block_size) * (decode_batch + 2) + decode_batch * (decode_steps // block_size + 2)
    pool = KVPool(cfg, n_blocks, block_size, dev, dtype)
    tokens = [(i * 31 + 7) % 250 for i in range(prompt_tokens)]
    cached_len = (int(prompt_tokens * 0.9) // block_size) * block_size
    say(f"{cfg.name} on {dev}: prompt {prompt_tokens} tokens, {cached_len} of them cached in the warm case")

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def fresh_core() -> KVCacheManager:
        return KVCacheManager(KvCacheConfig(num_gpu_blocks=n_blocks, block_size=block_size))

    def cold() -> float:
        core = fresh_core()
        a = core.allocate("r", Prompt.from_tokens(tokens, block_size))
        sync()
        t0 = time.perf_counter()
        model([SeqBatchItem(tokens, 0, a.block_table)], pool)
        sync()
        return time.perf_counter() - t0

    def cached() -> float:
        core = fresh_core()
        prefix = tokens[:cached_len]
        a = core.allocate("p", Prompt.from_tokens(prefix, block_size))
        model([SeqBatchItem(prefix, 0, a.block_table)], pool)  # the earlier request that cached it
        core.free("p")
        sync()
        t0 = time.perf_counter()
        b = core.allocate("r", Prompt.from_tokens(tokens, block_size))
        start = min(b.num_cached_tokens, prompt_tokens - 1)
        model([SeqBatchItem(tokens[start:], start, b.block_table)], pool)
        sync()
        assert b.num_cached_tokens == cached_len
        return time.perf_counter() - t0

    say(f"prefill, {repeats} interleaved rounds …")
    runs = interleaved({"cold": cold, "cached": cached}, warmup=1, repeats=repeats)

    def decode() -> float:
        core = fresh_core()
        seqs = []
        for i in range(decode_batch):
            prompt = [(t + i) % 250 for t in tokens[:256]]
            a = core.allocate(f"d{i}", Prompt.from_tokens(prompt, block_size))
            model([SeqBatchItem(prompt, 0, a.block_table)], pool)
            seqs.append((f"d{i}", 1))
        sync()
        t0 = time.perf_counter()
        for _ in range(decode_steps):
            batch = []
            for rid, tok in seqs:
                pos = core.num_tokens(rid)
                core.append_token(rid, tok)
                batch.append(SeqBatchItem([tok], pos, core.block_table(rid)))
            logits = model(batch, pool)
            seqs = [(rid, int(torch.argmax(lg).item())) for (rid, _), lg in zip(seqs, logits, strict=True)]
        sync()
        return time.perf_counter() - t0

    say(f"decode: {decode_batch} sequences x {decode_steps} steps …")
    dec = interleaved({"decode": decode}, warmup=1, repeats=max(2, repeats // 2))["decode"]

    res.figures["prefill_tokens_per_s"] = prompt_tokens / runs["cold"].median
    res.figures["prefill_cached_90pct_ms"] = runs["cached"].median * 1000
    res.figures["decode_tokens_per_s"] = decode_batch * decode_steps / dec.median
    res.baseline["prefill_cold_ms"] = runs["cold"].median * 1000
    res.ratios["prefill_speedup_cached_90pct"] = runs["cold"].median / runs["cached"].median
    res.goals["prefill_speedup_cached_90pct"] = ">= 5 (CPU)"
    res.details.update({"model": cfg.name, "parameters": sum(p.numel() for p in model.parameters()),
                        "device": str(dev), "dtype": str(dtype), "prompt_tokens": prompt_tokens,
                        "cached_tokens": cached_len, "cold_seconds": runs["cold"].as_dict(),
                        "cached_seconds": runs["cached"].as_dict(), "decode_seconds": dec.as_dict()})
    return res
