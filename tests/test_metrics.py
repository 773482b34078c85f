"""GET /metrics parses as Prometheus text and its counters move as known traffic says."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TINY_SERVED_NAME


async def _scrape(http: aiohttp.ClientSession, base: str) -> dict[tuple[str, tuple], float]:
    async with http.get(base + "/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_counters_follow_traffic(api_server, wait_idle) -> None:
    base = api_server.url
    prompt = list(range(500, 540))
    async with aiohttp.ClientSession() as http:
        before = await _scrape(http, base)
        for _ in range(3):
            body = {
                "model": TINY_SERVED_NAME,
                "prompt": prompt,
                "max_tokens": 5,
                "ignore_eos": True,
            }
            async with http.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200
        async with http.post(base + "/v1/completions", json={"model": TINY_SERVED_NAME}) as r:
            assert r.status == 400
        await wait_idle()
        after = await _scrape(http, base)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("deepinfer:generation_tokens_total") == 15
    assert delta("deepinfer:prompt_tokens_total") == 3 * len(prompt)
    assert delta("deepinfer:request_success_total", finished_reason="length") == 3
    assert delta("deepinfer:time_to_first_token_seconds_count") == 3
    assert delta("deepinfer:e2e_request_latency_seconds_count") == 3
    assert delta("deepinfer:request_queue_time_seconds_count") == 3
    assert delta("deepinfer:inter_token_latency_seconds_count") == 3 * 4
    assert delta("deepinfer:prompt_tokens_cached_total", tier="device") >= 2 * 32
    assert delta("deepinfer:prefix_cache_block_hits_total", tier="device") >= 4
    assert (
        delta("deepinfer:http_errors_total", status="400", type="invalid_request_error")
        + delta("deepinfer:http_errors_total", status="400", type="api_error")
        == 1
    )
    assert after[("deepinfer:num_requests_running", ())] == 0
    assert ("deepinfer:kv_cache_usage_perc", (("kind", "full"),)) in after
    assert ("deepinfer:num_preemptions_total", ()) in after
    assert after[("deepinfer:kv_cache_tier_bytes", (("tier", "device"),))] > 0
