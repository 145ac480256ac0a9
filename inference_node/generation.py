"""From an OpenAI body to the engine's requests: the checks a node makes, its limits, and the
sampling parameters (``inference_node.sampling``).

One body becomes ``len(prompts) × n`` sequences, in choice order (choice ``p * n + j`` is the
``j``-th sequence of prompt ``p``). A request's sequences go to the engine one after another, so
the first one's prompt blocks are cached (``stored``) before the others are admitted: they match
them as any later request would, and compute only the prompt's last partial block. That is how
``n`` > 1 shares the prompt's KV (``kvflow.cached_tokens`` in the answer shows it per choice).

Checks, in order, each answered in OpenAI's error shape: the model (404), the parameters a node
cannot honour (400 naming each, ``openai_api.schemas.CANNOT``), ``kv_retention`` (400), the prompts
(empty, token ids outside the vocabulary), the sampling parameters (``SamplingParams.validate``:
``logit_bias`` ids and duplicates, every range the engine would refuse), ``stop_token_ids``, the
context length and the KV capacity (400).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from inference_node.deps import error
from inference_node.engine import GenerationRequest
from inference_node.kv.retention import KvCacheRetentionConfig, RetentionConfigError, TokenRange
from inference_node.node import Node
from inference_node.sampling import SamplingParams
from openai_api.prompt_cache import CachePlan
from openai_api.schemas import GenerationBody, Refusal


@dataclass
class Plan:
    """What one body asks of the engine."""

    rid: str
    #: each prompt's token ids
    prompts: list[list[int]]
    #: sequences per prompt
    n: int
    #: the engine's requests, in choice order
    requests: list[GenerationRequest]
    #: the logprobs asked for: None, or the alternatives per token
    logprobs: int | None
    #: what the body's prompt-caching marks retain (``openai_api.prompt_cache``); None: no marks
    prompt_cache: CachePlan | None = None


def refused(refusals: list[Refusal]) -> JSONResponse:
    """400 naming every parameter a node cannot honour (``param``: the first)."""
    what = "; ".join(f"{r.param}: {r.reason}" for r in refusals)
    return error(400, f"unsupported parameter{'s' if len(refusals) > 1 else ''}: {what}", param=refusals[0].param)


def check_model(node: Node, model: str | None) -> JSONResponse | None:
    """404 unless ``model`` is None, the node's model, or the node's id."""
    name = node.model.cfg.name
    if model is not None and model not in (name, node.settings.node_id):
        return error(404, f"model {model!r} is not served here; this node serves {name!r}", "model_not_found",
                     param="model", code="model_not_found")
    return None


def _retention(body: GenerationBody, marks: CachePlan | None) -> KvCacheRetentionConfig | None:
    """The body's ``kv_retention``; else what its prompt-caching marks retain; else None."""
    r = body.kv_retention
    if r is None:
        if marks is None or not marks.segments:
            return None
        return KvCacheRetentionConfig(
            token_ranges=tuple(TokenRange(s.start, s.end, s.priority, s.duration_s) for s in marks.segments))
    return KvCacheRetentionConfig(
        token_ranges=tuple(TokenRange(t.start, t.end, t.priority, t.duration_s) for t in r.token_ranges),
        decode_priority=r.decode_priority, decode_duration_s=r.decode_duration_s)


def _logit_bias(body: GenerationBody, vocab: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, bias in (body.logit_bias or {}).items():
        if not key.strip().lstrip("-").isdigit() or not 0 <= int(key) < vocab:
            raise ValueError(f"logit_bias: {key!r} is not a token id within 0..{vocab - 1}")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def sampling_params(body: GenerationBody, logprobs: int | None, vocab: int) -> SamplingParams:
    """The body's sampling parameters, with OpenAI's defaults where it gives none (temperature 0).

    Raises:
        ValueError: a ``logit_bias`` key that is not a token id of the vocabulary (the parameters'
            ranges are checked by ``SamplingParams.validate``, which :func:`plan` calls).
    """
    return SamplingParams(
        temperature=body.temperature or 0.0, top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None or body.top_k < 0 else body.top_k, min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body, vocab), logprobs=logprobs, seed=body.seed)


def plan(node: Node, body: GenerationBody, prompts: list[list[int]], max_tokens: int | None,
         logprobs: int | None, prefix: str, marks: CachePlan | None = None) -> Plan | JSONResponse:
    """The engine's requests for ``body`` (its prompts already tokenized), or the 4xx that says
    what is wrong with it (see the module docstring for the order of the checks).

    Args:
        node: the node (its model, tokenizer and KV capacity).
        body: a completion or chat body (already checked by :func:`check_model` and ``refusals``).
        prompts: each prompt's token ids.
        max_tokens: the most tokens per sequence; None: up to the context and the node's KV.
        logprobs: the alternatives per token to return (None: no logprobs).
        prefix: the request id's prefix (``cmpl``, ``chatcmpl``).
        marks: what a chat's prompt-caching marks retain (used when the body has no ``kv_retention``).
    """
    s, cfg = node.settings, node.model.cfg
    vocab = cfg.vocab_size
    try:
        retention = _retention(body, marks)
    except RetentionConfigError as exc:
        return error(400, f"kv_retention: {exc}", param="kv_retention")
    try:  # every parameter the engine would refuse, refused here with a 400 that names it
        params = sampling_params(body, logprobs, vocab)
        params.validate(vocab)
    except ValueError as exc:
        return error(400, str(exc), param=str(exc).split(" ", 1)[0].rstrip(":"))
    stop_ids = tuple(body.stop_token_ids or ())
    if any(t >= vocab for t in stop_ids):
        return error(400, f"stop_token_ids must be within 0..{vocab - 1}", param="stop_token_ids")
    ctx = cfg.max_position_embeddings
    room = min(ctx, s.num_blocks * s.block_size)  # a sequence's tokens: the context, and the KV it can hold
    limits = []
    for p in prompts:
        if not p:
            return error(400, "the prompt is empty", param="prompt")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            return error(400, f"prompt token ids must be within 0..{vocab - 1}; got {bad[:3]}", param="prompt")
        want = max_tokens if max_tokens is not None else room - len(p)
        if want < 1 or len(p) + want > ctx:
            return error(400, f"prompt ({len(p)} tokens) + max_tokens ({want}) exceeds the context length of "
                              f"{ctx}", "context_length_exceeded", param="max_tokens", code="context_length_exceeded")
        need = -(-(len(p) + want) // s.block_size)
        if need > s.num_blocks:
            return error(400, f"this request needs {need} KV blocks; the node has {s.num_blocks}", param="max_tokens")
        limits.append(want)
    rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
    n = body.n
    requests = [
        GenerationRequest(f"{rid}-{i * n + j}" if len(prompts) * n > 1 else rid, p, limit, params.temperature,
                          params.seed, retention, body.lora_id, body.cache_salt, body.ignore_eos, sampling=params,
                          stop=body.stop_strings(), stop_token_ids=stop_ids, seed_offset=j)
        for i, (p, limit) in enumerate(zip(prompts, limits, strict=True)) for j in range(n)]
    return Plan(rid, prompts, n, requests, logprobs, marks if marks is not None and marks.source != "none" else None)
