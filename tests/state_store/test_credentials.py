"""The materializer's faust security settings match the librdkafka clients' for every protocol."""

from __future__ import annotations

import ssl

import pytest
from faust.types.auth import AuthProtocol
from pydantic import SecretStr

from eventbus.config import KafkaSecurityProtocol, KafkaSettings
from state_store.faust_app import broker_credentials

pytestmark = pytest.mark.unit


def settings(protocol: str, **kw) -> KafkaSettings:
    return KafkaSettings(security_protocol=protocol, sasl_username="u", sasl_password=SecretStr("pw"), **kw)


def test_plaintext_needs_no_credentials():
    assert broker_credentials(settings("PLAINTEXT")) == {}


@pytest.mark.parametrize(("protocol", "expected"), [
    ("SASL_PLAINTEXT", AuthProtocol.SASL_PLAINTEXT),
    ("SASL_SSL", AuthProtocol.SASL_SSL),   # TLS even without a CA file: the system trust store
    ("SSL", AuthProtocol.SSL),
])
def test_protocol_is_kept(protocol, expected):
    creds = broker_credentials(settings(protocol))["broker_credentials"]
    assert creds.protocol is expected
    # faust names the context `ssl_context` on SASL credentials and `context` on SSL ones
    context = creds.ssl_context if protocol.startswith("SASL") else creds.context
    if KafkaSecurityProtocol(protocol).value.endswith("SSL"):
        assert isinstance(context, ssl.SSLContext)
        assert context.verify_mode is ssl.CERT_REQUIRED
    else:
        assert context is None


def test_sasl_carries_user_password_and_mechanism():
    creds = broker_credentials(settings("SASL_SSL", sasl_mechanism="SCRAM-SHA-256"))["broker_credentials"]
    assert (creds.username, creds.password, str(creds.mechanism.value)) == ("u", "pw", "SCRAM-SHA-256")
