"""A streaming client for an OpenAI-compatible /v1/completions endpoint (vLLM's server), timed as
runners.run_serving times our gRPC stream: a request's clock starts when it is sent (after its
arrival offset and a free concurrency slot), and every output token is stamped when the chunk
carrying it is read."""
from __future__ import annotations

import asyncio
import json
import time

from llmsvc.bench.metrics import RequestRecord
from llmsvc.bench.runners import drive_arrivals


def completion_body(model: str, prompt: list[int], output_len: int) -> dict:
    """Greedy, exactly output_len tokens (ignore_eos and min_tokens are vLLM's extensions), the
    prompt given as token ids; return_token_ids makes each chunk say which tokens it carries."""
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "min_tokens": output_len,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "return_token_ids": True}


def chunk_tokens(data: str) -> int:
    """Output tokens carried by one server-sent event's data. Counts the chunk's token_ids when
    the server returns them; otherwise one per chunk with text, as vLLM's stream sends one
    chunk per engine step and request. Raises ValueError on an error event."""
    msg = json.loads(data)
    if "error" in msg or msg.get("object") == "error":
        raise ValueError(msg.get("error") or msg.get("message") or msg)
    n = 0
    for choice in msg.get("choices") or []:
        ids = choice.get("token_ids")
        n += len(ids) if ids is not None else int(bool(choice.get("text")))
    return n


async def sse_data(lines):
    """The data fields of a server-sent event stream of text lines, up to `data: [DONE]`."""
    async for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        line = line.strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments, event/id fields
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield data


async def _one(session, url: str, body: dict, rec: RequestRecord) -> None:
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        async for data in sse_data(resp.content):
            n = chunk_tokens(data)
            if n:
                now = time.perf_counter()
                rec.token_times += [now] * n
    rec.end = time.perf_counter()


async def _run(base_url: str, model: str, prompts, output_len: int, offsets, concurrency: int | None):
    import aiohttp

    url = base_url.rstrip("/") + "/v1/completions"
    # no client-side cap on connections or time: the concurrency limit is the only one, as for gRPC
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def send(i: int, rec: RequestRecord) -> None:
            try:
                await _one(session, url, completion_body(model, prompts[i], output_len), rec)
            except (aiohttp.ClientError, ValueError) as e:
                rec.error = f"{type(e).__name__}: {e}"

        return await drive_arrivals(prompts, offsets, concurrency, f"openai {base_url}", send)


def run_completions(base_url: str, model: str, prompts: list[list[int]], output_len: int,
                    offsets: list[float], concurrency: int | None = None) -> tuple[list[RequestRecord], float]:
    """Send every prompt at its arrival offset as a streaming completion; (records, wall seconds)."""
    return asyncio.run(_run(base_url, model, prompts, output_len, offsets, concurrency))
