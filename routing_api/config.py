"""Router settings (``KVFLOW_ROUTER_…``) and API keys."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from eventbus.protocol import DEFAULT_PRIORITY
from routing_api.scoring import DEFAULT_WEIGHTS as W
from routing_api.scoring import RoutingWeights

SCOPES = frozenset({"route", "complete", "read"})


class RouterSettings(BaseSettings):
    """Every setting of the router, from ``KVFLOW_ROUTER_…`` (the weights' defaults: ``RoutingWeights``)."""

    model_config = SettingsConfigDict(env_prefix="KVFLOW_ROUTER_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Bind address.")
    port: int = Field(default=8000, description="HTTP port.")
    workers: int = Field(default=1, ge=1, le=64, description=(
        "Router processes sharing the port. Each keeps its own in-flight counts, suspicion marks and "
        "recent decisions (/v1/stats, the dashboard), so one process is the most exact; more scale throughput."))
    api_keys: SecretStr | None = Field(
        default=None,
        description="Comma-separated `key[:tenant[:scope+scope]]`; scopes route, complete, read (default all). "
                    "A tenant's requests use its name as cache salt. None: open (development only).")
    api_keys_file: str | None = Field(default=None, description="File holding api_keys.")
    node_api_key: SecretStr | None = Field(default=None, description="Bearer key the router presents to nodes.",
                                           validation_alias="KVFLOW_NODE_API_KEY")
    tokenizer_dir: str | None = Field(default=None, description="Folder with the nodes' tokenizer.json.")
    block_size: int | None = Field(default=None, ge=1, description=(
        "Hash at this block size only (nodes of other sizes excluded); default: each node at its own."))
    overlap_weight: float = Field(default=W.overlap_weight, ge=0, description="Weight of blocks still to prefill.")
    host_credit: float = Field(default=W.host_credit, ge=0, le=1, description="Credit of a host-tier block.")
    low_priority_credit: float = Field(default=W.low_priority_credit, ge=0, le=1,
                                       description=f"Credit factor below priority {DEFAULT_PRIORITY}.")
    queued_weight_blocks: float = Field(default=W.queued_weight_blocks, ge=0,
                                        description="Blocks of load per queued request.")
    busy_fraction: float = Field(default=W.busy_fraction, gt=0,
                                 description="Load share of GPU blocks that filters a node out.")
    temperature: float = Field(default=W.temperature, ge=0, description="Softmax sampling temperature (0: argmin).")
    load_bound: float = Field(default=W.load_bound, ge=0, description=(
        "Bounded loads: a node whose load (blocks in hand) exceeds (1 + this) x the fleet's mean, the request "
        "counted, is not chosen; its prefixes go to a second node (0: off, the cost alone decides)."))
    work_bound: float = Field(default=W.work_bound, ge=0, description=(
        "Bounded work (with load_bound on): a node whose prefill work routed lately plus this request's exceeds "
        "(1 + this) x the fleet's mean is not chosen (0: off)."))
    work_tau_s: float = Field(default=W.work_tau_s, gt=0, description=(
        "Time constant (s) of the decay of the prefill work routed to each node (work_bound)."))
    ttft_quantile: float = Field(default=W.ttft_quantile, ge=0, lt=1, description=(
        "The tail guard: a request whose predicted time to first token on the cost's choice (queued) is above "
        "this quantile of the recent choices' goes to the node where it starts soonest, if sooner by more than the "
        "prefill the move gives up (0: off)."))
    ttft_tolerance: float = Field(default=W.ttft_tolerance, ge=0, le=1, description=(
        "The tail guard's nodes: their cached share of the prompt at most this much below the choice's."))
    ttft_work_slack: float = Field(default=W.ttft_work_slack, ge=1, description=(
        "The tail guard's nodes: their prefill work lately, this request's included, at most this x the choice's."))
    bound_gate: float = Field(default=W.bound_gate, ge=0, description=(
        "The bound gate: the node the cost alone would choose, left out by the load or work bound, takes the "
        "request anyway when its predicted time to first token is at most this x the bounded choice's (0: off)."))
    queue_tiebreak: bool = Field(default=W.queue_tiebreak, description=(
        "When the choice has a prefill queue, a node holding at least as much of the prompt where it starts "
        "sooner takes the request (false: off)."))
    noise_allowance: float = Field(default=W.noise_allowance, ge=0, description=(
        "The load bound is never tighter than the fleet's mean load plus this many spreads of a sum of requests "
        "in hand (sqrt(mean x blocks per request)): a node's share of a few requests is not imbalance (0: off)."))
    hub_fanout: int = Field(default=W.hub_fanout, ge=0, description=(
        "Hubs: a prefix that this many distinct prompts continue is copied (a one-token prefill of its tokens) "
        "to a light idle node when the bound gate keeps a request on an over-bound node holding it, and a "
        "request stays on an idle over-bound node holding its own context beyond such a prefix (0: both off)."))
    prefill_tokens_per_s: float = Field(default=10000.0, gt=0, description=(
        "A node's prefill rate before the router has measured it (from the first tokens it proxies): "
        "the tail guard's predicted waits."))
    retention_rules: str | None = Field(default=None, description=(
        "Fleet retention rules and tenant limits (docs/prompt-caching.md): 'seed' (the seed's table for "
        "requests that carry no retention) or a JSON file; unset: none (requests keep what they carry)."))
    nodes_cache_s: float = Field(default=0.5, ge=0, description="How long the nodes table is cached.")
    suspect_s: float = Field(default=10.0, ge=0, description="How long a node that failed a request is avoided.")
    account_finished: bool = Field(default=True, description=(
        "Take the load of the requests this router saw finish off the heartbeat that still counts them "
        "(false: the heartbeat's load as it is, as before; for comparisons)."))
    upstream_timeout_s: float = Field(default=300.0, gt=0, description="Timeout of a proxied request.")
    chat_template_ttl_s: float = Field(default=60.0, ge=0, description=(
        "How long a model's chat template, fetched from a node, is used before it is fetched again."))
    recent_decisions: int = Field(default=200, ge=1, description="Decisions kept for the dashboard.")
    max_request_bytes: int = Field(default=4 * 1024 * 1024, description="Largest request body accepted.")
    # A read replica (KVFLOW_DATABASE_READER_URL on a streaming standby): docs/scaling.md, "Read replicas".
    primary_reader_url: SecretStr | None = Field(default=None, description=(
        "The read-only role's URL on the primary, when KVFLOW_DATABASE_READER_URL is a standby: the "
        "reference of the replication lag, and where the router reads while the standby lags more than "
        "replica_max_lag_s. None: the lag is measured on the standby alone, and answers are only flagged."))
    replica_max_lag_s: float = Field(default=2.0, gt=0, description=(
        "Replication lag beyond which the router reads the primary (primary_reader_url) instead of the standby."))
    replica_check_s: float = Field(default=1.0, ge=0, description=(
        "How often the router measures the standby's lag (0: never; a reader that is no standby is "
        "checked once)."))

    def weights(self) -> RoutingWeights:
        """The decision's weights, as set (each ``RoutingWeights`` field has a setting of its name)."""
        return RoutingWeights(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RoutingWeights)})

    def api_key_spec(self) -> str:
        """The API keys' spec: ``api_keys``, else the contents of ``api_keys_file``, else "" (open)."""
        if self.api_keys:
            return self.api_keys.get_secret_value()
        return Path(self.api_keys_file).read_text().strip() if self.api_keys_file else ""


@dataclass(frozen=True)
class ApiKey:
    """One API key: the tenant whose name salts its requests (if any) and the scopes it grants."""

    key: str
    tenant: str | None
    scopes: frozenset[str]


def parse_api_keys(spec: str) -> dict[str, ApiKey]:
    """``key[:tenant[:scope+scope]]`` entries, comma-separated.

    Raises:
        ValueError: an unknown scope or an empty key.
    """
    out: dict[str, ApiKey] = {}
    for entry in spec.split(","):
        entry = entry.strip()
        if not entry:
            continue
        key, _, rest = entry.partition(":")
        tenant, _, scopes = rest.partition(":")
        if not key:
            raise ValueError("an API key entry has an empty key")
        scope_set = frozenset(s for s in scopes.split("+") if s) if scopes else SCOPES
        unknown = scope_set - SCOPES
        if unknown:
            raise ValueError(f"unknown API key scopes {sorted(unknown)}; known: {sorted(SCOPES)}")
        out[key] = ApiKey(key, tenant or None, scope_set)
    return out
