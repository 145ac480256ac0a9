"""Chat templates: rendered exactly as transformers' apply_chat_template; normalization; loading.

The reference templates below are written out from the real ones (no network to the Hugging Face
hub): ChatML as Qwen2.5-Instruct has it, Llama 3.1's (tools, ipython), Mistral-Instruct v0.1's
(alternating roles or an error), Gemma 2's (no system role), Llama 3.2's date line through
``strftime_now``, and one Qwen3-like template that uses the rest of the Jinja setup (namespace,
``break``/``continue``, ``{% generation %}``, ``tojson``'s arguments, ``items``, string methods).
"""

from __future__ import annotations

import copy
import hashlib
import json
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openai_api.chat import (
    DEFAULT_CHAT_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
    normalize_messages,
)

pytestmark = pytest.mark.unit

# ----------------------------------------------------------------------------- the templates

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501 - the real template's lines

LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # noqa: E501 - the real template's lines

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)

LLAMA32_DATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ (message['content'] or '') | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # noqa: E501 - the real template's lines

# Not a real model's: every other feature of transformers' Jinja setup, with its whitespace rules.
FEATURES = """{%- set ns = namespace(last_user=-1) %}
{%- for message in messages[::-1] %}
{%- if message.role == 'user' %}{%- set ns.last_user = messages|length - 1 - loop.index0 %}{%- break %}{%- endif %}
{%- endfor %}
{%- if tools %}<tools>
{%- for tool in tools %}
{{ tool | tojson(indent=2, sort_keys=true) }}
{% endfor %}</tools>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and not loop.first %}{% continue %}{% endif %}
<|im_start|>{{ message.role }}
{% if message.role == 'assistant' %}{% generation %}
{%- set content = message.content or '' %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{%- if loop.index0 > ns.last_user and message.reasoning_content is defined %}<think>
{{ message.reasoning_content.strip() }}
</think>
{% endif %}
{{- content }}
{%- for call in message.tool_calls or [] %}
<tool_call>{{ call.function.arguments | tojson(separators=(',', ':')) }}</tool_call>
{%- for k, v in call.function.arguments | items %} {{ k }}={{ v }}{% endfor %}
{%- endfor %}{% endgeneration %}
{%- else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""

# name → (template, bos_token, eos_token); "" is a token the model does not have.
TEMPLATES: dict[str, tuple[str, str, str]] = {
    "kvflow-default": (DEFAULT_CHAT_TEMPLATE, "", ""),
    "qwen2.5": (QWEN25, "", "<|im_end|>"),
    "llama3.1": (LLAMA31, "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": (MISTRAL, "<s>", "</s>"),
    "gemma": (GEMMA, "<bos>", "<eos>"),
    "llama3.2-date": (LLAMA32_DATE, "<|begin_of_text|>", "<|eot_id|>"),
    "features": (FEATURES, "", "<|im_end|>"),
}

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city, now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "description": "The time <UTC> & date.",
                                      "parameters": {"type": "object", "properties": {}}}},
]


def _call(id_: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


SYSTEM = {"role": "system", "content": "You are a terse assistant."}
CHATS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "Hello!"}],
    "system": [SYSTEM, {"role": "user", "content": "Hello!"}],
    "multi-turn": [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                   {"role": "user", "content": "  What is 2+2?  "}],
    "alternating": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}],
    "tool-call": [SYSTEM, {"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [_call("call_1", "get_weather", '{"city": "Oslo", "unit": "c"}')]},
                  {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 12}'}],
    "parallel-calls": [{"role": "user", "content": "Weather in Oslo and the time?"},
                       {"role": "assistant", "content": "Checking.",
                        "tool_calls": [_call("a", "get_weather", '{"city": "Oslo"}'), _call("b", "now", "")]},
                       {"role": "tool", "tool_call_id": "a", "content": "12°C"},
                       {"role": "tool", "tool_call_id": "b", "content": "noon"},
                       {"role": "assistant", "content": "12°C at noon."}],
    "parts": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
              {"role": "user", "content": [{"type": "text", "text": "Part one."},
                                           {"type": "text", "text": "Part two."}]},
              {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}], "refusal": None},
              {"role": "user", "content": "Why?", "name": None}],
    "unicode": [{"role": "user", "content": "héllo 日本 <b>&amp;</b> \"quoted\" \\ {{ not jinja }}"},
                {"role": "assistant", "content": None,
                 "tool_calls": [_call("c", "get_weather", '{"city": "Zürich <b>"}')]}],
    "reasoning": [{"role": "user", "content": "Think."},
                  {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nDone.", "reasoning_content": " hmm "}],
    "not-alternating": [{"role": "user", "content": "One"}, {"role": "user", "content": "Two"}],
    "system-only": [SYSTEM],
}


def _new_hf_tokenizer(bos: str, eos: str) -> Any:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=vocab, bos_token=bos or None, eos_token=eos or None)


@cache
def _hf_tokenizer(bos: str, eos: str) -> Any:
    return _new_hf_tokenizer(bos, eos)


Outcome = tuple[str, str]  # ("ok", prompt) or ("error", why)


def _hf(name: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None) -> Outcome:
    template, bos, eos = TEMPLATES[name]
    try:
        return "ok", _hf_tokenizer(bos, eos).apply_chat_template(
            messages, tools=tools, chat_template=template, add_generation_prompt=add_generation_prompt,
            tokenize=False)
    except Exception as exc:
        return "error", f"{type(exc).__name__}: {exc}"


def _ours(name: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
          tools: list[dict[str, Any]] | None) -> Outcome:
    template, bos, eos = TEMPLATES[name]
    try:
        return "ok", ChatTemplate(template, bos, eos).render(messages, add_generation_prompt=add_generation_prompt,
                                                             tools=tools)
    except ChatTemplateError as exc:
        return "error", str(exc)


# ------------------------------------------------------------------- exactly as transformers


@pytest.mark.parametrize("with_tools", [False, True], ids=["no-tools", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "no-gen"])
@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_renders_exactly_as_transformers(name: str, chat: str, add_generation_prompt: bool, with_tools: bool) -> None:
    messages = normalize_messages(CHATS[chat])
    tools = TOOLS if with_tools else None
    expected = _hf(name, messages, add_generation_prompt, tools)
    got = _ours(name, messages, add_generation_prompt, tools)
    if expected[0] == "error":
        assert got[0] == "error", f"transformers fails ({expected[1]}), kvflow renders {got[1]!r}"
        if expected[1].startswith("TemplateError: "):  # the template's raise_exception: the same message
            assert got[1].endswith(expected[1].removeprefix("TemplateError: "))
    else:
        assert got == expected


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_most_of_the_matrix_renders(name: str) -> None:
    """The comparison above is not vacuous: each template renders most chats."""
    ok = [chat for chat in CHATS if _ours(name, normalize_messages(CHATS[chat]), True, None)[0] == "ok"]
    assert len(ok) >= 3, ok


@pytest.mark.parametrize("name", ["mistral", "gemma"])
def test_non_alternating_roles_raise_in_both(name: str) -> None:
    messages = normalize_messages(CHATS["not-alternating"])
    kind, why = _hf(name, messages, True, None)
    assert kind == "error"
    assert "Conversation roles must alternate" in why
    with pytest.raises(ChatTemplateError, match="rejects these messages: Conversation roles must alternate"):
        ChatTemplate(*TEMPLATES[name]).render(messages)


def test_system_role_rejected_where_the_template_says_so() -> None:
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        ChatTemplate(*TEMPLATES["gemma"]).render(normalize_messages(CHATS["system"]))
    with pytest.raises(ChatTemplateError, match="Only user and assistant roles"):
        ChatTemplate(*TEMPLATES["mistral"]).render(normalize_messages(CHATS["multi-turn"])[1:] + [SYSTEM])


def test_llama_tool_rules_raise() -> None:
    llama = ChatTemplate(*TEMPLATES["llama3.1"])
    with pytest.raises(ChatTemplateError, match="single tool-calls"):
        llama.render(normalize_messages(CHATS["parallel-calls"]))
    with pytest.raises(ChatTemplateError, match="no first user message"):
        llama.render(normalize_messages(CHATS["system-only"]), tools=TOOLS)


def test_llama_tool_call_rendering() -> None:
    got = ChatTemplate(*TEMPLATES["llama3.1"]).render(normalize_messages(CHATS["tool-call"]), tools=TOOLS)
    assert got.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
    assert '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}<|eot_id|>' in got
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temp\\": 12}"<|eot_id|>' in got
    assert got.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_qwen_tool_rendering() -> None:
    got = ChatTemplate(*TEMPLATES["qwen2.5"]).render(normalize_messages(CHATS["parallel-calls"]), tools=TOOLS)
    assert '"description": "The time <UTC> & date."' in got  # tojson: no HTML escapes
    assert ('<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n') in got
    assert ("<|im_start|>user\n<tool_response>\n12°C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"
            "<|im_end|>\n") in got


@pytest.mark.parametrize("template", [
    "{{ strftime_now('%Y-%m-%d') }}",
    "{{ bos_token is defined }} {{ eos_token is defined }} {{ tools is none }} {{ documents is none }}",
    "{{ messages | tojson(indent=1) }}{{ messages[0] | tojson(sort_keys=true, separators=(',', ':')) }}",
    "{{ messages[0].content + 1 }}",  # fails: a TypeError in both
    "{{ messages.append(1) }}",  # the immutable sandbox refuses in both
    "{{ messages[0].content.__class__ }}",  # and unsafe attributes (rendered as undefined)
    "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}",
    "{% generation %}{{ messages[-1].content }}{% endgeneration %}",
    "{{ undefined_variable }}|{{ messages[0].missing }}|{{ messages[0].missing is defined }}",
    "{{ (bos_token or '') + messages[0].content }}",
])
@pytest.mark.parametrize("tokens", [("", ""), ("<s>", "</s>")], ids=["no-tokens", "tokens"])
def test_environment_matches_transformers(template: str, tokens: tuple[str, str]) -> None:
    TEMPLATES["probe"] = (template, *tokens)
    try:
        messages = normalize_messages(CHATS["unicode"])
        expected = _hf("probe", messages, True, None)
        got = _ours("probe", messages, True, None)
        assert got[0] == expected[0], (got, expected)
        if expected[0] == "ok":
            assert got == expected
    finally:
        del TEMPLATES["probe"]


def test_strftime_now_is_local_time() -> None:
    assert ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render(CHATS["user"]) == datetime.now().strftime("%Y-%m-%d")


def test_empty_chat_and_bad_templates() -> None:
    with pytest.raises(ChatTemplateError, match="at least one message"):
        ChatTemplate(DEFAULT_CHAT_TEMPLATE).render([])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% if messages %}unclosed", source="x.jinja")
    with pytest.raises(ChatTemplateError, match=r"from x\.jinja does not compile"):
        ChatTemplate("{{ messages | no_such_filter }}", source="x.jinja")
    with pytest.raises(ChatTemplateError, match="failed on these messages: TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}").render(CHATS["user"])


# ----------------------------------------------------------------------- the default template


def test_default_template_format() -> None:
    messages = normalize_messages([
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello.",
         "tool_calls": [_call("call_1", "get_weather", '{"city": "Oslo"}')]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12°C"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "now", "arguments": "{}"}}]},
    ])
    default = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
    assert default.render(messages) == (
        "<|system|>\nYou are terse.\n<|user|>\nHi!\n<|assistant|>\nHello.\n<|tool_call|>\n"
        '{"id": "call_1", "name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        "<|tool|>\ntool_call_id: call_1\n12°C\n"
        '<|assistant|>\n<|tool_call|>\n{"name": "now", "arguments": {}}\n<|assistant|>\n')
    with_tools = default.render(messages[:2], tools=TOOLS[1:], add_generation_prompt=False)
    assert with_tools == (
        "<|system|>\nYou are terse.\n\n# Tools\n\nYou may call these functions. To call one, answer with a line "
        '<|tool_call|> and, on the next line, a JSON object {"name": ..., "arguments": {...}}:\n'
        f"{json.dumps(TOOLS[1], ensure_ascii=False)}\n<|user|>\nHi!\n")
    assert default.render(messages[1:2], tools=TOOLS[1:]).startswith("<|system|>\n# Tools\n")
    assert default.render([{"role": "user", "content": "x"}]) == "<|user|>\nx\n<|assistant|>\n"


_text = st.text(max_size=40)
_turn = st.tuples(_text, _text)  # (user, assistant answer)


@settings(max_examples=200, deadline=None)
@given(system=st.none() | _text, turns=st.lists(_turn, max_size=4), question=_text, answer=_text,
       follow_up=_text, tools=st.booleans())
def test_default_template_next_turn_extends_the_previous_prompt(
        system: str | None, turns: list[tuple[str, str]], question: str, answer: str, follow_up: str,
        tools: bool) -> None:
    """Turn N+1's prompt starts with turn N's prompt + the answer: multi-turn chats share KV prefix blocks."""
    default = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
    history: list[dict[str, Any]] = [] if system is None else [{"role": "system", "content": system}]
    for user, assistant in turns:
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages = history + [{"role": "user", "content": question}]
    kw: dict[str, Any] = {"tools": TOOLS if tools else None}
    prompt = default.render(normalize_messages(messages), **kw)
    after = default.render(normalize_messages(
        messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]), **kw)
    assert after.startswith(prompt + answer)


def test_default_template_next_turn_after_a_tool_call() -> None:
    default = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    prompt = default.render(normalize_messages(messages), tools=TOOLS)
    generated = '<|tool_call|>\n{"id": "c1", "name": "get_weather", "arguments": {"city": "Oslo"}}'
    call = {"role": "assistant", "content": None, "tool_calls": [_call("c1", "get_weather", '{"city":"Oslo"}')]}
    after = default.render(normalize_messages(messages + [call, {"role": "tool", "tool_call_id": "c1",
                                                                 "content": "12°C"}]), tools=TOOLS)
    assert after.startswith(prompt + generated)


# ------------------------------------------------------------------------------ normalization


def test_normalize_content_parts_and_roles() -> None:
    out = normalize_messages(CHATS["parts"])
    assert out == [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "Part one.\nPart two."},
                   {"role": "assistant", "content": "I can't."},
                   {"role": "user", "content": "Why?"}]
    assert normalize_messages([{"role": "user", "content": ["a", {"type": "text", "text": None},
                                                            {"type": "text", "text": "b"}]}]) == [
        {"role": "user", "content": "a\nb"}]
    with pytest.raises(ChatTemplateError, match=r"messages\[0\].content\[0\]: parts of type 'image_url'"):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ChatTemplateError, match=r"messages\[1\] must be an object"):
        normalize_messages([{"role": "user", "content": "x"}, {"content": "no role"}])


def test_normalize_null_content() -> None:
    call = _call("c", "f", "{}")
    assert normalize_messages([{"role": "user", "content": None}, {"role": "user"}]) == [
        {"role": "user", "content": ""}, {"role": "user", "content": ""}]
    out = normalize_messages([{"role": "assistant", "content": None, "tool_calls": [call]},
                              {"role": "assistant", "tool_calls": [call]},
                              {"role": "assistant", "content": None, "tool_calls": []},
                              {"role": "assistant", "content": None, "tool_calls": None}])
    assert [m["content"] for m in out] == [None, None, "", ""]
    assert ["tool_calls" in m for m in out] == [True, True, False, False]


@pytest.mark.parametrize(("arguments", "parsed"), [
    ('{"city": "Oslo", "n": [1, 2]}', {"city": "Oslo", "n": [1, 2]}),
    ({"already": "a dict"}, {"already": "a dict"}),
    ("", {}),
    (None, {}),
    ("{not json", {}),
    ("[1, 2]", {}),
    ("42", {}),
])
def test_normalize_tool_call_arguments(arguments: Any, parsed: dict[str, Any]) -> None:
    message = {"role": "assistant", "content": None,
               "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}
    (out,) = normalize_messages([message])
    assert out["tool_calls"][0]["function"] == {"name": "f", "arguments": parsed}
    assert out["tool_calls"][0]["id"] == "c"


def test_normalize_drops_none_keys_and_never_mutates() -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "x", "name": None},
                {"role": "assistant", "content": "y", "refusal": None, "tool_calls": None, "function_call": None},
                {"role": "tool", "content": [{"type": "text", "text": "z"}], "tool_call_id": "c", "name": None},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    before = copy.deepcopy(messages)
    out = normalize_messages(messages)
    assert messages == before
    assert out[:3] == [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                       {"role": "tool", "content": "z", "tool_call_id": "c"}]
    assert all(a is not b for a, b in zip(out, messages, strict=True))
    assert out[3]["tool_calls"][0] is not messages[3]["tool_calls"][0]
    out[3]["tool_calls"][0]["function"]["name"] = "changed"
    assert messages[3]["tool_calls"][0]["function"]["name"] == "f"


@pytest.mark.parametrize("chat", list(CHATS))
def test_normalize_is_idempotent(chat: str) -> None:
    once = normalize_messages(CHATS[chat])
    assert normalize_messages(once) == once


# ----------------------------------------------------------------------- version and JSON


def test_version_covers_template_and_tokens_only() -> None:
    base = ChatTemplate("{{ messages[0].content }}", "<s>", "</s>", source="a")
    expected = hashlib.sha256(json.dumps(["{{ messages[0].content }}", "<s>", "</s>"]).encode()).hexdigest()[:16]
    assert base.version == expected
    assert ChatTemplate("{{ messages[0].content }}", "<s>", "</s>", source="b").version == base.version
    others = {ChatTemplate("{{ messages[0].content }} ", "<s>", "</s>").version,
              ChatTemplate("{{ messages[0].content }}", "", "</s>").version,
              ChatTemplate("{{ messages[0].content }}", "<s>", "").version,
              ChatTemplate("{{ messages[0].content }}", "", "<s></s>").version}
    assert len(others) == 4
    assert base.version not in others


def test_default_template_version_is_pinned() -> None:
    # Changing the default template changes every chat prompt of the built-in model (and so its
    # cached blocks): a deliberate change, with docs/chat-templates.md updated.
    assert load_chat_template(None).version == "d7c1a06aad9bf859"


def test_json_round_trip() -> None:
    t = ChatTemplate(QWEN25, "", "<|im_end|>", source="/models/qwen/tokenizer_config.json")
    d = json.loads(json.dumps(t.to_json()))
    assert set(d) == {"chat_template", "bos_token", "eos_token", "version", "source"}
    back = ChatTemplate.from_json(d)
    assert back.to_json() == t.to_json()
    messages = normalize_messages(CHATS["tool-call"])
    assert back.render(messages, tools=TOOLS) == t.render(messages, tools=TOOLS)


def test_from_json_checks_the_version() -> None:
    d = ChatTemplate(DEFAULT_CHAT_TEMPLATE, source="kvflow default").to_json()
    with pytest.raises(ValueError, match="does not match"):
        ChatTemplate.from_json({**d, "eos_token": "</s>"})
    with pytest.raises(ValueError, match="does not match"):
        ChatTemplate.from_json({k: v for k, v in d.items() if k != "version"})
    with pytest.raises(ValueError, match="'chat_template'"):
        ChatTemplate.from_json({"version": d["version"]})


# ------------------------------------------------------------------------------------ loading


def _write(folder: Path, name: str, content: Any) -> None:
    text = content if isinstance(content, str) else json.dumps(content)
    (folder / name).write_text(text, encoding="utf-8")


def test_load_default_without_a_template(tmp_path: Path) -> None:
    for where in (None, tmp_path, tmp_path / "missing"):
        t = load_chat_template(where)
        assert (t.template, t.bos_token, t.eos_token, t.source) == (DEFAULT_CHAT_TEMPLATE, "", "", "kvflow default")
    _write(tmp_path, "tokenizer_config.json", {"bos_token": "<s>", "chat_template": None})
    assert load_chat_template(str(tmp_path)).source == "kvflow default"


def test_load_from_tokenizer_config(tmp_path: Path) -> None:
    _write(tmp_path, "tokenizer_config.json", {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
        "eos_token": "</s>", "chat_template": MISTRAL})
    t = load_chat_template(tmp_path)
    assert (t.template, t.bos_token, t.eos_token) == (MISTRAL, "<s>", "</s>")
    assert t.source == str(tmp_path / "tokenizer_config.json")
    assert t.render(normalize_messages(CHATS["alternating"])) == (
        "<s>[INST] Hi [/INST]Hello.</s>[INST] Bye [/INST]Bye.</s>")


def test_load_prefers_chat_template_jinja(tmp_path: Path) -> None:
    _write(tmp_path, "tokenizer_config.json", {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": GEMMA})
    _write(tmp_path, "chat_template.jinja", QWEN25)
    t = load_chat_template(tmp_path)
    assert (t.template, t.bos_token, t.eos_token) == (QWEN25, "", "<|im_end|>")
    assert t.source == str(tmp_path / "chat_template.jinja")


def test_load_list_form(tmp_path: Path) -> None:
    _write(tmp_path, "tokenizer_config.json", {"chat_template": [
        {"name": "tool_use", "template": LLAMA31}, {"name": "default", "template": GEMMA}]})
    assert load_chat_template(tmp_path).template == GEMMA
    _write(tmp_path, "tokenizer_config.json", {"chat_template": [{"name": "rag", "template": GEMMA}]})
    with pytest.raises(ChatTemplateError, match="'default'"):
        load_chat_template(tmp_path)


def test_load_errors(tmp_path: Path) -> None:
    _write(tmp_path, "tokenizer_config.json", "{not json")
    with pytest.raises(ChatTemplateError, match="not valid JSON"):
        load_chat_template(tmp_path)
    _write(tmp_path, "tokenizer_config.json", {"chat_template": "{% for %}"})
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config\.json does not compile"):
        load_chat_template(tmp_path)


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1", "gemma"])
def test_load_what_transformers_saves(tmp_path: Path, name: str) -> None:
    template, bos, eos = TEMPLATES[name]
    saved = _new_hf_tokenizer(bos, eos)
    saved.chat_template = template
    saved.save_pretrained(tmp_path)
    t = load_chat_template(tmp_path)
    assert (t.template, t.bos_token, t.eos_token) == (template, bos, eos)
    chat = "tool-call" if name != "gemma" else "alternating"
    messages = normalize_messages(CHATS[chat])
    assert t.render(messages, tools=TOOLS) == saved.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)

