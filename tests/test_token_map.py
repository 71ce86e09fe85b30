"""FR-Spec token maps: loading and validation errors, and the restricted draft lm_head."""

from __future__ import annotations

import pytest
import torch

from engine import ConfigError
from engine.speculative.token_map import HotVocabHead, load_token_map


@pytest.mark.parametrize("data", [[5, 3, 9, 0], torch.tensor([5, 3, 9, 0], dtype=torch.int32), (5, 3, 9, 0)])
def test_loads_list_tuple_or_tensor_in_order(tmp_path, data):
    path = tmp_path / "map.pt"
    torch.save(data, path)
    ids = load_token_map(path, vocab_size=10)
    assert ids.dtype == torch.long and ids.tolist() == [5, 3, 9, 0]


@pytest.mark.parametrize("data, message", [
    ([1, 2, 10], "token id 10, outside the vocabulary \\[0, 10\\)"),
    ([1, -1], "token id -1, outside"),
    ([4, 2, 4], "token id 4 more than once"),
    ([], "1-D, not empty"),
    (torch.zeros(2, 3, dtype=torch.long), "shape \\(2, 3\\)"),
    (torch.tensor([1.0, 2.0]), "torch.float32 tensor"),
    ([1, 2.5], "non-integer items"),
    ({"ids": [1, 2]}, "holds a dict"),
])
def test_invalid_maps_say_what_to_pass(tmp_path, data, message):
    path = tmp_path / "map.pt"
    torch.save(data, path)
    with pytest.raises(ConfigError, match=message) as err:
        load_token_map(path, vocab_size=10)
    assert "--speculative-token-map" in str(err.value)


def test_missing_or_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; pass a file written by torch.save"):
        load_token_map(tmp_path / "nope.pt", 10)
    path = tmp_path / "text.pt"
    path.write_text("1 2 3")
    with pytest.raises(ConfigError, match="cannot be read by torch.load"):
        load_token_map(path, 10)


def test_hot_vocab_head_matches_full_head_on_hot_tokens():
    torch.manual_seed(0)
    weight, hidden = torch.randn(50, 8), torch.randn(3, 8)
    hot = torch.tensor([7, 2, 41, 13])
    logits = HotVocabHead(weight, hot, vocab_size=50)(hidden)
    full = hidden @ weight.T
    assert logits.shape == (3, 50) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[:, hot], full[:, hot])
    cold = torch.ones(50, dtype=torch.bool)
    cold[hot] = False
    assert torch.isneginf(logits[:, cold]).all()
    # Top-k over the full logits picks among hot tokens only, in the full head's order.
    assert set(logits.topk(2).indices.flatten().tolist()) <= set(hot.tolist())
    assert logits.argmax(-1).tolist() == hot[full[:, hot].argmax(-1)].tolist()
