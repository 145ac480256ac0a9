"""The KV cache core: pure Python, synchronous, deterministic; no torch and no I/O."""
