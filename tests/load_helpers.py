"""Many concurrent HTTP clients against a running farm, counting what they were answered.

Used by the load tests (and shaped like bench/service.py's runs): every client opens its own
keep-alive connection, waits for the others, then uploads a model of its own and submits a
compile of it, `rounds` times. Nothing here asserts on time; the tests assert on answers.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

ModelBytes = Callable[[int], bytes]


@dataclass
class LoadResult:
    statuses: Counter[int] = field(default_factory=Counter)
    """HTTP status of every answer."""
    failures: list[str] = field(default_factory=list)
    """Requests that got no answer (connection dropped, timed out) and 5xx bodies."""
    job_ids: list[str] = field(default_factory=list)

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


async def _client(
    url: str,
    key: str,
    index: int,
    rounds: int,
    model: ModelBytes,
    options: dict[str, object],
    start: asyncio.Event,
    ready: list[int],
    result: LoadResult,
) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120.0) as http:
        await http.get("/healthz")
        ready.append(index)
        await start.wait()
        for r in range(rounds):
            try:
                up = await http.post(
                    "/v1/models",
                    content=model(index * rounds + r),
                    params={"filename": f"m{index}-{r}.onnx"},
                    headers={"Content-Type": "application/octet-stream"},
                )
                _count(result, up)
                if up.status_code != 201:
                    continue
                job = await http.post(
                    "/v1/compile-jobs", json={"model_id": up.json()["id"], "options": options}
                )
                _count(result, job)
                if job.status_code in (200, 202):
                    result.job_ids.append(job.json()["id"])
            except httpx.HTTPError as exc:
                result.failures.append(f"client {index}: {type(exc).__name__}: {exc}")


def _count(result: LoadResult, answer: httpx.Response) -> None:
    result.statuses[answer.status_code] += 1
    if answer.status_code >= 500:
        result.failures.append(f"HTTP {answer.status_code}: {answer.text[:300]}")


async def _run(
    url: str, key: str, clients: int, rounds: int, model: ModelBytes, options: dict[str, object]
) -> LoadResult:
    result = LoadResult()
    start = asyncio.Event()
    ready: list[int] = []
    tasks = [
        asyncio.create_task(_client(url, key, i, rounds, model, options, start, ready, result))
        for i in range(clients)
    ]
    for _ in range(3000):  # bounded: until every client is connected (or one failed)
        if len(ready) == clients or any(t.done() for t in tasks):
            break
        await asyncio.sleep(0.01)
    start.set()
    await asyncio.gather(*tasks)
    return result


def upload_and_submit(
    url: str,
    key: str,
    *,
    clients: int,
    rounds: int,
    model: ModelBytes,
    options: dict[str, object],
) -> LoadResult:
    """`clients` concurrent clients, each uploading `model(n)` and submitting it `rounds`
    times; every answer counted."""
    return asyncio.run(_run(url, key, clients, rounds, model, options))


async def _identical(
    url: str, key: str, body: dict[str, object], clients: int, rounds: int
) -> list[dict[str, object]]:
    answers: list[dict[str, object]] = []
    start = asyncio.Event()
    ready: list[int] = []

    async def one(index: int) -> None:
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120.0) as http:
            await http.get("/healthz")
            ready.append(index)
            await start.wait()
            for _ in range(rounds):
                answer = await http.post("/v1/compile-jobs", json=body)
                assert answer.status_code in (200, 202), answer.text
                answers.append(answer.json())

    tasks = [asyncio.create_task(one(i)) for i in range(clients)]
    for _ in range(3000):
        if len(ready) == clients or any(t.done() for t in tasks):
            break
        await asyncio.sleep(0.01)
    start.set()
    await asyncio.gather(*tasks)
    return answers


def identical_submits(
    url: str, key: str, body: dict[str, object], *, clients: int, rounds: int
) -> list[dict[str, object]]:
    """The same submit from `clients` concurrent clients, `rounds` times each: every
    answer's JSON (each must be 200 or 202)."""
    return asyncio.run(_identical(url, key, body, clients, rounds))
