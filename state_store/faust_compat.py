"""A patch of faust-streaming's aiokafka transport: a Kafka fetch wait of our own.

Targets faust-streaming 0.15.3 with aiokafka 0.14.0 (:data:`TESTED_WITH`; another version logs a
warning when the transport is made, and ``tests/state_store/test_materializer.py`` checks the
started fetcher really has the wait).

Why: faust's ``AIOKafkaConsumerThread._create_worker_consumer`` passes ``fetch_max_wait_ms=1500``
to ``aiokafka.AIOKafkaConsumer`` and has no setting for it. aiokafka does not fetch a partition
again while its last records are still being consumed, and sends at most one fetch per broker at a
time: a fetch of the other partitions, with nothing new to return, holds the broker's connection
for up to that long while the consumed ones wait. ``kvflow bench pipeline`` saw stalls of
0.5-0.7 s mid-stream with the whole backlog already in Kafka (docs/materializer.md, "Fetching").

How: the consumer faust made gets our wait before it starts. aiokafka 0.14.0 keeps the
constructor's ``fetch_max_wait_ms`` as ``AIOKafkaConsumer._fetch_max_wait_ms`` and hands it to its
``Fetcher`` in ``start()``; that private attribute is the one thing written here. (Building the
consumer ourselves would mean copying faust's fifty lines of its other settings.)

Also: faust's producer (the DLQ, resync commands on ``kv-control``) gets aiokafka's
``enable_idempotence`` (faust has no setting for it; ``acks`` is all already), so that a send
retried across a broker failover is written once, as the nodes' librdkafka producers do.

And: :func:`group_generation` reads the consumer's generation in its group (aiokafka's
coordinator, through faust's consumer thread; private attributes of the same versions) for
``/healthz``, which tells a standby worker (in the group, no partition) from one still joining.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import aiokafka
import faust
from faust.transport.drivers import aiokafka as faust_aiokafka

log = logging.getLogger("kvflow.materializer")

#: The versions this patch was written for and tested with.
TESTED_WITH = {"faust-streaming": "0.15.3", "aiokafka": "0.14.0"}
#: The aiokafka attribute ``AIOKafkaConsumer.start()`` reads the fetch wait from.
FETCH_WAIT_ATTRIBUTE = "_fetch_max_wait_ms"


class _ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> aiokafka.AIOKafkaConsumer:
        consumer = super()._create_worker_consumer(transport)
        if isinstance(transport, FetchWaitTransport):
            if not hasattr(consumer, FETCH_WAIT_ATTRIBUTE):
                log.warning("aiokafka %s has no AIOKafkaConsumer.%s: the fetch wait stays faust's 1500 ms",
                            aiokafka.__version__, FETCH_WAIT_ATTRIBUTE)
            else:
                setattr(consumer, FETCH_WAIT_ATTRIBUTE, transport.fetch_max_wait_ms)
        return consumer


class _Consumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
        return _ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class _Producer(faust_aiokafka.Producer):
    """faust's producer with aiokafka's idempotence on (faust sets ``acks`` = all but has no
    setting for it): a DLQ or control message retried after a broker failover is written once."""

    def _settings_default(self) -> Mapping[str, Any]:
        return {**super()._settings_default(), "enable_idempotence": True}


class FetchWaitTransport(faust_aiokafka.Transport):
    """faust's aiokafka transport, whose worker consumer waits at most ``fetch_max_wait_ms`` at
    the broker for partitions without new data (see the module docstring).

    Args:
        url: the brokers (faust's ``app.conf.broker_consumer``).
        app: the faust app.
        fetch_max_wait_ms: the wait (faust's own: 1500).
    """

    Consumer = _Consumer
    Producer = _Producer

    def __init__(self, url: Any, app: faust.App, *, fetch_max_wait_ms: int) -> None:
        super().__init__(url, app)
        self.fetch_max_wait_ms = fetch_max_wait_ms
        installed = {"faust-streaming": faust.__version__, "aiokafka": aiokafka.__version__}
        if installed != TESTED_WITH:
            log.warning("state_store.faust_compat was written for %s, not %s: check the fetch wait patch",
                        TESTED_WITH, installed)


def group_generation(app: faust.App) -> int:
    """The worker's generation in its consumer group, read from the aiokafka consumer faust runs
    (``AIOKafkaConsumerThread._consumer._coordinator.generation``, as faust itself reads it to
    commit); -1 while it is not a member: not started, joining, or dropped from the group (the
    coordinator resets it to -1 when it must join again)."""
    thread = getattr(getattr(app, "_consumer", None), "_thread", None)
    consumer = getattr(thread, "_consumer", None)
    coordinator = getattr(consumer, "_coordinator", None)
    generation = getattr(coordinator, "generation", -1)
    return generation if isinstance(generation, int) else -1
