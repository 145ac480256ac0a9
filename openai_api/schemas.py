"""The HTTP request contracts shared by nodes and the router (pydantic; no torch).

* :class:`CompletionRequest` (``POST /v1/completions``) and :class:`ChatCompletionRequest`
  (``POST /v1/chat/completions``): OpenAI's bodies, as a node serves them. Unknown fields are
  accepted and ignored, as vLLM does, so that clients written for other engines keep working; the
  standard parameters are typed, and a wrong type or an out-of-range value is refused (422) with
  a message naming the field. Parameters a node cannot honour are never ignored silently:
  :meth:`refusals` names them, and the node answers 400 with those names (see ``CANNOT``).
  kvflow's extensions: ``kv_retention``, ``lora_id``, ``cache_salt`` (an empty salt is refused),
  ``ignore_eos``, and vLLM's ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``.
* :class:`RouteRequest` (``POST /v1/route``).

NOTE: a node's defaults differ from OpenAI's in one place: ``temperature`` defaults to 0
(greedy), as the node always did, not 1.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple, cast

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from eventbus.protocol import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY

#: ``cache_salt``'s description: an empty salt is refused (it would silently mean no salt).
SALT = ("Salt of the first block's hash: only requests with the same salt share cached blocks. Omit it (or "
        "null) for no salt; an empty string is refused.")

#: A token id as the block identity packs it (u32); a model's vocabulary is checked by the node.
TokenId = Annotated[StrictInt, Field(ge=0, le=(1 << 32) - 1)]

#: The most sequences one request may ask for (prompts × ``n``).
MAX_SEQUENCES = 64


class TokenRangeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    start: StrictInt = Field(ge=0, description="First token of the range.")
    end: StrictInt | None = Field(default=None, description="One past the last token; null: end of prompt.")
    priority: StrictInt = Field(ge=MIN_PRIORITY, le=MAX_PRIORITY, description="0 (evicted first) to 100.")
    duration_s: float | None = Field(default=None, description="Seconds at this priority once evictable.")


class RetentionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token_ranges: list[TokenRangeIn] = Field(default_factory=list, max_length=1024)
    decode_priority: StrictInt = Field(default=DEFAULT_PRIORITY, ge=MIN_PRIORITY, le=MAX_PRIORITY,
                                       description="Priority of the generated tokens' blocks.")
    decode_duration_s: float | None = None


class Refusal(NamedTuple):
    """A parameter a node cannot honour, and why."""

    param: str
    reason: str


#: Parameters (OpenAI's, or well-known extensions of vLLM's) that a node cannot honour, with the
#: values that ask for nothing (accepted) and the reason given when another value is sent. Only
#: checked among the fields a request model does not declare itself.
CANNOT: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": ((None, ""), "insertion after a suffix is not supported"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "the model does not reason"),
    "verbosity": ((None,), "verbosity is not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "functions": ((None, []), "function calling is not supported (tools with tool_choice 'none' render the "
                              "tools into the prompt)"),
    "function_call": ((None, "none"), "function calling is not supported"),
    "echo": ((None, False), "echo is not supported for chats"),
    "chat_template": ((None,), "a node renders chats with its own template (GET /v1/chat/template), the one the "
                               "router routes by"),
    "chat_template_kwargs": ((None, {}), "a node renders chats with its own template's defaults, the ones the "
                                         "router routes by"),
    "documents": ((None, []), "documents are not supported"),
    "continue_final_message": ((None, False), "continuing the final message is not supported"),
    "min_tokens": ((None, 0), "min_tokens is not supported"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "length_penalty": ((None, 1.0), "beam search is not supported"),
    "prompt_logprobs": ((None,), "prompt logprobs are not supported"),
    "include_stop_str_in_output": ((None, False), "the stop string is never included in the output"),
    "skip_special_tokens": ((None, True), "special tokens are always skipped in the text"),
    "guided_json": ((None,), "constrained decoding is not supported"),
    "guided_regex": ((None,), "constrained decoding is not supported"),
    "guided_choice": ((None,), "constrained decoding is not supported"),
    "guided_grammar": ((None,), "constrained decoding is not supported"),
    "structured_outputs": ((None,), "constrained decoding is not supported"),
    "response_format": ((None, {"type": "text"}), "only text output is supported"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported"),
    "bad_words": ((None, []), "bad_words is not supported"),
    "logits_processors": ((None,), "custom logits processors are not supported"),
    "truncate_prompt_tokens": ((None,), "prompts are never truncated"),
}


class PromptCacheBreakpoint(BaseModel):
    """OpenAI's ``prompt_cache_breakpoint`` on a content part: the exact end of a reusable prefix."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["explicit"] = Field(description="Always 'explicit'.")
    ttl: Literal["30m", "12h"] | None = Field(default=None, description="Its lifetime; default: the request's.")


class CacheControl(BaseModel):
    """Anthropic's ``cache_control`` on a content part or a message (as gateways forward it)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["ephemeral"] = Field(description="Always 'ephemeral'.")
    ttl: Literal["5m", "1h"] | None = Field(default=None, description="Its lifetime; default 5m.")


class PromptCacheOptions(BaseModel):
    """OpenAI's ``prompt_cache_options``."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["implicit", "explicit"] = Field(
        default="implicit", description="implicit: one breakpoint kvflow places (the end of the system part) and "
                                        "the latest 3 explicit ones; explicit: the latest 4 explicit ones only.")
    ttl: Literal["30m", "12h"] | None = Field(default=None, description="Every breakpoint's lifetime unless its "
                                                                        "own says otherwise (default 30m).")


#: The longest ``prompt_cache_key`` accepted (characters).
PROMPT_CACHE_KEY_MAX = 256


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool | None = Field(
        default=None, description="A last chunk with empty choices and the usage (and usage null on the others).")


class GenerationBody(BaseModel):
    """What both kinds of request share: sampling, streaming, kvflow's extensions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(default=None, max_length=256,
                              description="The model to serve it (a node serves one): the router sends the request "
                                          "only to nodes of this model; a node refuses another (404).")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="Default 0: greedy.")
    top_p: float | None = Field(default=None, ge=0.0, le=1.0, description="Nucleus sampling (default 1: off).")
    top_k: StrictInt | None = Field(default=None, ge=-1, description="Only the k likeliest tokens; 0 or -1: off.")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0,
                                description="Only tokens at least this fraction as likely as the likeliest.")
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100.0,
                                             description="Hugging Face's, over prompt and output (default 1: off).")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, max_length=1024, description="Token id (as a string) -> bias added to its logit.")
    seed: StrictInt | None = Field(default=None, ge=-(1 << 63), le=(1 << 64) - 1,
                                   description="Sampling seed (with temperature > 0); a 64-bit integer. With n > 1, "
                                               "sequence i uses seed + i.")
    n: StrictInt = Field(default=1, ge=1, le=16, description="Sequences per prompt (they share the prompt's KV).")
    stop: Annotated[str, Field(min_length=1, max_length=256)] | list[
        Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(
        default=None, max_length=16, description="Stop strings: never in the output; finish_reason 'stop'.")
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64,
                                                 description="Token ids that end a sequence (finish_reason 'stop').")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=1024, description="Accepted; logged by nothing.")
    kv_retention: RetentionIn | None = None
    lora_id: StrictInt | None = Field(default=None, ge=0, le=(1 << 63) - 1)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256, description=SALT)
    ignore_eos: StrictBool = False
    prompt_cache_key: str | None = Field(
        default=None, min_length=1, max_length=PROMPT_CACHE_KEY_MAX,
        description="Requests with the same key (within a tenant) go to the same node while load allows.")
    prompt_cache_options: PromptCacheOptions | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        default=None, description="Deprecated by OpenAI: the breakpoints' lifetime when no ttl says (5m / 24h).")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)

    def refusals(self) -> list[Refusal]:
        """The parameters of this request that a node cannot honour (empty: none)."""
        out = []
        for name, value in (self.model_extra or {}).items():
            if name not in CANNOT:
                continue  # unknown: ignored, as vLLM does
            accepted, reason = CANNOT[name]
            if not any(value == a for a in accepted):
                out.append(Refusal(name, reason))
        if self.stream_options is not None and not self.stream:
            out.append(Refusal("stream_options", "stream_options needs stream: true"))
        return out


class CompletionRequest(GenerationBody):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description="Text, token ids, or a list of either (one choice per prompt and n).")
    max_tokens: StrictInt | None = Field(default=16, ge=1, le=8192,
                                         description="Default 16; null: up to the context (and the node's KV).")
    echo: StrictBool = Field(default=False, description="The prompt's text before the completion.")
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20,
                                       description="Each token's logprob and the top N alternatives.")
    best_of: StrictInt | None = Field(default=None, ge=1, description="Only null or equal to n.")

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts, one per choice group: texts or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return cast("list[str] | list[list[int]]", p)

    def refusals(self) -> list[Refusal]:
        out = super().refusals()
        if self.best_of is not None and self.best_of != self.n:
            out.append(Refusal("best_of", f"best_of {self.best_of} != n {self.n}: every sequence generated is "
                                          "returned (best_of must be null or equal to n)"))
        if self.echo and self.logprobs is not None:
            out.append(Refusal("echo", "echo with logprobs (the prompt's logprobs) is not supported"))
        if len(self.prompts()) * self.n > MAX_SEQUENCES:
            out.append(Refusal("n", f"{len(self.prompts())} prompts x n {self.n} is more than {MAX_SEQUENCES} "
                                    "sequences"))
        return out


class ContentPart(BaseModel):
    """A part of a message's content; only text parts (``text``, or ``refusal`` in an assistant's)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    refusal: str | None = None
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = Field(
        default=None, description="Retain the prompt up to the end of this part (docs/prompt-caching.md).")
    cache_control: CacheControl | None = Field(default=None, description="The same, in Anthropic's words.")


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any] = Field(default="{}", description="JSON text (OpenAI) or an object.")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(description="system, developer (rendered as system), user, assistant or tool.")
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    cache_control: CacheControl | None = Field(default=None, description="A breakpoint at the end of the message.")


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str = "function"
    function: ToolFunction


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str = "function"
    function: dict[str, Any]


#: Roles a message may have (``developer`` is rendered as ``system``).
ROLES = ("system", "developer", "user", "assistant", "tool")


class _Conversation(BaseModel):
    """What a chat template renders: the messages, the tools, the generation prompt."""

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    tools: list[ChatTool] | None = Field(default=None, max_length=256,
                                         description="Rendered into the prompt (tool_choice must be 'none').")
    add_generation_prompt: StrictBool = Field(default=True, description="The template's assistant header at the end.")

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as given (``openai_api.chat.normalize_messages`` makes them what templates expect)."""
        return [m.model_dump(exclude_unset=True) for m in self.messages]

    def chat_tools(self) -> list[dict[str, Any]] | None:
        return None if self.tools is None else [t.model_dump(exclude_unset=True) for t in self.tools]


class ChatCompletionRequest(GenerationBody, _Conversation):
    """``POST /v1/chat/completions``: rendered through the node's chat template (``openai_api.chat``)."""

    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=8192,
                                                    description="Default: up to the context (and the node's KV).")
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=8192,
                                         description="Deprecated by OpenAI: max_completion_tokens wins.")
    logprobs: StrictBool | None = Field(default=None, description="Each output token's logprob.")
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20, description="Alternatives per token.")
    tool_choice: str | NamedToolChoice | None = Field(
        default=None, description="Only 'none' with tools: the node does not call functions.")
    parallel_tool_calls: StrictBool | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def refusals(self) -> list[Refusal]:
        out = super().refusals()
        for i, m in enumerate(self.messages):
            if m.role not in ROLES:
                out.append(Refusal(f"messages[{i}].role", f"role {m.role!r} is not one of {', '.join(ROLES)}"))
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                marks = [k for k in ("prompt_cache_breakpoint", "cache_control") if getattr(part, k) is not None]
                if marks and part.type not in ("text", "refusal"):
                    out.append(Refusal(f"messages[{i}].content[{j}].{marks[0]}",
                                       f"a breakpoint must mark a text part, not a {part.type!r} part"))
                if part.type not in ("text", "refusal"):
                    out.append(Refusal(f"messages[{i}].content[{j}].type",
                                       f"content parts of type {part.type!r} are not supported (text only)"))
                elif (part.text if part.type == "text" else part.refusal) is None:
                    out.append(Refusal(f"messages[{i}].content[{j}]", f"a {part.type} part needs its {part.type!r}"))
        for i, t in enumerate(self.tools or []):
            if t.type != "function":
                out.append(Refusal(f"tools[{i}].type", f"tools of type {t.type!r} are not supported"))
        choice = self.tool_choice
        if choice is None and self.tools:
            choice = "auto"  # OpenAI's default with tools
        if choice not in (None, "none") and (self.tools or choice != "auto"):
            what = choice if isinstance(choice, str) else "a named function"
            out.append(Refusal("tool_choice", f"tool_choice {what!r} needs function calling, which a node does not "
                                              "do (the default with tools is 'auto'): send tool_choice 'none' to "
                                              "render the tools into the prompt"))
        if self.top_logprobs is not None and not self.logprobs:
            out.append(Refusal("top_logprobs", "top_logprobs needs logprobs: true"))
        return out


class RouteRequest(BaseModel):
    """``POST /v1/route``: a prompt as text, as token ids, or a chat's messages (rendered through
    the model's chat template, as ``POST /v1/chat/completions`` routes them)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(default=None, description="Text (tokenized as the nodes do).")
    token_ids: list[TokenId] | None = Field(default=None, max_length=1_000_000, description="Or token ids.")
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=10_000,
                                               description="Or a chat, rendered as the node will render it.")
    tools: list[ChatTool] | None = Field(default=None, max_length=256, description="A chat's tools.")
    add_generation_prompt: StrictBool = Field(default=True, description="A chat's generation prompt.")
    lora_id: StrictInt | None = Field(default=None, ge=0, le=(1 << 63) - 1)
    model: str | None = Field(default=None, max_length=256, description="Only nodes serving this model.")
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256, description=SALT)
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=PROMPT_CACHE_KEY_MAX,
                                         description="Credit the node of this key's requests (within the tenant).")

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_unset=True) for m in self.messages or ()]

    def chat_tools(self) -> list[dict[str, Any]] | None:
        return None if self.tools is None else [t.model_dump(exclude_unset=True) for t in self.tools]


class _Proxied(BaseModel):
    """What the router reads of a body it proxies: only what routing needs. Everything else is
    forwarded unchanged, for the node to check (a router must not be stricter than its engines)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(default=None, max_length=256, description="Only nodes serving this model.")
    stream: StrictBool = False
    kv_retention: RetentionIn | None = None
    lora_id: StrictInt | None = Field(default=None, ge=0, le=(1 << 63) - 1)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256, description=SALT)
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=PROMPT_CACHE_KEY_MAX)
    prompt_cache_options: PromptCacheOptions | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None


class ProxiedCompletion(_Proxied):
    """``POST /v1/completions`` as the router reads it (routed by its first prompt)."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description="Text, token ids, or a list of either (all go to one node, chosen by the first).")

    def first_prompt(self) -> str | list[int]:
        """The prompt the decision is made for: the only one, or the first of a list."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return cast("str | list[int]", p)
        first: str | list[int] = p[0]
        return first


class ProxiedChat(_Proxied, _Conversation):
    """``POST /v1/chat/completions`` as the router reads it: what the chat template renders."""
