"""A small fleet for router tests: a materializer, two nodes, the router (in-process)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from routing_api.app import create_app
from routing_api.config import RouterSettings
from tests.inference_node.test_node_kafka import start_node
from tests.support import applied_through_id, materializer, wait_for


@pytest.fixture
def fleet(kafka_settings, migrated_database_url, reader_url, tmp_path):
    mat = materializer(kafka_settings, migrated_database_url, tmp_path).start()
    a, url_a = start_node(kafka_settings, tmp_path, "node-a", num_blocks="256")
    b, url_b = start_node(kafka_settings, tmp_path, "node-b", num_blocks="256")
    wait_for(lambda: all(applied_through_id(migrated_database_url, n) for n in ("node-a", "node-b")), 60,
             what="both nodes in PostgreSQL")
    router = TestClient(create_app(RouterSettings(nodes_cache_s=0.0), database_url=reader_url))
    with router:
        yield {"router": router, "a": url_a, "b": url_b, "procs": {"a": a, "b": b}, "db": migrated_database_url}
    for p in (a, b, mat):
        p.stop()


