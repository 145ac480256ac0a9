"""Access: API keys and scopes, the read-only role, and secrets that production refuses."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from eventbus.config import Environment, KafkaSecurityProtocol, KafkaSettings
from routing_api.app import create_app
from routing_api.config import RouterSettings, parse_api_keys
from state_store.config import DatabaseSettings
from tests.support import ROOT


def test_api_key_specs_name_a_tenant_and_scopes():
    keys = parse_api_keys("k1, k2:acme, k3:acme:route, k4::read+route")
    assert keys["k1"].scopes == {"route", "complete", "read"} and keys["k1"].tenant is None
    assert keys["k2"].tenant == "acme"
    assert keys["k3"].scopes == {"route"}
    assert keys["k4"].tenant is None and keys["k4"].scopes == {"read", "route"}
    with pytest.raises(ValueError, match="unknown API key scopes"):
        parse_api_keys("k5:t:admin")


@pytest.mark.integration
def test_the_router_answers_401_without_a_key_and_403_without_the_scope(reader_url):
    app = create_app(RouterSettings(api_keys=SecretStr("full:acme,routeonly::route")), database_url=reader_url)
    with TestClient(app) as c:
        assert c.post("/v1/route", json={"prompt": "x"}).status_code == 401
        assert c.post("/v1/route", json={"prompt": "x"}, headers={"authorization": "Bearer nope"}).status_code == 401
        ok = c.post("/v1/route", json={"prompt": "x"}, headers={"authorization": "Bearer routeonly"})
        assert ok.status_code == 503  # authorized; no node in this fresh database
        denied = c.get("/v1/nodes", headers={"authorization": "Bearer routeonly"})
        assert denied.status_code == 403 and "lacks the 'read' scope" in denied.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": "x"},
                      headers={"authorization": "Bearer routeonly"}).status_code == 403


@pytest.mark.integration
def test_the_router_refuses_oversized_bodies_declared_or_chunked(reader_url):
    app = create_app(RouterSettings(max_request_bytes=10_000), database_url=reader_url)
    big = b'{"prompt": "' + b"x" * 20_000 + b'"}'
    with TestClient(app) as c:
        assert c.post("/v1/route", content=big, headers={"content-type": "application/json"}).status_code == 413
        r = c.post("/v1/route", content=iter([big[i:i + 1000] for i in range(0, len(big), 1000)]),
                   headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert r.json()["error"]["message"] == "request body larger than 10000 bytes"
        assert c.get("/v1/nodes", headers={"authorization": "Bearer full"}).status_code == 200
        assert c.get("/healthz").status_code == 200  # probes stay open


def test_placeholder_secrets_are_refused_outside_development():
    sasl = KafkaSettings(security_protocol=KafkaSecurityProtocol.SASL_SSL, sasl_username="kvflow",
                         sasl_password=SecretStr("changeme"))
    sasl.check(Environment.DEVELOPMENT)
    with pytest.raises(ValueError, match="KVFLOW_KAFKA_SASL_PASSWORD is missing or a placeholder"):
        sasl.check(Environment.PRODUCTION)
    DatabaseSettings().check(Environment.DEVELOPMENT)
    with pytest.raises(ValueError, match="the password in KVFLOW_DATABASE_URL is missing or a placeholder"):
        DatabaseSettings().check(Environment.PRODUCTION)
    strong = DatabaseSettings(url=SecretStr("postgresql://kvflow:Xq8!long-secret@db/kvflow"),
                              reader_url=SecretStr("postgresql://kvflow_reader:Yz9?other-secret@db/kvflow"))
    strong.check(Environment.PRODUCTION)
    # Each service checks only the role it uses: the router (reader) needs no writer password.
    reader_only = DatabaseSettings(reader_url=SecretStr("postgresql://kvflow_reader:Yz9?other-secret@db/kvflow"))
    reader_only.check(Environment.PRODUCTION, writer=False)
    with pytest.raises(ValueError, match="KVFLOW_DATABASE_URL"):
        reader_only.check(Environment.PRODUCTION, reader=False)


def test_secrets_come_from_files_and_are_never_printed(tmp_path):
    f = tmp_path / "pw"
    f.write_text("s3cr3t-from-a-file\n")
    s = KafkaSettings(security_protocol=KafkaSecurityProtocol.SASL_PLAINTEXT, sasl_username="u",
                      sasl_password_file=str(f))
    assert s.sasl_password is not None and s.sasl_password.get_secret_value() == "s3cr3t-from-a-file"
    assert "s3cr3t" not in repr(s) and "s3cr3t" not in str(s.model_dump())
    conf = s.librdkafka()
    assert conf["sasl.username"] == "u" and conf["sasl.password"] == "s3cr3t-from-a-file"
    assert conf["security.protocol"] == "SASL_PLAINTEXT" and conf["sasl.mechanism"] == "SCRAM-SHA-512"


def test_production_services_refuse_to_start_with_placeholders_in_one_line():
    env = {"PATH": "/usr/bin:/bin", "KVFLOW_ENV": "production"}
    for args in (["router"], ["node", "--no-kafka"], ["materializer"]):
        proc = subprocess.run([sys.executable, "-m", "kvflow.cli", *args], env=env, capture_output=True, text=True,
                              timeout=60, cwd=ROOT, check=False)
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert "placeholder" in proc.stderr or "required" in proc.stderr, proc.stderr
