"""Chat templates: OpenAI chat messages → one prompt string, as the model's own template says.

Both the inference node (to run a chat) and the router (to hash a chat's prompt and route it to the
node that caches its prefix) render chats here, so both must produce the same string, byte for
byte; and both must produce what the model was trained on. No torch here: the router imports it.

**The rule: exactly what transformers renders.** :meth:`ChatTemplate.render` gives the string that
Hugging Face ``transformers`` gives for ``tokenizer.apply_chat_template(messages, tokenize=False,
add_generation_prompt=..., tools=...)`` with the same template and special tokens, without
importing transformers. It reproduces transformers' Jinja setup (``chat_template_utils.py``):

* ``jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
  ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``) and the ``{% generation %}`` tag
  (transformers' ``AssistantTracker``; here it only renders its body);
* the ``tojson`` filter replaced by ``json.dumps(x, ensure_ascii=False, indent=..., separators=...,
  sort_keys=...)`` (Jinja's own escapes HTML characters);
* the globals ``raise_exception(message)`` (the template rejects the chat) and
  ``strftime_now(format)`` (local time, ``datetime.now().strftime``);
* the variables ``messages``, ``tools`` (``None`` when not given), ``documents`` (``None``),
  ``add_generation_prompt``, and ``bos_token`` / ``eos_token`` when the model has them (an empty
  token here is a token the model does not have: the variable is then undefined, as transformers
  leaves a ``None`` token out of its ``special_tokens_map``).

A template that raises or fails to render raises :class:`ChatTemplateError` (a ``ValueError``)
saying why; so does an empty chat (transformers refuses one too).

**Messages are normalized first** (:func:`normalize_messages`, what the OpenAI API allows →
what templates expect, as vLLM does with its "string" content format): content given as parts
(``text``, ``refusal``) becomes one string, the parts joined with ``"\\n"``; ``None`` content
becomes ``""`` except for an assistant message with tool calls; role ``developer`` becomes
``system``; a tool call's ``function.arguments`` JSON string becomes the object it encodes
(templates write it with ``| tojson``), ``{}`` when it is empty, not valid JSON or not an object;
an empty ``tool_calls`` list and keys whose value is ``None`` are dropped (templates test
``'tool_calls' in message`` or ``message.name is defined``), and so is a message's ``cache_control``
(a prompt-caching mark, ``openai_api.prompt_cache``, not part of the prompt). :meth:`ChatTemplate.render` renders
the messages it is given as they are: pass it :func:`normalize_messages`' result.

**The default template** (:data:`DEFAULT_CHAT_TEMPLATE`, kvflow's built-in byte-token model, which
has no special tokens) tags each message with its role on a line of its own and ends each
message with a newline (the ``# Tools`` part only when ``tools`` are given)::

    <|system|>
    You are terse.

    # Tools

    You may call these functions. To call one, answer with a line <|tool_call|> and, ...
    {"type": "function", "function": {"name": "get_weather", ...}}
    <|user|>
    Hi!
    <|assistant|>
    Hello.
    <|tool_call|>
    {"id": "call_1", "name": "get_weather", "arguments": {"city": "Oslo"}}
    <|tool|>
    tool_call_id: call_1
    12°C
    <|assistant|>

Nothing a message renders depends on the messages after it, and the generation prompt is the
same ``<|assistant|>\\n`` an answered assistant message starts with, so a conversation's next turn
renders as its previous prompt + the answer + the new messages: multi-turn chats share their KV
prefix blocks.

:func:`load_chat_template` finds a model folder's template (``chat_template.jinja``, else
``tokenizer_config.json``'s ``chat_template``) and falls back to the default. A template's
:attr:`ChatTemplate.version` (over the template and its special tokens) tells the router whether
the template it renders with is the one the node renders with.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "ChatTemplate",
    "ChatTemplateError",
    "load_chat_template",
    "normalize_messages",
]

DEFAULT_CHAT_TEMPLATE: str = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] or '' %}"
    "{%- set rest = messages[1:] %}"
    "{%- else %}"
    "{%- set system = none %}"
    "{%- set rest = messages %}"
    "{%- endif %}"
    "{%- if tools %}"
    "{{- '<|system|>\\n' }}"
    "{%- if system %}{{- system + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call these functions. To call one, answer with a line <|tool_call|> and, on the '"
    " + 'next line, a JSON object {\"name\": ..., \"arguments\": {...}}:\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n' }}{%- endfor %}"
    "{%- elif system is not none %}"
    "{{- '<|system|>\\n' + system + '\\n' }}"
    "{%- endif %}"
    "{%- for message in rest %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|assistant|>\\n' }}"
    "{%- if message['content'] %}{{- message['content'] + '\\n' }}{%- endif %}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- if call['id'] %}"
    "{{- '<|tool_call|>\\n' + ({'id': call['id'], 'name': fn['name'], 'arguments': fn['arguments']} | tojson)"
    " + '\\n' }}"
    "{%- else %}"
    "{{- '<|tool_call|>\\n' + ({'name': fn['name'], 'arguments': fn['arguments']} | tojson) + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|tool|>\\n' }}"
    "{%- if message['tool_call_id'] %}{{- 'tool_call_id: ' + message['tool_call_id'] + '\\n' }}{%- endif %}"
    "{{- (message['content'] or '') + '\\n' }}"
    "{%- else %}"
    "{{- '<|' + message['role'] + '|>\\n' + (message['content'] or '') + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)
"""kvflow's built-in template: ``<|role|>\\n`` + content + ``\\n`` per message (module docstring)."""

DEFAULT_SOURCE = "kvflow default"

_TEXT_PARTS = {"text": "text", "refusal": "refusal"}  # part type → the key holding its text


class ChatTemplateError(ValueError):
    """A chat template that does not compile, rejects the chat (``raise_exception``) or fails."""


class _TemplateRaised(jinja2.TemplateError):
    """What the template's ``raise_exception(message)`` raises (a ``TemplateError``, as transformers')."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant tokens with it; the body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()  # rendering is thread-safe; compiled templates share it


def _version(template: str, bos_token: str, eos_token: str) -> str:
    blob = json.dumps([template, bos_token, eos_token], ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


class ChatTemplate:
    """A compiled chat template and the special tokens it may use. Immutable by convention."""

    __slots__ = ("_compiled", "_tokens", "bos_token", "eos_token", "source", "template", "version")

    template: str
    bos_token: str
    eos_token: str
    source: str
    version: str

    def __init__(self, template: str, bos_token: str = "", eos_token: str = "", source: str = "") -> None:
        if not isinstance(template, str) or not isinstance(bos_token, str) or not isinstance(eos_token, str):
            raise ChatTemplateError("a chat template and its special tokens are strings")
        self.template = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.source = source
        self.version = _version(template, bos_token, eos_token)
        # A token the model lacks is left undefined, as transformers leaves out a None token.
        self._tokens = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v}
        try:
            self._compiled = _ENV.from_string(template)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template{self._where()} does not compile: {exc.message} "
                                    f"(line {exc.lineno})") from exc
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template{self._where()} does not compile: {exc}") from exc

    def _where(self) -> str:
        return f" from {self.source}" if self.source else ""

    def __repr__(self) -> str:
        return f"ChatTemplate(version={self.version!r}, source={self.source!r})"

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt of ``messages`` (normalized: :func:`normalize_messages`), as transformers renders it."""
        if not messages:
            raise ChatTemplateError("a chat needs at least one message")
        try:
            return self._compiled.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self._tokens)
        except _TemplateRaised as exc:
            raise ChatTemplateError(f"the chat template rejects these messages: {exc.message}") from exc
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from exc
        except Exception as exc:  # a template's own bug (e.g. None + str): the chat cannot be rendered
            raise ChatTemplateError(f"the chat template failed on these messages: "
                                    f"{type(exc).__name__}: {exc}") from exc

    def to_json(self) -> dict[str, Any]:
        return {"chat_template": self.template, "bos_token": self.bos_token, "eos_token": self.eos_token,
                "version": self.version, "source": self.source}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ChatTemplate:
        """The template of :meth:`to_json`; a ``ValueError`` when its version does not match its text."""
        if not isinstance(d, dict) or not isinstance(d.get("chat_template"), str):
            raise ValueError("a chat template's JSON needs a string 'chat_template'")
        out = cls(d["chat_template"], d.get("bos_token") or "", d.get("eos_token") or "",
                  source=d.get("source") or "")
        if d.get("version") != out.version:
            raise ValueError(f"chat template version {d.get('version')!r} does not match its text "
                             f"(which is version {out.version!r})")
        return out


# ------------------------------------------------------------------------------ normalization


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages → what chat templates expect (module docstring). New dicts; idempotent."""
    if not isinstance(messages, list):
        raise ChatTemplateError("messages must be a list")
    return [_normalize_message(i, m) for i, m in enumerate(messages)]


def _normalize_message(i: int, message: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ChatTemplateError(f"messages[{i}] must be an object with a string 'role'")
    out = {k: v for k, v in message.items() if v is not None and k != "cache_control"}  # kvflow's, not the template's
    if out["role"] == "developer":
        out["role"] = "system"
    calls = out.pop("tool_calls", None)
    if calls is not None:
        if not isinstance(calls, list):
            raise ChatTemplateError(f"messages[{i}].tool_calls must be a list")
        if calls:
            out["tool_calls"] = [_normalize_tool_call(f"messages[{i}].tool_calls[{j}]", c)
                                 for j, c in enumerate(calls)]
    content = message.get("content")
    if content is None:
        out["content"] = None if out.get("tool_calls") and out["role"] == "assistant" else ""
    elif isinstance(content, list):
        out["content"] = _join_parts(i, content)
    elif not isinstance(content, str):
        raise ChatTemplateError(f"messages[{i}].content must be a string, a list of parts or null")
    return out


def _join_parts(i: int, parts: list[Any]) -> str:
    texts: list[str] = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise ChatTemplateError(f"messages[{i}].content[{j}]: parts of type {kind!r} are not supported "
                                    "(text and refusal only)")
        text = part.get(_TEXT_PARTS[kind])
        if text is None:
            continue  # vLLM skips a text part without text
        if not isinstance(text, str):
            raise ChatTemplateError(f"messages[{i}].content[{j}].{_TEXT_PARTS[kind]} must be a string")
        texts.append(text)
    return "\n".join(texts)


def _normalize_tool_call(where: str, call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ChatTemplateError(f"{where} must be an object with a 'function' object")
    out = {k: v for k, v in call.items() if v is not None}
    function = {k: v for k, v in call["function"].items() if v is not None}
    function["arguments"] = _arguments(function.get("arguments"))
    out["function"] = function
    return out


def _arguments(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as an object (vLLM's rule): parsed JSON, ``{}`` when empty or not an object."""
    if isinstance(arguments, dict):
        return dict(arguments)
    if isinstance(arguments, str) and arguments:
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


# ------------------------------------------------------------------------------------ loading


def load_chat_template(model_dir: str | Path | None) -> ChatTemplate:
    """A model folder's chat template; kvflow's default when there is no folder or it has no template.

    ``chat_template.jinja`` (transformers >= 4.43 saves it there) wins over ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of ``{"name", "template"}`` of which ``default`` is taken);
    ``bos_token`` and ``eos_token`` come from ``tokenizer_config.json`` (a string or ``{"content": ...}``).
    """
    if model_dir is None:
        return ChatTemplate(DEFAULT_CHAT_TEMPLATE, source=DEFAULT_SOURCE)
    folder = Path(model_dir)
    config_path = folder / "tokenizer_config.json"
    config = _read_config(config_path)
    bos, eos = _token(config.get("bos_token"), "bos_token"), _token(config.get("eos_token"), "eos_token")
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        return ChatTemplate(jinja_path.read_text(encoding="utf-8"), bos, eos, source=str(jinja_path))
    template = _config_template(config.get("chat_template"), config_path)
    if template is None:
        return ChatTemplate(DEFAULT_CHAT_TEMPLATE, source=DEFAULT_SOURCE)
    return ChatTemplate(template, bos, eos, source=str(config_path))


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ChatTemplateError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ChatTemplateError(f"{path} is not a JSON object")
    return config


def _token(value: Any, name: str) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ChatTemplateError(f"tokenizer_config.json's {name} must be a string or {{'content': ...}}")
    return value


def _config_template(value: Any, path: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        if isinstance(template, str):
            return template
        raise ChatTemplateError(f"{path}: none of its chat templates {sorted(map(str, named))} is named "
                                "'default'")
    raise ChatTemplateError(f"{path}: chat_template must be a string or a list of {{'name', 'template'}}")
