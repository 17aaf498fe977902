"""A flooding client, run as its own process by the fairness test.

    python -m bench.flood.flood HOST PORT TOKEN [--connections 32] [--max-requests 20000]

Keeps ``--connections`` keep-alive connections busy with ``GET /v1/tasks/1``
as fast as the server answers, ignoring ``Retry-After`` (an abusive client).
Prints ``ready`` once every connection has had an answer, and stops when its
standard input closes or after ``--max-requests``; then prints one JSON line:
how many requests, how many 429s, how many of those had ``Retry-After``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter


async def _connection(
    host: str,
    port: int,
    request: bytes,
    counts: Counter[str],
    stop: asyncio.Event,
    first: asyncio.Event,
    answered: list[int],
    limit: int,
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while not stop.is_set() and counts["requests"] < limit:
            writer.write(request)
            counts["requests"] += 1
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ")[1])
            headers = {
                name.strip().lower(): value.strip()
                for name, _, value in (line.partition(":") for line in lines[1:] if line)
            }
            await reader.readexactly(int(headers.get("content-length", "0")))
            counts[str(status)] += 1
            if status == 429 and headers.get("retry-after", "").isdigit():
                counts["429 with Retry-After"] += 1
            if not first.is_set():
                answered[0] += 1
                if answered[0] >= answered[1]:
                    first.set()
    finally:
        writer.close()


async def main_async(args: argparse.Namespace) -> dict[str, int]:
    request = (
        f"GET /v1/tasks/1 HTTP/1.1\r\nHost: {args.host}\r\n"
        f"Authorization: Bearer {args.token}\r\n\r\n"
    ).encode()
    counts: Counter[str] = Counter()
    stop, first = asyncio.Event(), asyncio.Event()
    answered = [0, args.connections]
    loop = asyncio.get_running_loop()
    tasks = [
        asyncio.create_task(
            _connection(
                args.host, args.port, request, counts, stop, first, answered, args.max_requests
            )
        )
        for _ in range(args.connections)
    ]
    await first.wait()
    print("ready", flush=True)
    reading = loop.run_in_executor(None, sys.stdin.read)  # returns when stdin closes
    await asyncio.wait(
        [asyncio.ensure_future(reading), *tasks], return_when=asyncio.FIRST_COMPLETED
    )
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    counts["hit the request cap"] = int(counts["requests"] >= args.max_requests)
    return dict(counts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("token")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--max-requests", type=int, default=20_000)
    args = p.parse_args()
    print(json.dumps(asyncio.run(main_async(args))), flush=True)


if __name__ == "__main__":
    main()
