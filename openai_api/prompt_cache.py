"""Prompt-caching marks as clients send them → kvflow's retention (docs/prompt-caching.md).

Clients already say which prefix of a prompt they will send again, in their own words:

* OpenAI's ``prompt_cache_breakpoint`` on a chat content part (``{"mode": "explicit", "ttl":
  "30m" | "12h"}``), ``prompt_cache_options`` (``mode`` implicit/explicit, ``ttl``) and the
  deprecated ``prompt_cache_retention`` (``in_memory`` / ``24h``);
* Anthropic's ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` on a content part or,
  as gateways forward it, on a message.

:func:`plan_chat` turns them into token ranges of the rendered prompt at :data:`BREAKPOINT_PRIORITY`,
each for its lifetime. The rules:

* **Where a breakpoint is.** The chat is rendered up to the breakpoint (the messages before it,
  its message cut after the marked part, no generation prompt) and tokenized; the breakpoint is
  the longest token prefix that rendering shares with the prompt. That is the end of the marked
  part as the template renders it (plus the template's end-of-message tokens when the part ends
  its message, which the next turn shares too), found without knowing the template, and never
  past what the prompt really holds.
* **Blocks.** A block straddling a breakpoint is not retained: the retained range is rounded down
  to whole blocks. A block is matched whole (its hash covers all its tokens), so the straddling
  block is only reused by a prompt that also shares the tokens after the breakpoint, which is not
  what the mark promises. (OpenAI says its boundary "is not rounded to a token block"; a paged
  cache cannot keep less than a block.)
* **Which breakpoints.** OpenAI's "latest N" rule: in ``implicit`` mode (the default) the latest
  3 explicit breakpoints (in message order) and one implicit breakpoint kvflow places at the end
  of the leading system/developer messages (tools included where the template renders them
  there; not listed when an explicit breakpoint falls at the same token); in ``explicit`` mode
  the latest 4 explicit ones and no implicit one (none given: nothing retained). Earlier ones are
  not written; the answer names them (``ignored``).
* **Lifetimes.** A breakpoint's own ``ttl`` (``30m`` 1,800 s, ``12h`` 43,200 s; cache_control
  ``5m`` 300 s, ``1h`` 3,600 s, default ``5m``), else ``prompt_cache_options.ttl``, else
  ``prompt_cache_retention`` (``in_memory`` 300 s, ``24h`` 86,400 s), else 30 minutes. The prompt
  from a breakpoint back to the previous one is retained for the longest lifetime of the
  breakpoints at or after it (they all cover it).
* **When.** Only a request that uses these controls (a mark, ``prompt_cache_options`` or
  ``prompt_cache_retention``) gets retention from them: a request that names none is cached as
  before. ``kv_retention`` wins where both are given (the marks are then not applied, and the
  answer says so).

Pure: rendering and tokenizing are passed in (the node's and the router's own).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from openai_api.chat import ChatTemplate, ChatTemplateError, normalize_messages
from openai_api.schemas import (
    ChatMessage,
    ContentPart,
    PromptCacheOptions,
    RetentionIn,
)

#: The priority of a prefix a breakpoint retains (the seed's system prompts are at 100, set by an
#: operator's rule; a client's own mark sits just below, above every default).
BREAKPOINT_PRIORITY = 90
#: Lifetimes in seconds.
TTL_S = {"30m": 1800.0, "12h": 43200.0, "5m": 300.0, "1h": 3600.0}
RETENTION_S = {"in_memory": 300.0, "24h": 86400.0}
DEFAULT_TTL_S = 1800.0
CACHE_CONTROL_DEFAULT_TTL_S = 300.0
#: Breakpoints written per request (OpenAI's: four, one of them implicit in implicit mode).
MAX_WRITTEN = 4


class PromptCacheError(ValueError):
    """Marks that cannot be honoured: ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class Marked(Protocol):
    """What carries the controls: a node's body, or the router's reading of one."""

    @property
    def kv_retention(self) -> RetentionIn | None: ...
    @property
    def prompt_cache_options(self) -> PromptCacheOptions | None: ...
    @property
    def prompt_cache_retention(self) -> str | None: ...


class MarkedChat(Marked, Protocol):
    """A chat that carries them (``ChatCompletionRequest``, the router's ``ProxiedChat``)."""

    @property
    def messages(self) -> list[ChatMessage]: ...
    def chat_messages(self) -> list[dict[str, Any]]: ...
    def chat_tools(self) -> list[dict[str, Any]] | None: ...


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """One mark: where it is in the body, its kind and lifetime, and (once found) its token position."""

    field: str
    kind: str  # "prompt_cache_breakpoint", "cache_control" or "implicit"
    message: int
    part: int | None  # None: the end of the whole message
    ttl_s: float
    position: int = 0  # tokens of the prompt up to the breakpoint


@dataclass(frozen=True, slots=True)
class Segment:
    """Prompt tokens ``[start, end)`` retained at ``priority`` for ``duration_s``."""

    start: int
    end: int
    priority: int
    duration_s: float | None


@dataclass(frozen=True, slots=True)
class CachePlan:
    """What a body's marks retain (:func:`plan_chat`)."""

    #: "prompt_cache" (the marks apply), "kv_retention" (the body's own wins), "none"
    source: str
    written: tuple[Breakpoint, ...] = ()
    ignored: tuple[str, ...] = ()
    segments: tuple[Segment, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """As the answer's ``kvflow.prompt_cache`` shows it."""
        return {"source": self.source,
                "breakpoints": [{"field": b.field, "kind": b.kind, "position": b.position, "ttl_s": b.ttl_s}
                                for b in self.written],
                "ignored": list(self.ignored), "retained": retention_body(self.segments)["token_ranges"]}


def uses_marks(body: Marked) -> bool:
    """Whether the body uses any prompt-caching control that retains (not ``prompt_cache_key``)."""
    if body.prompt_cache_options is not None or body.prompt_cache_retention is not None:
        return True
    return hasattr(body, "messages") and bool(explicit_marks(cast("MarkedChat", body), 0.0))


def _request_ttl(body: Marked) -> float:
    opts = body.prompt_cache_options
    if opts is not None and opts.ttl is not None:
        return TTL_S[opts.ttl]
    if body.prompt_cache_retention is not None:
        return RETENTION_S[body.prompt_cache_retention]
    return DEFAULT_TTL_S


def _part_mark(where: str, i: int, j: int | None, part: ContentPart | ChatMessage,
               default_s: float) -> Breakpoint | None:
    bp = getattr(part, "prompt_cache_breakpoint", None)
    cc = part.cache_control
    if bp is None and cc is None:
        return None
    ttls = []
    if bp is not None:
        ttls.append(TTL_S[bp.ttl] if bp.ttl else default_s)
    if cc is not None:
        ttls.append(TTL_S[cc.ttl] if cc.ttl else CACHE_CONTROL_DEFAULT_TTL_S)
    kind = "prompt_cache_breakpoint" if bp is not None else "cache_control"
    return Breakpoint(f"{where}.{kind}", kind, i, j, max(ttls))


def explicit_marks(body: MarkedChat, default_s: float) -> list[Breakpoint]:
    """Every explicit mark of the chat, in message order (a part's, then its message's).

    Raises:
        PromptCacheError: a mark on a part that holds no text.
    """
    out = []
    for i, m in enumerate(body.messages):
        parts = m.content if isinstance(m.content, list) else []
        for j, part in enumerate(parts):
            mark = _part_mark(f"messages[{i}].content[{j}]", i, j, part, default_s)
            if mark is None:
                continue
            if part.type not in ("text", "refusal") or (part.text if part.type == "text" else part.refusal) is None:
                raise PromptCacheError(mark.field, f"a breakpoint must mark a text part (this one is a "
                                                   f"{part.type!r} part without text)")
            out.append(mark)
        mark = _part_mark(f"messages[{i}]", i, None, m, default_s)
        if mark is not None:
            out.append(mark)
    return out


def system_end(body: MarkedChat) -> int:
    """How many leading messages are system/developer ones (where the implicit breakpoint goes)."""
    n = 0
    while n < len(body.messages) and body.messages[n].role in ("system", "developer"):
        n += 1
    return n


def prefix_tokens(template: ChatTemplate, encode: Callable[[str], Sequence[int]], body: MarkedChat,
                  message: int, part: int | None, prompt: Sequence[int]) -> int:
    """The prompt's tokens up to the end of ``messages[message]`` (cut after ``part`` when given):
    the longest token prefix shared by ``prompt`` and the chat rendered up to there.

    Raises:
        ChatTemplateError: the template refuses the chat cut there.
    """
    messages = body.chat_messages()[:message + 1]
    if part is not None:
        last = dict(messages[-1])
        last["content"] = list(last["content"])[:part + 1]
        messages[-1] = last
    text = template.render(normalize_messages(messages), add_generation_prompt=False, tools=body.chat_tools())
    ids = encode(text)
    n = 0
    for a, b in zip(ids, prompt, strict=False):
        if a != b:
            break
        n += 1
    return n


def segments_of(written: Sequence[Breakpoint], block_size: int, priority: int = BREAKPOINT_PRIORITY
                ) -> tuple[Segment, ...]:
    """Disjoint ranges, whole blocks only: each from the previous breakpoint to the next, retained
    for the longest lifetime among the breakpoints that cover it (those at or after its end)."""
    ends = sorted({(b.position // block_size) * block_size for b in written})
    out = []
    start = 0
    for end in ends:
        if end <= start:
            continue
        ttl = max(b.ttl_s for b in written if (b.position // block_size) * block_size >= end)
        out.append(Segment(start, end, priority, ttl))
        start = end
    return tuple(out)


def plan_chat(body: MarkedChat, template: ChatTemplate, encode: Callable[[str], Sequence[int]],
              prompt: Sequence[int], block_size: int) -> CachePlan:
    """What the chat's marks retain of ``prompt`` (its rendered, tokenized prompt); see the module
    docstring for the rules.

    Raises:
        PromptCacheError: a mark that cannot be placed (``param`` names it).
    """
    explicit = explicit_marks(body, _request_ttl(body))
    if not explicit and body.prompt_cache_options is None and body.prompt_cache_retention is None:
        return CachePlan("none")  # no control used: cached as before (uses_marks, without walking twice)
    if body.kv_retention is not None:
        return CachePlan("kv_retention", ignored=tuple(b.field for b in explicit))
    implicit = body.prompt_cache_options is None or body.prompt_cache_options.mode == "implicit"
    keep = MAX_WRITTEN - 1 if implicit else MAX_WRITTEN
    ignored = explicit[:max(0, len(explicit) - keep)]  # OpenAI's rule: the latest ones are written
    marks = explicit[len(ignored):]
    if implicit and (n := system_end(body)) > 0:
        marks.append(Breakpoint("implicit", "implicit", n - 1, None, _request_ttl(body)))
    written = []
    for b in marks:
        try:
            pos = prefix_tokens(template, encode, body, b.message, b.part, prompt)
        except ChatTemplateError as exc:
            raise PromptCacheError(b.field, f"the chat template cannot render the chat up to this breakpoint: "
                                            f"{exc}") from exc
        written.append(Breakpoint(b.field, b.kind, b.message, b.part, b.ttl_s, pos))
    explicit_at = {b.position for b in written if b.kind != "implicit"}
    written = sorted((b for b in written if b.kind != "implicit" or b.position not in explicit_at),
                     key=lambda b: b.position)  # an implicit breakpoint where an explicit one is: the same
    return CachePlan("prompt_cache", tuple(written), tuple(b.field for b in ignored),
                     segments_of(written, block_size))


def retention_body(segments: Sequence[Segment]) -> dict[str, Any]:
    """The ``kv_retention`` object (``RetentionIn``'s shape) that retains ``segments``."""
    return {"token_ranges": [{"start": s.start, "end": s.end, "priority": s.priority, "duration_s": s.duration_s}
                             for s in segments]}

