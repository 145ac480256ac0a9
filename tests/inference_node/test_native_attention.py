"""The compiled decode attention (``kvflow_native``) against the torch path it replaces, and the
node's logits with it against transformers (``test_reference_parity.py`` runs with it on)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from inference_node.model import native_attention

pytestmark = pytest.mark.skipif(native_attention._kernel is None and os.environ.get("KVFLOW_REQUIRE_NATIVE") != "1",
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
    got = native_attention.decode_attention(q, k_pool, v_pool, tables, lengths)
    torch.testing.assert_close(got, _reference(q, k_pool, v_pool, tables, lengths), rtol=0, atol=2e-6)


def test_bad_tables_and_lengths_are_refused_not_read():
    k = torch.zeros(4, 8, 2, 16)
    q = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="outside the pool"):
        native_attention.decode_attention(q, k, k, torch.tensor([[9]]), torch.tensor([3]))
    with pytest.raises(ValueError, match="do not fit"):
        native_attention.decode_attention(q, k, k, torch.tensor([[1]]), torch.tensor([9]))
    with pytest.raises(ValueError, match="contiguous"):
        native_attention.decode_attention(q, k.transpose(0, 1), k.transpose(0, 1), torch.tensor([[1]]),
                                          torch.tensor([3]))
