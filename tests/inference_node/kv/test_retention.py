"""Retention configs: per-block priorities and durations, and refusal of bad configs."""

from __future__ import annotations

import math

import pytest

from inference_node.kv.retention import KvCacheRetentionConfig, RetentionConfigError, TokenRange


def per_block(cfg: KvCacheRetentionConfig, block_size: int, prompt_len: int, n_blocks: int):
    return [cfg.block_retention(i * block_size, (i + 1) * block_size, prompt_len) for i in range(n_blocks)]


def test_ranges_on_block_boundaries_match_tensorrt_llm():
    # TensorRT-LLM's BlockConfigTest: ranges [0,64)@80 and [64,128)@50, block size 64.
    cfg = KvCacheRetentionConfig((TokenRange(0, 64, 80), TokenRange(64, 128, 50)), decode_priority=30)
    assert [p for p, _ in per_block(cfg, 64, 256, 4)] == [80, 50, 35, 35]


def test_a_block_takes_the_highest_priority_among_the_ranges_it_overlaps():
    cfg = KvCacheRetentionConfig((TokenRange(0, 40, 10), TokenRange(40, 100, 90), TokenRange(100, None, 5)))
    assert [p for p, _ in per_block(cfg, 32, 160, 5)] == [10, 90, 90, 90, 5]


def test_uncovered_blocks_take_the_default_and_generated_blocks_the_decode_priority():
    cfg = KvCacheRetentionConfig((TokenRange(0, 1, 80),), decode_priority=12, decode_duration_s=5)
    # prompt of 70 tokens, block 32: block 2 holds prompt tokens 64..69 (prompt retention)
    assert per_block(cfg, 32, 70, 4) == [(80, None), (35, None), (35, None), (12, 5.0)]


def test_durations_follow_the_winning_range_and_ties_keep_the_longest():
    cfg = KvCacheRetentionConfig((TokenRange(0, 10, 70, 30), TokenRange(10, 20, 70, 60), TokenRange(20, 32, 70)))
    assert cfg.block_retention(0, 32, 100) == (70, None)  # None = never expires: longest
    cfg = KvCacheRetentionConfig((TokenRange(0, 10, 70, 30), TokenRange(10, 20, 70, 60)))
    assert cfg.block_retention(0, 32, 100) == (70, 60.0)


@pytest.mark.parametrize(("ranges", "message"), [
    ([TokenRange(0, 64, 80), TokenRange(30, 128, 80)], r"token ranges \[0, 64\) and \[30, 128\) overlap"),
    ([TokenRange(50, None, 80), TokenRange(100, 120, 80)], r"token ranges \[50, end\) and \[100, 120\) overlap"),
])
def test_overlapping_ranges_are_refused(ranges, message):
    with pytest.raises(RetentionConfigError, match=message):
        KvCacheRetentionConfig(tuple(ranges))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"start": 0, "end": 10, "priority": 101}, r"priority 101 is outside 0\.\.100"),
    ({"start": 0, "end": 10, "priority": -1}, r"priority -1 is outside 0\.\.100"),
    ({"start": 0, "end": 10, "priority": True}, "priority must be an integer"),
    ({"start": 0, "end": 10, "priority": 50.5}, "priority must be an integer"),
    ({"start": 0, "end": 10, "priority": 50, "duration_s": -1}, r"duration_s must be finite and >= 0"),
    ({"start": 0, "end": 10, "priority": 50, "duration_s": math.nan}, r"duration_s must be finite and >= 0"),
    ({"start": 0, "end": 10, "priority": 50, "duration_s": "1"}, "duration_s must be a number"),
    ({"start": 10, "end": 10, "priority": 50}, "end must be an integer > start"),
    ({"start": -1, "end": 10, "priority": 50}, "start must be an integer >= 0"),
])
def test_bad_ranges_are_refused_with_a_clear_error(kwargs, message):
    with pytest.raises(RetentionConfigError, match=message):
        TokenRange(**kwargs)


def test_bad_decode_settings_and_missing_fields_are_refused():
    with pytest.raises(RetentionConfigError, match="decode_priority: priority 200 is outside"):
        KvCacheRetentionConfig(decode_priority=200)
    with pytest.raises(RetentionConfigError, match="decode_duration_s: duration_s must be finite"):
        KvCacheRetentionConfig(decode_duration_s=-5)
