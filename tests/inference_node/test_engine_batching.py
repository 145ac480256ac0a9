"""The engine's step: waiting prompts are admitted together and computed in one forward with the
running requests' decode tokens (a ragged batch), within ``max_running`` and ``max_batch_tokens``."""

from __future__ import annotations

import asyncio
import threading

from inference_node.engine import GenerationRequest, Output

from .conftest import collect, generate, make_node


def _together(node, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], Output]]:
    """Submit every prompt while the engine thread is held, so that all wait for the same step."""
    hold = threading.Event()
    node.engine.call(hold.wait)

    async def run() -> list[tuple[list[int], Output]]:
        loop = asyncio.get_running_loop()
        handles = [node.engine.submit(GenerationRequest(f"t{i}", p, max_tokens, ignore_eos=True), loop)
                   for i, p in enumerate(prompts)]
        hold.set()

        return list(await asyncio.gather(*(collect(h) for h in handles)))

    return asyncio.run(run())


PROMPTS = [[(7 * i + j) % 200 + 1 for j in range(30)] for i in range(3)]


def test_prompts_waiting_together_run_in_one_forward_and_answer_as_alone():
    alone_node = make_node()
    try:
        alone = [generate(alone_node, p, max_tokens=4, ignore_eos=True)[0] for p in PROMPTS]
    finally:
        alone_node.close()
    node = make_node()
    try:
        before = node.engine.stats.decode_steps
        got = _together(node, PROMPTS, 4)
        assert [tokens for tokens, _ in got] == alone
        # All three prefilled in the first forward, then 3 decode steps for all of them together.
        assert node.engine.stats.decode_steps - before == 3
        assert node.engine.stats.prefill_tokens_computed == 90
    finally:
        node.close()


def test_a_prompt_reads_the_blocks_another_prompt_of_the_same_forward_computes():
    """The second prompt matches the first's two full blocks, stored at admission and written by
    the same forward layer by layer before any attention reads them; it answers as it does alone."""
    shared = [(5 * j) % 200 + 1 for j in range(32)]  # two blocks of 16
    a, b = shared + [11, 12, 13], shared + [21, 22]
    alone_node = make_node()
    try:
        want_b = generate(alone_node, b, max_tokens=4, ignore_eos=True)[0]
    finally:
        alone_node.close()
    node = make_node()
    try:
        (_, out_a), (tokens_b, out_b) = _together(node, [a, b], 4)
        assert out_a.cached_tokens == 0 and out_b.cached_tokens == 32
        assert tokens_b == want_b
        assert node.engine.stats.prefill_tokens_computed == len(a) + 2
    finally:
        node.close()


def test_the_token_budget_spreads_prompts_over_steps_and_the_first_always_runs():
    """Budget 40: the first 30-token prompt alone; the next joins when the decode tokens leave room."""
    node = make_node(max_batch_tokens=40)
    try:
        got = _together(node, PROMPTS, 4)
        assert all(len(tokens) == 4 for tokens, _ in got)
        # Forwards: [p1], [p1 decode + p2], [p1, p2 decode + p3], then 3 more decode steps for p3
        # (p1 and p2 finish on the way): 5 forwards with decode tokens.
        assert node.engine.stats.decode_steps == 5
        long = [(3 * j) % 200 + 1 for j in range(50)]  # over the budget alone: it still runs
        assert len(generate(node, long, max_tokens=2, ignore_eos=True)[0]) == 2
    finally:
        node.close()


def test_a_forward_that_fails_answers_the_prompts_it_had_admitted():
    """The prompts of a failing step are no longer waiting and not yet answered: the crash
    handler answers them with the error instead of leaving them to hang."""
    node = make_node()
    try:
        def broken(*_a, **_k):
            raise RuntimeError("boom: a device fault")

        node.engine.model.forward = broken  # the next forward fails (a stand-in for a CUDA error)
        got = _together(node, PROMPTS[:2], 4)
        assert [out.finish_reason for _, out in got] == ["error", "error"]
        assert all("boom" in (out.error or "") for _, out in got)
    finally:
        node.close()


def test_a_prompt_that_does_not_fit_beside_one_admitted_in_its_step_waits_for_it():
    """4 blocks of 16: the first prompt (30 tokens) takes 2, the second (40 tokens) needs 3: it is
    not refused, it waits until the first is done, then runs."""
    node = make_node(num_blocks=4)
    try:
        first, second = PROMPTS[0], [(11 * j) % 200 + 1 for j in range(40)]
        got = _together(node, [first, second], 2)
        assert [out.finish_reason for _, out in got] == ["length", "length"]
        assert node.engine.stats.rejected == 0
    finally:
        node.close()


def test_a_prompt_larger_than_the_cache_with_nothing_running_is_refused_at_once():
    node = make_node(num_blocks=2)  # 32 tokens of KV; the prompt needs 3 blocks
    try:
        tokens, out = generate(node, [(11 * j) % 200 + 1 for j in range(40)], max_tokens=2)
        assert tokens == [] and out.finish_reason == "error" and "cannot hold this prompt" in (out.error or "")
        assert node.engine.stats.rejected == 1
    finally:
        node.close()
