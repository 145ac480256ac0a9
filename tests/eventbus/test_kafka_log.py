"""A Kafka outage is said once, then summarized, instead of one log line per failed connection."""

from __future__ import annotations

import logging
import time

from eventbus.config import KafkaSettings
from eventbus.kafka import KafkaLog, make_consumer, make_producer

FAIL = "localhost:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after 0ms in state CONNECT)"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_is_logged_once_then_every_summary_interval_and_other_lines_pass(caplog):
    clock = Clock()
    kl = KafkaLog("t.kafka", summary_s=30, clock=clock)
    with caplog.at_level(logging.INFO, logger="t.kafka"):
        for i in range(100):  # a failure every 0.9 s for 90 s
            clock.now = i * 0.9
            kl.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", FAIL)
        kl.log(logging.INFO, "%s [%s] %s", "CONFWARN", "rdkafka#producer-1", "a configuration warning")
        clock.now = 89.1 + 31  # quiet for longer than the interval: the outage ended; a new one
        kl.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", FAIL)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"Kafka unreachable: {FAIL} (further connection errors are summarized every 30 s)",
        # at 30.6 s (failure 34) and 61.2 s (failure 68), the first at or past 30 s since the last line
        "Kafka still unreachable after 31 s: 34 connection errors in the last 31 s",
        "Kafka still unreachable after 61 s: 34 connection errors in the last 31 s",
        "CONFWARN [rdkafka#producer-1] a configuration warning",
        f"Kafka unreachable: {FAIL} (further connection errors are summarized every 30 s)",
    ]
    assert kl.failures == 101


def test_a_client_without_a_broker_logs_the_outage_once_and_nothing_on_stderr(caplog, capfd):
    settings = KafkaSettings(bootstrap="localhost:1")
    producer = make_producer(settings)  # kvflow's clients (the node's producer and control consumer)
    consumer = make_consumer(settings, group_id="t-outage")
    consumer.subscribe(["t-outage"])
    with caplog.at_level(logging.INFO, logger="kvflow.kafka"):
        producer.produce("t-outage", b"x")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # librdkafka retries every few hundred ms meanwhile
            producer.poll(0.1)
            consumer.poll(0.1)
        consumer.close()
        del producer
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvflow.kafka"]
    assert len(warnings) == 2 and all(m.startswith("Kafka unreachable: ") for m in warnings)  # once per client
    assert "Connection refused" not in capfd.readouterr().err  # none of librdkafka's own lines
