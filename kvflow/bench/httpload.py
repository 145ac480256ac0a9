"""A lean HTTP/1.1 load generator for the benchmarks: keep-alive connections on asyncio streams.

A general-purpose client (httpx) spends ~1.7 ms of CPU per request here — as much as the router
it measures, on the same 2 cores. Like ``wrk``, this one only writes a request and reads the
status line, the headers and a ``Content-Length`` body, so that the cores go to the server.
It speaks just what the benchmarks need: POST of a JSON body, a non-chunked response.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


class HttpError(RuntimeError):
    pass


@dataclass
class LoadResult:
    latencies: list[float] = field(default_factory=list)  # seconds, one per request
    bodies: list[bytes] = field(default_factory=list)
    elapsed: float = 0.0

    @property
    def per_second(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed else 0.0


class Connection:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        assert self.reader is not None and self.writer is not None, "open() first"
        self.writer.write(b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), len(body), body))
        head = await self.reader.readuntil(b"\r\n\r\n")
        status_line, _, headers = head.partition(b"\r\n")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise HttpError(f"not an HTTP/1 response: {status_line[:80]!r}")
        length = None
        for line in headers.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
            elif name.strip().lower() == b"transfer-encoding":
                raise HttpError("chunked responses are not supported by this load generator")
        if length is None:
            raise HttpError("response without content-length")
        return int(parts[1]), await self.reader.readexactly(length)


async def post_load(host: str, port: int, path: str, bodies: Sequence[bytes], n: int, concurrency: int,
                    check: Callable[[int, bytes], None] | None = None) -> LoadResult:
    """POST ``bodies`` round-robin, ``n`` requests in all, ``concurrency`` connections in parallel.

    Every response must be 200 (and pass ``check``), else the load stops with an error."""
    res = LoadResult()
    next_i = 0
    conns = [Connection(host, port) for _ in range(concurrency)]
    await asyncio.gather(*(c.open() for c in conns))

    async def worker(conn: Connection) -> None:
        nonlocal next_i
        while next_i < n:
            i = next_i
            next_i += 1
            t0 = time.perf_counter()
            status, body = await conn.post(path, bodies[i % len(bodies)])
            res.latencies.append(time.perf_counter() - t0)
            if status != 200:
                raise HttpError(f"HTTP {status}: {body[:300]!r}")
            if check is not None:
                check(status, body)
            res.bodies.append(body)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(c) for c in conns))
    finally:
        res.elapsed = time.perf_counter() - t0
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
    return res
