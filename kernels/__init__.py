"""spec's kernels, imported as spec_kernels, each beside a torch reference it is tested against.

- C kernels for the CPU (`cpu_*.c`, built at first use by native.py with the system's compiler and
  cached; each `cpu_*.py` loads one and says why when it cannot): attention over the paged cache
  (batch-invariant), w4a8 GEMM on GGUF blocks (VNNI), a fused decoder layer, elementwise ops, argmax
  and the keyed sampler.
- Triton kernels for a CUDA GPU (paged_attention.py): decode, extend and tree verification over the
  paged cache.
"""
