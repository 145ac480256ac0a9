"""The node's compiled kernels (``kvflow_native``, Rust in ``native/src``), used when the package
is installed and the tensors are float32 on the CPU; torch computes the same everywhere else.

**Decode attention** over the paged pool (``attention.rs``) computes what
:class:`~inference_node.model.llama.Attention` computes with torch for the decode tokens (their
blocks gathered, one ``scaled_dot_product_attention``), reading each key and value where it lies
in the pool instead of copying them first, in address order, the next block prefetched; AVX2 for
head sizes that are a multiple of 8. SmolLM2, 16 sequences of 950 tokens, one layer: 2.3 ms
(torch's gather + SDPA: ~8 ms; the kernel's first, scalar version: 3.9 ms).

**Small-batch linear** (``gemm.rs``): ``x @ w.T`` for the few rows of a decode step. For 2-16 rows
the BLAS under torch copies ("packs") the whole weight matrix on every call and took 2-3x the time
of one row on this project's 2-core AVX2 machine; the kernel reads each weight row once, as
``nn.Linear`` keeps it, against every input row (SmolLM2's layers, 4 rows: 66 -> 38 ms; 16 rows:
67 -> 59 ms; 1 row: 29 -> 24 ms). Larger products (prefill) stay with torch.

``tests/inference_node/test_native_kernels.py`` compares both with torch.
``KVFLOW_NODE_NATIVE=0`` turns both off (the torch paths then run everywhere).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    from kvflow_native import paged_decode_attention as _kernel
    from kvflow_native import small_batch_linear as _linear
except ImportError:  # an older build, or none: torch computes it
    _kernel = _linear = None

ENABLED = os.environ.get("KVFLOW_NODE_NATIVE", "1").lower() not in ("0", "false", "off", "no")
#: The most rows the linear kernel takes; from there torch's BLAS is as fast (measured: 32 rows).
LINEAR_MAX_ROWS = 16


def usable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the compiled kernels compute for tensors of this dtype on this device."""
    return ENABLED and _kernel is not None and dtype == torch.float32 and device.type == "cpu"


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``F.linear(x, weight)`` (no bias) for a 2-d ``x``; the kernel for few float32 CPU rows."""
    m = x.shape[0]
    if (m > LINEAR_MAX_ROWS or _linear is None or not ENABLED or x.dtype != torch.float32
            or weight.dtype != torch.float32 or x.device.type != "cpu" or weight.device.type != "cpu"
            or x.dim() != 2 or not weight.is_contiguous()):
        return F.linear(x, weight)
    x = x.contiguous()
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"linear: x has {x.shape[1]} features, the weight {k}")
    y = torch.empty(m, n, dtype=torch.float32)
    _linear(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, k, n, torch.get_num_threads())
    return y


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
