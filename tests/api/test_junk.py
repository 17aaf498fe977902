"""1,000 junk requests: each gets a 4xx, the server stays healthy, and nothing is written.

Seeded. Most go through httpx's ASGI transport (fast); a share goes to a real
uvicorn server, some of them as raw bytes on a socket, where the HTTP parser
itself is the first thing to meet them.
"""

from __future__ import annotations

import contextlib
import random
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from outbox.api import create_app
from outbox.service import Outbox
from tests.api.conftest import PROBLEM, Http, Tokens, asgi_http, live_http, written

SEED = 20260101
IN_PROCESS = 880
OVER_HTTP = 80
RAW = 40
assert IN_PROCESS + OVER_HTTP + RAW == 1000

PATHS = [
    "/v1/tasks",
    "/v1/tools/create_support_task",
    "/v1/tools/",
    "/v1/tools/%00",
    "/v1/tools/" + "t" * 3000,
    "/v1/operations/",
    "/v1/operations/%ff%fe",
    "/v1/tasks/-1",
    "/v1/tasks/99999999999999999999999999",
    "/v1/tasks/1e3",
    "/v1/../etc/passwd",
    "/openapi.json/x",
    "/%2e%2e/%2e%2e",
]


def _text(rng: random.Random, n: int) -> str:
    return "".join(chr(rng.randint(0x21, 0x7E)) for _ in range(n))


def junk_body(rng: random.Random) -> bytes:
    kind = rng.randrange(8)
    if kind == 0:
        return rng.randbytes(rng.randint(1, 2000))
    if kind == 1:  # deep JSON, past and under Python's recursion limit
        depth = rng.choice([50, 900, 5_000, 30_000])
        opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
        return (opener * depth + "1" + closer * depth).encode()
    if kind == 2:  # invalid UTF-8 inside an otherwise fine document
        return b'{"subject": "' + rng.randbytes(8).replace(b'"', b"x") + b'\xc3\x28"}'
    if kind == 3:  # JSON with the wrong types (strict validation)
        return rng.choice(
            [b'{"subject": 1}', b'{"subject": null}', b'{"subject": ["a"]}', b'{"subject": true}']
        )
    if kind == 4:  # not an object
        return rng.choice([b"[]", b'"subject"', b"null", b"1", b"1e999", b"-0"])
    if kind == 5:  # numbers and constants Python would accept and JSON does not
        return rng.choice([b'{"subject": NaN}', b'{"subject": Infinity}', b"9" * 5000])
    if kind == 6:  # lone surrogates and NUL escapes
        return rng.choice([b'{"subject": "\\ud800"}', b'{"subject": "a\\u0000"}'])
    return b""


def junk_request(rng: random.Random, tokens: Tokens) -> tuple[str, str, dict[str, str], bytes]:
    """A request that is wrong in at least one way (so that none of them may write)."""
    # Weighted towards the write routes, so that most junk gets past routing to the body.
    method = rng.choice(["POST"] * 12 + ["GET", "PUT", "DELETE", "PATCH", "OPTIONS"])
    path = rng.choice(PATHS) if rng.random() < 0.3 else "/v1/tasks"
    headers: dict[str, str] = {}
    auth = rng.randrange(8)
    if auth == 0:
        headers["Authorization"] = "Bearer " + _text(rng, rng.randint(1, 200))
    elif auth == 1:
        headers["Authorization"] = rng.choice(["Basic Zm9vOmJhcg==", "Bearer", "Token x"])
    elif auth == 3:
        headers["Authorization"] = f"Bearer {tokens.revoked}"
    elif auth >= 4:
        headers["Authorization"] = f"Bearer {tokens.acme}"
    key = rng.randrange(8)
    if key == 0:
        headers["Idempotency-Key"] = _text(rng, rng.randint(256, 8000))  # too long
    elif key == 1:
        headers["Idempotency-Key"] = rng.choice(["", "a b", "x\ty", "k" * 256])
    elif key >= 2:
        headers["Idempotency-Key"] = _text(rng, rng.randint(1, 64))
    headers["Content-Type"] = rng.choice(
        ["application/json"] * 5
        + ["text/plain", "application/json; charset=utf-16", "multipart/form-data", "a/b/c"]
    )
    if rng.random() < 0.1:
        headers["X-Huge"] = _text(rng, rng.randint(8_000, 60_000))
    body = junk_body(rng)
    if rng.random() < 0.03:
        body = b'{"subject": "' + b"a" * 70_000 + b'"}'  # over the body limit
    return method, path, headers, body


def assert_4xx_problem(response: Any, request: Any) -> None:
    assert 400 <= response.status_code < 500, (request, response.status_code, response.text)
    assert response.headers["content-type"] == PROBLEM, (request, response.headers)
    doc = response.json()
    assert doc["status"] == response.status_code
    assert doc["retry"] in ("same_key", "never", "after_fix", "reconcile")


def send_raw(base_url: str, payload: bytes) -> bytes:
    host, port = urlsplit(base_url).hostname, urlsplit(base_url).port
    assert host == "127.0.0.1" and port
    with socket.create_connection((host, port), timeout=10) as sock:
        # No half-close: uvicorn takes EOF as a disconnect and drops the answer.
        # Every payload says `Connection: close` or is rejected by the parser (which closes).
        with contextlib.suppress(ConnectionError):
            sock.sendall(payload)  # the server may answer and close before it has read it all
        chunks = []
        while True:  # bounded by the socket timeout and by the server closing
            try:
                data = sock.recv(65536)
            except ConnectionResetError:  # closed with our unread bytes: the answer came first
                break
            if not data:
                break
            chunks.append(data)
            if sum(map(len, chunks)) > 1_000_000:
                break
    return b"".join(chunks)


def raw_junk(rng: random.Random, tokens: Tokens) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:  # garbage instead of a request line
        return rng.randbytes(rng.randint(1, 500)).replace(b"\r\n\r\n", b"") + b"\r\n\r\n"
    if kind == 1:  # headers far past any sane size
        return b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"
    if kind == 2:  # a lying Content-Length
        return (
            b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: abc\r\n\r\n{}"
        )
    if kind == 3:  # non-ASCII bytes in the key and the token
        return (
            b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Authorization: Bearer " + tokens.acme.encode() + b"\r\n"
            b"Idempotency-Key: cl\xe9\xff\r\nContent-Type: application/json\r\n"
            b'Content-Length: 17\r\n\r\n{"subject": "x"}\n'
        )
    return (  # a declared body far over the limit, never sent
        b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: 999999999\r\n\r\n{"
    )


def test_junk_requests_get_4xx_and_write_nothing(box: Outbox, tokens: Tokens) -> None:
    rng = random.Random(SEED)
    app = create_app(box)
    statuses: dict[int, int] = {}

    def run(http: Http, n: int) -> None:
        for _ in range(n):
            method, path, headers, body = junk_request(rng, tokens)
            response = http.request(method, path, headers=headers, content=body)
            assert_4xx_problem(response, (method, path, {k: v[:80] for k, v in headers.items()}))
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    with asgi_http(app) as http:
        run(http, IN_PROCESS)
    with live_http(app) as http:
        run(http, OVER_HTTP)
        for _ in range(RAW):
            payload = raw_junk(rng, tokens)
            answer = send_raw(http.base_url, payload)
            assert answer.startswith(b"HTTP/1.1 4"), (payload[:80], answer[:200])
            code = int(answer[9:12])
            statuses[code] = statuses.get(code, 0) + 1
        # Still healthy, and still serving real work.
        assert http.get("/healthz").json() == {"status": "ok"}
        assert http.get("/readyz").status_code == 200
        assert written(box) == {"tasks": 0, "operations": 0, "outbox": 0}
        # The junk was sent as tenant acme, as fast as this machine goes: it may have
        # spent acme's rate limit (100/second). A 429 says "the same request after
        # Retry-After", and a real client does just that (bounded by count).
        for _ in range(5):
            ok = http.post(
                "/v1/tasks",
                json={"subject": "after the junk"},
                headers={"Authorization": f"Bearer {tokens.acme}", "Idempotency-Key": "real"},
            )
            if ok.status_code != 429:
                break
            assert ok.json()["retry"] == "same_key"
            time.sleep(float(ok.headers["Retry-After"]))
        assert ok.status_code == 201, ok.text

    assert sum(statuses.values()) == 1000
    # The mix reached every layer: auth, key, media type, size, JSON, validation, routing.
    assert {400, 401, 404, 405, 413, 415} <= statuses.keys(), statuses
