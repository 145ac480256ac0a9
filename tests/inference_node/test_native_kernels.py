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


def test_linear_leaves_what_it_does_not_compute_to_torch():
    """More rows than the kernel takes, another dtype or a transposed weight: torch's own result."""
    x, w = torch.randn(native.LINEAR_MAX_ROWS + 1, 32), torch.randn(8, 32)
    assert torch.equal(native.linear(x, w), torch.nn.functional.linear(x, w))
    assert native.linear(x[:2].double(), w.double()).dtype == torch.float64
    wt = torch.randn(32, 8).t()
    assert torch.equal(native.linear(x[:2], wt), torch.nn.functional.linear(x[:2], wt))
    with pytest.raises(ValueError, match="features"):
        native.linear(torch.randn(2, 31), w)
