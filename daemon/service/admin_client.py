"""`deepinfer admin`: the admin socket's command-line client (prints the JSON answer)."""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiohttp
import orjson

_REQUESTS = {
    "status": ("GET", "/status"),
    "expert-load": ("GET", "/expert-load"),
    "rebalance-now": ("POST", "/rebalance"),
    "set-intervals": ("POST", "/intervals"),
    "drain": ("POST", "/drain"),
    "resume": ("POST", "/resume"),
}


async def call(socket_path: str, command: str, body: dict | None = None) -> tuple[int, dict]:
    method, path = _REQUESTS[command]
    async with (
        aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket_path)) as http,
        http.request(method, "http://admin" + path, json=body) as r,
    ):
        return r.status, await r.json(content_type=None)


def run_admin(socket_path: str, command: str, args: argparse.Namespace) -> int:
    body = None
    if command == "set-intervals":
        body = {
            k: v
            for k, v in (("stats_interval", args.stats), ("rebalance_interval", args.rebalance))
            if v is not None
        }
    try:
        status, answer = asyncio.run(call(socket_path, command, body))
    except (aiohttp.ClientError, OSError) as e:
        print(f"deepinfer admin: cannot reach {socket_path}: {e}", file=sys.stderr)
        return 1
    print(orjson.dumps(answer, option=orjson.OPT_INDENT_2).decode())
    return 0 if status < 400 else 1
