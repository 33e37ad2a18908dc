"""Bounded-concurrency async client for vLLM's /v1/completions.

Why async + a semaphore: a vLLM server batches concurrent requests, so throughput comes
from keeping K requests in flight, while an unbounded fan-out would time out requests
queued behind each other. Transient failures (connection resets, 5xx while the engine is
busy) are retried with exponential backoff; a 4xx is our bug and fails at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

NUM_RETRIES = 3  # a transient failure's retries, with exponential backoff


class CompletionClient:
    def __init__(
        self,
        url: str,
        concurrency: int = 8,
        timeout_s: float = 300.0,
        api_key: str | None = None,
    ):
        self.url = url.rstrip("/")
        self._semaphore = asyncio.Semaphore(concurrency)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=headers)
        self.model: str | None = None
        self.model_root: str | None = None
        self.num_retried = 0

    async def __aenter__(self) -> CompletionClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self._client.aclose()

    async def connect(self, timeout_s: float) -> dict[str, Any]:
        """Wait for /v1/models; returns the first served model's entry."""
        deadline = time.monotonic() + timeout_s
        last_error = "no answer"
        while True:
            try:
                r = await self._client.get(self.url + "/v1/models", timeout=5.0)
                if r.status_code == 200 and r.json().get("data"):
                    entry = r.json()["data"][0]
                    self.model, self.model_root = entry["id"], entry.get("root")
                    return entry
                last_error = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last_error = type(e).__name__
            if time.monotonic() >= deadline:
                raise ValueError(  # a user error: the wrong URL, or no server started
                    f"server {self.url} not reachable after {timeout_s:.0f} s ({last_error}); "
                    "start one with `python -m eval.serve HF_DIR` and pass its URL"
                )
            await asyncio.sleep(1.0)

    async def complete(self, **body: Any) -> dict[str, Any]:
        body.setdefault("model", self.model)
        async with self._semaphore:
            for attempt in range(NUM_RETRIES + 1):
                try:
                    r = await self._client.post(self.url + "/v1/completions", json=body)
                    if r.status_code < 500:
                        if r.status_code != 200:
                            raise ValueError(
                                f"server rejected a completion request: HTTP {r.status_code} "
                                f"{r.text[:300]}"
                            )
                        return r.json()
                    error = f"HTTP {r.status_code}"
                except httpx.TransportError as e:
                    error = type(e).__name__
                if attempt == NUM_RETRIES:
                    raise ValueError(
                        f"completion request to {self.url} failed {attempt + 1} times ({error})"
                    )
                self.num_retried += 1
                await asyncio.sleep(0.5 * 2**attempt)
