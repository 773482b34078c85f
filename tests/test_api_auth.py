"""API keys a real daemon is sent as raw header bytes: anything but the key (non-UTF-8 bytes
included) is a 401 in the protocol's shape, and the configured key shows in no log line, not
even in a logged traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.daemons import ROOT, checkout_env, daemon

KEY = "sk-live-7f3a9c1e5b"
BODY = orjson.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1})
MESSAGES = orjson.dumps(
    {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
)


def raw_request(url: str, path: str, headers: list[bytes], body: bytes) -> tuple[int, dict]:
    """POST with header lines sent byte for byte (HTTP clients refuse non-ASCII values)."""
    host, port = url.removeprefix("http://").split(":")
    head = [
        f"POST {path} HTTP/1.1".encode(),
        f"Host: {host}".encode(),
        b"Content-Type: application/json",
        f"Content-Length: {len(body)}".encode(),
        b"Connection: close",
        *headers,
    ]
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    payload = data.split(b"\r\n\r\n", 1)[1]
    return status, orjson.loads(payload) if payload else {}


@pytest.fixture(scope="module")
def guarded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("auth") / "d.log"
    args = [
        "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-memory-gb",
        "0.05", "--no-kv-store", "--api-key", KEY, "--log-format", "json",
    ]  # fmt: skip
    with daemon(args, log) as (url, _):
        yield url, log


BAD_KEYS = [
    b"Authorization: Bearer \xff\xfe",
    b"Authorization: Bearer " + KEY.encode() + b"\xff",
    b"Authorization: \xc3\x28 " + KEY.encode(),
    b"x-api-key: \xff",
    b"x-api-key: " + KEY.encode() + b"\x80",
    b"x-api-key: caf\xc3\xa9",  # valid UTF-8, not ASCII
]


@pytest.mark.parametrize("header", BAD_KEYS)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_bad_key_bytes_are_a_401(guarded, header: bytes, path: str) -> None:
    url, log = guarded
    body = MESSAGES if path == "/v1/messages" else BODY
    status, payload = raw_request(url, path, [header], body)
    assert status == 401, payload
    if path == "/v1/messages":
        assert payload["type"] == "error"
        assert payload["error"]["type"] == "authentication_error"
    else:
        assert payload["error"]["code"] == "invalid_api_key"
    assert KEY not in log.read_text()


def test_the_key_itself_is_served(guarded) -> None:
    url, log = guarded
    status, _ = raw_request(
        url, "/v1/completions", [b"Authorization: Bearer " + KEY.encode()], BODY
    )
    assert status == 200
    status, _ = raw_request(url, "/v1/completions", [b"x-api-key: " + KEY.encode()], BODY)
    assert status == 200
    assert KEY not in log.read_text()


# A traceback logged while the key is a local variable (in a frame, or an exception's text).
LOG_A_TRACEBACK = """
import logging, sys
import structlog
from daemon.service import logs
logs.setup_logging("info", sys.argv[1], None)
logs.add_secret(sys.argv[2])

def check(api_key):
    raise ValueError("bad key " + api_key)

try:
    check(sys.argv[2])
except ValueError:
    structlog.get_logger().exception("unhandled_error", note=sys.argv[2])
    logging.getLogger("aiohttp.server").exception("Error handling request " + sys.argv[2])
structlog.get_logger().info("done")
"""


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_no_log_line_shows_the_key(fmt: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", LOG_A_TRACEBACK, fmt, KEY],
        cwd=ROOT,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "done" in output, output
    assert "ValueError" in output and "Error handling request" in output
    assert KEY not in output, output
