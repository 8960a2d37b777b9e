"""benchmarks.soak --swap, for 20 s against `llmsvc serve` on a tiny random model: requests are
swapped out and back, some are cancelled, aborted, dropped or run out of deadline while swapped
out, and afterwards every block of the KV cache and of the swap space is free."""
from __future__ import annotations

import json

from benchmarks import soak
from tests.server_harness import make_tiny_served_model_dir


def test_soak_with_swap_leaks_no_block_in_either_pool(tmp_path):
    # byte-level tokens: prompts of up to ~330 tokens. The 68 blocks of 16 tokens (8 KiB each)
    # hold one longest request (1024 tokens) but never eight clients' requests of up to 600 new
    # tokens, so requests are swapped out all the time; long outputs keep the swapped ones out
    # for a while (the tiny model decodes in milliseconds), long enough to be aimed at.
    model = make_tiny_served_model_dir(tmp_path / "model", max_position_embeddings=1024)
    out = tmp_path / "soak.json"
    code = soak.main(["--model", model, "--swap", "--swap-space", "1MiB", "--kv-cache-memory", "544KiB",
                      "--max-model-len", "1024", "--max-tokens", "600", "--concurrency", "8", "--minutes", "0.33",
                      "--interval", "2", "--idle-timeout", "20", "--seed", "1", "--json", str(out)])
    summary = json.loads(out.read_text())
    summary.pop("timeline")
    assert code == 0, json.dumps(summary)  # the soak printed why ("soak: FAILED: ...") on stderr
    assert summary["preemption_mode"] == "swap" and summary["num_swap_blocks"] == 128
    assert summary["swap_outs"] > 0 and summary["ended_while_swapped"] > 0, summary
    assert summary["all_swap_blocks_free_end"] and summary["free_swap_blocks_end"] == 128, summary
    assert summary["swapped_end"] == 0 and summary["all_blocks_free_end"], summary
    assert summary["calls_by_code"].get("CANCELLED", 0) > 0, summary  # the abuse did happen
