"""The adaptive policy as an :class:`~inference_node.kv.policy.EvictionPolicy`: the same order and
retention clocks as TensorRT-LLM's, with priorities learned online for requests without hints.

What it learns and why is :mod:`inference_node.kv.adaptive` (the settings,
:class:`~inference_node.kv.adaptive.AdaptivePolicy`, and the learner,
:class:`~inference_node.kv.adaptive.AdaptiveLearner`); this module connects the learner to the
pool's events and acts on the cache where the learner says so:

* a lookup teaches it (ghosts, the guard's shadows, the life tables, the floor); when the guard
  turns the bands off, every block the policy raised returns to 35
  (:meth:`AdaptiveEviction._revoke`); when the floor engages, every block it placed, junk too;
* a reuse without hints may raise a block, new blocks get the learned priority of their class;
* before an eviction, the life tables may demote the frequency band's oldest blocks
  (:meth:`AdaptiveEviction.before_eviction`);
* releases, evictions, moves and failed admissions feed its counts.

A client's retention config always wins: the manager then never asks the policy for
priorities, and a block a client re-prioritized is the client's for good (class -1).
"""

from __future__ import annotations

from collections.abc import Sequence

from eventbus.protocol import DEFAULT_PRIORITY, GPU, BlockDigest
from inference_node.kv.adaptive import (
    DEMOTED_PRIORITY,
    FREQUENCY_PRIORITY,
    RECENCY_PRIORITY,
    AdaptiveLearner,
    AdaptivePolicy,
    BlockContext,
)
from inference_node.kv.block import Block
from inference_node.kv.policy import EvictionPolicy, Retention, Retentions


class AdaptiveEviction(EvictionPolicy):
    """Priority + retention with learned priorities for requests without hints (see the module
    docstring). ``cache_blocks``: the cache's blocks on both tiers; ``tiered``: it has a host
    tier (no life tables there)."""

    name = "adaptive"

    def __init__(self, settings: AdaptivePolicy, cache_blocks: int, tiered: bool = False) -> None:
        super().__init__()
        self._learner = AdaptiveLearner(settings, cache_blocks, tiered=tiered)
        #: Slots other requests hold with no cached block in them, at the coming lookup (the
        #: floor's shadow leaves them: :meth:`held`).
        self._held = 0

    @property
    def learner(self) -> AdaptiveLearner:
        return self._learner

    def describe(self) -> dict[str, object]:
        return self._learner.describe()

    # ------------------------------------------------------------------ what happened

    def _released(self, level: int, first_tick: int) -> None:
        self._learner.released(self.orders[level].arrived, first_tick)

    def given_back(self, b: Block) -> None:
        self._learner.given_back(b)

    def evicted(self, victims: Sequence[Block], runs: Sequence[Sequence[Block]] | None = None) -> None:
        self._learner.on_evict(victims, self._tick, runs)

    def _moved(self, b: Block, old: int) -> None:
        self._learner.moved(b, old)

    # ------------------------------------------------------------------ requests without retention

    def held(self, slots: int) -> None:
        self._held = slots

    def lookup(self, digests: Sequence[BlockDigest], blocks: Sequence[Block]) -> None:
        learner = self._learner
        learner.on_lookup(digests, len(blocks), self._clock(), self._tick, self._held)
        if blocks:
            learner.taken(blocks)  # before a revoke: they left their bands as they were
        if learner.floor_due:
            learner.floor_due = learner.revoke_due = False
            self._revoke(everything=True)
            if learner.floor is not None:
                learner.floor.note_missing(self._cached)
        elif learner.revoke_due:
            learner.revoke_due = False
            self._revoke()

    def generated(self, digest: BlockDigest) -> None:
        floor = self._learner.floor
        if floor is not None:  # LRU would hold it too: the floor's shadow does
            floor.lru.touch(digest)

    def reused(self, blocks: Sequence[Block]) -> None:
        on_reuse = self._learner.on_reuse
        for b in blocks:
            raised = on_reuse(b.adaptive_class, b.priority, b.hits - 1, b.last_used)
            if raised is not None and raised[0] >= b.priority:
                self.set_priority(b, raised[0], raised[1])
                b.adaptive_class = raised[2]

    def prompt_retention(self, prompt_blocks: int, matched: int, end: int) -> Retentions:
        return self._learner.prompt_retention(prompt_blocks, matched, end)

    def new_block(self, index: int, prompt_blocks: int, matched: int, is_decode: bool) -> Retention:
        return self._learner.new_block(BlockContext(index=index, prompt_blocks=prompt_blocks,
                                                    matched_blocks=matched, is_decode=is_decode))

    # ------------------------------------------------------------------ acting on the cache

    def _revoke(self, everything: bool = False) -> None:
        """The guard turned the bands off: every block the policy raised above the default
        priority returns to it, at its place in recency (``updated`` for each), as does a block it
        demoted (``DEMOTED_PRIORITY``), and a duration it gave ends; its junk band stays.
        ``everything``: the floor engaged — the junk band returns to the default too (the cache is
        then plain LRU over what it holds). Blocks a client's retention config set are left alone."""
        for b in self._cached.values():
            if b.adaptive_class < 0:
                continue
            if b.duration is not None:
                b.duration = None
                b.expiry_version += 1  # its expiry entry goes stale
            if b.priority > DEFAULT_PRIORITY or b.priority == DEMOTED_PRIORITY or \
                    (everything and b.priority != DEFAULT_PRIORITY):
                old = b.priority
                self.orders[b.level].rekey(b, DEFAULT_PRIORITY)
                if not b.ref:
                    self._learner.moved(b, old)
                self._updated(b, old, DEFAULT_PRIORITY)

    def before_eviction(self, k: int) -> None:
        """The life tables before ``k`` evictions (with the bands on): the frequency band's oldest
        evictable blocks that the tables rate below the recency band's oldest
        (:meth:`~inference_node.kv.lifetables.LifeTables.frequency_first`), up to the victims that
        the junk band (and blocks demoted before) do not provide, go to ``DEMOTED_PRIORITY``
        (``updated`` for each; a duration they had ends), where eviction takes them before the
        recency band. A client's block at 36 is the client's: never demoted."""
        learner = self._learner
        life = learner.life
        if life is None or not learner.bands or learner.lru_only or learner.strict:
            return
        index = self.orders[GPU]
        k -= index.listed_below(RECENCY_PRIORITY)
        if k <= 0:
            return
        r = next(index.front(RECENCY_PRIORITY), None)
        if r is None:  # no recency block: eviction takes the frequency band anyway
            return
        tick = self._tick
        a_r = tick - r.last_used
        frequency_first = life.frequency_first
        demote: list[Block] = []
        for f in index.front(FREQUENCY_PRIORITY):
            if f.adaptive_class < 0:
                continue
            if not frequency_first(tick - f.last_used, a_r):
                break
            demote.append(f)
            if len(demote) == k:
                break
        if not demote:
            return
        learner.life_demotions += len(demote)
        for f in demote:
            if f.duration is not None:
                f.duration = None
                f.expiry_version += 1
            index.rekey(f, DEMOTED_PRIORITY)
            self._updated(f, FREQUENCY_PRIORITY, DEMOTED_PRIORITY)
