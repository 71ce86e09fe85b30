"""Speculative decoding: draft trees, lossless verification, and one worker per algorithm."""
