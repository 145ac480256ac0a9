"""A Llama-family decoder whose keys and values live in a paged block pool.

RMSNorm, rotary embeddings (Hugging Face's ``rotate_half`` convention), SwiGLU, grouped-query
attention. The cache is a :class:`KVPool`: for every layer a tensor of ``num_blocks`` blocks of
``block_size`` token slots. A sequence's tokens live in the blocks of its *block table* (given by
the KV core): token ``p`` is at slot ``block_table[p // block_size] * block_size + p % block_size``.

:meth:`LlamaModel.forward` runs a *ragged batch*: several sequences, each with some new tokens
at some start position (a prefill's uncached suffix, or one decode token). Projections and MLPs
run on all new tokens together; attention runs per sequence over its keys gathered from the
pool, so a prefill whose prefix is cached computes only its new tokens. On the CPU the compiled
kernels of :mod:`inference_node.model.native` take the decode sizes: a step of decode tokens only
runs every layer in one call; bf16 there means bf16 weights and keys/values with fp32 arithmetic.

Weights: seeded random by default (nothing is ever downloaded), or a local Hugging Face folder
(``config.json`` + ``*.safetensors``) with the standard Llama parameter names, its configuration
read by :mod:`inference_node.model.config` (which refuses what this module does not compute). The
node's math is checked against transformers' ``LlamaForCausalLM`` on the same weights
(``tests/inference_node/test_reference_parity.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inference_node.model import native
from inference_node.model.config import ModelConfig, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """transformers' LlamaRMSNorm: normalized in float32, scaled in the input's dtype."""
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        out: Tensor = self.weight * y.to(x.dtype)
        return out


class Fused:
    """The weights of several ``nn.Linear`` of one input as one matrix (one matmul instead of
    several: q, k, v; gate, up). The modules' own weights become views into it, so nothing is held
    twice and the state dict keeps Hugging Face's names; it is made again when a weight moved
    (``Module.to``)."""

    def __init__(self, *modules: nn.Linear) -> None:
        self.modules = modules
        self.weight: Tensor | None = None
        self._key: tuple[int, ...] = ()

    def get(self) -> Tensor:
        key = tuple(m.weight.data_ptr() for m in self.modules)
        if self.weight is None or key != self._key:
            fused = torch.cat([m.weight.data for m in self.modules])
            offset = 0
            for m in self.modules:
                n = m.weight.shape[0]
                m.weight.data = fused[offset:offset + n]
                offset += n
            self.weight = fused
            self._key = tuple(m.weight.data_ptr() for m in self.modules)
        return self.weight


def rope_tables(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin of each position, ``[T, head_dim]`` float32 (transformers' product, exactly)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D] in x's dtype (or [T, D], cast here)."""
    if cos.dim() == 2:
        cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class KVPool:
    """Per-layer key and value blocks, ``[num_blocks, block_size, kv_heads, head_dim]`` each."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, pin_memory: bool = False) -> None:
        shape = (cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype, pin_memory=pin_memory)
        self.v = torch.zeros(shape, device=device, dtype=dtype, pin_memory=pin_memory)
        self.num_blocks = num_blocks
        self.block_size = block_size

    def nbytes(self) -> int:
        return int(self.k.numel() * self.k.element_size() * 2)


def copy_block(src: KVPool, src_block: int, dst: KVPool, dst_block: int) -> None:
    """Copy one block (all layers) between pools, e.g. GPU → host on offload."""
    dst.k[:, dst_block].copy_(src.k[:, src_block], non_blocking=True)
    dst.v[:, dst_block].copy_(src.v[:, src_block], non_blocking=True)


@dataclass
class SeqBatchItem:
    """One sequence of a ragged batch: new tokens from ``start`` on, in the given blocks."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]


@dataclass
class AttentionPlan:
    """Where one forward's tokens read and write their keys and values, worked out once for all
    layers: the new tokens' pool slots; the decode tokens (one new token of a sequence) as one
    padded batch over their block tables; each prefill (several new tokens) on its own."""

    #: [T] flat pool slots of the new tokens, in the batch's order
    slots: Tensor
    #: [D] rows (in the batch's tokens) of the decode tokens; None without any
    decode_rows: Tensor | None
    #: [D, B] block ids of each decode sequence (padded with its first block)
    decode_blocks: Tensor | None
    #: [D, 1, 1, B × block_size] True where a decode token sees a key (its sequence's, up to itself)
    decode_mask: Tensor | None
    #: [D] the keys each decode token sees (its position + 1)
    decode_lengths: Tensor | None
    #: per prefill: offset in the batch, new tokens, start position, [B] its block ids
    prefills: list[tuple[int, int, int, Tensor]]

    @classmethod
    def of(cls, batch: Sequence[SeqBatchItem], block_size: int, device: torch.device) -> AttentionPlan:
        bs = block_size
        new_slots: list[int] = []
        decode: list[tuple[int, int, Sequence[int]]] = []  # (row, keys, blocks)
        prefills: list[tuple[int, int, int, Tensor]] = []
        offset = 0
        for item in batch:
            n = len(item.token_ids)
            end = item.start + n
            table = item.block_table
            new_slots.extend(table[p // bs] * bs + p % bs for p in range(item.start, end))
            blocks = table[:-(-end // bs)]
            if n == 1:
                decode.append((offset, end, blocks))
            else:
                prefills.append((offset, n, item.start, torch.as_tensor(blocks, dtype=torch.long, device=device)))
            offset += n
        slots = torch.as_tensor(new_slots, dtype=torch.long, device=device)
        if not decode:
            return cls(slots, None, None, None, None, prefills)
        width = max(len(b) for _, _, b in decode)
        padded = [list(b) + [b[0]] * (width - len(b)) for _, _, b in decode]
        keys = torch.as_tensor([k for _, k, _ in decode], device=device)
        mask = torch.arange(width * bs, device=device)[None, :] < keys[:, None]
        return cls(slots, torch.as_tensor([r for r, _, _ in decode], dtype=torch.long, device=device),
                   torch.as_tensor(padded, dtype=torch.long, device=device), mask[:, None, None, :], keys, prefills)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.qkv = Fused(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, pool: KVPool, plan: AttentionPlan) -> Tensor:
        """x: [T, hidden] for all new tokens; their keys and values go into the pool, then each
        attends to its sequence's keys up to itself (``plan``)."""
        cfg = self.cfg
        t = x.shape[0]
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv = native.linear(x, self.qkv.get())
        q = apply_rope(qkv[:, :h * d].view(t, h, d), cos, sin)
        k = apply_rope(qkv[:, h * d:(h + kvh) * d].view(t, kvh, d), cos, sin)
        v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
        pool_k, pool_v = pool.k[layer], pool.v[layer]  # [blocks, block_size, kvh, d]
        pool_k.view(-1, kvh, d)[plan.slots] = k.to(pool_k.dtype)
        pool_v.view(-1, kvh, d)[plan.slots] = v.to(pool_v.dtype)
        out = torch.empty(t, h, d, device=x.device, dtype=x.dtype)
        if plan.decode_rows is not None and x.dtype == torch.float32 and native.usable(pool_k.dtype, x.device):
            assert plan.decode_blocks is not None and plan.decode_lengths is not None
            out[plan.decode_rows] = native.decode_attention(
                q[plan.decode_rows], pool_k, pool_v, plan.decode_blocks, plan.decode_lengths)
        elif plan.decode_rows is not None:
            # Every decode token at once: its sequence's blocks gathered (padded, masked).
            assert plan.decode_blocks is not None
            n = plan.decode_blocks.shape[0]
            keys = pool_k[plan.decode_blocks].view(n, -1, kvh, d).transpose(1, 2).to(x.dtype)  # [D, kvh, S, d]
            vals = pool_v[plan.decode_blocks].view(n, -1, kvh, d).transpose(1, 2).to(x.dtype)
            qd = q[plan.decode_rows].unsqueeze(2)  # [D, h, 1, d]
            o = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=plan.decode_mask, enable_gqa=True)
            out[plan.decode_rows] = o.squeeze(2)
        for offset, n_new, start, blocks in plan.prefills:
            end = start + n_new
            keys = pool_k[blocks].view(-1, kvh, d)[:end].transpose(0, 1).to(x.dtype)  # [kvh, S, d]
            vals = pool_v[blocks].view(-1, kvh, d)[:end].transpose(0, 1).to(x.dtype)
            qs = q[offset:offset + n_new].transpose(0, 1)  # [h, n, d]
            if start == 0:  # the whole prompt: plain causal attention
                o = F.scaled_dot_product_attention(qs, keys, vals, is_causal=True, enable_gqa=True)
            else:  # query i sits at position start + i and sees keys up to it
                qpos = torch.arange(start, end, device=x.device)[:, None]
                mask = torch.arange(end, device=x.device)[None, :] <= qpos
                o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, enable_gqa=True)
            out[offset:offset + n_new] = o.transpose(0, 1)
        projected: Tensor = native.linear(out.reshape(t, h * d), self.o_proj.weight)
        return projected


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up = Fused(self.gate_proj, self.up_proj)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = native.linear(x, self.gate_up.get()).chunk(2, dim=-1)
        out: Tensor = native.linear(F.silu(gate) * up, self.down_proj.weight)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class LlamaModel(nn.Module):
    """Llama for causal LM over a paged KV pool (parameter names as in Hugging Face)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # RoPE's inverse frequencies per device, float32 whatever the model's dtype (not a buffer:
        # Module.to(dtype) would round it).
        self._inv_freq: dict[torch.device, Tensor] = {}
        self._fused_cache: tuple[tuple[int, ...], native.LayerWeights] | None = None

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0) -> LlamaModel:
        """Seeded random weights (std 0.02, as Llama initializes)."""
        gen = torch.Generator().manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("layernorm.weight") or name == "norm.weight":
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        return model.eval()

    @torch.no_grad()
    def forward(self, batch: list[SeqBatchItem], pool: KVPool, all_logits: bool = False) -> list[Tensor]:
        """Run the new tokens of each sequence; return each sequence's logits for its last token
        (``[vocab]``), or for all its new tokens (``[n, vocab]``) with ``all_logits``."""
        device = self.embed_tokens.weight.device
        tokens: list[int] = []
        positions: list[int] = []
        for item in batch:
            tokens.extend(item.token_ids)
            positions.extend(range(item.start, item.start + len(item.token_ids)))
        plan = AttentionPlan.of(batch, pool.block_size, device)
        ids = torch.as_tensor(tokens, dtype=torch.long, device=device)
        # bf16 on the CPU: weights and keys/values in bf16, the arithmetic in fp32 (native.compute_dtype).
        x = self.embed_tokens(ids).to(native.compute_dtype(self.embed_tokens.weight.dtype, device))
        inv_freq = self._inv_freq.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freq[device] = rope_inv_freq(self.cfg, device)
        cos, sin = rope_tables(torch.as_tensor(positions, device=device), inv_freq)
        if (not plan.prefills and plan.decode_blocks is not None and plan.decode_lengths is not None
                and x.dtype == torch.float32 and pool.k.dtype == self.embed_tokens.weight.dtype
                and native.fused_decode_usable(pool.k.dtype, device, len(tokens))):
            # Decode tokens only: every layer in one compiled call (native.decode_layers).
            x = x.contiguous()
            native.decode_layers(x, self._fused_weights(), pool.k, pool.v, cos, sin, plan.slots, plan.decode_blocks,
                                 plan.decode_lengths, self.cfg.rms_norm_eps)
        else:
            cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)  # once for every layer
            for i, module in enumerate(self.layers):
                layer = cast(DecoderLayer, module)
                x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, i, pool, plan)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        if not all_logits:  # the last token of each sequence, through the head at once
            last, offset = [], 0
            for item in batch:
                offset += len(item.token_ids)
                last.append(offset - 1)
            return list(native.linear(self.norm(x[last]), self.lm_head.weight).float().unbind(0))
        out, offset = [], 0
        for item in batch:
            n = len(item.token_ids)
            out.append(native.linear(self.norm(x[offset:offset + n]), self.lm_head.weight).float())
            offset += n
        return out

    def _fused_weights(self) -> native.LayerWeights:
        """The layers' weights for :func:`native.decode_layers`, made again when a weight moved
        (``Module.to``: the fused matrices are remade then too)."""
        layers = [cast(DecoderLayer, module) for module in self.layers]
        fused = [(layer.self_attn.qkv.get(), layer.mlp.gate_up.get()) for layer in layers]
        key = tuple(t.data_ptr() for pair in fused for t in pair) + tuple(
            p.data_ptr() for layer in (layers[0], layers[-1]) for p in layer.parameters())
        cached = self._fused_cache
        if cached is None or cached[0] != key:
            tensors: list[Tensor] = []
            for layer, (qkv, gate_up) in zip(layers, fused, strict=True):
                tensors += [layer.input_layernorm.weight.data, qkv, layer.self_attn.o_proj.weight.data,
                            layer.post_attention_layernorm.weight.data, gate_up, layer.mlp.down_proj.weight.data]
            cfg = self.cfg
            cached = self._fused_cache = (key, native.LayerWeights(
                tensors, hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim, inter=cfg.intermediate_size))
        return cached[1]

    # ----------------------------------------------------------------- Hugging Face format

    def save_hf(self, folder: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` as Hugging Face's LlamaForCausalLM."""
        from safetensors.torch import save_file

        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.cfg.to_hf(), indent=2))
        tensors = {_to_hf_name(k): v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if self.cfg.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def load_hf(cls, folder: str | Path) -> LlamaModel:
        """Load Llama-architecture weights from a local Hugging Face folder (never downloads):
        ``config.json`` (:meth:`ModelConfig.from_hf`) and safetensors in fp32, bf16 or fp16, one
        file or shards listed by ``model.safetensors.index.json``; the weights are held in fp32
        (the caller moves them to its device and dtype)."""
        path = Path(folder)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file} not found: --model-dir must be a Hugging Face model folder")
        cfg = ModelConfig.from_hf(json.loads(cfg_file.read_text()), name=path.name)
        state = load_safetensors(path)
        model = cls(cfg)
        mapped = {_from_hf_name(k): v for k, v in state.items()}
        if cfg.tie_word_embeddings and "lm_head.weight" not in mapped:
            mapped["lm_head.weight"] = mapped.get("embed_tokens.weight", torch.empty(0))
        for k, v in mapped.items():
            if v.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"weight {k} has dtype {v.dtype}: fp32, bf16 or fp16 expected (quantized "
                                 "checkpoints are not supported)")
        try:
            missing, unexpected = model.load_state_dict(mapped, strict=False)
        except RuntimeError as exc:  # shape mismatches: a config that does not describe these weights
            raise ValueError(f"weights do not match {cfg_file}: {str(exc).splitlines()[-1].strip()}") from exc
        unexpected = [u for u in unexpected if "rotary_emb" not in u]
        if missing or unexpected:
            raise ValueError(f"weights do not match a Llama model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        return model.eval()


def load_safetensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of a folder's checkpoint: the shards ``model.safetensors.index.json`` lists
    (its ``weight_map``), else every ``*.safetensors`` file."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = [path / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index.name} lists shards that are missing: {', '.join(absent[:3])}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _to_hf_name(name: str) -> str:
    return name if name.startswith("lm_head") else f"model.{name}"


def _from_hf_name(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def flops_per_token(cfg: ModelConfig) -> float:
    """Rough forward FLOPs per token (2 × parameters in the matmuls)."""
    per_layer = (cfg.hidden_size * cfg.head_dim * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
                 + 3 * cfg.hidden_size * cfg.intermediate_size)
    return 2.0 * (per_layer * cfg.num_hidden_layers + cfg.hidden_size * cfg.vocab_size)


__all__ = ["AttentionPlan", "KVPool", "LlamaModel", "ModelConfig", "SeqBatchItem", "copy_block", "flops_per_token",
           "load_safetensors"]
