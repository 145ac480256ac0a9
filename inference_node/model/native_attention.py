"""Decode attention over the paged pool in compiled code (``kvflow_native``, Rust in
``native/src/attention.rs``), when it is installed and the tensors are float32 on the CPU.

It computes what :class:`~inference_node.model.llama.Attention` computes with torch for the
decode tokens (their blocks gathered, one ``scaled_dot_product_attention``), reading each key and
value where it lies in the pool instead of copying them first: on SmolLM2 with 16 sequences of
~1,000 tokens, the attention of a decode step goes from a gather and an SDPA per layer to one pass
over the keys and values. ``tests/inference_node/test_native_attention.py`` compares the two.
``KVFLOW_NODE_NATIVE_ATTENTION=0`` turns it off (the torch path then runs everywhere).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    from kvflow_native import paged_decode_attention as _kernel
except ImportError:  # an older build, or none: torch computes it
    _kernel = None

ENABLED = os.environ.get("KVFLOW_NODE_NATIVE_ATTENTION", "1").lower() not in ("0", "false", "off", "no")


def usable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the compiled kernel computes this forward's decode attention."""
    return ENABLED and _kernel is not None and dtype == torch.float32 and device.type == "cpu"


def decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, lengths: Tensor) -> Tensor:
    """``[D, heads, head_dim]``: each decode sequence's query heads over its first ``lengths[i]``
    keys, in the blocks ``tables[i]`` of one layer's pool (``[blocks, block_size, kv_heads,
    head_dim]``), scaled by ``1 / sqrt(head_dim)``."""
    assert _kernel is not None
    n, h, d = q.shape
    blocks, bs, kvh, d2 = k_pool.shape
    if (d2 != d or v_pool.shape != k_pool.shape or tables.dim() != 2 or tables.shape[0] != n
            or lengths.shape != (n,)):
        raise ValueError("decode_attention: shapes do not agree")
    for t, dtype in ((q, torch.float32), (k_pool, torch.float32), (v_pool, torch.float32), (tables, torch.int64),
                     (lengths, torch.int64)):
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"decode_attention: a {t.dtype} tensor on {t.device} (contiguous: {t.is_contiguous()})")
    out = torch.empty_like(q)
    _kernel(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), out.data_ptr(), tables.data_ptr(), lengths.data_ptr(),
            n, h, kvh, d, bs, tables.shape[1], blocks, d ** -0.5, torch.get_num_threads())
    return out
