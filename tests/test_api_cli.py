"""`python -m daemon serve` as a real process: it serves, answers the SDK, and exits 0 on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from openai import OpenAI

from tests.daemons import ROOT, free_port, wait_healthy


def test_serve_subprocess(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    cmd = [
        sys.executable, "-m", "daemon", "serve", "--model", str(tiny_model_dir),
        "--port", str(port), "--served-model-name", "cli-tiny", "--kv-cache-memory-gb", "0.02",
        "--max-num-seqs", "4", "--max-model-len", "256", "--log-format", "json",
        "--kv-store-dir", str(tmp_path / "kv-store"),
    ]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc, timeout=120)
            client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            r = client.completions.create(model="cli-tiny", prompt="Hello", max_tokens=3)
            assert (
                r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
            )
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0, log_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = log_path.read_text()
    assert '"event": "serving"' in log and '"event": "stopped"' in log, log
    assert '"event": "heap_frozen"' in log, log
