"""FR-Spec token maps: loading and validation errors, and the restricted draft lm_head."""

from __future__ import annotations

import pytest
import torch

from engine import ConfigError
from engine.speculative.token_map import HotVocabHead, load_token_map, resolve_token_map


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


HUB_MAP = "thunlp/LLaMA3-Instruct-8B-FR-Spec/freq_32768.pt"      # SGLang's guide's form


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    # huggingface_hub reads these when imported, so the module attributes are what count.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))


def test_token_map_path_is_a_local_file_or_a_hub_file(tmp_path, monkeypatch):
    path = tmp_path / "map.pt"
    torch.save([1, 2], path)
    assert resolve_token_map(str(path)) == str(path)
    with pytest.raises(ConfigError, match="does not exist.*org/repo/file.pt"):
        resolve_token_map(str(tmp_path / "nope.pt"))
    import huggingface_hub

    calls = []

    def cached(repo, filename, local_files_only=False):          # what the hub's local cache answers
        calls.append((repo, filename, local_files_only))
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", cached)
    assert resolve_token_map(HUB_MAP) == str(path)
    assert calls == [("thunlp/LLaMA3-Instruct-8B-FR-Spec", "freq_32768.pt", True)]


def test_unreachable_hub_map_says_what_to_pass(offline_hub):
    with pytest.raises(ConfigError, match="hub is unreachable.*hf download thunlp/LLaMA3-Instruct-8B-FR-Spec "
                                          "freq_32768.pt --local-dir DIR.*DIR/freq_32768.pt"):
        resolve_token_map(HUB_MAP)


def test_unreachable_map_is_refused_before_any_weight_loads(offline_hub, target, monkeypatch):
    from engine import Engine

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the token map was checked")

    monkeypatch.setattr("engine.core.model_runner.load_model", no_weights)
    with pytest.raises(ConfigError, match="--speculative-token-map.*unreachable"):
        Engine(model_path=str(target), speculative_algorithm="STANDALONE", speculative_draft_model_path="unused",
               speculative_token_map=HUB_MAP)


def test_hot_vocab_head_matches_full_head_on_hot_tokens():
    torch.manual_seed(0)
    weight, hidden = torch.randn(50, 8), torch.randn(3, 8)
    hot = torch.tensor([7, 2, 41, 13])
    logits = HotVocabHead(weight, hot, vocab_size=50, dtype=torch.float32)(hidden)
    full = hidden @ weight.T
    assert logits.shape == (3, 50) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[:, hot], full[:, hot])
    cold = torch.ones(50, dtype=torch.bool)
    cold[hot] = False
    assert torch.isneginf(logits[:, cold]).all()
    # Top-k over the full logits picks among hot tokens only, in the full head's order.
    assert set(logits.topk(2).indices.flatten().tolist()) <= set(hot.tolist())
    assert logits.argmax(-1).tolist() == hot[full[:, hot].argmax(-1)].tolist()
