"""The router's chat templates: fetched once from a live node of the model, kept while that node
instance lives (at most the TTL), the last one kept when no node answers."""

from __future__ import annotations

import asyncio

import httpx

from openai_api.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from routing_api.templates import ChatTemplates

OTHER = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def row(node: str, instance: str = "i1", status: str = "live", model: str = "m") -> dict:
    return {"node_id": node, "instance_id": instance, "status": status, "model": model,
            "url": f"http://{node}.test"}


class Nodes:
    """Nodes answering GET /v1/chat/template (a template per node; None: the node is down)."""

    def __init__(self, **templates: str | None) -> None:
        self.templates = templates
        self.asked: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        node = request.url.host.removesuffix(".test")
        self.asked.append(node)
        template = self.templates.get(node)
        if template is None:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"model": "m", **ChatTemplate(template).to_json()})


def run(nodes: Nodes, *calls: list[dict], ttl_s: float = 60.0) -> list[str | None]:
    async def go() -> list[str | None]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(nodes)) as client:
            templates = ChatTemplates(client, ttl_s)
            out = []
            for rows in calls:
                t = await templates.get("m", rows)
                out.append(None if t is None else t.template)
            return out

    return asyncio.run(go())


def test_fetched_once_and_kept_while_its_node_instance_lives():
    nodes = Nodes(a=DEFAULT_CHAT_TEMPLATE, b=OTHER)
    rows = [row("a"), row("b")]
    assert run(nodes, rows, rows, rows) == [DEFAULT_CHAT_TEMPLATE] * 3
    assert nodes.asked == ["a"]


def test_fetched_again_when_its_node_restarts_or_goes_and_after_the_ttl():
    nodes = Nodes(a=DEFAULT_CHAT_TEMPLATE, b=OTHER)
    got = run(nodes, [row("a"), row("b")], [row("a", "i2"), row("b")], [row("a", status="gone"), row("b")])
    assert got == [DEFAULT_CHAT_TEMPLATE, DEFAULT_CHAT_TEMPLATE, OTHER] and nodes.asked == ["a", "a", "b"]
    nodes = Nodes(a=DEFAULT_CHAT_TEMPLATE)
    assert run(nodes, [row("a")], [row("a")], ttl_s=0.0) == [DEFAULT_CHAT_TEMPLATE] * 2 and nodes.asked == ["a", "a"]


def test_a_node_that_does_not_answer_is_skipped_and_the_last_template_beats_none():
    nodes = Nodes(a=None, b=OTHER)
    assert run(nodes, [row("a"), row("b")]) == [OTHER] and nodes.asked == ["a", "b"]
    nodes = Nodes(a=DEFAULT_CHAT_TEMPLATE)
    first, later = [row("a")], [row("a", "i2")]

    def down_after_first(request: httpx.Request) -> httpx.Response:
        answer = Nodes(a=DEFAULT_CHAT_TEMPLATE if not nodes.asked else None)(request)
        nodes.asked.append("a")
        return answer

    async def go() -> list[str | None]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(down_after_first)) as client:
            templates = ChatTemplates(client)
            return [None if (t := await templates.get("m", rows)) is None else t.template for rows in (first, later)]

    assert asyncio.run(go()) == [DEFAULT_CHAT_TEMPLATE, DEFAULT_CHAT_TEMPLATE]
    assert run(Nodes(a=None), [row("a")]) == [None]
    assert run(Nodes(a=OTHER), [row("a", model="other")]) == [None]  # no node of the model


def test_nodes_that_serve_no_template_get_the_routers_own_folders():
    async def go() -> str | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(Nodes(a=None))) as client:  # e.g. a vLLM
            t = await ChatTemplates(client, fallback=ChatTemplate(OTHER, source="folder")).get("m", [row("a")])
            return None if t is None else t.template

    assert asyncio.run(go()) == OTHER
