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

**A whole decode step's layers** (``decode.rs``): when every sequence of a forward brings one
token, all the decoder layers run in one call: the norms, q/k/v, the rotary embedding, the KV
write, attention, the output projection, SwiGLU and the residual adds, with the kernels above,
the threads started once per step and meeting at a spinning barrier between phases. In torch a
layer is ~20 dispatches, and each product started its threads anew (~0.1 ms each on the 2-core
VM: more than a 576 × 576 product by one row). SmolLM2, 950-token sequences, a step at 1 / 4 / 16
sequences: see docs/benchmarks.md ("Where the time goes").

``tests/inference_node/test_native_kernels.py`` compares them with torch.
``KVFLOW_NODE_NATIVE=0`` turns them off (the torch paths then run everywhere).
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
try:
    from kvflow_native import decode_layers as _layers
except ImportError:  # a build from before the fused step
    _layers = None

ENABLED = os.environ.get("KVFLOW_NODE_NATIVE", "1").lower() not in ("0", "false", "off", "no")
#: The most rows the linear kernel takes; from there torch's BLAS is as fast (measured: 32 rows).
LINEAR_MAX_ROWS = 16


#: The dtypes the kernels read weights and keys/values in (bf16 since the build with the fused step).
KERNEL_DTYPES = (torch.float32, torch.bfloat16) if _layers is not None else (torch.float32,)


def usable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the compiled kernels compute for weights and a KV pool of this dtype on this device
    (the activations are float32 either way: :func:`compute_dtype`)."""
    return ENABLED and _kernel is not None and dtype in KERNEL_DTYPES and device.type == "cpu"


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a model of weights in ``dtype`` computes in: float32 for bfloat16 on the CPU
    (weights and keys/values stay bf16 in memory, read as f32: the CPUs this runs on have no bf16
    arithmetic worth the name, ~12 GFLOPS against ~47 in fp32 on the 2-core VM), else ``dtype``."""
    return torch.float32 if dtype == torch.bfloat16 and device.type == "cpu" else dtype


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``F.linear(x, weight)`` (no bias) for a 2-d ``x``: the kernel for few float32 CPU rows and a
    float32 or bfloat16 weight; for a float32 ``x`` and a bfloat16 weight otherwise, torch's
    product in float32 (the weight widened for the call: exact)."""
    m = x.shape[0]
    if x.dtype == torch.float32 and weight.dtype == torch.bfloat16 and (
            m > LINEAR_MAX_ROWS or not usable(weight.dtype, weight.device)):
        return F.linear(x, weight.float())
    if (m > LINEAR_MAX_ROWS or _linear is None or not ENABLED or x.dtype != torch.float32
            or weight.dtype not in KERNEL_DTYPES or x.device.type != "cpu" or weight.device.type != "cpu"
            or x.dim() != 2 or not weight.is_contiguous()):
        return F.linear(x, weight)
    x = x.contiguous()
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"linear: x has {x.shape[1]} features, the weight {k}")
    y = torch.empty(m, n, dtype=torch.float32)
    if weight.dtype == torch.bfloat16:
        _linear(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, k, n, torch.get_num_threads(), bf16=True)
    else:
        _linear(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, k, n, torch.get_num_threads())
    return y


def decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, lengths: Tensor) -> Tensor:
    """``[D, heads, head_dim]``: each decode sequence's query heads over its first ``lengths[i]``
    keys, in the blocks ``tables[i]`` of one layer's pool (``[blocks, block_size, kv_heads,
    head_dim]``, float32 or bfloat16), scaled by ``1 / sqrt(head_dim)``; ``q`` float32."""
    assert _kernel is not None
    n, h, d = q.shape
    blocks, bs, kvh, d2 = k_pool.shape
    if (d2 != d or v_pool.shape != k_pool.shape or tables.dim() != 2 or tables.shape[0] != n
            or lengths.shape != (n,)):
        raise ValueError("decode_attention: shapes do not agree")
    pool = k_pool.dtype if k_pool.dtype in KERNEL_DTYPES else torch.float32
    for t, dtype in ((q, torch.float32), (k_pool, pool), (v_pool, pool), (tables, torch.int64),
                     (lengths, torch.int64)):
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"decode_attention: a {t.dtype} tensor on {t.device} (contiguous: {t.is_contiguous()})")
    out = torch.empty_like(q)
    args = (q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), out.data_ptr(), tables.data_ptr(), lengths.data_ptr(),
            n, h, kvh, d, bs, tables.shape[1], blocks, d ** -0.5, torch.get_num_threads())
    if pool == torch.bfloat16:
        _kernel(*args, bf16=True)
    else:
        _kernel(*args)
    return out


def fused_decode_usable(dtype: torch.dtype, device: torch.device, rows: int) -> bool:
    """Whether :func:`decode_layers` runs a decode step of ``rows`` tokens."""
    return usable(dtype, device) and _layers is not None and 0 < rows <= LINEAR_MAX_ROWS


class LayerWeights:
    """The decoder layers' weights as :func:`decode_layers` takes them, checked once: per layer the
    input norm, fused q/k/v, output projection, post-attention norm, fused gate/up and down, all
    float32 or all bfloat16, contiguous, on the CPU, of the shapes the model's configuration
    gives. Holds the tensors, so the addresses stay valid while it lives."""

    def __init__(self, weights: list[Tensor], *, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 inter: int) -> None:
        expected = [(hidden,), ((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (hidden,),
                    (2 * inter, hidden), (hidden, inter)]
        if not weights or len(weights) % 6:
            raise ValueError(f"decode_layers: {len(weights)} weights, not 6 per layer")
        for i, w in enumerate(weights):
            if tuple(w.shape) != expected[i % 6]:
                raise ValueError(f"decode_layers: weight {i} has shape {tuple(w.shape)}, not {expected[i % 6]}")
            if w.dtype != weights[0].dtype or w.dtype not in KERNEL_DTYPES or w.device.type != "cpu" \
                    or not w.is_contiguous():
                raise ValueError(f"decode_layers: weight {i} is {w.dtype} on {w.device} "
                                 f"(contiguous: {w.is_contiguous()})")
        self.tensors = weights
        self.dtype = weights[0].dtype
        self.addresses = [w.data_ptr() for w in weights]
        self.layers = len(weights) // 6
        self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter = hidden, heads, kv_heads, head_dim, inter


def decode_layers(x: Tensor, weights: LayerWeights, k_pool: Tensor, v_pool: Tensor, cos: Tensor, sin: Tensor,
                  slots: Tensor, tables: Tensor, lengths: Tensor, eps: float) -> None:
    """Every decoder layer for ``m`` decode tokens, ``x`` (``[m, hidden]``, the embeddings) updated
    in place to the last layer's output; each token's key and value written to its pool slot.

    ``k_pool``/``v_pool`` ``[layers, blocks, block_size, kv_heads, head_dim]`` in the weights'
    dtype (bfloat16: keys and values rounded as ``Tensor.to`` rounds); ``cos``/``sin``
    ``[m, head_dim]`` (each token's position); ``slots`` ``[m]`` (each token's flat slot in a
    layer's pool, checked against its table and length); ``tables`` ``[m, width]``, ``lengths``
    ``[m]`` as :func:`decode_attention`."""
    assert _layers is not None
    w = weights
    m = x.shape[0]
    if (x.dim() != 2 or x.shape[1] != w.hidden or k_pool.dim() != 5
            or (k_pool.shape[0], k_pool.shape[3], k_pool.shape[4]) != (w.layers, w.kv_heads, w.head_dim)
            or v_pool.shape != k_pool.shape or cos.shape != (m, w.head_dim)
            or sin.shape != (m, w.head_dim) or slots.shape != (m,) or tables.dim() != 2 or tables.shape[0] != m
            or lengths.shape != (m,)):
        raise ValueError("decode_layers: shapes do not agree")
    for t, dtype in ((x, torch.float32), (k_pool, w.dtype), (v_pool, w.dtype), (cos, torch.float32),
                     (sin, torch.float32), (slots, torch.int64), (tables, torch.int64), (lengths, torch.int64)):
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"decode_layers: a {t.dtype} tensor on {t.device} (contiguous: {t.is_contiguous()})")
    _layers(x.data_ptr(), w.addresses, k_pool.data_ptr(), v_pool.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            slots.data_ptr(), tables.data_ptr(), lengths.data_ptr(), m, w.hidden, w.heads, w.kv_heads, w.head_dim,
            w.inter, k_pool.shape[1], k_pool.shape[2], tables.shape[1], eps, w.head_dim ** -0.5,
            torch.get_num_threads(), bf16=w.dtype == torch.bfloat16)
