"""The home of Triton kernels for hot spots, each with a torch reference; imported as spec_kernels.
None has landed yet: attention runs on torch SDPA (engine/attention/torch_backend.py)."""
