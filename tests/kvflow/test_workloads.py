"""The generated workload families: deterministic, sorted, scaled, and each with its defining property."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, defaultdict

import pytest

from kvflow.sim.workloads import (
    BLOCK_TOKENS,
    GENERATORS,
    MOONCAKE_PROMPT_TOKENS_PER_S,
    SHIFTING_PHASES,
    Labelled,
    SimRequest,
    as_trace,
    chain_key,
    chunk_chain,
    labelled,
    write_trace,
)
from kvflow.traces import load_trace, replay_core, trace_prompts

FAMILIES = ("system_prompt", "multi_turn", "agentic", "rag", "scan", "shifting_mix", "hot_prefixes", "one_shot",
            "bursts", "zipf_skew", "long_tail", "many_tenants", "prefix_tree")


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="module")
def full() -> dict[str, list[Labelled]]:
    """Every family at its defaults (6,000 requests)."""
    return {name: labelled(name) for name in FAMILIES}


def test_the_families_are_offered_deterministic_sorted_and_of_the_size_asked():
    assert tuple(GENERATORS) == FAMILIES
    for name, gen in GENERATORS.items():
        a, b = gen(400), gen(400)
        assert a == b and len(a) == 400, name
        assert all(x.t <= y.t for x, y in itertools.pairwise(a)), name
        assert gen(400, seed=99) != a, name  # the seed matters
        assert [x.req for x in labelled(name, 400)] == a, name  # the labels describe the same requests


def test_each_family_is_scaled_for_the_benchmarks(full):
    """Offered prompt load about the Mooncake trace's, a working set over 16,000 blocks, and an LRU
    cache of 1,000 blocks that neither always hits nor always misses (one_shot: the floor)."""
    for name, xs in full.items():
        reqs = [x.req for x in xs]
        tokens = sum(len(r.keys) for r in reqs) * BLOCK_TOKENS
        rate = tokens / (reqs[-1].t - reqs[0].t)
        assert 0.9 * MOONCAKE_PROMPT_TOKENS_PER_S < rate < 1.1 * MOONCAKE_PROMPT_TOKENS_PER_S, (name, rate)
        assert len({k for r in reqs for k in r.keys}) > 16_000, name
        trace = as_trace(reqs)
        hit = replay_core(trace, trace_prompts(trace), 1000).hit_rate
        if name == "one_shot":
            assert hit == 0.0
        else:
            assert 0.1 < hit < 0.9, (name, hit)


def test_the_load_the_families_aim_at_is_the_mooncake_traces():
    trace = load_trace()
    rate = sum(r.input_length for r in trace) / (trace[-1].timestamp_s - trace[0].timestamp_s)
    assert round(rate) == MOONCAKE_PROMPT_TOKENS_PER_S


def test_multi_turn_resends_the_history_and_comes_back_after_heavy_tailed_gaps(full):
    sessions: dict[tuple[int, ...], list[Labelled]] = defaultdict(list)
    for x in full["multi_turn"]:
        sessions[x.unit[:1]].append(x)
    think: list[float] = []
    for turns in sessions.values():
        assert [x.unit[1] for x in turns] == list(range(len(turns)))  # turns in order, none lost
        for a, b in itertools.pairwise(turns):
            assert b.req.keys[:len(a.req.keys)] == a.req.keys  # the whole previous prompt …
            assert len(b.req.keys) > len(a.req.keys)  # … plus the answer and the question
            think.append(b.req.t - a.req.t - a.req.output_tokens / 30)
    assert len(sessions) > 1000 and len(think) > 4000
    assert min(think) >= 2.0 - 1e-9
    assert 25 < statistics.median(think) < 60
    long = sum(g > 300 for g in think) / len(think)
    # A tenth of the think times are over five minutes; within the ~20 minutes of 6,000 requests,
    # where the longest returns fall past the end, about one return in twenty-two is.
    assert 0.03 < long < 0.1
    assert max(think) > 600
    # Returns after many minutes find a small LRU cache empty: capacity matters.
    trace = as_trace([x.req for x in full["multi_turn"]])
    prompts = trace_prompts(trace)
    assert replay_core(trace, prompts, 1000).hit_rate < 0.5 * replay_core(trace, prompts, 16000).hit_rate


def test_agentic_tasks_resend_growing_contexts_under_shared_tools_with_short_gaps(full):
    tasks: dict[tuple[int, ...], list[Labelled]] = defaultdict(list)
    for x in full["agentic"]:
        tasks[x.unit[:1]].append(x)
    tools: dict[tuple[int, ...], int] = {}
    gaps = []
    for steps in tasks.values():
        t = steps[0].req
        tools.setdefault(t.keys[:t.pinned_blocks], 0)
        tools[t.keys[:t.pinned_blocks]] += 1
        for a, b in itertools.pairwise(steps):
            assert b.req.keys[:len(a.req.keys)] == a.req.keys and len(b.req.keys) > len(a.req.keys)
            assert b.req.pinned_blocks == a.req.pinned_blocks
            gaps.append(b.req.t - a.req.t)
    assert len(tools) == 8 and all(8 <= len(k) <= 40 for k in tools)
    assert statistics.median(gaps) < 20
    # Many tasks at once: count the tasks between their first and last step at each request.
    spans = sorted((s[0].req.t, s[-1].req.t) for s in tasks.values())
    mid = full["agentic"][len(full["agentic"]) // 2].req.t
    assert sum(a <= mid <= b for a, b in spans) >= 10


def test_rag_chunks_are_keyed_by_what_precedes_them():
    system = [1, 2, 3]
    abc = chunk_chain(system, [(10, 2), (11, 3), (12, 2)])
    acb = chunk_chain(system, [(10, 2), (12, 2), (11, 3)])
    bac = chunk_chain(system, [(11, 3), (10, 2), (12, 2)])
    assert len(abc) == len(acb) == len(bac) == 10
    assert common_prefix(tuple(abc), tuple(acb)) == 3 + 2  # the system prompt and the equal leading chunk
    assert not set(abc[5:]) & set(acb[5:])  # the same chunks after a different one: other blocks
    assert common_prefix(tuple(abc), tuple(bac)) == 3 and not set(abc[3:]) & set(bac[3:])
    assert abc == chunk_chain(system, [(10, 2), (11, 3), (12, 2)])  # deterministic
    assert abc[3] == chain_key(3, 10, 0) and abc[4] == chain_key(abc[3], 10, 1) >= 1 << 62


def chunk_sizes(x: Labelled) -> list[int]:
    """Check a rag request is its system prompt, its chunks keyed by prefix, one question block;
    return the chunks' sizes."""
    keys, pos = x.req.keys, x.req.pinned_blocks
    prev, sizes = keys[pos - 1], []
    for chunk in x.unit[1:]:
        j = 0
        while pos < len(keys) - 1 and keys[pos] == chain_key(prev, chunk, j):
            prev, pos, j = keys[pos], pos + 1, j + 1
        assert 2 <= j <= 4
        sizes.append(j)
    assert pos == len(keys) - 1 and keys[-1] < 1 << 62  # then a fresh question block
    return sizes


def test_rag_requests_share_only_the_system_prompt_and_equal_leading_chunks(full):
    xs = full["rag"]
    by_set: dict[tuple[int, frozenset[int]], list[Labelled]] = defaultdict(list)
    for x in xs:
        sizes = dict(zip(x.unit[1:], chunk_sizes(x), strict=True))
        assert 3 <= len(sizes) <= 6
        by_set[(x.unit[0], frozenset(sizes))].append(x)
    reordered = 0
    for group in by_set.values():
        for a, b in itertools.combinations(group[:6], 2):
            if a.unit == b.unit:
                continue
            reordered += 1
            lead = common_prefix(a.unit[1:], b.unit[1:])
            sizes = chunk_sizes(a)
            assert common_prefix(a.req.keys, b.req.keys) == a.req.pinned_blocks + sum(sizes[:lead])
    assert reordered > 100  # the same chunks in another order are common
    firsts = Counter(x.unit[1] for x in xs)
    assert firsts.most_common(1)[0][1] > 100 and len(firsts) > 300  # popular chunks lead, and a long tail


def test_scan_bursts_share_no_block_with_anything_and_would_flush_an_lru_cache(full):
    xs = full["scan"]
    uses = Counter(k for x in xs for k in x.req.keys)
    bursts: dict[tuple[int, ...], list[Labelled]] = defaultdict(list)
    for x in xs:
        if x.kind == "scan":
            assert all(uses[k] == 1 for k in x.req.keys)
            assert x.req.retention is None
            bursts[x.unit].append(x)
        else:
            assert x.kind == "user"
    assert len(bursts) >= 7
    complete = list(bursts.values())[:-1]  # the last may run past the end
    assert all(len(b) == 150 for b in complete)
    assert min(sum(len(x.req.keys) for x in b) for b in complete) > 3000
    users = [x for x in xs if x.kind == "user"]
    assert 0.7 < len(users) / len(xs) < 0.85
    per_user = Counter(x.unit for x in users)
    assert per_user.most_common(1)[0][1] > 300  # recurring users: a hot working set
    for x in users:
        assert x.req.keys[:2] == users[0].req.keys[:2]  # the app's system prompt


def test_shifting_mix_changes_its_mix_by_phase(full):
    xs = full["shifting_mix"]
    third = len(xs) // 3
    keys_of: dict[tuple[int, str], set[int]] = defaultdict(set)
    for p, weights in enumerate(SHIFTING_PHASES):
        phase = xs[p * third:(p + 1) * third]
        assert {x.phase for x in phase} == {p}  # the phases follow each other
        counts = Counter(x.family for x in phase)
        assert dict(counts) == {k: round(third * w) for k, w in weights.items()}
        start, end = phase[0].req.t, phase[-1].req.t
        for fam in weights:
            ts = [x.req.t for x in phase if x.family == fam]
            assert ts[0] < start + 0.1 * (end - start) and ts[-1] > end - 0.2 * (end - start), (p, fam)
        load = sum(len(x.req.keys) for x in phase) * BLOCK_TOKENS / (end - start)
        assert 0.8 * MOONCAKE_PROMPT_TOKENS_PER_S < load < 1.2 * MOONCAKE_PROMPT_TOKENS_PER_S, p
        for x in phase:
            keys_of[(p, x.family)].update(x.req.keys)
    for a, b in itertools.combinations(keys_of, 2):
        assert not keys_of[a] & keys_of[b], (a, b)  # the components share no block


def test_hot_prefixes_take_most_requests(full):
    xs = full["hot_prefixes"]
    hot = [x for x in xs if x.kind == "hot"]
    assert {x.kind for x in xs} == {"hot", "cold"}
    assert 0.67 < len(hot) / len(xs) < 0.73
    prefixes = {x.req.keys[:x.req.pinned_blocks] for x in hot}
    assert len(prefixes) == 4 and all(20 <= len(p) <= 40 for p in prefixes)
    # Measured on the keys alone: the requests under the four most used prefixes are the hot ones.
    firsts = Counter(x.req.keys[0] for x in xs)
    top = {k for k, _ in firsts.most_common(4)}
    assert sum(x.req.keys[0] in top for x in xs) == len(hot)
    assert firsts.most_common(1)[0][1] > 0.2 * len(xs)
    cold = Counter(x.unit for x in xs if x.kind == "cold")
    assert len(cold) > 500  # a long tail


def test_one_shot_shares_nothing(full):
    uses = Counter(k for x in full["one_shot"] for k in x.req.keys)
    assert set(uses.values()) == {1}


def test_as_trace_renumbers_keys_and_write_trace_round_trips(tmp_path):
    reqs = [SimRequest(0.0004, (1 << 40, 7, 1 << 62), 5), SimRequest(1.2345, (1 << 40, 9), 6),
            SimRequest(2.0, (7,), 0)]
    trace = as_trace(reqs)
    assert [r.hash_ids for r in trace] == [(0, 1, 2), (0, 3), (1,)]
    assert [r.timestamp_s for r in trace] == [0.0, 1.234, 2.0]  # to the millisecond
    assert [r.input_length for r in trace] == [3 * 512, 2 * 512, 512]
    assert [r.output_length for r in trace] == [5, 6, 0]
    assert load_trace(write_trace(reqs, tmp_path / "t.jsonl")) == trace
    for name in FAMILIES:
        family = GENERATORS[name](300)
        path = write_trace(family, tmp_path / f"{name}.jsonl")
        assert load_trace(path) == as_trace(family), name
    line = (tmp_path / "t.jsonl").read_text().splitlines()[1]
    assert line == '{"timestamp": 1234, "input_length": 1024, "output_length": 6, "hash_ids": [0, 3]}'


def test_bursts_alternate_calm_periods_and_bursts_at_six_times_the_rate(full):
    xs = full["bursts"]
    calm = [x for x in xs if x.kind == "calm"]
    burst = [x for x in xs if x.kind == "burst"]
    assert calm and burst
    # the arrival rate in the bursts over the calm periods' is the burst factor (6), about
    span = {kind: sum(b.req.t - a.req.t for a, b in itertools.pairwise(xs) if b.kind == kind) for kind in
            ("calm", "burst")}
    ratio = (len(burst) / span["burst"]) / (len(calm) / span["calm"])
    assert 4.5 < ratio < 7.5, ratio
    for x in xs:  # an app prompt of 4-16 blocks (pinned), then the user's part
        assert 4 <= x.req.pinned_blocks <= 16 and len(x.req.keys) > x.req.pinned_blocks
    assert len({x.req.keys[:x.req.pinned_blocks] for x in xs}) <= 32


def test_zipf_skew_sends_most_requests_to_a_few_documents(full):
    docs = Counter(x.unit for x in full["zipf_skew"])
    top = [c for _, c in docs.most_common(10)]
    n = len(full["zipf_skew"])
    assert 0.2 < top[0] / n < 0.45  # the first document ~30 %
    assert 0.5 < sum(top) / n < 0.75  # the first ten ~60 %
    assert len(docs) > 500  # and a long tail
    assert all(x.req.retention is None for x in full["zipf_skew"])


def test_long_tail_prompts_are_mostly_short_with_a_few_very_long(full):
    bodies = [len(x.req.keys) - x.req.pinned_blocks for x in full["long_tail"]]
    assert statistics.median(bodies) <= 2 and max(bodies) == 250
    long = [b for b in bodies if b >= 32]
    assert 0.02 < len(long) / len(bodies) < 0.08
    assert sum(long) > 0.4 * sum(bodies)  # the few long prompts bring much of the work


def test_many_tenants_keep_short_conversations_under_their_own_system_prompts(full):
    sessions: dict[int, list[Labelled]] = defaultdict(list)
    for x in full["many_tenants"]:
        sessions[x.unit[1]].append(x)
    assert len({x.unit[0] for x in full["many_tenants"]}) > 1000  # many tenants seen
    for turns in sessions.values():
        assert 1 <= len(turns) <= 5 and [x.unit[2] for x in turns] == list(range(len(turns)))
        for a, b in itertools.pairwise(turns):
            assert b.req.keys[:len(a.req.keys)] == a.req.keys and len(b.req.keys) > len(a.req.keys)
    top = Counter(x.unit[0] for x in full["many_tenants"]).most_common(1)[0][1]
    assert top < 0.02 * len(full["many_tenants"])  # no tenant dominates


def test_prefix_tree_shares_prefixes_at_every_depth(full):
    xs = full["prefix_tree"]
    by_depth: dict[int, list[Labelled]] = defaultdict(list)
    for x in xs:
        by_depth[x.unit[0]].append(x)
    assert sorted(by_depth) == [1, 2, 3, 4]
    # the same tree node is the same prefix; a child extends its parent's prefix
    prefix: dict[tuple[int, int], tuple[int, ...]] = {}
    for x in xs:
        depth, index = x.unit
        prefix.setdefault((depth, index), x.req.keys)
    for (depth, index), keys in prefix.items():
        parent = prefix.get((depth - 1, index // (3, 5, 8, 12)[depth - 1]))
        if parent is not None:
            assert common_prefix(keys, parent) >= 2 * (depth - 1)  # every level is at least 2 blocks
    # shallow nodes are shared by more requests than deep ones
    per_node = {d: len(v) / len({x.unit for x in v}) for d, v in by_depth.items()}
    assert per_node[1] > per_node[2] > per_node[3] > per_node[4]
