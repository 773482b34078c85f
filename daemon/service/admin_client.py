"""`deepinfer admin`: the admin socket's command-line client (prints the JSON answer)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass

import orjson


@dataclass(frozen=True)
class AdminCommand:
    method: str
    path: str  # on the admin socket (api.http.admin)
    help: str


COMMANDS = {
    "status": AdminCommand("GET", "/status", "engine, cache and MoE state"),
    "expert-load": AdminCommand(
        "GET", "/expert-load", "per MoE layer: expert loads, rank loads, imbalance (max/mean)"
    ),
    "rebalance-now": AdminCommand(
        "POST", "/rebalance", "place the experts anew from the load window, live"
    ),
    "set-intervals": AdminCommand(
        "POST", "/intervals", "MoE statistics / rebalance intervals (rank 0)"
    ),
    "drain": AdminCommand("POST", "/drain", "stop admitting requests (503); running ones finish"),
    "resume": AdminCommand("POST", "/resume", "admit requests again"),
    "set-role": AdminCommand(
        "POST", "/role", "prefill / decode node: drain the current role, switch, register again"
    ),
}


def add_admin_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", required=True, help="the daemon's admin socket path")
    sub = p.add_subparsers(dest="admin_command", required=True)
    for name, command in COMMANDS.items():
        cmd = sub.add_parser(name, help=command.help)
        if name == "set-intervals":
            cmd.add_argument("--stats", type=int, help="steps between expert-load samples")
            cmd.add_argument("--rebalance", type=int, help="steps between placements (0: off)")
        if name == "set-role":
            cmd.add_argument("role", choices=("prefill", "decode"))


async def call(socket_path: str, command: str, body: dict | None = None) -> tuple[int, dict]:
    import aiohttp  # here, not above: the parser (add_admin_arguments) stays import-light

    c = COMMANDS[command]
    async with (
        aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket_path)) as http,
        http.request(c.method, "http://admin" + c.path, json=body) as r,
    ):
        return r.status, await r.json(content_type=None)


def run_admin(args: argparse.Namespace) -> int:
    import aiohttp

    body = None
    if args.admin_command == "set-intervals":
        body = {
            k: v
            for k, v in (("stats_interval", args.stats), ("rebalance_interval", args.rebalance))
            if v is not None
        }
    if args.admin_command == "set-role":
        body = {"role": args.role}
    try:
        status, answer = asyncio.run(call(args.socket, args.admin_command, body))
    except (aiohttp.ClientError, OSError) as e:
        print(f"deepinfer admin: cannot reach {args.socket}: {e}", file=sys.stderr)
        return 1
    print(orjson.dumps(answer, option=orjson.OPT_INDENT_2).decode())
    return 0 if status < 400 else 1
