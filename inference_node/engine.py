"""The engine: one thread that owns the model, the KV core and the publisher, and runs requests.

Each loop iteration is one forward of the model over a ragged batch (continuous batching, as
vLLM's scheduler does it): (1) every running request's next token (decode), then (2) the prompts
of waiting requests admitted now, as many as ``max_running`` and a budget of ``max_batch_tokens``
new tokens allow (at least one; the KV core matches each cached prefix, so only the uncached
suffix is computed, reading the prefix from the pool); (3) the block copies the core asks for
(offload to and onboard from the host pool) run before that forward, and (4) the core's events
are drained to the publisher after it. ``NodeStats`` heartbeats go out from a thread of their own
(``inference_node.heartbeat``),
so that a long prefill does not make the node look gone; a node that stops says goodbye with a
last heartbeat (:meth:`Engine.stop`).

Each sequence samples with its own :class:`~inference_node.sampling.Sampler` (penalties, top-p/k,
min-p, logit bias, logprobs, a seeded generator) and is detokenized here too
(``inference_node.detok``), so that a stop string ends it at the token that completes it and
frees its blocks at once: an ``Output`` carries the text that is safe to show (a possible start of
a stop string is held back until it is resolved), and the texts of a sequence's outputs add up to
its whole answer, streamed or not. A sequence ends on EOS (unless ``ignore_eos``) or one of its
``stop_token_ids`` (neither is part of the text), on a stop string (not part of the text either),
or at ``max_tokens``.

Everything that touches the core or the tensors happens on this thread; the HTTP server talks
to it through :meth:`Engine.submit` (outputs come back on an asyncio queue) and
:meth:`Engine.call` (a function run between steps, e.g. to read the ground truth).

NOTE: a prompt's new blocks are cached (``stored``) when it is admitted, before the forward
writes them, and a prompt admitted after it in the same step may match them. That is sound because
the forward writes every new token's keys and values of a layer into the pool before any attention
of that layer reads it (``inference_node.model.llama.Attention``): the later prompt reads the
earlier one's keys as they are computed, layer by layer. Running requests take their next blocks
before new prompts are admitted, so admission never starves a running request.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import torch

from eventbus.protocol import InstanceId, NodeCounters, NodeId, NodeStats
from eventbus.publisher import ControlListener, Publisher
from inference_node.detok import Detokenizer
from inference_node.heartbeat import Heartbeat
from inference_node.kv.manager import GPU, BlockCopy, KVCacheManager, OutOfBlocks
from inference_node.kv.prompt import Prompt
from inference_node.kv.retention import KvCacheRetentionConfig
from inference_node.model.llama import KVPool, LlamaModel, SeqBatchItem, copy_block
from inference_node.sampling import Sampled, Sampler, SamplingParams, StopStrings
from openai_api.tokenizers import Tokenizer

log = logging.getLogger("kvflow.engine")
T = TypeVar("T")


class _Unservable(Exception):
    """A request the engine cannot serve (a bad seed, token ids the hasher refuses); not a fault."""


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    retention: KvCacheRetentionConfig | None = None
    lora_id: int | None = None
    cache_salt: str | None = None
    ignore_eos: bool = False
    #: the sampling parameters (None: greedy, or ``temperature`` with ``seed``)
    sampling: SamplingParams | None = None
    #: stop strings (never part of the text) and token ids that end the sequence
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    #: the sequence's index among a request's ``n`` (its seed is ``seed + seed_offset``)
    seed_offset: int = 0

    def params(self) -> SamplingParams:
        return self.sampling or SamplingParams(temperature=self.temperature, seed=self.seed)


@dataclass
class Output:
    """One step of a request's output, sent to its handle: a token and the text it makes safe to
    show; the last one (``finished``) has the text still held and the usage."""

    token_id: int | None
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    text: str = ""
    #: the token's logprob and the top alternatives (with ``SamplingParams.logprobs``)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class RequestHandle:
    """The server's side of a request: outputs arrive on an asyncio queue, as ``(index, output)``.

    The sequences of one answer (``n`` > 1, several prompts) may share one queue, each handle with
    its ``index``; iterating a handle (``async for``) is for a queue of its own."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, *,
                 queue: asyncio.Queue[tuple[int, Output]] | None = None, index: int = 0) -> None:
        self.request_id = request_id
        self.loop = loop
        self.index = index
        self.queue: asyncio.Queue[tuple[int, Output]] = queue if queue is not None else asyncio.Queue()
        self.submitted = time.monotonic()

    def put(self, out: Output) -> None:  # called from the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, out))

    async def __aiter__(self) -> Any:
        while True:
            _, out = await self.queue.get()
            yield out
            if out.finished:
                return


@dataclass
class _Running:
    req: GenerationRequest
    handle: RequestHandle
    prompt_len: int
    cached_tokens: int
    sampler: Sampler
    detok: Detokenizer
    stops: StopStrings
    last_token: int
    generated: int = 1
    started: float = field(default_factory=time.monotonic)


@dataclass
class EngineStats:
    requests: int = 0
    finished: int = 0
    rejected: int = 0
    preempted: int = 0
    generated_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    copies: int = 0


class Engine:
    """Runs requests on one model and one KV cache (see the module docstring)."""

    def __init__(self, *, model: LlamaModel, tokenizer: Tokenizer, core: KVCacheManager, gpu_pool: KVPool,
                 host_pool: KVPool | None, publisher: Publisher, node_id: NodeId, instance_id: InstanceId,
                 url: str, model_name: str, max_running: int = 32, max_batch_tokens: int = 2048,
                 heartbeat_s: float = 1.0,
                 control: ControlListener | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.core = core
        self.gpu_pool = gpu_pool
        self.host_pool = host_pool
        self.publisher = publisher
        self.node_id = node_id
        self.instance_id = instance_id
        self.url = url
        self.model_name = model_name
        self.block_size = core.block_size
        self.context_len = model.cfg.max_position_embeddings
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.heartbeat_s = heartbeat_s
        self.control = control
        self.stats = EngineStats()
        self._waiting: collections.deque[tuple[GenerationRequest, RequestHandle]] = collections.deque()
        self._calls: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = \
            collections.deque()
        self._cancelled: set[str] = set()
        self._running: dict[str, _Running] = {}
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"engine-{node_id}", daemon=True)
        self.heartbeat = Heartbeat(self, lambda stats: self.publisher.sink.send_stats(stats), heartbeat_s)
        self.started = False
        self.fatal: BaseException | None = None

    # ----------------------------------------------------------------- API (any thread)

    def start(self) -> None:
        self.started = True
        self._thread.start()
        self.heartbeat.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and the heartbeats, publish what is queued, and say goodbye: a last
        heartbeat with ``status`` ``stopping``, so that the node leaves the router's candidates at
        once (the materializer marks it gone) instead of after the stale timeout."""
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        if self.started:
            self._thread.join(timeout)
        self.heartbeat.stop()
        if (left := self.publisher.drain(5)) > 0:
            log.error("stopping: %d event batches not delivered within 5 s", left)
        if self.started and not self._thread.is_alive() and self.fatal is None:
            self.publisher.sink.send_stats(msgspec.structs.replace(self.node_stats(), status="stopping"))
        self.publisher.sink.flush(5)

    def submit(self, req: GenerationRequest, loop: asyncio.AbstractEventLoop,
               handle: RequestHandle | None = None) -> RequestHandle:
        """Queue ``req``; its outputs go to ``handle`` (default: a new one of its own)."""
        handle = handle or RequestHandle(req.request_id, loop)
        with self._wake:
            if self.fatal is not None:  # a crashed engine answers at once instead of queueing forever
                handle.put(Output(None, True, "error", error=f"engine crashed: {self.fatal}"))
                return handle
            self._waiting.append((req, handle))
            self._wake.notify()
        return handle

    def cancel(self, request_id: str) -> None:
        with self._wake:
            self._cancelled.add(request_id)
            self._wake.notify()

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the engine thread between steps (for reads of the core)."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._wake:
            if self.fatal is not None:
                fut.set_exception(RuntimeError(f"engine crashed: {self.fatal}"))
                return fut
            self._calls.append((fn, fut))
            self._wake.notify()
        return fut

    @property
    def queue_depth(self) -> tuple[int, int]:
        return len(self._running), len(self._waiting)

    # ----------------------------------------------------------------- the loop

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._serve_calls()
                self._handle_cancels()
                worked = self._step()
                self._housekeeping()
                if not worked:
                    with self._wake:
                        if not (self._waiting or self._calls or self._cancelled or self._stop.is_set()):
                            self._wake.wait(timeout=0.05)
        except BaseException as exc:  # the node is broken: say so on every open request
            log.exception("engine crashed")
            with self._wake:  # submit() and call() check `fatal` under the same lock: none is left waiting
                self.fatal = exc
                waiting, self._waiting = self._waiting, collections.deque()
                calls, self._calls = self._calls, collections.deque()
            for r in list(self._running.values()):
                r.handle.put(Output(None, True, "error", error=f"engine crashed: {exc}"))
            for _, h in waiting:
                h.put(Output(None, True, "error", error=f"engine crashed: {exc}"))
            for _, fut in calls:
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(RuntimeError(f"engine crashed: {exc}"))
            # Logged and kept in `fatal`; /healthz reports it. The thread ends here.
        finally:
            self._serve_calls()

    def _serve_calls(self) -> None:
        while self._calls:
            fn, fut = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:
                    fut.set_exception(exc)

    def _handle_cancels(self) -> None:
        if not self._cancelled:
            return
        with self._wake:
            cancelled, self._cancelled = self._cancelled, set()
            self._waiting = collections.deque((r, h) for r, h in self._waiting if r.request_id not in cancelled)
        for rid in cancelled:
            run = self._running.pop(rid, None)
            if run is not None:
                self.core.free(rid)
                run.handle.put(Output(None, True, "cancelled", run.prompt_len, run.cached_tokens, run.generated))

    def _housekeeping(self) -> None:
        if self.control is not None and self.control.take_resync():
            self.core.request_snapshot()
        self.core.tick()
        self.publisher.pump()

    # ----------------------------------------------------------------- one step

    def _step(self) -> bool:
        """One forward: the next token of every running request and the prompts admitted now.
        False when there was nothing to compute."""
        batch, runs = self._decode_items()
        prefills = self._admit(len(batch))
        if not batch and not prefills:
            return False
        items = batch + [item for _, item in prefills]
        t0 = time.perf_counter()
        logits = self.model(items, self.gpu_pool)
        dt = time.perf_counter() - t0
        prefill_tokens = sum(len(item.token_ids) for _, item in prefills)
        share = prefill_tokens / (prefill_tokens + len(batch))  # the forward's time, split by tokens
        self.stats.prefill_seconds += dt * share
        self.stats.prefill_tokens_computed += prefill_tokens
        if batch:
            self.stats.decode_seconds += dt * (1 - share)
            self.stats.decode_steps += 1
            sampled_all = Sampler.sample_batch([r.sampler for r in runs], torch.stack(logits[:len(batch)]))
            for run, sampled in zip(runs, sampled_all, strict=True):
                run.last_token = sampled.token_id
                run.generated += 1
                self._emit(run, sampled)
        for (run, _), row in zip(prefills, logits[len(batch):], strict=True):
            sampled = run.sampler.sample(row)
            run.last_token = sampled.token_id
            self._emit(run, sampled)
        return True

    def _decode_items(self) -> tuple[list[SeqBatchItem], list[_Running]]:
        """Each running request's last token, its next slot allocated (a request that gets no
        block ends here, see docs/node.md "Known limits")."""
        batch: list[SeqBatchItem] = []
        runs: list[_Running] = []
        for run in list(self._running.values()):
            rid = run.req.request_id
            pos = self.core.num_tokens(rid)
            try:
                _, copies = self.core.append_token(rid, run.last_token)
            except OutOfBlocks:
                self.stats.preempted += 1
                log.warning("request %s stopped: no KV block for its next token", rid)
                self._finish(run, "length")
                continue
            self._copy(copies)
            batch.append(SeqBatchItem([run.last_token], pos, self.core.block_table(rid)))
            runs.append(run)
        return batch, runs

    def _admit(self, decoding: int) -> list[tuple[_Running, SeqBatchItem]]:
        """Waiting requests admitted into this step, in order: while ``max_running`` allows and
        their new tokens fit the step's budget (the first one always does)."""
        admitted: list[tuple[_Running, SeqBatchItem]] = []
        budget = self.max_batch_tokens - decoding
        while self._waiting and len(self._running) < self.max_running:
            with self._wake:
                req, handle = self._waiting[0]
            try:
                prepared = self._prepare(req, handle)
            except _Unservable as exc:  # this request, not the engine: nothing of it was allocated
                log.warning("request %s refused: %s", req.request_id, exc)
                with self._wake:
                    self._waiting.popleft()
                self.stats.rejected += 1
                handle.put(Output(None, True, "error", error=f"request refused: {exc}"))
                continue
            if admitted and len(req.prompt_ids) - sum(self.core.match_prefix(prepared[1])) * self.block_size > budget:
                break  # the next step takes it
            try:
                run, item = self._allocate(req, handle, *prepared)
            except OutOfBlocks:
                if not self._running:  # nothing running, nothing admitted: no block will free, it cannot fit now
                    with self._wake:
                        self._waiting.popleft()
                    self.stats.rejected += 1
                    handle.put(Output(None, True, "error", error="the KV cache cannot hold this prompt right now"))
                    continue
                break  # wait for running requests to finish and free blocks
            with self._wake:
                self._waiting.popleft()
            # Running from now on: should the forward fail, the crash handler answers it too.
            self._running[req.request_id] = run
            admitted.append((run, item))
            budget -= len(item.token_ids)
        return admitted

    def _prepare(self, req: GenerationRequest, handle: RequestHandle) -> tuple[Sampler, Prompt]:
        """What can fail for this request alone fails here, before the core caches anything of it:
        once allocated, its new blocks are cached and must be computed, so a later failure is fatal."""
        try:
            params = req.params()
            if params.seed is not None and not -(1 << 63) <= params.seed < 1 << 64:
                raise ValueError(f"seed {params.seed} is not a 64-bit integer")
            params.validate(self.model.cfg.vocab_size)
            sampler = Sampler(params, req.prompt_ids, req.seed_offset)
            prompt = Prompt.from_tokens(req.prompt_ids, self.block_size, lora_id=req.lora_id,
                                        cache_salt=req.cache_salt)
        except (ValueError, OverflowError, TypeError) as exc:
            raise _Unservable(f"{type(exc).__name__}: {exc}") from exc
        return sampler, prompt

    def _allocate(self, req: GenerationRequest, handle: RequestHandle, sampler: Sampler,
                  prompt: Prompt) -> tuple[_Running, SeqBatchItem]:
        alloc = self.core.allocate(req.request_id, prompt, req.retention)
        self.stats.requests += 1
        self._copy(alloc.copies)
        n = len(req.prompt_ids)
        # At least the last prompt token is computed: its logits give the first output token.
        start = min(alloc.num_cached_tokens, n - 1)
        run = _Running(req, handle, n, start, sampler, Detokenizer(self.tokenizer), StopStrings(req.stop), -1)
        return run, SeqBatchItem(req.prompt_ids[start:], start, alloc.block_table)

    def _emit(self, run: _Running, sampled: Sampled) -> None:
        """Send one sampled token with the text it makes safe to show; end the sequence on EOS, a
        stop token id, a stop string (the text before it is the answer) or ``max_tokens``."""
        self.stats.generated_tokens += 1
        req, token = run.req, sampled.token_id
        # with ignore_eos an EOS token is just a token
        ends = (not req.ignore_eos and token in self.tokenizer.eos_token_ids) or token in req.stop_token_ids
        text, stopped = "", False
        if not ends:
            run.detok.add(token)
            text, stopped = run.stops.feed(run.detok.text)
        run.handle.put(Output(token, text=text, logprob=sampled.logprob, top_logprobs=sampled.top_logprobs))
        if ends or stopped:
            self._finish(run, "stop", flush=not stopped)
        elif run.generated >= req.max_tokens:
            self._finish(run, "length")

    def _finish(self, run: _Running, reason: str, flush: bool = True) -> None:
        """End a sequence: free its blocks; the last output has the text still held (unless a
        stop string ended it: what followed it is never shown) and the usage."""
        rid = run.req.request_id
        self._running.pop(rid, None)
        self.core.free(rid)
        self.stats.finished += 1
        tail = ""
        if flush:
            run.detok.finish()
            tail, stopped = run.stops.feed(run.detok.text)
            if stopped:
                reason = "stop"
            else:
                tail += run.stops.finish()
        run.handle.put(Output(None, True, reason, run.prompt_len, run.cached_tokens, run.generated, text=tail))

    def _copy(self, copies: list[BlockCopy]) -> None:
        for c in copies:
            self.stats.copies += 1
            src = self.gpu_pool if c.src_level == GPU else self.host_pool
            dst = self.gpu_pool if c.dst_level == GPU else self.host_pool
            assert src is not None and dst is not None, "a host copy without a host pool"
            copy_block(src, c.src_slot, dst, c.dst_slot)

    # ----------------------------------------------------------------- state

    def node_stats(self) -> NodeStats:
        """The heartbeat now (on the engine thread, or once it has stopped)."""
        st = self.core.stats
        used = self.core.used_blocks
        running, waiting = len(self._running), len(self._waiting)
        return NodeStats(
            schema_version=1, node_id=self.node_id, instance_id=self.instance_id, url=self.url,
            model=self.model_name, block_size=self.block_size, ts=time.time(),
            capacity=[self.core.config.num_gpu_blocks, self.core.config.num_host_blocks], used=list(used),
            active_requests=running, queued_requests=waiting, last_event_id=self.core.last_event_id,
            active_blocks=used[0] - self.core.evictable_blocks[0],
            counters=NodeCounters(
                prompt_tokens=st.prompt_tokens, cached_tokens=st.cached_tokens, hits=st.hit_blocks,
                misses=st.miss_blocks, requests=st.requests,
                evictions_by_priority={str(k): v for k, v in sorted(st.evictions_by_priority.items())},
                offloads_by_priority={str(k): v for k, v in sorted(st.offloads_by_priority.items())},
                events_published=self.publisher.events_sent, events_overflowed=st.events_overflowed),
        )
