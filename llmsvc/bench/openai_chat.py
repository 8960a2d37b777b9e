"""A streaming client for any OpenAI-compatible /v1/chat/completions endpoint (the SMG gateway in
front of llmsvc or of vLLM's gRPC worker, vLLM's own OpenAI server, ...), timed as
runners.run_serving times our gRPC stream: a request's clock starts when it is sent (after its
arrival offset and a free concurrency slot), and output is stamped when the chunk carrying it is
read.

Token counts: a chat stream carries text, not token ids. Each chunk with new content (or
reasoning) text counts one token when it is read; the stream's closing usage
(`stream_options.include_usage`) says how many tokens the request generated, and any the chunks
did not account for (a server that packs several tokens into one chunk) are stamped at the last
chunk. So output tok/s and TTFT are exact; inter-token times are exact only for one token per
chunk."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request

from llmsvc.bench.metrics import RequestRecord
from llmsvc.bench.openai_stream import sse_data
from llmsvc.bench.runners import drive_arrivals

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, whatever *_proxy says


def chat_body(model: str, text: str, output_len: int) -> dict:
    """One user message; greedy, exactly output_len tokens (ignore_eos and min_tokens are the
    engines' extensions, which SMG passes on), usage in the stream's last chunk."""
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": output_len,
            "min_tokens": output_len, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


def chat_chunk(data: str) -> tuple[int, int | None, int | None]:
    """(chunks of new text: 0 or 1, the usage's completion_tokens, its cached prompt tokens) of
    one server-sent event's data. Raises ValueError on an error event."""
    msg = json.loads(data)
    if "error" in msg or msg.get("object") == "error":
        raise ValueError(msg.get("error") or msg.get("message") or msg)
    texts = 0
    for choice in msg.get("choices") or []:
        delta = choice.get("delta") or {}
        texts = texts or int(bool(delta.get("content") or delta.get("reasoning_content")))
    usage = msg.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return texts, usage.get("completion_tokens"), cached


async def _one(session, url: str, body: dict, rec: RequestRecord) -> None:
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        total = None
        async for data in sse_data(resp.content):
            texts, completion, cached = chat_chunk(data)
            if texts:
                rec.token_times.append(time.perf_counter())
            if completion is not None:
                total = completion
            if cached:
                rec.cached_tokens = cached
    rec.end = time.perf_counter()
    if total is not None and total > len(rec.token_times):
        rec.token_times += [rec.token_times[-1] if rec.token_times else rec.end] * (total - len(rec.token_times))


async def _run(base_url: str, model: str, texts: list[str], prompt_lens: list[int], output_len: int,
               offsets, concurrency: int | None, desc: str):
    import aiohttp

    url = base_url.rstrip("/") + "/v1/chat/completions"
    # no client-side cap on connections or time: the concurrency limit is the only one, as for gRPC
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def send(i: int, rec: RequestRecord) -> None:
            rec.prompt_len = prompt_lens[i]
            try:
                await _one(session, url, chat_body(model, texts[i], output_len), rec)
            except (aiohttp.ClientError, ValueError) as e:
                rec.error = f"{type(e).__name__}: {e}"

        return await drive_arrivals(texts, offsets, concurrency, desc, send)


def run_chat(base_url: str, model: str, texts: list[str], prompt_lens: list[int], output_len: int,
             offsets: list[float], concurrency: int | None = None,
             desc: str = "openai") -> tuple[list[RequestRecord], float]:
    """Send every text as one streamed chat completion at its arrival offset; (records, wall s).
    prompt_lens: the prompts' token counts as the server renders them (for the input figures)."""
    return asyncio.run(_run(base_url, model, texts, prompt_lens, output_len, offsets, concurrency, desc))


def served_model(base_url: str, timeout: float = 10.0) -> str:
    """The first model the endpoint lists (GET /v1/models); OSError / ValueError when none."""
    with _NO_PROXY.open(base_url.rstrip("/") + "/v1/models", timeout=timeout) as r:
        data = json.loads(r.read().decode()).get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return data[0]["id"]


def flush_cache(base_url: str, timeout: float = 30.0) -> bool:
    """POST /flush_cache (SMG forwards it to every worker, which empties its prefix cache): True
    when the endpoint answered 2xx, so the next run starts from an empty cache."""
    try:
        req = urllib.request.Request(base_url.rstrip("/") + "/flush_cache", data=b"", method="POST")
        with _NO_PROXY.open(req, timeout=timeout) as r:
            return 200 <= r.status < 300
    except OSError:  # HTTPError (404: no such endpoint) included
        return False
