"""The adaptive policy's settings (:class:`AdaptivePolicy`) and its bands' priorities.

What the settings mean and how the policy learns: :mod:`inference_node.kv.adaptive`. Kept apart
so that a cache's configuration (``KvCacheConfig.adaptive``) names the settings without loading
the learner.
"""

from __future__ import annotations

from dataclasses import dataclass

from eventbus.protocol import DEFAULT_PRIORITY

#: The recency band (ARC's T1, S3-FIFO's small FIFO) and the frequency band (T2, the main FIFO).
RECENCY_PRIORITY = DEFAULT_PRIORITY
FREQUENCY_PRIORITY = DEFAULT_PRIORITY + 1
#: The frequency band's oldest blocks, lowered by the policy when the life tables rate them below
#: the recency band's oldest, so that eviction takes them first (the junk band still goes before).
DEMOTED_PRIORITY = DEFAULT_PRIORITY - 1


@dataclass(frozen=True)
class AdaptivePolicy:
    """The adaptive policy's settings (see the module docstring); what it learns lives in an
    :class:`AdaptiveLearner`, one per cache. Which data chose the defaults: docs/benchmarks.md
    ("Adaptive eviction")."""

    #: A class reused less often than this is junk: stored at ``junk_priority``.
    junk_probability: float = 0.1
    junk_priority: int = 5
    #: The reuse probability a class starts from, weighted as ``min_samples`` observations.
    prior_probability: float = 0.25
    min_samples: float = 20.0
    #: Exponential forgetting of old observations (1.0 = keep all), per observation of a class.
    decay: float = 0.99
    #: Evicted blocks remembered for the classes' counts (digest -> class), so that a later miss
    #: on one counts as the reuse it would have been. In blocks; 0 = ``ghost_caches`` x the cache.
    ghost_capacity: int = 0
    #: The ghosts in caches' worth of blocks (when ``ghost_capacity`` is 0): a block that returns
    #: later than that after its eviction counts as one that left unused. Which data chose it:
    #: docs/benchmarks.md ("Which data chose the defaults").
    ghost_caches: float = 3.5
    #: The sampled blocks each shadow aims to hold: the sampling rate is
    #: ``min(1, shadow_sample_blocks / capacity)``.
    shadow_sample_blocks: int = 2048
    #: Weight of one lookup in the guard's moving average of (own - LRU) sampled hits.
    guard_rate: float = 0.002
    #: The lead, in sampled hits per sampled block, that turns the bands off (or on again).
    guard_margin: float = 0.003
    #: Observations between two computations of the class table.
    table_every: int = 512
    #: If > 0, a block in the frequency band keeps it only this many *horizons* (how long the LRU
    #: shadow keeps a block: the age of its oldest entry) after it was last used, then falls back
    #: to 35. Off by default; 2 (with ``soon_share`` 0.3) is what a KV-aware routed fleet wanted in
    #: the simulator (docs/benchmarks.md, "The bands lose in a routed fleet").
    frequency_horizons: float = 0.0
    #: If > 0, a new block of a class goes straight to the frequency band when at least this share
    #: of the class's observations were reuses *soon*: within as many block releases as the cache
    #: holds blocks (where LRU would have hit them). Off by default; 0.3 behind a KV-aware router.
    soon_share: float = 0.0
    #: Life tables (module docstring): the core weighs the frequency band's oldest block against
    #: the recency band's by the chance that a block of its band and age is used again. Off: the
    #: recency band always goes first (strict bands).
    life_tables: bool = True
    #: The life tables' guard: strict bands (no demotion) once a shadow of strict bands leads the
    #: cache by the guard's margin, the tables again once the cache falls behind the LRU shadow
    #: (the module docstring of :mod:`inference_node.kv.adaptive`, "The life tables' guard").
    strict_guard: bool = True
    #: The evidence, in blocks, that an age bucket needs to outweigh the estimate of the younger
    #: ages (the prior's weight).
    life_prior_blocks: float = 800.0
    #: The tables' counts of hits and evictions are halved every so many of them.
    life_half_events: int = 4096
    #: Lookups between two computations of the tables' estimates.
    life_every: int = 16
    #: The floor against LRU (:mod:`inference_node.kv.floor`): an exact LRU shadow, and plain LRU
    #: for the cache once the policy's loss against it, beyond ``floor_share`` of LRU's hits, grows
    #: by more than ``min(floor_blocks, floor_caches x the cache's blocks)``; the policy runs again
    #: after ``floor_retry`` x the cache's size in blocks looked up (doubled after each retry that
    #: lost). Which data chose them: docs/benchmarks.md ("The floor").
    floor: bool = True
    floor_share: float = 0.005
    floor_blocks: float = 1024.0
    floor_caches: float = 1.0
    floor_retry: float = 1.0
    #: Keep the ghosts, the guard's shadows and the life tables in the compiled tables of
    #: ``kvflow_native`` when it is installed (the same decisions as the Python ones, call for
    #: call; only faster: :mod:`inference_node.kv.shadows`).
    compiled: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.junk_priority < DEMOTED_PRIORITY:
            raise ValueError(f"junk_priority must be within 0..{DEMOTED_PRIORITY - 1}, got {self.junk_priority}")
        if not 0 < self.decay <= 1:
            raise ValueError("decay must be within (0, 1]")
        if not 0 < self.guard_rate <= 1:
            raise ValueError("guard_rate must be within (0, 1]")
        if self.guard_margin < 0:
            raise ValueError("guard_margin must not be negative")
        if self.frequency_horizons < 0:
            raise ValueError("frequency_horizons must not be negative")
        if not 0 <= self.soon_share <= 1:
            raise ValueError("soon_share must be within [0, 1]")
        if self.ghost_capacity < 0 or self.ghost_caches <= 0:
            raise ValueError("ghost_capacity must not be negative, ghost_caches must be positive")
        if self.life_prior_blocks < 0:
            raise ValueError("life_prior_blocks must not be negative")
        if not 0 <= self.floor_share < 1 or self.floor_blocks < 0 or self.floor_caches < 0 or self.floor_retry <= 0:
            raise ValueError("floor_share must be within [0, 1), floor_blocks and floor_caches >= 0, floor_retry > 0")
        if self.life_half_events < 1 or self.life_every < 1:
            raise ValueError("life_half_events and life_every must be at least 1")
