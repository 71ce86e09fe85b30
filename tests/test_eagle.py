"""EAGLE and EAGLE-3: published checkpoint layouts load as they are, the draft computes what a plain
(cache-free) implementation of the published architecture computes, decoding stays exactly the
target's, and a draft that predicts well is accepted."""

from __future__ import annotations

import json
import logging
import types

import pytest
import torch

from engine.errors import ConfigError, ModelLoadError
from engine.models.eagle import Eagle3Draft, EagleDraft, eagle3_aux_layers, load_eagle_draft
from engine.core.sampling_params import SamplingParams
from tests import eagle_checkpoints as ckpt
from tests.dense_draft import DenseDraft
from tests.tiny import make_model, random_prompts, tiny_engine

GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
CHAIN = (3, 1, 4)
TREE = (3, 2, 6)


prompts = random_prompts
engine = tiny_engine


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    config, tensors = ckpt.eagle_tensors(target, seed=1)
    return {
        "repo": ckpt.save_eagle_repo(root / "repo", config, tensors),
        "sglang": ckpt.save_sglang_eagle(root / "sglang", target, config, tensors),
        "eagle3": ckpt.save_eagle3(root / "eagle3", target, seed=2),
    }


@pytest.fixture(scope="module")
def plain(target):
    eng = engine(target)
    batch = prompts(5)
    return eng, batch, [o["output_ids"] for o in eng.generate(input_ids=batch, sampling_params=GREEDY)]


# ------------------------------------------------------------------------------------------------ loading
@pytest.mark.parametrize("layout", ["repo", "sglang", "eagle3"])
def test_layout_loads_as_published(plain, drafts, layout):
    target_model = plain[0].debug.target.model
    algorithm = "EAGLE3" if layout == "eagle3" else "EAGLE"
    model = load_eagle_draft(algorithm, drafts[layout], target_model, max_positions=600,
                             dtype=torch.float32, device="cpu")
    saved = torch.load(drafts["repo" if layout == "sglang" else layout] / "pytorch_model.bin")
    layer = "layers.0" if algorithm == "EAGLE" else "midlayer"
    qkv = torch.cat([saved[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(model.attention.qkv_proj.weight, qkv)
    assert torch.equal(model.fc.weight, saved["fc.weight"])
    if algorithm == "EAGLE":
        assert isinstance(model, EagleDraft) and model.aux_layers == ()
        assert torch.equal(model.fc.bias, saved["fc.bias"])
        assert isinstance(model.layers[0].input_layernorm, torch.nn.Identity)
        h = torch.randn(3, 64)      # logits are the target's lm_head over the layer output, no norm
        torch.testing.assert_close(model.logits(h), target_model.compute_logits(h))
    else:
        assert isinstance(model, Eagle3Draft) and model.fc.bias is None
        assert model.aux_layers == (2, 2, 1)
        ids = torch.arange(200) + saved["d2t"]
        assert torch.equal(model.head.ids, ids) and torch.equal(ids, saved["t2d"].nonzero().flatten())
        logits = model.logits(torch.randn(3, 64))
        assert logits.shape == (3, 320) and torch.isinf(logits).sum() == 3 * 120
        assert torch.isfinite(logits[:, ids]).all()


def test_eagle3_aux_layers():
    cfg = types.SimpleNamespace
    assert eagle3_aux_layers(cfg(), 32, "d") == (2, 16, 29)
    # Checkpoint ids name layer outputs: index = id + 1 (SGLang's convention), nested or top level.
    nested = cfg(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 15, 28]})
    assert eagle3_aux_layers(nested, 32, "d") == (2, 16, 29)
    assert eagle3_aux_layers(cfg(eagle_aux_hidden_state_layer_ids=[0, 1, 3]), 4, "d") == (1, 2, 4)
    with pytest.raises(ConfigError, match="below the target's 4 layers"):
        eagle3_aux_layers(cfg(eagle_aux_hidden_state_layer_ids=[0, 1, 4]), 4, "d")
    with pytest.raises(ConfigError, match="at least 3"):
        eagle3_aux_layers(cfg(), 2, "d")


def test_bad_drafts_are_refused_clearly(plain, drafts, target, tmp_path):
    target_model = plain[0].debug.target.model

    def load(algorithm, path):
        return load_eagle_draft(algorithm, path, target_model, max_positions=600, dtype=torch.float32, device="cpu")

    config, tensors = ckpt.eagle_tensors(target, hidden=32)
    with pytest.raises(ConfigError, match="hidden size 32 but the target has 64"):
        load("EAGLE", ckpt.save_eagle_repo(tmp_path / "narrow", config, tensors))
    d2t = torch.zeros(200, dtype=torch.long)
    d2t[-1] = 200      # draft id 199 -> target id 399, past the target's 320 tokens
    with pytest.raises(ConfigError, match="d2t maps draft token 199 to target id 399"):
        load("EAGLE3", ckpt.save_eagle3(tmp_path / "bad_d2t", target, d2t=d2t))
    with pytest.raises(ConfigError, match="is an EAGLE3 draft.*--speculative-algorithm EAGLE3"):
        load("EAGLE", drafts["eagle3"])
    with pytest.raises(ModelLoadError, match="one decoder layer.*num_hidden_layers=4.*STANDALONE"):
        load("EAGLE", target)       # an ordinary model is not an EAGLE draft
    full_config, full = ckpt.eagle_tensors(target)
    del full["fc.weight"]
    with pytest.raises(ModelLoadError, match="no fc.weight"):
        load("EAGLE", ckpt.save_eagle_repo(tmp_path / "no_fc", full_config, full))
    bare = tmp_path / "odd"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    torch.save(tensors, bare / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="expected one of LlamaForCausalLM, LlamaForCausalLMEagle"):
        load("EAGLE", bare)


# ------------------------------------------------------------------------------------------------ the draft's numbers
def drafter_of(eng):
    return eng.debug.drafter


@pytest.mark.parametrize("layout,shape", [("EAGLE", CHAIN), ("EAGLE3", CHAIN), ("EAGLE", TREE), ("EAGLE3", TREE)])
def test_draft_matches_plain_implementation(target, drafts, monkeypatch, layout, shape):
    """Root scores and every expanded node's scores equal the plain computation along the node's
    path, after the prefill and again after each verification (catch-up on accepted tokens)."""
    import engine.speculative.model_drafter as model_drafter

    draft_dir = drafts["repo" if layout == "EAGLE" else "eagle3"]
    eng = engine(target, layout, draft_dir, shape, chunked_prefill_size=8)     # prompt fed in chunks
    dense = DenseDraft(target, draft_dir, layout, drafter_of(eng).capture_hidden)
    calls = []

    def recording_search(roots, root_scores, expand, *args, **kw):
        def recorded(depth, tokens, parents):
            scores = expand(depth, tokens, parents)
            calls[-1].append((tokens[0].tolist(), parents[0].tolist(), scores[0]))
            return scores
        calls.append([(None, None, root_scores[0])])
        tree = search_trees(roots, root_scores, recorded, *args, **kw)
        calls[-1].append(tree)
        return tree

    search_trees = model_drafter.search_trees
    monkeypatch.setattr(model_drafter, "search_trees", recording_search)
    req = eng.make_request(prompts(1, seed=7)[0] + [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11], SamplingParams(**GREEDY))
    eng.add_request(req)
    while req.kv_len < req.prompt_len:
        eng.step()                                  # prefill, chunk by chunk
    for _ in range(3):
        committed = list(req.token_ids)
        eng.step()                                  # draft, verify, commit, catch up
        (_, _, root_scores), *expansions, tree = calls[-1]
        torch.testing.assert_close(root_scores, dense.path_logits(committed, [])[0], atol=1e-4, rtol=1e-4)
        paths = [[]]                                # draft tokens from the root to each frontier node
        for tokens, parents, scores in expansions:
            paths = [paths[p] + [tok] for p, tok in zip(parents, tokens)]
            for path, row in zip(paths, scores):
                torch.testing.assert_close(row, dense.path_logits(committed, path)[-1], atol=1e-4, rtol=1e-4)
        if shape[1] == 1:                           # greedy chain: argmax at every depth
            drafted = tree.tokens[0, 1:].tolist()
            assert drafted == dense.path_logits(committed, drafted).argmax(-1).tolist()[:-1]


def test_radix_hit_keeps_the_draft_context_of_the_cached_prefix(target, drafts):
    """A prefix served from the radix cache is cached for the draft too (its KV shares the target's
    slots): after the prefill of the rest, the draft's root state is the one computed over the whole
    sequence from position 0."""
    eng = engine(target, "EAGLE3", drafts["eagle3"])
    drafter = drafter_of(eng)
    dense = DenseDraft(target, drafts["eagle3"], "EAGLE3", drafter.capture_hidden)
    base = prompts(1, seed=11)[0] + [20, 21, 22, 23]
    eng.generate(input_ids=base, sampling_params=dict(GREEDY, max_new_tokens=4))
    req = eng.make_request(base + [5, 6, 7], SamplingParams(**GREEDY))
    eng.add_request(req)
    eng.step()
    assert req.cached_tokens == len(base) - 1       # pair keys: the cached position needs its next token
    torch.testing.assert_close(drafter.model.logits(drafter.last[req.row][None])[0],
                               dense.path_logits(req.token_ids, [])[0], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("layout,tree", [("EAGLE", CHAIN), ("EAGLE", TREE), ("EAGLE3", CHAIN), ("EAGLE3", TREE)])
def test_greedy_output_is_the_targets(plain, drafts, target, layout, tree):
    _, batch, expected = plain
    eng = engine(target, layout, drafts["repo" if layout == "EAGLE" else "eagle3"], tree)
    outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == expected
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
    assert eng.stats()["kv_tokens_used"] == 0


def test_repo_and_sglang_layouts_draft_alike(target, drafts):
    """Same weights in both layouts: sampled outputs (rejection sampling reads the draft's
    probabilities) and verification counts are identical."""
    params = [{"temperature": 0.9, "max_new_tokens": 16, "ignore_eos": True, "seed": s} for s in range(3)]
    batch = prompts(3, seed=3)
    runs = []
    for layout in ("repo", "sglang"):
        outs = engine(target, "EAGLE", drafts[layout]).generate(input_ids=batch, sampling_params=params)
        runs.append([(o["output_ids"], o["meta_info"]["spec_verify_ct"]) for o in outs])
    assert runs[0] == runs[1]


def test_well_predicting_draft_is_accepted(tmp_path):
    """A bigram target and a draft that computes its prediction exactly: every draft is accepted."""
    target = ckpt.make_bigram_target(make_model(tmp_path / "target", "llama"))
    draft = ckpt.save_eagle_repo(tmp_path / "draft", *ckpt.exact_eagle_tensors(target))
    batch = prompts(3, seed=5)
    expected = [o["output_ids"] for o in engine(target).generate(input_ids=batch, sampling_params=GREEDY)]
    outs = engine(target, "EAGLE", draft).generate(input_ids=batch, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == expected
    # 32 tokens: 1 from the prefill, then 4 per verification (3 drafts + bonus) for 8 steps (the last cut).
    assert all(o["meta_info"]["spec_verify_ct"] == 8 for o in outs)


def test_retraction_and_early_finish(drafts, target):
    """Retractions (prefilled again partly from the radix cache, where the draft's cache is too) and a
    request finished by its prefill keep the output the target's."""
    g = torch.Generator().manual_seed(6)
    batch = [torch.randint(3, 300, (int(torch.randint(10, 20, (1,), generator=g)),), generator=g).tolist()
             for _ in range(6)]
    params = [dict(GREEDY, max_new_tokens=1 if i == 1 else 40) for i in range(len(batch))]
    expected = [o["output_ids"] for o in engine(target).generate(input_ids=batch, sampling_params=params)]
    eng = engine(target, "EAGLE", drafts["repo"], max_total_tokens=120)
    assert [o["output_ids"] for o in eng.generate(input_ids=batch, sampling_params=params)] == expected
    stats = eng.stats()
    assert stats["retractions"] > 0 and stats["kv_tokens_used"] == 0


def test_token_map_restricts_eagle_drafts(plain, drafts, target, tmp_path, caplog):
    _, batch, expected = plain
    hot = list(range(100, 320))
    torch.save(hot, tmp_path / "freq.pt")
    eng = engine(target, "EAGLE", drafts["repo"], TREE, speculative_token_map=str(tmp_path / "freq.pt"))
    drafted = set()
    drafter = drafter_of(eng)
    draft = drafter.draft

    def spy(step):
        trees = draft(step)
        drafted.update(trees.tokens[:, 1:].flatten().tolist())
        return trees

    drafter.draft = spy
    assert [o["output_ids"] for o in eng.generate(input_ids=batch[:2], sampling_params=GREEDY)] == expected[:2]
    assert drafted and drafted <= set(hot)
    with caplog.at_level(logging.WARNING):
        engine(target, "EAGLE3", drafts["eagle3"], speculative_token_map=str(tmp_path / "freq.pt"))
    assert "ignored with EAGLE3" in caplog.text
