"""CPU fast paths for the ops where plain torch loses most; `kernels/ops.py` picks them.

  attention.py    paged attention read in place, and the KV store (native C, built by build.py)
  elementwise.py  one-pass RMSNorm, fused add + RMSNorm, SiLU-and-mul, neox RoPE, row argmax (native)
  linear.py       linear layers on weights packed once: fp32 panels for gemm.c and bf16 VNNI
                  panels for gemm_bf16.c (AMX tiles, or AVX512-BF16 dot products; native) at
                  decode batch sizes, MKL / oneDNN otherwise
  decoder.py      every Llama decoder layer of a step in one native call (decoder.c), bit for
                  bit the per-op path, its reference

Each op has the torch reference in `kernels/reference.py` as its ground truth and fallback.
"""
