"""Assembling a node from settings: model, tokenizer, KV core and pools, publisher, engine."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from eventbus.config import KafkaSettings
from eventbus.hashing import DEFAULT_BLOCK_SIZE
from eventbus.protocol import DEFAULT_PRIORITY, MAX_PRIORITY, InstanceId, NodeId
from eventbus.publisher import ControlListener, KafkaSink, NullSink, Publisher, Sink
from inference_node.engine import Engine
from inference_node.kv.adaptive import AdaptivePolicy
from inference_node.kv.manager import KvCacheConfig, KVCacheManager
from inference_node.model.llama import KVPool, LlamaModel, ModelConfig
from openai_api.chat import ChatTemplate, load_chat_template
from openai_api.tokenizers import Tokenizer, load_tokenizer

log = logging.getLogger("kvflow.node")

#: Random-weight model sizes (nothing is downloaded; ``--model-dir`` loads real weights instead).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=4096, name="kvflow-tiny-llama"),
    "small": ModelConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=8,
                         num_key_value_heads=2, max_position_embeddings=8192, name="kvflow-small-llama"),
}


class NodeSettings(BaseSettings):
    """``KVFLOW_NODE_…`` (the ``kvflow node`` flags override them)."""

    model_config = SettingsConfigDict(env_prefix="KVFLOW_NODE_", extra="ignore", protected_namespaces=())

    node_id: NodeId = Field(default=NodeId("node-a"), description="Stable node name (the Kafka key).")
    host: str = Field(default="127.0.0.1", description="Bind address of the HTTP API.")
    port: int = Field(default=8101, description="Port of the HTTP API.")
    advertise_url: str | None = Field(default=None, description="URL the router uses (default http://host:port).")
    num_blocks: int = Field(default=1024, ge=1, description="GPU-tier KV blocks.")
    host_blocks: int = Field(default=0, ge=0, description="Host-memory-tier KV blocks (0: no host tier).")
    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, ge=1, description="Tokens per KV block.")
    device: str = Field(default="auto", description="cpu, cuda, cuda:N or auto (CUDA when present).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Weights and KV: auto is float32 on the CPU, bfloat16 on CUDA; bfloat16 on the "
                                    "CPU computes in float32 over bf16 weights and KV (half the memory traffic).")
    model_dir: str | None = Field(default=None, description="Local Hugging Face Llama folder; default: random.")
    model_preset: Literal["tiny", "small"] = Field(default="small", description="Random model size.")
    seed: int = Field(default=0, description="Seed of the random weights.")
    max_running: int = Field(default=32, ge=1, description="Requests decoded together at most.")
    max_batch_tokens: int = Field(default=2048, ge=1, description="New tokens in one forward at most (decode "
                                  "tokens and admitted prompts' uncached tokens; a longer prompt runs alone).")
    heartbeat_s: float = Field(default=1.0, gt=0, le=2.0, description="NodeStats interval.")
    max_queued_events: int = Field(default=100_000, ge=1, description="Events held while Kafka is away.")
    max_inflight_batches: int = Field(default=1000, ge=1,
                                      description="Undelivered batches in the producer before events wait in the "
                                                  "KV core's queue instead.")
    secondary_offload_min_priority: int = Field(default=DEFAULT_PRIORITY, ge=0, le=MAX_PRIORITY + 1,
                                                description="Offload threshold (101: never offload).")
    adaptive: bool = Field(default=False, description="Learned priorities for requests without hints.")
    adaptive_frequency_horizons: float = Field(
        default=0.0, ge=0, description="With --adaptive: keep the frequency band this many LRU horizons (0: no "
                                       "limit); 2 for nodes behind KV-aware routing (docs/kv-core.md).")
    adaptive_soon_share: float = Field(
        default=0.0, ge=0, le=1, description="With --adaptive: new blocks of a class whose reuses come within the "
                                             "cache's size at least this often go to the frequency band (0: off); "
                                             "0.3 for nodes behind KV-aware routing (docs/kv-core.md).")
    adaptive_life_tables: bool = Field(
        default=True, description="With --adaptive: weigh the frequency band's oldest block against the recency "
                                  "band's by how likely blocks of that band and age are used again (false: the "
                                  "recency band always goes first; docs/kv-core.md).")
    adaptive_floor: bool = Field(
        default=True, description="With --adaptive: hand the cache to plain LRU while the policy keeps fewer "
                                  "hits than an exact LRU shadow beyond the floor's bound (docs/kv-core.md).")
    adaptive_strict_guard: bool = Field(
        default=True, description="With --adaptive and the life tables: strict bands (no demotion) while a shadow "
                                  "of them leads the cache (docs/kv-core.md, the life tables' guard).")
    emit_token_ids: bool = Field(default=False, description="Token ids in stored events.")
    kafka: bool = Field(default=True, description="Publish events to Kafka (false: drop them).")
    api_keys: SecretStr | None = Field(default=None, description="Comma-separated bearer keys (none: open).")
    max_request_bytes: int = Field(default=4 * 1024 * 1024, description="Largest request body accepted.")


@dataclass
class Node:
    settings: NodeSettings
    instance_id: InstanceId
    url: str
    device: torch.device
    model: LlamaModel
    tokenizer: Tokenizer
    core: KVCacheManager
    engine: Engine
    sink: Sink
    control: ControlListener | None
    #: the chat template (the model folder's, else kvflow's default; ``openai_api.chat``)
    chat_template: ChatTemplate

    def close(self) -> None:
        self.engine.stop()
        if self.control is not None:
            self.control.close()
        self.sink.close()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    return dev


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: float32 on the CPU, bfloat16 on CUDA; else the dtype named."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_node(s: NodeSettings, kafka: KafkaSettings | None = None, *, sink: Sink | None = None,
               start: bool = True) -> Node:
    device = pick_device(s.device)
    dtype = pick_dtype(s.dtype, device)
    model = LlamaModel.load_hf(s.model_dir) if s.model_dir else LlamaModel.random(PRESETS[s.model_preset], seed=s.seed)
    model = model.to(device=device, dtype=dtype)
    tokenizer = load_tokenizer(s.model_dir)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"tokenizer vocabulary ({tokenizer.vocab_size}) exceeds the model's ({model.cfg.vocab_size})")
    instance_id = InstanceId(uuid.uuid4().hex)
    url = s.advertise_url or f"http://{s.host}:{s.port}"
    adaptive = AdaptivePolicy(frequency_horizons=s.adaptive_frequency_horizons,
                              soon_share=s.adaptive_soon_share,
                              life_tables=s.adaptive_life_tables, floor=s.adaptive_floor,
                              strict_guard=s.adaptive_strict_guard) if s.adaptive else None
    core = KVCacheManager(KvCacheConfig(
        num_gpu_blocks=s.num_blocks, num_host_blocks=s.host_blocks, block_size=s.block_size,
        secondary_offload_min_priority=s.secondary_offload_min_priority,
        window_size=model.cfg.max_position_embeddings, max_queued_events=s.max_queued_events,
        emit_token_ids=s.emit_token_ids, adaptive=adaptive))
    gpu_pool = KVPool(model.cfg, s.num_blocks, s.block_size, device, dtype)
    host_pool = KVPool(model.cfg, s.host_blocks, s.block_size, torch.device("cpu"), dtype,
                       pin_memory=device.type == "cuda") if s.host_blocks else None
    control = None
    if sink is None:
        if s.kafka:
            kafka = kafka or KafkaSettings()
            sink = KafkaSink(kafka, s.node_id)
            control = ControlListener(kafka, s.node_id, instance_id)
        else:
            sink = NullSink()
    publisher = Publisher(core, sink, s.node_id, instance_id, max_in_flight=s.max_inflight_batches)
    engine = Engine(model=model, tokenizer=tokenizer, core=core, gpu_pool=gpu_pool, host_pool=host_pool,
                    publisher=publisher, node_id=s.node_id, instance_id=instance_id, url=url,
                    model_name=model.cfg.name, max_running=s.max_running, max_batch_tokens=s.max_batch_tokens,
                    heartbeat_s=s.heartbeat_s,
                    control=control)
    node = Node(s, instance_id, url, device, model, tokenizer, core, engine, sink, control,
                load_chat_template(s.model_dir))
    if start:
        if control is not None:
            control.start()
        engine.start()
    log.info("node %s (instance %s): %s on %s, %d GPU blocks + %d host blocks of %d tokens",
             s.node_id, instance_id, model.cfg.name, device, s.num_blocks, s.host_blocks, s.block_size)
    return node
