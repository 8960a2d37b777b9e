"""Standard workloads (shared/bench/workloads.json) and the prompts/arrivals they define."""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

PACKAGED = Path(__file__).with_name("workloads.json")
SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "bench" / "workloads.json"


@dataclass
class Workload:
    name: str
    num_requests: int
    input_len: int
    output_len: int
    seed: int = 0
    arrival: str = "all-at-once"  # or "poisson"
    rate: float | None = None  # requests/s for poisson
    shared_prefix_len: int = 0
    concurrency: int | None = None  # optional client-side cap on in-flight requests

    @property
    def total_prompt_tokens(self) -> int:
        return self.num_requests * self.input_len

    @property
    def total_output_tokens(self) -> int:
        return self.num_requests * self.output_len


def workloads_path() -> Path:
    """$LLMSVC_WORKLOADS, else ../shared/bench/workloads.json beside the repo, else the packaged copy."""
    env = os.environ.get("LLMSVC_WORKLOADS")
    if env:
        return Path(env)
    return SHARED if SHARED.exists() else PACKAGED


def load_workloads(path: str | Path | None = None) -> dict[str, Workload]:
    data = json.loads(Path(path or workloads_path()).read_text())
    fields = set(Workload.__dataclass_fields__)
    return {w["name"]: Workload(**{k: v for k, v in w.items() if k in fields}) for w in data["workloads"]}


def ordinary_vocab(tokenizer) -> list[int]:
    """Token ids of the model's ordinary vocabulary: no special or added tokens."""
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    return [i for i in range(len(tokenizer)) if i not in special]


def build_prompts(w: Workload, vocab: list[int]) -> list[list[int]]:
    """Request i: input_len ids drawn with random.Random(seed + i); with shared_prefix_len, the
    first shared_prefix_len ids are the same for all requests (drawn with random.Random(seed))."""
    prefix_rng = random.Random(w.seed)
    prefix = [prefix_rng.choice(vocab) for _ in range(w.shared_prefix_len)]
    prompts = []
    for i in range(w.num_requests):
        rng = random.Random(w.seed + i)
        own = [rng.choice(vocab) for _ in range(w.input_len - w.shared_prefix_len)]
        prompts.append(prefix + own)
    return prompts


def arrival_offsets(w: Workload) -> list[float]:
    """Seconds after the start at which each request is sent (Poisson: exponential gaps)."""
    if w.arrival != "poisson":
        return [0.0] * w.num_requests
    rng = random.Random(w.seed)
    t, out = 0.0, []
    for _ in range(w.num_requests):
        out.append(t)
        t += rng.expovariate(w.rate)
    return out
