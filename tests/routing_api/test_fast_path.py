"""FastPath: a hot POST endpoint answered without the framework, and everything else left to it."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from openai_api.http import BodyLimit
from routing_api.fastpath import RouterApp


class Body(BaseModel):
    n: int


def make_app() -> tuple[FastAPI, list[bytes]]:
    app = RouterApp()
    seen: list[bytes] = []

    @app.post("/hot")
    async def hot(body: Body) -> dict[str, object]:
        return {"via": "framework", "n": body.n}

    @app.post("/cold")
    async def cold(body: Body) -> dict[str, object]:
        return {"via": "cold", "n": body.n}

    async def fast(scope: dict, raw: bytes, headers: dict[bytes, bytes]) -> tuple[int, bytes] | None:
        seen.append(raw)
        if headers.get(b"x-skip") or b'"n"' not in raw:
            return None
        return 201, b'{"via": "fast"}'

    app.add_middleware(BodyLimit, max_bytes=1000)
    app.fast_routes = {"/hot": fast}
    app.max_body_bytes = 1000
    return app, seen


def test_the_handler_answers_or_the_framework_gets_the_same_body():
    app, seen = make_app()
    with TestClient(app) as c:
        r = c.post("/hot", json={"n": 1})
        assert (r.status_code, r.json(), r.headers["content-type"]) == (201, {"via": "fast"}, "application/json")
        assert r.headers["content-length"] == str(len(b'{"via": "fast"}'))
        # declined: FastAPI answers, having read the very bytes the handler saw (replayed)
        r = c.post("/hot", json={"n": 2}, headers={"x-skip": "1"})
        assert (r.status_code, r.json()) == (200, {"via": "framework", "n": 2})
        r = c.post("/hot", content=b'{"m": 3}', headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "n"]
        # a body in chunks is gathered whole
        r = c.post("/hot", content=iter([b'{"n"', b": 4}"]), headers={"content-type": "application/json"})
        assert r.status_code == 201 and seen[-1] == b'{"n": 4}'
        # other paths and methods never reach the handler
        n = len(seen)
        assert c.post("/cold", json={"n": 5}).json() == {"via": "cold", "n": 5}
        assert c.get("/hot").status_code == 405
        assert len(seen) == n


def test_a_body_over_the_limit_goes_to_the_framework_whole_and_is_refused_there():
    app, seen = make_app()

    @app.exception_handler(413)
    async def too_big(request, exc):  # the router's format (its on_http handler)
        from fastapi.responses import JSONResponse

        return JSONResponse(status_code=413, content={"error": {"message": exc.detail, "type": "http_error"}})

    with TestClient(app) as c:
        big = b'{"n": 1, "pad": "' + b"x" * 2000 + b'"}'
        r = c.post("/hot", content=iter([big[i:i + 100] for i in range(0, len(big), 100)]),
                   headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert r.json() == {"error": {"message": "request body larger than 1000 bytes", "type": "http_error"}}
        r = c.post("/hot", content=big, headers={"content-type": "application/json"})  # declared length
        assert r.status_code == 413
        # at the limit exactly, a chunked body is read whole and handled
        ok = b'{"n": 1, "pad": "' + b"x" * (1000 - 19) + b'"}'
        assert len(ok) == 1000
        r = c.post("/hot", content=iter([ok[:500], ok[500:]]), headers={"content-type": "application/json"})
        assert r.status_code == 201 and seen == [ok]
