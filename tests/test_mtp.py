"""MTP: a target's own multi-token-prediction layer (MiMo's mtp_layers, a DeepSeek-style nextn layer on a
Llama) or a separate nextn checkpoint drafts through the EAGLE worker. The target loads as without its
MTP layer, the draft computes what a plain implementation of the published layer computes, decoding
stays exactly the target's, and a layer that predicts well is accepted."""

from __future__ import annotations

import json

import pytest
import torch

from engine.errors import ConfigError, ModelLoadError
from engine.models.mtp import MtpDraft, load_mtp_draft
from engine.core.sampling_params import SamplingParams
from tests import eagle_checkpoints as ckpt
from tests.planning import untimed
from tests.tiny import make_model, random_prompts, tiny_engine

GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
CHAIN = (3, 1, 4)
TREE = (3, 2, 6)
BASE_ARCH = {"mimo": "qwen2", "nextn": "llama"}


prompts = random_prompts
engine = tiny_engine


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per layout: (the plain base target, the same target with an MTP layer)."""
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for layout, arch in BASE_ARCH.items():
        base = make_model(root / f"{arch}", arch)
        out[layout] = base, ckpt.save_mtp_target(root / layout, base, layout, seed=3)
    return out


@pytest.fixture(scope="module")
def expected(models):
    """Greedy outputs of each plain base target for a batch of mixed prompts."""
    batch = prompts(5)
    return batch, {layout: [o["output_ids"] for o in engine(base).generate(input_ids=batch, sampling_params=GREEDY)]
                   for layout, (base, _) in models.items()}


# ------------------------------------------------------------------------------------------------ the target
@pytest.mark.parametrize("layout", ["mimo", "nextn"])
def test_target_loads_as_without_its_mtp_layer(models, expected, layout):
    batch, outputs = expected
    eng = engine(models[layout][1])
    assert eng.debug.target.model.num_layers == 2
    assert [o["output_ids"] for o in eng.generate(input_ids=batch, sampling_params=GREEDY)] == outputs[layout]


# ------------------------------------------------------------------------------------------------ the draft's numbers
class PlainMtp:
    """The MTP layer computed plainly: features from transformers' target (the plain base), then the
    published forward, its decoder layer and final norm run as transformers' own one-layer model,
    attending causally over the whole context from position `start`."""

    def __init__(self, base_dir, mtp_dir, layout: str):
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        config = AutoConfig.from_pretrained(base_dir)
        self.eps, self.layout = config.rms_norm_eps, layout
        prefix = "model.mtp_layers.0." if layout == "mimo" else f"model.layers.{config.num_hidden_layers}."
        t = {n[len(prefix):]: v for n, v in load_file(mtp_dir / "model.safetensors").items() if n.startswith(prefix)}
        self.token_norm, self.feature_norm, proj, final_norm = ckpt.MTP_NAMES[layout]
        self.t, self.proj = t, t[f"{proj}.weight"]
        config.num_hidden_layers = 1
        self.block = AutoModel.from_config(config).eval()
        state = {"norm.weight": t[f"{final_norm}.weight"], "embed_tokens.weight": self.block.embed_tokens.weight}
        state.update({f"layers.0.{n}": v for n, v in t.items()
                      if n.startswith(("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"))})
        self.block.load_state_dict(state, strict=True)

    def _rms(self, x, name):
        return self.t[f"{name}.weight"] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def features(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.target(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]

    def run(self, tokens: list[int], feats: torch.Tensor, start: int) -> torch.Tensor:
        positions = torch.arange(start, start + len(tokens))
        with torch.no_grad():
            e = self.target.model.embed_tokens(torch.tensor(tokens))
            if self.layout == "mimo":       # MiMo's MTP ignores the token at position 0 (as in SGLang)
                e = e * (positions != 0)[:, None]
            e, f = self._rms(e, self.token_norm), self._rms(feats, self.feature_norm)
            x = torch.cat([f, e] if self.layout == "mimo" else [e, f], -1) @ self.proj.T
            return self.block(inputs_embeds=x[None], position_ids=positions[None]).last_hidden_state[0]

    def path_logits(self, committed: list[int], path: list[int]) -> torch.Tensor:
        """Logits after the committed tokens (the last one is the root), then after each drafted token of
        `path`, whose feature is the layer's own output before it."""
        tokens, feats = committed[1:], self.features(committed[:-1])
        out = []
        for i in range(len(path) + 1):
            h = self.run(tokens, feats, 0)
            out.append(self.target.lm_head(h[-1]).detach())
            if i < len(path):
                tokens, feats = tokens + [path[i]], torch.cat([feats, h[-1:]])
        return torch.stack(out)


@pytest.mark.parametrize("layout", ["mimo", "nextn"])
def test_draft_matches_plain_implementation(models, layout):
    """After a chunked prefill and after each verification (catch-up on accepted tokens), the root's
    draft logits and the greedy chain (the layer fed its own outputs) are the plain computation's."""
    base, mtp_dir = models[layout]
    eng = engine(mtp_dir, "MTP", chunked_prefill_size=8)
    drafter = eng.debug.drafter
    assert isinstance(drafter.model, MtpDraft) and drafter.capture_hidden == ()
    plain = PlainMtp(base, mtp_dir, layout)
    req = eng.make_request(prompts(1, seed=7)[0] + [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11], SamplingParams(**GREEDY))
    eng.add_request(req)
    while req.kv_len < req.prompt_len:
        eng.step()
    trees = []
    draft = drafter.draft
    drafter.draft = lambda step: trees.append(draft(step)) or trees[-1]
    for _ in range(3):
        committed = list(req.token_ids)
        with torch.inference_mode():
            root = drafter.model.logits(drafter.last[req.row][None])[0]
        eng.step()
        drafted = trees[-1].tokens[0, 1:].tolist()
        expected = plain.path_logits(committed, drafted)
        torch.testing.assert_close(root, expected[0], atol=1e-4, rtol=1e-4)
        assert drafted == expected.argmax(-1).tolist()[:-1]


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("layout,tree", [("mimo", CHAIN), ("mimo", TREE), ("nextn", CHAIN), ("nextn", TREE)])
def test_greedy_output_is_the_targets(models, expected, layout, tree):
    batch, outputs = expected
    eng = engine(models[layout][1], "MTP", tree=tree)
    outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == outputs[layout]
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
    assert eng.stats()["kv_tokens_used"] == 0


@pytest.mark.parametrize("layout", ["mimo", "nextn"])
def test_separate_checkpoint_and_nextn_alias(models, expected, tmp_path, layout):
    """With a draft path the MTP layer comes from there (the plain target has none): a MiMo checkpoint
    passed as its own draft (SGLang's MiMo usage), or SGLang's exported nextn checkpoint; NEXTN = MTP."""
    batch, outputs = expected
    base, mtp_dir = models[layout]
    draft = mtp_dir if layout == "mimo" else ckpt.save_nextn_export(tmp_path / "export", mtp_dir)
    eng = engine(base, "NEXTN", draft, TREE)
    assert eng.args.speculative_algorithm == "MTP" and isinstance(eng.debug.drafter.model, MtpDraft)
    outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == outputs[layout]
    # The same layer as from the target's own checkpoint: the same drafts, so the same verify counts.
    own = engine(mtp_dir, "MTP", tree=TREE).generate(input_ids=batch, sampling_params=GREEDY)
    assert [o["meta_info"]["spec_verify_ct"] for o in outs] == [o["meta_info"]["spec_verify_ct"] for o in own]


@pytest.mark.parametrize("layout", ["mimo", "nextn"])
def test_well_predicting_mtp_layer_is_accepted(tmp_path, layout):
    """A bigram target and an MTP layer that computes its prediction exactly: every draft is accepted."""
    base = ckpt.make_bigram_target(make_model(tmp_path / "base", BASE_ARCH[layout]))
    target = ckpt.save_mtp_target(tmp_path / "target", base, layout, exact=True)
    batch = prompts(3, seed=5)
    plain = [o["output_ids"] for o in engine(base).generate(input_ids=batch, sampling_params=GREEDY)]
    outs = engine(target, "MTP").generate(input_ids=batch, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == plain
    # 32 tokens: 1 from the prefill, then 4 per verification (3 drafts + bonus) for 8 steps (the last cut).
    assert all(o["meta_info"]["spec_verify_ct"] == 8 for o in outs)


def test_eagle_without_a_draft_runs_the_targets_mtp_layers(models, expected):
    """SGLang's MiMo-7B-RL example: --speculative-algorithm EAGLE, steps 1, topk 1, 2 draft tokens, no draft."""
    batch, outputs = expected
    eng = engine(models["mimo"][1], "EAGLE", tree=(1, 1, 2))
    assert eng.args.speculative_algorithm == "MTP" and isinstance(eng.debug.drafter.model, MtpDraft)
    outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == outputs["mimo"]
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)


# ------------------------------------------------------------------------------------------------ refusals
def test_target_without_mtp_layers_is_refused(models):
    base = models["mimo"][0]
    with pytest.raises(ConfigError, match="has no MTP layers.*--speculative-draft-model-path.*EAGLE.*NGRAM"):
        engine(base, "MTP")
    with pytest.raises(ConfigError, match="EAGLE needs a draft model.*this target has none"):
        engine(base, "EAGLE")


def test_bad_mtp_checkpoints_are_refused(models, tmp_path):
    base, mtp_dir = models["nextn"]
    target = engine(base).debug.target.model

    def load(path, own=False):
        return load_mtp_draft(path, target, own=own, max_positions=600, dtype=torch.float32, device="cpu")

    with pytest.raises(ModelLoadError, match="unexpected weight 'layer.self_attn.kv_a_proj_with_mqa.weight'"):
        load(ckpt.save_nextn_export(tmp_path / "mla", mtp_dir, mla=True))     # MLA weights, a Llama config
    with pytest.raises(ConfigError, match="has no MTP layers.*--speculative-algorithm EAGLE"):
        load(ckpt.save_eagle_repo(tmp_path / "eagle", *ckpt.eagle_tensors(base)))
    with pytest.raises(ConfigError, match="hidden_size 32 but the target has 64"):
        load(make_model(tmp_path / "narrow", "llama", hidden=32))
    # A config that declares MTP layers whose weights were dropped.
    declared = tmp_path / "declared"
    declared.mkdir()
    for f in base.iterdir():
        (declared / f.name).write_bytes(f.read_bytes())
    config = json.loads((base / "config.json").read_text())
    (declared / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(ModelLoadError, match="declares 1 MTP layer.*holds no MTP weights"):
        load(declared)


# ------------------------------------------------------------------------------------------------ multi-layer
@pytest.mark.parametrize("layout", ["mimo", "nextn"])
def test_multi_layer_draft_step_k_runs_layer_k(tmp_path, layout):
    """A bigram target and 3 MTP layers, each exact (computes the target's next token) or random: with
    multi-layer drafting (on by itself: 3 layers, 3 steps) the drafts accepted per verification are the
    exact layers before the first random one, so step k ran layer k. 32 tokens: 1 from the prefill, then
    1 + accepted drafts per verification."""
    base = ckpt.make_bigram_target(make_model(tmp_path / "base", BASE_ARCH[layout]))
    batch = prompts(3, seed=5)
    plain = [o["output_ids"] for o in engine(base).generate(input_ids=batch, sampling_params=GREEDY)]
    for exact, verifies in (((True, True, True), 8), ((True, True, False), 11), ((True, False, True), 16)):
        target = ckpt.save_mtp_target(tmp_path / "".join(map(str, map(int, exact))), base, layout, exact=exact)
        eng = engine(target, "MTP")
        assert eng.args.enable_multi_layer_eagle and eng.debug.drafter.model.num_layers == 3
        outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == plain
        assert [o["meta_info"]["spec_verify_ct"] for o in outs] == [verifies] * 3, exact
    # Off (3 steps exceed 2 layers): the exact first layer drafts every step, all accepted; on (2 steps),
    # the random second layer drafts the second token.
    target = ckpt.save_mtp_target(tmp_path / "two", base, layout, exact=(True, False))
    for tree, multi, verifies in (((3, 1, 4), False, 8), ((2, 1, 3), True, 16)):
        eng = engine(target, "EAGLE", tree=tree)
        assert eng.args.enable_multi_layer_eagle == multi
        outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == plain
        assert [o["meta_info"]["spec_verify_ct"] for o in outs] == [verifies] * 3


def test_multi_layer_refusals(models, tmp_path):
    single = models["mimo"][1]
    with pytest.raises(ConfigError, match="needs a model with several MTP layers; this target has 1.*Drop the flag"):
        engine(single, "MTP", enable_multi_layer_eagle=True)
    three = ckpt.save_mtp_target(tmp_path / "three", models["mimo"][0], "mimo", exact=(False,) * 3)
    with pytest.raises(ConfigError, match="--speculative-num-steps 4 needs 4 MTP layers.*has 3.*Lower"):
        engine(three, "MTP", tree=(4, 1, 5), enable_multi_layer_eagle=True)
    with pytest.raises(ConfigError, match="drafts a chain.*--speculative-eagle-topk 1"):
        engine(three, "MTP", tree=TREE, enable_multi_layer_eagle=True)
    # A separate nextn checkpoint with one layer: counted as it loads.
    with pytest.raises(ConfigError, match="has 1 MTP layer.*--speculative-num-steps 3 runs one layer per step"):
        engine(models["nextn"][0], "MTP", draft=models["nextn"][1], enable_multi_layer_eagle=True)
    # Auto: the tree is one step per layer; a tree (topk > 1) is drafted by the first layer.
    assert engine(three, "MTP", tree=TREE).args.enable_multi_layer_eagle is False
    from engine import Engine

    eng = Engine(planner=untimed, model_path=str(three), dtype="float32", speculative_algorithm="EAGLE",
                 speculative_adaptive="off", max_total_tokens=4096)
    assert eng.args.enable_multi_layer_eagle and eng.args.speculative_tree == (3, 1, 4)
