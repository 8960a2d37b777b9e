"""The standard workloads shipped with the package (workloads.json beside this module) and the
prompts and arrivals they define."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources


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
    num_prefixes: int = 1  # request i starts with shared prefix i % num_prefixes
    concurrency: int | None = None  # optional client-side cap on in-flight requests

    @property
    def total_prompt_tokens(self) -> int:
        return self.num_requests * self.input_len

    @property
    def total_output_tokens(self) -> int:
        return self.num_requests * self.output_len


def load_workloads() -> dict[str, Workload]:
    """The packaged workloads by name. Only the copy inside the package is read (no environment
    variable, working directory or checkout layout changes it), so every run of a given version
    measures the same thing; other shapes are given with the bench's custom-workload flags."""
    data = json.loads(resources.files(__package__).joinpath("workloads.json").read_text())
    fields = set(Workload.__dataclass_fields__)
    return {w["name"]: Workload(**{k: v for k, v in w.items() if k in fields}) for w in data["workloads"]}


def get_workload(name: str) -> Workload:
    """The packaged workload `name`; "custom" is a 16 x 128 -> 128 base for the custom-workload
    flags. Raises ValueError naming the known workloads for any other name."""
    table = load_workloads()
    if name in table:
        return table[name]
    if name == "custom":
        return Workload("custom", 16, 128, 128)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(table)} (or 'custom' with "
                     "--input-len/--output-len/--num-requests)")


def ordinary_vocab(tokenizer) -> list[int]:
    """Token ids of the model's ordinary vocabulary: no special or added tokens."""
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    return [i for i in range(len(tokenizer)) if i not in special]


def build_prompts(w: Workload, vocab: list[int]) -> list[list[int]]:
    """Request i: input_len ids drawn with random.Random(seed + i); with shared_prefix_len, its
    first shared_prefix_len ids are prefix i % num_prefixes, prefix 0 drawn with
    random.Random(seed) and prefix j > 0 with random.Random(f"{seed}:{j}")."""
    prefixes = []
    for j in range(max(1, w.num_prefixes)):
        prefix_rng = random.Random(w.seed if j == 0 else f"{w.seed}:{j}")
        prefixes.append([prefix_rng.choice(vocab) for _ in range(w.shared_prefix_len)])
    prompts = []
    for i in range(w.num_requests):
        rng = random.Random(w.seed + i)
        own = [rng.choice(vocab) for _ in range(w.input_len - w.shared_prefix_len)]
        prompts.append(prefixes[i % len(prefixes)] + own)
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
