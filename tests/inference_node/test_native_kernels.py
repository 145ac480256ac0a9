"""The compiled decode attention (``kvflow_native``) against the torch path it replaces, and the
node's logits with it against transformers (``test_reference_parity.py`` runs with it on)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from inference_node.model import native

pytestmark = pytest.mark.skipif(native._kernel is None and os.environ.get("KVFLOW_REQUIRE_NATIVE") != "1",
                                reason="kvflow_native is not installed")


def _reference(q, k_pool, v_pool, tables, lengths):
    """The torch path of ``Attention.forward`` for decode tokens: blocks gathered, padded, masked."""
    n, _h, d = q.shape
    kvh = k_pool.shape[2]
    keys = k_pool[tables].view(n, -1, kvh, d).transpose(1, 2)
    vals = v_pool[tables].view(n, -1, kvh, d).transpose(1, 2)
    mask = torch.arange(keys.shape[2])[None, :] < lengths[:, None]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, vals, attn_mask=mask[:, None, None, :], enable_gqa=True)
    return o.squeeze(2)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 32), (4, 4, 16, 8), (8, 2, 12, 5)])
def test_the_kernel_gives_the_torch_path_on_random_pools(heads, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    blocks = 40
    k_pool = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g)
    v_pool = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g)
    lengths = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 7 * block_size])
    width = 7
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in lengths])
    q = torch.randn(len(lengths), heads, head_dim, generator=g)
    got = native.decode_attention(q, k_pool, v_pool, tables, lengths)
    torch.testing.assert_close(got, _reference(q, k_pool, v_pool, tables, lengths), rtol=0, atol=2e-6)


@pytest.mark.skipif(torch.bfloat16 not in native.KERNEL_DTYPES, reason="kvflow_native predates bf16")
def test_the_kernel_reads_a_bf16_pool_as_the_torch_path_reads_it_widened():
    g = torch.Generator().manual_seed(7)
    k_pool = torch.randn(30, 16, 3, 64, generator=g).to(torch.bfloat16)
    v_pool = torch.randn(30, 16, 3, 64, generator=g).to(torch.bfloat16)
    lengths = torch.tensor([1, 16, 17, 100])
    tables = torch.stack([torch.randperm(30, generator=g)[:7] for _ in lengths])
    q = torch.randn(4, 9, 64, generator=g)
    got = native.decode_attention(q, k_pool, v_pool, tables, lengths)
    want = _reference(q, k_pool.float(), v_pool.float(), tables, lengths)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


def test_bad_tables_and_lengths_are_refused_not_read():
    k = torch.zeros(4, 8, 2, 16)
    q = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="outside the pool"):
        native.decode_attention(q, k, k, torch.tensor([[9]]), torch.tensor([3]))
    with pytest.raises(ValueError, match="do not fit"):
        native.decode_attention(q, k, k, torch.tensor([[1]]), torch.tensor([9]))
    with pytest.raises(ValueError, match="contiguous"):
        native.decode_attention(q, k.transpose(0, 1), k.transpose(0, 1), torch.tensor([[1]]),
                                          torch.tensor([3]))


@pytest.mark.parametrize(("m", "k", "n"), [(1, 576, 960), (2, 576, 3072), (3, 13, 7), (5, 64, 37), (16, 1536, 576)])
def test_the_linear_kernel_gives_torchs_product(m, k, n):
    """Every row and column, odd sizes included (rows left over from the 4x2 tiles, a tail of
    features past the last eight), against torch's product in float64."""
    torch.manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k), torch.randn(n, k)
    got = native.linear(x, w)
    want = (x.double() @ w.double().t()).float()
    assert got.shape == (m, n)
    assert torch.allclose(got, want, rtol=0, atol=2e-6 * k ** 0.5 * 4)


@pytest.mark.skipif(torch.bfloat16 not in native.KERNEL_DTYPES, reason="kvflow_native predates bf16")
@pytest.mark.parametrize(("m", "k", "n"), [(1, 576, 960), (3, 13, 7), (16, 1536, 576), (17, 64, 40)])
def test_a_bf16_weight_gives_the_product_with_the_weight_widened(m, k, n):
    """f32 rows by a bf16 weight (the kernel to 16 rows, torch on the widened weight beyond): the
    product of the exact f32 values of the weight, in f32."""
    torch.manual_seed(m + k)
    x, w = torch.randn(m, k), torch.randn(n, k).to(torch.bfloat16)
    got = native.linear(x, w)
    want = (x.double() @ w.double().t()).float()
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert torch.allclose(got, want, rtol=0, atol=2e-6 * k ** 0.5 * 4)


def test_linear_leaves_what_it_does_not_compute_to_torch():
    """More rows than the kernel takes, another dtype or a transposed weight: torch's own result."""
    x, w = torch.randn(native.LINEAR_MAX_ROWS + 1, 32), torch.randn(8, 32)
    assert torch.equal(native.linear(x, w), torch.nn.functional.linear(x, w))
    assert native.linear(x[:2].double(), w.double()).dtype == torch.float64
    wt = torch.randn(32, 8).t()
    assert torch.equal(native.linear(x[:2], wt), torch.nn.functional.linear(x[:2], wt))
    with pytest.raises(ValueError, match="features"):
        native.linear(torch.randn(2, 31), w)


def _decode_setup(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A small GQA model (9 heads over 3 KV heads, as SmolLM2) and five sequences of different
    lengths prefilled into scattered blocks of a pool, weights and pool in ``dtype``."""
    from inference_node.model.config import ModelConfig
    from inference_node.model.llama import KVPool, LlamaModel, SeqBatchItem

    cfg = ModelConfig(vocab_size=97, hidden_size=72, intermediate_size=88, num_hidden_layers=3,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=8, rope_theta=100000.0)
    model = LlamaModel.random(cfg, seed=seed)
    with torch.no_grad():  # norms that matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model = model.to(dtype)
    pool = KVPool(cfg, 64, 4, torch.device("cpu"), dtype)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(64, generator=g).tolist()
    lengths = [1, 4, 5, 13, 30]
    tables = [order[i * 12:(i + 1) * 12] for i in range(len(lengths))]
    for n, table in zip(lengths, tables, strict=True):
        model.forward([SeqBatchItem(torch.randint(0, 97, (n,), generator=g).tolist(), 0, table)], pool)
    return model, pool, lengths, tables, SeqBatchItem


def _pool_copy(pool):
    """A copy of a pool's keys and values."""
    from inference_node.model.llama import KVPool

    copy = KVPool.__new__(KVPool)
    copy.k, copy.v, copy.num_blocks, copy.block_size = pool.k.clone(), pool.v.clone(), pool.num_blocks, pool.block_size
    return copy


def _decode_steps(model, pool, lengths, tables, item, steps: int = 4):
    return [torch.stack(model.forward([item([3 + i + s], n + s, t) for i, (n, t) in
                                       enumerate(zip(lengths, tables, strict=True))], pool))
            for s in range(steps)]


@pytest.mark.skipif(native._layers is None, reason="kvflow_native predates the fused decode step")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_decode_step_gives_the_layer_by_layer_step(monkeypatch, dtype):
    """Several decode tokens through every layer in one call: the logits and the keys and values
    it wrote are those of the layer-by-layer path (the same kernels, dispatched by torch), on any
    number of threads. In bf16 the keys and values it wrote are torch's rounding of f32 values
    that agree to rounding: at most one bf16 step apart."""
    model, pool, lengths, tables, item = _decode_setup(dtype=dtype)
    layered_pool = _pool_copy(pool)
    fused = _decode_steps(model, pool, lengths, tables, item)
    monkeypatch.setattr(native, "_layers", None)
    layered = _decode_steps(model, layered_pool, lengths, tables, item)
    for a, b in zip(fused, layered, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6 if dtype == torch.float32 else 2e-4)
    for got, want in ((pool.k, layered_pool.k), (pool.v, layered_pool.v)):
        if dtype == torch.bfloat16:  # one step of bf16 (8 bits of mantissa) where a rounding tipped
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-30)
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    monkeypatch.undo()
    model, pool, lengths, tables, item = _decode_setup(seed=1, dtype=dtype)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):  # the same prefilled pool each time; only the decode steps' threads differ
            torch.set_num_threads(n)
            results.append(_decode_steps(model, _pool_copy(pool), lengths, tables, item, steps=2))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:  # each output is one thread's, whatever the split: bit for bit
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


@pytest.mark.skipif(native._layers is None, reason="kvflow_native predates the fused decode step")
def test_the_fused_decode_step_refuses_what_it_would_misread():
    model, pool, _lengths, _tables, _item = _decode_setup()
    weights = model._fused_weights()
    x, cs = torch.zeros(1, 72), torch.zeros(1, 8)
    table, length = torch.tensor([[5, 6]]), torch.tensor([6])
    native.decode_layers(x, weights, pool.k, pool.v, cs, cs, torch.tensor([6 * 4 + 1]), table, length, 1e-5)
    with pytest.raises(ValueError, match="not its position"):  # the token's slot is not its last key's
        native.decode_layers(x, weights, pool.k, pool.v, cs, cs, torch.tensor([5 * 4 + 1]), table, length, 1e-5)
    with pytest.raises(ValueError, match="outside the pool"):
        native.decode_layers(x, weights, pool.k, pool.v, cs, cs, torch.tensor([1]), torch.tensor([[0, 64]]),
                             length, 1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        native.decode_layers(x, weights, pool.k, pool.v, cs, cs, torch.tensor([1]), table, torch.tensor([9]), 1e-5)
    with pytest.raises(ValueError, match="shapes"):
        native.decode_layers(torch.zeros(1, 71), weights, pool.k, pool.v, cs, cs, torch.tensor([25]), table, length,
                             1e-5)
    strided = torch.tensor([[5, 0, 6, 0]])[:, ::2]
    with pytest.raises(ValueError, match="contiguous: False"):
        native.decode_layers(x, weights, pool.k, pool.v, cs, cs, torch.tensor([25]), strided, length, 1e-5)
    with pytest.raises(ValueError, match="float64"):
        native.decode_layers(x, weights, pool.k, pool.v, cs, cs, torch.tensor([25]), table, length.double(), 1e-5)
    with pytest.raises(ValueError, match="shape"):
        native.LayerWeights(weights.tensors[:6], hidden=72, heads=9, kv_heads=3, head_dim=8, inter=80)
