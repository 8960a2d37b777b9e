"""`llmsvc bench --openai [NAME=]URL`: OpenAI-compatible endpoints (SMG in front of llmsvc, SMG in
front of vLLM's gRPC worker, ...) measured beside our own gRPC run on the same prompts, taking
turns with it, and compared with it and with each other.

Same prompts: a chat endpoint takes text and applies the model's chat template itself, so with
--openai every prompt of the workload becomes one user message (its token ids decoded), and our
gRPC run sends that message rendered with the same template and tokenizer, as token ids: every
system computes the same prompt tokens and generates output_len tokens greedily with EOS ignored.
The first --openai endpoint is "ours through the gateway": it is compared with llmsvc's own
gRPC API (what the gateway costs) and with every other endpoint (e.g. vLLM behind the same
gateway)."""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from llmsvc.bench.metrics import summarize
from llmsvc.bench.repeat import System, ratio, summarize_runs


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str


def parse_endpoint(text: str) -> Endpoint:
    """`NAME=URL` or `URL` (named after its host:port); argparse reports a malformed one."""
    name, sep, url = text.partition("=")
    if not sep or "://" in name:
        name, url = "", text
    m = re.fullmatch(r"(https?)://([^/\s]+)(/\S*)?", url.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"--openai {text!r}: expected [NAME=]http://HOST:PORT")
    return Endpoint(name.strip() or m.group(2), url.strip().rstrip("/"))


def check_endpoints(endpoints: list[Endpoint]) -> str | None:
    """Why the endpoints cannot be told apart (the message for exit code 2), or None."""
    names = [e.name for e in endpoints]
    dup = sorted({n for n in names if names.count(n) > 1})
    return f"--openai: name {dup[0]!r} given twice (name them NAME=URL)" if dup else None


class ChatPrompts:
    """The workload's token-id prompts as chat: the user text of each and its rendered token ids."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def texts(self, prompts: list[list[int]]) -> list[str]:
        return [self.tokenizer.decode(p, skip_special_tokens=True) for p in prompts]

    def rendered(self, texts: list[str]) -> list[list[int]]:
        """Each text as a one-message conversation with the assistant's turn opened, tokenized
        as a chat endpoint tokenizes it (the template adds the special tokens)."""
        out = []
        for t in texts:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                     tokenize=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        return out


def as_chat(prompts: list[list[int]], chat: ChatPrompts | None) -> tuple[list[list[int]], list[str] | None]:
    """(prompt ids, user texts): unchanged and None without --openai; with it, each prompt's text
    and that text rendered by the chat template, so every system computes the same prompt."""
    if chat is None:
        return prompts, None
    texts = chat.texts(prompts)
    return chat.rendered(texts), texts


def openai_systems(endpoints: list[Endpoint], texts: list[str], prompt_ids: list[list[int]], output_len: int,
                   offsets: list[float], concurrency: int | None) -> tuple[list[System], dict[str, str]]:
    """A system per endpoint (key "openai:NAME"), and the notes of endpoints whose prefix cache
    could not be emptied before a run (later runs of the same prompts then find them cached)."""
    from llmsvc.bench.openai_chat import flush_cache, run_chat, served_model

    lens = [len(p) for p in prompt_ids]
    notes: dict[str, str] = {}

    def make(e: Endpoint) -> System:
        def run() -> dict:
            model = served_model(e.url)
            # one short request outside the clock (connections, the gateway's tokenizer, the
            # worker's first step), then an empty prefix cache for the measured run
            run_chat(e.url, model, texts[:1], lens[:1], 2, [0.0], desc=f"{e.name} warm-up")
            if not flush_cache(e.url):
                notes[e.name] = f"{e.url}/flush_cache failed: its prefix cache may hold earlier runs' prompts"
                print(f"  note: {notes[e.name]}")
            s = summarize(*run_chat(e.url, model, texts, lens, output_len, offsets, concurrency, desc=e.name))
            if e.name in notes:
                s["note"] = notes[e.name]
            return s
        return System(f"openai:{e.name}", f"{e.name} (OpenAI chat)", run)

    return [make(e) for e in endpoints], notes


def _stats(res: dict, key: str) -> dict:
    return res.get("repeat", {}).get(key) or summarize_runs([res[key]])


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def print_openai_ratios(res: dict, endpoints: list[Endpoint]) -> None:
    """The first endpoint over llmsvc's gRPC run and over each other endpoint, from the medians:
    output tok/s (above 1: the first is faster) and TTFT p50 / p99 (below 1: it answers sooner)."""
    if not endpoints:
        return
    first = f"openai:{endpoints[0].name}"
    others = [("serve", "llmsvc gRPC")] if "serve" in res else []
    others += [(f"openai:{e.name}", e.name) for e in endpoints[1:]]
    out = res.setdefault("openai_ratios", {})
    for key, label in others:
        a, b = _stats(res, first), _stats(res, key)
        r = {f: ratio(a, b, f) for f in ("output_tok_s", "ttft_p50_s", "ttft_p99_s")}
        out[f"{endpoints[0].name} / {label}"] = r
        print(f"  {endpoints[0].name} / {label}: output tok/s {_x(r['output_tok_s'])}  "
              f"TTFT p50 {_x(r['ttft_p50_s'])}  p99 {_x(r['ttft_p99_s'])} (medians)")
