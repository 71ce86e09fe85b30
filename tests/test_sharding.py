"""engine/distributed/sharding.py on its own: which block of each checkpoint tensor a rank loads."""

from __future__ import annotations

import pytest
import torch

from engine.distributed import group
from engine.distributed.group import Group
from engine.distributed.sharding import local_block, local_config, local_groups, local_rows
from engine.loader.gguf_quant import Groups


@pytest.fixture
def rank1_of_2(monkeypatch):
    """Build as rank 1 of 2 (no processes: only the block arithmetic runs)."""
    monkeypatch.setattr(group, "_building", Group(1, 2, "cpu", None))


def test_blocks_by_layer_kind():
    w = torch.arange(24.0).view(4, 6)
    assert torch.equal(local_block("model.layers.0.self_attn.q_proj.weight", w, 1, 2), w[2:])       # column
    assert torch.equal(local_block("model.layers.0.mlp.down_proj.weight", w, 1, 2), w[:, 3:])       # row
    bias = torch.ones(4)
    assert torch.equal(local_block("model.layers.0.self_attn.o_proj.bias", bias, 0, 2), bias)       # added once
    assert torch.equal(local_block("model.layers.0.self_attn.o_proj.bias", bias, 1, 2), torch.zeros(4))
    assert torch.equal(local_block("model.norm.weight", bias, 1, 2), bias)                          # replicated
    assert torch.equal(local_block("fc.weight", w, 1, 2), w)


def test_vocabulary_blocks_are_padded_to_equal_rows():
    embed = torch.arange(10.0).view(5, 2)
    first, last = (local_block("model.embed_tokens.weight", embed, r, 2) for r in (0, 1))
    assert torch.equal(first, embed[:3]) and torch.equal(last, torch.cat([embed[3:], torch.zeros(1, 2)]))


def test_local_config_divides_heads_units_and_vocabulary(rank1_of_2):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=321)
    local = local_config(config)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size, local.vocab_size,
            local.head_dim) == (2, 1, 64, 161, 16)
    assert config.num_attention_heads == 4 and local_rows(321) == 161


def test_gguf_groups_are_cut_on_whole_groups(rank1_of_2):
    rows, cols = 4, 128                                   # 4 groups of 32 per row: 2 per rank
    packed = torch.arange(rows * cols // 2, dtype=torch.uint8).view(rows, cols // 2)
    scale, low = torch.rand(rows, cols // 32), torch.rand(rows, cols // 32)
    groups = local_groups(lambda name: Groups(4, packed, scale, low))
    got = groups("model.layers.0.mlp.down_proj.weight")                                    # row-parallel
    assert torch.equal(got.q, packed[:, 32:]) and torch.equal(got.scale, scale[:, 2:])
    assert torch.equal(got.low, low[:, 2:])
    got = groups("model.layers.0.mlp.up_proj.weight")                                      # column-parallel
    assert torch.equal(got.q, packed[2:]) and torch.equal(got.scale, scale[2:]) and got.bits == 4
    narrow = local_groups(lambda name: Groups(4, packed[:, :16], scale[:, :1], low[:, :1]))  # 32 columns: 16 each
    assert narrow("model.layers.0.self_attn.o_proj.weight") is None                        # stays dense


def test_k_quant_groups_are_cut_on_whole_super_blocks_and_the_head_by_vocabulary(rank1_of_2):
    rows, cols = 5, 512                                   # 2 super-blocks of 256 per row: 1 per rank
    q = torch.randint(0, 64, (rows, cols), dtype=torch.uint8)
    scale, d = torch.randint(-128, 128, (rows, cols // 16)).to(torch.int8), torch.rand(rows, cols // 256, 1).half()
    groups = local_groups(lambda name: Groups(6, q, scale, None, d))
    got = groups("model.layers.0.mlp.down_proj.weight")
    assert torch.equal(got.q, q[:, 256:]) and torch.equal(got.scale, scale[:, 16:]) and torch.equal(got.super, d[:, 1:])
    assert got.low is None
    head = groups("lm_head.weight")                       # ceil(5 / 2) = 3 rows a rank: rows 3, 4 and zeros
    assert head.bits == 6 and torch.equal(head.q[:2], q[3:]) and not head.q[2].any() and not head.scale[2].any()
    half = local_groups(lambda name: Groups(6, q[:, :256], scale[:, :16], None, d[:, :1]))
    assert half("model.layers.0.mlp.down_proj.weight") is None                              # 128 columns each
