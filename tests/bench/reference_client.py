"""An independent minimal streaming client: http.client in threads, no aiohttp, no code
shared with meshserve.bench. The end-to-end test checks the benchmark against it."""
from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit


def stream_once(base_url: str, endpoint: str, model: str, prompt: str, max_tokens: int) -> dict:
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    start = time.perf_counter()
    conn.request("POST", endpoint, body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    token_times, usage = [], None
    while resp.status == 200:
        line = resp.readline()
        now = time.perf_counter()
        if not line or line.strip() == b"data: [DONE]":
            break
        if not line.startswith(b"data:"):
            continue
        chunk = json.loads(line[5:])
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                token_times.append(now)
    end = time.perf_counter()
    conn.close()
    return {"status": resp.status, "start": start, "token_times": token_times, "end": end,
            "usage": usage}


def run(base_url: str, endpoint: str, model: str, prompts: list[tuple[str, int]],
        concurrency: int) -> list[dict]:
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda p: stream_once(base_url, endpoint, model, *p), prompts))


def timings(results: list[dict]) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT, E2EL and pooled ITL in ms, from the raw timestamps."""
    ok = [r for r in results if r["status"] == 200 and r["token_times"]]
    out: dict[str, list[float]] = {"ttft": [], "tpot": [], "e2el": [], "itl": []}
    for r in ok:
        first, n = r["token_times"][0], r["usage"]["completion_tokens"]
        out["ttft"].append((first - r["start"]) * 1000)
        out["e2el"].append((r["end"] - r["start"]) * 1000)
        if n > 1:
            out["tpot"].append((r["end"] - first) * 1000 / (n - 1))
        out["itl"] += [(b - a) * 1000 for a, b in zip(r["token_times"], r["token_times"][1:])]
    return out
