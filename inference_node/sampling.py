"""Token sampling and stop strings: pure functions of the logits, the tokens seen and the decoded text.

Sampling
========

One :class:`Sampler` per sequence holds its :class:`SamplingParams`, its generator and the tokens it
has seen. For each step it takes the model's logits over the vocabulary and does, in this order
(vLLM's v1 sampler: ``vllm/v1/sample/sampler.py`` ``Sampler.forward`` / ``apply_logits_processors`` /
``sample``; penalties as ``vllm/model_executor/layers/utils.py`` ``apply_penalties``; min-p as
``vllm/v1/sample/logits_processor/builtin.py`` ``MinPLogitsProcessor``; top-k/top-p as
``vllm/v1/sample/ops/topk_topp_sampler.py`` ``apply_top_k_top_p_pytorch``):

0. **logprobs** (when asked): ``log_softmax`` of the *raw* logits, before bias, penalties and
   temperature. This is vLLM's default ``logprobs_mode="raw_logprobs"`` ("Use the original logits
   (before any penalties or temperature scaling) for the top-k logprobs"). The chosen token's logprob
   and the top ``k`` alternatives, best first, come from this distribution.
1. **logit_bias**: each bias added to its token's raw logit (vLLM's ``LogitBiasLogitsProcessor``, a
   non-argmax-invariant processor, so it runs before greedy).
2. **penalties**, in vLLM's order: repetition (Hugging Face / vLLM: over the prompt *and* output
   tokens, a logit ``> 0`` is divided by ``r``, any other multiplied by ``r``), then frequency
   (OpenAI: ``- f * count`` of the token in the output so far), then presence (OpenAI: ``- p`` if the
   token occurred in the output so far).
3. **greedy** at ``temperature == 0``: ``argmax`` (the lowest token id among equal maxima, as
   ``torch.argmax``); nothing below applies.
4. **temperature**: ``(x - max x) / T``. Shifted first, so that any ``T > 0`` (even ``1e-300``) gives
   finite scores: the best token scores 0, the others ``<= 0`` (``-inf`` at worst), never ``inf - inf``.
5. **min_p**: with ``probs = softmax``, tokens with ``prob < min_p * max(probs)`` are dropped (vLLM
   applies it after the temperature, as an argmax-invariant processor).
6. **top_k** (``0`` or ``-1``: off): the ``k`` best tokens are kept.
7. **top_p** (within ``[0, 1]``, OpenAI's range): over the distribution left by top_k (renormalized,
   as vLLM), the smallest set of the best tokens whose mass is ``>= top_p`` is kept (always at least
   the best one, so ``top_p = 0`` keeps only it: greedy; vLLM refuses 0).
8. **draw** from ``softmax`` of what is left, by inverse CDF with one float64 uniform from the
   sequence's generator (seeded) or torch's default generator (unseeded).

A dropped token scores ``-inf`` and is never drawn (nor is any token whose processed logit is
``-inf``). Everything from step 0 on is computed in float64 on the CPU: exact and deterministic
(logits are small, the vocabulary at most ~130k), so a seeded sequence is reproducible on any device.

Where this differs from vLLM, on purpose:

* Ties are broken by the lowest token id everywhere (argmax, top_k, top_p, the top logprobs), so
  top_k=1 and a tiny top_p are exactly greedy. ``torch.topk``'s own order among ties is unspecified
  (on the CPU ``topk([1, 3, 3, 2, 3], 1)`` returns index 2 while ``argmax`` returns 1), and vLLM's top_k
  keeps *every* token tied with the k-th value, so more than ``k`` may survive there.
* Only ``temperature == 0`` is greedy; vLLM also treats ``0 < T < 1e-5`` (``_SAMPLING_EPS``) as greedy.
  Here such a temperature samples (the shift keeps it finite), which is greedy except among ties.
* The draw is an inverse CDF; vLLM draws by an exponential race (``argmax(p / q)``, ``q ~ Exp(1)``).
  Same distribution, different random stream.
* A positive logit under repetition penalty is divided by ``r`` (as Hugging Face), vLLM multiplies by
  ``1 / r`` (a last-bit difference at most).

Stop strings
============

:class:`StopStrings` watches the decoded output while it streams. The rule, shared with the
non-streamed answer :func:`cut_at_stop`: generation stops at the first text (the full decoded output
at some step) that contains any stop string, and the answer is that text cut at the *earliest*
occurrence, ``min(text.find(s) for s in stops)``. A longer stop that started earlier but has not
completed by then does not count: it is not in the text. Streaming emits only text that cannot turn
out to be part of a stop (a suffix that could begin a stop is held back until resolved), so the
concatenation of its deltas equals ``cut_at_stop(text at the stop)`` exactly, and never holds a stop.
Empty stop strings are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "Sampled",
    "Sampler",
    "SamplingParams",
    "StopStrings",
    "apply_logit_bias",
    "apply_min_p",
    "apply_penalties",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "cut_at_stop",
    "sampling_scores",
]

_NEG_INF = float("-inf")
_U64 = 2**64
MAX_ABS_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_ABS_PENALTY = 2.0  # OpenAI's (and vLLM's) range for presence/frequency penalties


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one sequence picks its tokens (see the module docstring for the order of processing)."""

    temperature: float = 0.0  # 0: greedy (argmax after the logits processors below)
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI's: subtract p if the token occurred in the OUTPUT so far
    frequency_penalty: float = 0.0  # OpenAI's: subtract f * count in the OUTPUT so far
    repetition_penalty: float = 1.0  # HF / vLLM: over prompt AND output tokens; logit>0 -> /r, else *r
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to the raw logit)
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and the top k alternatives
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: a bare argmax, nothing to compute or return besides."""
        return self.greedy and not self.penalized and not self.logit_bias and self.logprobs is None

    def validate(self, vocab_size: int) -> None:
        """Raise ``ValueError`` for the first parameter out of range, the message starting with its name."""
        if not _is_int(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if not _is_real(self.top_p) or not 0 <= self.top_p <= 1:  # OpenAI's range; 0 keeps the best token
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1: off), got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -MAX_ABS_PENALTY <= v <= MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        self._validate_logit_bias(vocab_size)
        k = self.logprobs
        if k is not None and (not _is_int(k) or not 0 <= k <= vocab_size):
            raise ValueError(f"logprobs must be None or an int in [0, {vocab_size}], got {k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")

    def _validate_logit_bias(self, vocab_size: int) -> None:
        seen: set[int] = set()
        for entry in self.logit_bias:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {entry!r}")
            tid, bias = entry
            if not _is_int(tid) or not 0 <= tid < vocab_size:
                raise ValueError(f"logit_bias token id {tid!r} is out of range [0, {vocab_size})")
            if tid in seen:
                raise ValueError(f"logit_bias token id {tid} appears more than once")
            seen.add(tid)
            if not _is_real(bias) or not -MAX_ABS_BIAS <= bias <= MAX_ABS_BIAS:
                raise ValueError(f"logit_bias for token {tid} must be in [-100, 100], got {bias!r}")


@dataclass(slots=True)
class Sampled:
    """One sampled token, with its logprobs when asked for."""

    token_id: int
    logprob: float | None  # of the chosen token (None without logprobs)
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # top k (id, logprob), best first


# --------------------------------------------------------------------------- processors
# Each takes a 1-D float tensor (float64 on the CPU in the sampler) and returns a new one.


def apply_logit_bias(logits: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """Add each ``(token id, bias)`` to the token's logit (biases of a repeated id add up)."""
    x = logits.clone()
    if bias:
        ids = torch.tensor([b[0] for b in bias], dtype=torch.long, device=x.device)
        x.index_add_(0, ids, torch.tensor([float(b[1]) for b in bias], dtype=x.dtype, device=x.device))
    return x


def _ids_in_vocab(ids: Iterable[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([i for i in ids if 0 <= i < vocab_size], dtype=torch.long, device=device)


def apply_penalties(
    logits: torch.Tensor,
    seen_ids: Collection[int],
    output_counts: Mapping[int, int],
    *,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
) -> torch.Tensor:
    """Repetition over ``seen_ids`` (the prompt's and the output's tokens), then frequency and presence
    over ``output_counts`` (token id -> occurrences in the output so far). Ids outside the vocabulary
    are ignored."""
    x = logits.clone()
    vocab = x.numel()
    if repetition_penalty != 1.0 and (seen_ids or output_counts):
        ids = _ids_in_vocab({*seen_ids, *output_counts}, vocab, x.device)
        v = x[ids]
        x[ids] = torch.where(v > 0, v / repetition_penalty, v * repetition_penalty)
    if output_counts and (frequency_penalty != 0.0 or presence_penalty != 0.0):
        pairs = [(i, c) for i, c in output_counts.items() if 0 <= i < vocab and c > 0]
        ids = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=x.device)
        counts = torch.tensor([float(p[1]) for p in pairs], dtype=x.dtype, device=x.device)
        v = x[ids]
        if frequency_penalty != 0.0:
            v = v - frequency_penalty * counts
        if presence_penalty != 0.0:
            v = v - presence_penalty
        x[ids] = v
    return x


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``(x - max x) / T`` for ``T > 0``: finite for any ``T`` (the best scores 0). A ``+inf`` logit
    takes all the mass (the limit), so that no ``inf - inf`` arises."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 here, got {temperature!r}")
    m = logits.max()
    if m == math.inf:
        return torch.where(logits == math.inf, 0.0, _NEG_INF).to(logits.dtype)
    return (logits - m) / temperature


def apply_min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop (to ``-inf``) the tokens whose probability is below ``min_p`` times the best one's."""
    if min_p <= 0:
        return scores.clone()
    probs = torch.softmax(scores, dim=-1)
    return scores.masked_fill(probs < min_p * probs.max(), _NEG_INF)


def _top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the ``k`` largest values, best first, ties by the lowest index (O(V), no full sort)."""
    if 4 * k >= x.numel():  # most of it: one full sort is cheaper than topk and a sort
        return torch.sort(x, descending=True, stable=True).indices[:k]
    threshold = torch.topk(x, k).values[-1]
    candidates = torch.nonzero(x >= threshold).flatten()  # ascending ids: the stable sort keeps them so
    order = torch.sort(x[candidates], descending=True, stable=True).indices[:k]
    return candidates[order]


def apply_top_k(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the ``top_k`` best tokens (ties by the lowest id); ``0`` or ``-1``: off."""
    if top_k <= 0 or top_k >= int((scores > _NEG_INF).sum()):  # off, or no more than k left anyway
        return scores.clone()
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep[_top_indices(scores, top_k)] = True
    return scores.masked_fill(~keep, _NEG_INF)


def apply_top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of the best tokens whose probability mass is ``>= top_p`` (at least one):
    a token stays iff the mass of the tokens ranked before it (ties by the lowest id) is ``< top_p``."""
    if top_p >= 1:
        return scores.clone()
    probs = torch.softmax(scores, dim=-1)
    live = torch.nonzero(scores > _NEG_INF).flatten()  # ascending ids, so ties stay by the lowest id
    # Rank only as many of the best as it takes to reach top_p (a growing prefix of the full ranking,
    # the same prefix a full stable sort gives), not the whole vocabulary.
    sub = scores[live]
    n = live.numel()
    k = min(n, 256)
    while True:
        ranked = live[_top_indices(sub, k)]
        cum = torch.cumsum(probs[ranked], dim=-1)
        if k == n or cum[-1] >= top_p:
            break
        k = n if 32 * k >= n else 8 * k
    before = torch.zeros_like(cum)  # the mass ranked before each token (not cum - p: rounding)
    before[1:] = cum[:-1]
    keep = before < top_p
    keep[0] = True
    kept = ranked[keep]
    out = torch.full_like(scores, _NEG_INF)
    out[kept] = scores[kept]
    return out


def sampling_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Steps 4-7 on logits already biased and penalized: temperature, min_p, top_k, top_p. The result's
    softmax is the distribution drawn from."""
    z = apply_temperature(logits, params.temperature)
    z = apply_min_p(z, params.min_p)
    z = apply_top_k(z, params.top_k)
    return apply_top_p(z, params.top_p)


def _draw(scores: torch.Tensor, generator: torch.Generator | None) -> int:
    """Inverse CDF: the first token whose cumulative mass exceeds ``u * total``, ``u`` in [0, 1). A token
    of zero probability adds nothing to the CDF, so it is never the first to exceed it."""
    if not math.isfinite(float(scores.max())):
        raise ValueError("no token can be sampled: every processed logit is -inf (or one is nan)")
    probs = torch.softmax(scores, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand((1,), generator=generator, dtype=torch.float64, device=scores.device) * cdf[-1]
    idx = int(torch.searchsorted(cdf, u, right=True).item())
    if idx >= probs.numel() or probs[idx] <= 0:  # cannot happen (u * total < total); defensive
        idx = int(torch.nonzero(probs > 0).flatten()[-1].item())
    return idx


# --------------------------------------------------------------------------- the sampler


class Sampler:
    """One sequence's sampler: its params, its generator (seeded per sequence), the tokens it has seen."""

    __slots__ = ("_counts", "_seen", "generator", "output_ids", "params")

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], seed_offset: int = 0) -> None:
        self.params = params
        # seed_offset: the index of the sequence within n > 1, so that n seeded sequences differ but are
        # reproducible. manual_seed takes [0, 2**64); a negative seed maps to its unsigned value.
        self.generator: torch.Generator | None = None
        if params.seed is not None and params.temperature > 0:
            self.generator = torch.Generator().manual_seed((params.seed + seed_offset) % _U64)
        self.output_ids: list[int] = []
        # Only kept when a penalty needs them: the prompt's and output's ids (an ordered set), and the
        # output's counts.
        self._seen: dict[int, None] = dict.fromkeys(prompt_ids) if params.repetition_penalty != 1.0 else {}
        self._counts: dict[int, int] = {}

    def _record(self, token: int) -> None:
        self.output_ids.append(token)
        p = self.params
        if p.repetition_penalty != 1.0:
            self._seen[token] = None
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            self._counts[token] = self._counts.get(token, 0) + 1

    def processed_logits(self, raw: torch.Tensor) -> torch.Tensor:
        """Steps 1-2 (logit_bias, penalties) on the raw float64 logits."""
        p = self.params
        x = apply_logit_bias(raw, p.logit_bias) if p.logit_bias else raw
        if p.penalized:
            x = apply_penalties(x, self._seen, self._counts, repetition_penalty=p.repetition_penalty,
                                frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty)
        return x

    def _sample_row(self, raw: torch.Tensor) -> Sampled:
        """The whole pipeline on one row of raw logits, float64 on the CPU."""
        p = self.params
        x = self.processed_logits(raw)
        token = int(torch.argmax(x).item()) if p.greedy else _draw(sampling_scores(x, p), self.generator)
        out = Sampled(token, None, [])
        if p.logprobs is not None:
            lp = torch.log_softmax(raw, dim=-1)
            out.logprob = float(lp[token])
            if p.logprobs > 0:
                top = _top_indices(lp, min(p.logprobs, lp.numel()))
                out.top_logprobs = list(zip(top.tolist(), lp[top].tolist(), strict=True))
        self._record(token)
        return out

    def sample(self, logits: torch.Tensor) -> Sampled:
        """Sample one token from ``logits`` (1-D over the vocabulary, any dtype or device) and record it."""
        if logits.dim() != 1:
            raise ValueError(f"logits must be 1-D over the vocabulary, got shape {tuple(logits.shape)}")
        if self.params.plain_greedy:  # float64 would not change the argmax: the conversion is exact
            token = int(torch.argmax(logits).item())
            self._record(token)
            return Sampled(token, None, [])
        return self._sample_row(logits.detach().to("cpu").to(torch.float64))

    @staticmethod
    def sample_batch(samplers: Sequence[Sampler], logits: torch.Tensor) -> list[Sampled]:
        """``logits`` [B, V], row i for ``samplers[i]``: the same as ``samplers[i].sample(logits[i])`` in
        order. The plain greedy rows take one argmax together on the logits' device; the others go to
        the CPU in one transfer (in their own dtype) and through the pipeline row by row."""
        if logits.dim() != 2 or logits.shape[0] != len(samplers):
            raise ValueError(f"logits must be [{len(samplers)}, V], got shape {tuple(logits.shape)}")
        out: list[Sampled | None] = [None] * len(samplers)
        plain = [i for i, s in enumerate(samplers) if s.params.plain_greedy]
        rest = [i for i, s in enumerate(samplers) if not s.params.plain_greedy]
        if plain:
            rows = logits if len(plain) == len(samplers) else logits[plain]
            for i, token in zip(plain, torch.argmax(rows, dim=-1).tolist(), strict=True):
                samplers[i]._record(token)
                out[i] = Sampled(token, None, [])
        if rest:
            rows = logits if len(rest) == len(samplers) else logits[rest]
            cpu = rows.detach().to("cpu").to(torch.float64)
            for j, i in enumerate(rest):  # in order: unseeded rows share torch's default generator
                out[i] = samplers[i]._sample_row(cpu[j])
        return [o for o in out if o is not None]


# --------------------------------------------------------------------------- stop strings


def _clean_stops(stops: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(s for s in stops if s))


def _earliest_stop(text: str, stops: Sequence[str], clean_len: int = 0) -> int:
    """``min(text.find(s))`` over the stops, or -1; ``text[:clean_len]`` is known to hold none, so an
    occurrence of ``s`` can only start at ``clean_len - len(s) + 1`` or later."""
    best = -1
    for s in stops:
        i = text.find(s, max(0, clean_len - len(s) + 1))
        if i >= 0 and (best < 0 or i < best):
            best = i
    return best


def cut_at_stop(text: str, stops: Iterable[str]) -> tuple[str, bool]:
    """The non-streamed answer: ``text`` cut at the earliest occurrence of any (non-empty) stop, and
    whether one occurred."""
    cut = _earliest_stop(text, _clean_stops(stops))
    return (text, False) if cut < 0 else (text[:cut], True)


def _held_suffix(text: str, start: int, stops: Sequence[str]) -> int:
    """The length of the longest suffix of ``text[start:]`` that is a proper prefix of some stop."""
    held = 0
    for s in stops:
        tail_start = max(start, len(text) - len(s) + 1)
        j = text.find(s[0], tail_start)
        while j >= 0 and len(text) - j > held:  # ascending j: the first match is this stop's longest
            if s.startswith(text[j:]):
                held = len(text) - j
                break
            j = text.find(s[0], j + 1)
    return held


class StopStrings:
    """Incremental stop-string detection over decoded text."""

    __slots__ = ("_done", "_emitted", "_emitted_len", "_held", "_seen_len", "_stopped", "stops")

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = _clean_stops(stops)
        self._emitted: list[str] = []
        self._emitted_len = 0  # text[:_emitted_len] is out
        self._seen_len = 0  # the length of the last text fed (it held no stop)
        self._held = ""  # text[_emitted_len:_seen_len]: could still begin a stop
        self._stopped = False
        self._done = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def emitted(self) -> str:
        """Everything emitted so far (the deltas of :meth:`feed` and :meth:`finish`)."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    def _emit(self, delta: str) -> str:
        if delta:
            self._emitted.append(delta)
            self._emitted_len += len(delta)
        return delta

    def feed(self, text: str) -> tuple[str, bool]:
        """``text``: the FULL decoded output so far (it only grows). Returns the new text safe to emit
        now, and whether a stop string has appeared (then the text before its earliest occurrence
        is all out, and nothing more will be)."""
        if self._stopped or self._done:
            return "", self._stopped
        if len(text) < self._seen_len or not text.startswith(self._held, self._emitted_len):
            raise ValueError("StopStrings.feed: the text must extend the text fed before")
        cut = _earliest_stop(text, self.stops, self._seen_len)
        if cut >= 0:  # cut >= _emitted_len: what could begin a stop was held back
            self._stopped = True
            self._held = ""
            return self._emit(text[self._emitted_len:cut]), True
        boundary = max(self._emitted_len, len(text) - _held_suffix(text, self._emitted_len, self.stops))
        delta = self._emit(text[self._emitted_len:boundary])
        self._seen_len = len(text)
        self._held = text[boundary:]
        return delta, False

    def finish(self) -> str:
        """At the end without a stop: the held-back text (nothing after a stop, or a second time)."""
        if self._stopped or self._done:
            return ""
        self._done = True
        held, self._held = self._held, ""
        return self._emit(held)
