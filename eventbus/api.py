"""The HTTP completion contract shared by nodes and the router (pydantic; no torch).

``POST /v1/completions`` accepts this body on a node and on the router alike: an OpenAI-style
subset plus kvflow's ``kv_retention``, ``lora_id`` and ``cache_salt``. Unknown fields and wrong
types are refused (422) with a message naming the field.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

#: ``cache_salt``'s description: an empty salt is refused (it would silently mean no salt).
SALT = ("Salt of the first block's hash: only requests with the same salt share cached blocks. Omit it (or "
        "null) for no salt; an empty string is refused.")

#: A token id as the block identity packs it (u32); a model's vocabulary is checked by the node.
TokenId = Annotated[StrictInt, Field(ge=0, le=(1 << 32) - 1)]


class TokenRangeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    start: StrictInt = Field(ge=0, description="First token of the range.")
    end: StrictInt | None = Field(default=None, description="One past the last token; null: end of prompt.")
    priority: StrictInt = Field(description="0 (evicted first) to 100.")
    duration_s: float | None = Field(default=None, description="Seconds at this priority once evictable.")


class RetentionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token_ranges: list[TokenRangeIn] = Field(default_factory=list, max_length=1024)
    decode_priority: StrictInt = 35
    decode_duration_s: float | None = None


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, max_length=256,
                              description="The model to serve it (a node serves one): the router sends the request "
                                          "only to nodes of this model; a node refuses another (404).")
    prompt: str | list[TokenId] = Field(description="Text, or token ids.")
    max_tokens: StrictInt = Field(default=16, ge=1, le=8192)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    seed: StrictInt | None = Field(default=None, ge=-(1 << 63), le=(1 << 64) - 1,
                                   description="Sampling seed (with temperature > 0); a 64-bit integer.")
    stream: StrictBool = False
    kv_retention: RetentionIn | None = None
    lora_id: StrictInt | None = Field(default=None, ge=0, le=(1 << 63) - 1)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256, description=SALT)
    ignore_eos: StrictBool = False
    n: StrictInt = Field(default=1, ge=1, le=1, description="Only 1 is supported.")
    user: str | None = Field(default=None, max_length=256)


class RouteRequest(BaseModel):
    """``POST /v1/route``: a prompt as text or token ids."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(default=None, description="Text (tokenized as the nodes do).")
    token_ids: list[TokenId] | None = Field(default=None, max_length=1_000_000, description="Or token ids.")
    lora_id: StrictInt | None = Field(default=None, ge=0, le=(1 << 63) - 1)
    model: str | None = Field(default=None, max_length=256, description="Only nodes serving this model.")
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256, description=SALT)
