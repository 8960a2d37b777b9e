"""CPU fast paths for the ops where plain torch loses most; `kernels/ops.py` picks them.

  attention.py    paged attention read in place, and the KV store (native C, built by build.py)
  elementwise.py  one-pass RMSNorm, fused add + RMSNorm, SiLU-and-mul, neox RoPE, row argmax (native)
  linear.py       linear layers on weights packed once: fp32 panels for gemm.c (native) at decode
                  batch sizes, MKL / oneDNN packed GEMMs otherwise

Each has the torch reference in `kernels/reference.py` as its ground truth and fallback.
"""
