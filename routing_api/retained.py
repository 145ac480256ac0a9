"""The retention the router sends with a proxied request (docs/prompt-caching.md).

What a request retains comes from, in order: its own ``kv_retention``; its prompt-caching marks
(``openai_api.prompt_cache``, placed by the router with the model's chat template, as the node
places them); the first fleet rule that matches it (``routing_api.retention``). Then its tenant's
limits apply. The body goes to a kvflow node unchanged unless a rule gave the retention or a limit
lowered it: then it carries the result as ``kv_retention`` (which a node takes over any marks). An
engine behind a bridge gets the retention in its own words (``routing_api.engine_words``).
"""

from __future__ import annotations

from collections.abc import Sequence

from eventbus.protocol import ENGINE_KVFLOW
from openai_api.chat import ChatTemplate
from openai_api.prompt_cache import MarkedChat, plan_chat, retention_body, uses_marks
from openai_api.schemas import _Proxied
from routing_api.decisions import Routed
from routing_api.retention import Retention, cap_priority, rule_retention
from routing_api.state import RouterState

__all__ = ["Retention", "retain"]


def retain(state: RouterState, routed: Routed, req: _Proxied, chat: MarkedChat | None, template: ChatTemplate | None,
           tenant: str | None, model: str | None) -> Retention | None:
    """The request's retention after the rules and its tenant's limits (``in_body``: to be sent as
    the body's ``kv_retention``, for it differs from what the node would make of the body); None
    when the router has nothing to say.

    Raises:
        PromptCacheError: marks that cannot be placed (the node would refuse them the same way).
    """
    policy = state.policy
    bs = routed.block_size
    tokens: Sequence[int] = routed.prompt.tokens if routed.prompt is not None else ()  # as the decision tokenized them

    def encode(text: str) -> Sequence[int]:
        return state.tokenizer.encode_compact(text, add_special_tokens=False)

    plan = None if req.kv_retention is not None or chat is None or template is None else \
        plan_chat(chat, template, encode, tokens, bs)
    if req.kv_retention is not None:
        r = Retention("kv_retention", req.kv_retention.model_dump())
    elif plan is not None and plan.source == "prompt_cache":
        r = Retention("prompt_cache", retention_body(plan.segments))
    elif plan is None and uses_marks(req):
        return None  # marks without a template to place them (the node does), or a completion's (nothing to mark)
    else:
        rule = policy.rule_for(model, tenant, bool(chat is not None and chat.chat_tools()), len(tokens))
        if rule is None:
            return None
        r = Retention("rule", rule_retention(rule, chat, template, encode, tokens, bs), rule=rule.name)
    if r.source != "rule" and not policy.limits_anything and \
            all(c.engine == ENGINE_KVFLOW for c in routed.decision.ranked()):
        return None  # kvflow's nodes make the same retention of the body themselves
    limit = policy.limit_for(tenant)
    cap_priority(r, limit, tenant)
    chosen = routed.decision.chosen
    if chosen is not None and routed.prompt is not None and limit.max_retained_share < 1:
        capacity = next((v.capacity_gpu for v in routed.prompt.fleet.views if v.node_id == chosen.node_id), 0)
        state.ledger.admit(r, limit, tenant, chosen.node_id, capacity,
                           routed.prompt.hashed.get(chosen.block_size, b""), chosen.block_size or bs)
    if routed.recent is not None:  # the dashboard's recent decisions show it
        routed.recent["retention"] = r.source + (f":{r.rule}" if r.rule else "") + (" (lowered)" if r.lowered else "")
    return r
