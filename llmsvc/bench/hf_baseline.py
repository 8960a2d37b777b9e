"""The peer: Hugging Face transformers' static-batch `generate` on the same weights and prompts."""
from __future__ import annotations

import time

from tqdm import tqdm

from llmsvc.bench.metrics import RequestRecord


def run_hf(model_dir: str, prompts: list[list[int]], output_len: int, dtype: str = "float32",
           batch_size: int = 64, device: str = "auto") -> tuple[list[RequestRecord], float]:
    """Greedy, exactly output_len new tokens each, in static batches of `batch_size` (prompts of a
    batch have equal length in the standard workloads, so no padding). Per-token times are not
    observable in `generate`: every token of a batch is stamped at the batch's end. device
    "auto" is the engine's default: the GPU where there is one."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmsvc.bench.ceiling import bench_device
    from llmsvc.models.loader import to_torch_dtype

    device, sync = bench_device(device)
    dt = to_torch_dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).to(device).eval()
    with torch.inference_mode():  # warm-up outside the clock, as the engine warms up at start
        model.generate(torch.tensor(prompts[:1], device=device), do_sample=False, max_new_tokens=2,
                       pad_token_id=model.config.eos_token_id or 0)
    records = []
    sync()
    t_start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch_size), desc="hf generate", unit="batch"):
        batch = prompts[i:i + batch_size]
        assert len({len(p) for p in batch}) == 1, "static batches need equal prompt lengths"
        ids = torch.tensor(batch, device=device)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=output_len, min_new_tokens=output_len,
                                 pad_token_id=model.config.eos_token_id or 0)
        sync()
        t1 = time.perf_counter()
        n_new = out.shape[1] - ids.shape[1]
        for p in batch:
            records.append(RequestRecord(len(p), t0, [t1] * n_new, t1))
    return records, time.perf_counter() - t_start
