"""BodyLimit: bodies over the limit get 413, whether they declare a length or arrive chunked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from pydantic import BaseModel

from openai_api.http import BodyLimit

pytestmark = pytest.mark.unit
LIMIT = 1000


class Body(BaseModel):
    text: str


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = FastAPI()
    app.add_middleware(BodyLimit, max_bytes=LIMIT)

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"error": {"message": exc.detail}})

    @app.post("/model")
    async def model(body: Body) -> dict[str, int]:
        return {"n": len(body.text)}

    @app.post("/raw")
    async def raw(request: Request) -> dict[str, int]:
        return {"n": len(await request.body())}

    with TestClient(app) as c:
        yield c


def chunks(total: int, size: int = 100) -> Iterator[bytes]:
    """A JSON body of ``total`` bytes sent in pieces, so no Content-Length is declared."""
    body = b'{"text": "' + b"x" * (total - 12) + b'"}'
    assert len(body) == total
    for i in range(0, total, size):
        yield body[i:i + size]


@pytest.mark.parametrize("path", ["/model", "/raw"])
def test_chunked_bodies_are_counted(client, path):
    ok = client.post(path, content=chunks(LIMIT), headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text
    assert "content-length" not in ok.request.headers
    over = client.post(path, content=chunks(LIMIT + 1), headers={"content-type": "application/json"})
    assert over.status_code == 413
    assert over.json() == {"error": {"message": f"request body larger than {LIMIT} bytes"}}


def test_a_declared_length_over_the_limit_is_refused_before_reading(client):
    r = client.post("/raw", content=b"x" * (LIMIT + 1))
    assert r.status_code == 413
    assert r.json()["error"] == {"message": f"request body larger than {LIMIT} bytes",
                                 "type": "invalid_request_error"}
    assert client.post("/raw", content=b"x" * LIMIT).json() == {"n": LIMIT}


def test_a_malformed_length_is_refused(client):
    r = client.post("/raw", content=b"x", headers={"content-length": "1e9"})
    assert r.status_code == 413
