"""Two daemon processes on one block-store directory: the second gets block hits from what
the first wrote, and answers the same."""

from __future__ import annotations

from pathlib import Path

from openai import OpenAI

from tests.daemons import daemon

PROMPT = list(range(1000, 1150))  # 150 tokens: 9 full blocks of 16


def _args(model: Path, store: Path) -> list[str]:
    return [
        "--model", str(model), "--served-model-name", "tiny", "--kv-cache-memory-gb", "0.02",
        "--max-num-seqs", "4", "--max-model-len", "512", "--kv-store-dir", str(store),
        "--log-format", "json",
    ]  # fmt: skip


def _complete(url: str):
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    return client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )


def test_second_daemon_hits_the_first_ones_blocks(tiny_model_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    with daemon(_args(tiny_model_dir, store), tmp_path / "a.log") as (url_a, _):
        first = _complete(url_a)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        with daemon(_args(tiny_model_dir, store), tmp_path / "b.log") as (url_b, _):
            second = _complete(url_b)
    assert len(list(store.rglob("*.kvb"))) >= 9
    details = second.usage.prompt_tokens_details
    assert details.cached_tokens == 144, details
    assert details.model_extra["cached_tokens_by_tier"] == {"store": 144}
    assert second.choices[0].text == first.choices[0].text


def test_fifos_in_place_of_block_files_neither_hang_requests_nor_the_shutdown(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A FIFO opened for reading waits for a writer: the startup sweep, a request's block
    reads and the SIGTERM shutdown must not."""
    import os
    import signal

    store = tmp_path / "store"
    with daemon(_args(tiny_model_dir, store), tmp_path / "a.log") as (url, _):
        first = _complete(url)
    files = list(store.rglob("*.kvb"))
    assert len(files) >= 9
    for f in files:
        f.unlink()
        os.mkfifo(f)
    with daemon(_args(tiny_model_dir, store), tmp_path / "b.log") as (url, proc):
        second = _complete(url)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert second.choices[0].text == first.choices[0].text
    assert second.usage.prompt_tokens_details.cached_tokens == 0
    # the FIFOs were removed as garbage; the blocks were written anew
    assert all(f.is_file() for f in store.rglob("*.kvb"))
