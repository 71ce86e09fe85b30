"""RoPE of every kind (engine/models/rope.py) against transformers' own rotary embedding, from configs as
transformers 5 writes them (rope_parameters) and as transformers 4 did (rope_scaling beside rope_theta)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.errors import ModelLoadError
from engine.models.llama import Rotary
from engine.models.rope import rope_parameters

HEAD_DIM, MAX_POS, ORIGINAL = 64, 512, 128
KINDS = {
    "default": {},
    "linear": {"factor": 4.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 32, "beta_slow": 1},
    "yarn-mscale": {"factor": 40.0, "original_max_position_embeddings": ORIGINAL, "mscale": 1.0, "mscale_all_dim": 0.707},
    "longrope": {"short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.0 + 0.5 * i for i in range(HEAD_DIM // 2)], "original_max_position_embeddings": ORIGINAL},
    "dynamic": {"factor": 2.0},
}


def config(kind: str) -> LlamaConfig:
    params = {"rope_type": kind.split("-")[0], "rope_theta": 50000.0, **KINDS[kind]}
    return LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                       max_position_embeddings=MAX_POS, rope_parameters=params)


def ours(cfg, positions: int = MAX_POS) -> tuple[torch.Tensor, torch.Tensor]:
    """Our tables as transformers gives them: cos and sin [positions, head_dim]."""
    rotary = Rotary(cfg, HEAD_DIM, positions)
    sin = rotary.signed_sin.clone()
    sin[:, :HEAD_DIM // 2].neg_()
    return rotary.cos, sin


def theirs(cfg, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = LlamaRotaryEmbedding(cfg)
    ids = torch.tensor([list(positions)])
    cos, sin = rotary(torch.zeros(1, len(positions), HEAD_DIM), ids)
    return cos[0], sin[0]


@pytest.mark.parametrize("kind", list(KINDS))
def test_tables_are_transformers_within_the_original_context(kind):
    cfg = config(kind)
    cos, sin = ours(cfg)
    # dynamic and longrope change their frequencies past the original context: compared there below.
    within = range(ORIGINAL if kind in ("longrope", "dynamic") else MAX_POS)
    ref_cos, ref_sin = theirs(cfg, within)
    torch.testing.assert_close(cos[:len(within)], ref_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[:len(within)], ref_sin, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_past_the_original_context_a_position_rotates_as_generated_token_by_token(kind):
    """transformers computes these frequencies from the sequence's length: a token generated at position
    p saw a sequence of p + 1 tokens."""
    cfg = config(kind)
    cos, _ = ours(cfg, 4 * MAX_POS)
    for p in (ORIGINAL, MAX_POS - 1, MAX_POS, 3 * MAX_POS + 5):
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=p + 1)
        expected = torch.cat([p * inv_freq, p * inv_freq]).cos() * scaling
        torch.testing.assert_close(cos[p], expected.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_transformers_4_config_gives_the_same_tables(kind):
    """transformers 4 kept the scaling in rope_scaling (`type` in older files) and rope_theta apart."""
    new = config(kind)
    scaling = {k: v for k, v in rope_parameters(new).items() if k != "rope_theta"}
    scaling["type"] = scaling.pop("rope_type")
    old = SimpleNamespace(rope_scaling=None if kind == "default" else scaling, rope_theta=50000.0,
                          max_position_embeddings=MAX_POS)
    for a, b in zip(ours(old), ours(new)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_phi3_128k_as_transformers_4_wrote_it():
    """Phi-3's first long-context releases: LongRoPE named "su", the original context outside rope_scaling."""
    new = config("longrope")
    factors = {k: KINDS["longrope"][k] for k in ("short_factor", "long_factor")}
    old = SimpleNamespace(rope_scaling={"type": "su", **factors}, rope_theta=50000.0, max_position_embeddings=MAX_POS,
                          original_max_position_embeddings=ORIGINAL)
    for a, b in zip(ours(old), ours(new)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_per_layer_type_parameters():
    """Gemma 3: global layers scaled, local ones at their own base (5: a dict per layer type; 4:
    rope_local_base_freq)."""
    new = SimpleNamespace(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    old = SimpleNamespace(rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_theta=1e6, rope_local_base_freq=1e4)
    for cfg in (new, old):
        assert rope_parameters(cfg, "full_attention") == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
        assert rope_parameters(cfg, "sliding_attention") == {"rope_type": "default", "rope_theta": 1e4}


def test_unknown_kinds_and_partial_rotation_are_refused():
    with pytest.raises(ModelLoadError, match="RoPE type 'xpos' is not supported"):
        Rotary(SimpleNamespace(rope_scaling={"type": "xpos"}, rope_theta=1e4), HEAD_DIM, 16)
    with pytest.raises(ModelLoadError, match="partial rotary"):
        Rotary(SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                "partial_rotary_factor": 0.5}), HEAD_DIM, 16)
