"""Triton kernels for hot spots, each with a torch reference; imported as spec_kernels."""
