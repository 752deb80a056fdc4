"""GET /metrics: Prometheus text that agrees with what the clients saw and the log says."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families
from server import serve, serve_model

GEN = "/v1/generate"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_count_what_clients_saw(tiny_gguf: Path, tmp_path: Path) -> None:
    async with (
        serve(
            tiny_gguf, tmp_path, max_concurrency=2, max_pending_requests=2, pending_timeout_ms=400
        ) as srv,
        srv.client(limits=httpx.Limits(max_connections=50)) as c,
    ):
        statuses: Counter[int] = Counter()
        completion_tokens = 0
        prompt_tokens = 0

        async def one(i: int) -> None:
            nonlocal completion_tokens, prompt_tokens
            # No promises: a place held for a refused client would refuse the request
            # below until it lapsed (tests/test_retry_after.py is about those).
            body = {"prompt": "x y", "max_new_tokens": 12, "ignore_eos": True}
            r = await c.post(GEN, json=body, headers={"x-ninfer-no-promise": "1"})
            statuses[r.status_code] += 1
            if r.status_code == 200:
                usage = r.json()["usage"]
                completion_tokens += usage["completion_tokens"]
                prompt_tokens += usage["prompt_tokens"]

        async with trio.open_nursery() as n:
            for i in range(16):
                n.start_soon(one, i)
        bad = await c.post(GEN, json={"prompt": "x", "max_new_tokens": -1})
        assert bad.status_code == 422
        assert (await c.get("/nowhere")).status_code == 404
        page = await c.get("/metrics")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "_created" not in page.text  # turned off (metrics.md lists no such series)
        m = _samples(page.text)

    assert set(statuses) <= {200, 429, 503}
    assert statuses[200] >= 2
    assert _value(m, "ninfer_http_requests_total", route=GEN, status="200") == statuses[200]
    assert _value(m, "ninfer_http_requests_total", route=GEN, status="429") == statuses[429]
    assert _value(m, "ninfer_http_requests_total", route=GEN, status="422") == 1
    assert _value(m, "ninfer_http_requests_total", route="unmatched", status="404") == 1
    assert _value(m, "ninfer_request_success_total", finished_reason="length") == statuses[200]
    assert _value(m, "ninfer_admission_rejections_total", reason="queue_full") == statuses[429]
    assert _value(m, "ninfer_admission_rejections_total", reason="queue_timeout") == statuses[503]
    assert _value(m, "ninfer_request_rejections_total", status="422", type="invalid_request") == 1
    assert _value(m, "ninfer_generation_tokens_total") == completion_tokens
    assert _value(m, "ninfer_prompt_tokens_total") == prompt_tokens
    assert _value(m, "ninfer_time_to_first_token_seconds_count") == statuses[200]
    assert _value(m, "ninfer_e2e_request_latency_seconds_count") == statuses[200]
    # One inter-token sample per token after each request's first.
    assert (
        _value(m, "ninfer_inter_token_latency_seconds_count") == completion_tokens - statuses[200]
    )
    assert _value(m, "ninfer_num_requests_running") == 0
    assert _value(m, "ninfer_num_requests_waiting") == 0
    assert _value(m, "ninfer_kv_pages_used") == 0
    assert _value(m, "ninfer_kv_pages_free") > 0
    # The log's terminal records say the same.
    done = [r for r in srv.log_records() if r["event"] == "request_done"]
    assert len(done) == statuses[200]


async def test_metrics_need_the_api_key(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve_model(tiny_gguf, tmp_path, api_key="sekrit") as srv, srv.client() as c:
        refused = await c.get("/metrics")
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "unauthorized"
        ok = await c.get("/metrics", headers={"authorization": "Bearer sekrit"})
        assert ok.status_code == 200
        assert "ninfer_num_requests_running" in ok.text


async def test_a_repeated_prompt_is_served_from_the_prefix_cache(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        body = {"model": srv.app.lifespan.public_id, "prompt": " ".join(["x y"] * 30),
                "max_tokens": 4, "temperature": 0}  # fmt: skip
        first = (await c.post("/v1/completions", json=body)).json()
        second = (await c.post("/v1/completions", json=body)).json()
        m = _samples((await c.get("/metrics")).text)
    prompt = first["usage"]["prompt_tokens"]
    assert prompt > 32
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 16 * ((prompt - 1) // 16)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert _value(m, "ninfer_prefix_cache_hits_total") == cached
    assert _value(m, "ninfer_prefix_cache_queries_total") == 2 * prompt
