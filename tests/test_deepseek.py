"""DeepSeek-V3 and V2 targets (MLA attention, MoE with shared experts: V3's grouped sigmoid routing, V2's
softmax top k, greedy or among the best groups) against transformers' DeepseekV3ForCausalLM and
DeepseekV2ForCausalLM on tiny random configs: logits, captured hidden states and greedy decoding."""

from __future__ import annotations

import json

import pytest
import torch

from engine import Engine, ModelLoadError
from engine.core.forward_batch import make_batch
from engine.models.deepseek import DeepseekV3ForCausalLM, MoE
from tests.planning import untimed
from tests.tiny import make_deepseek, random_prompts, reference_greedy, tiny_runner

YARN = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 128,
                            "beta_fast": 32, "beta_slow": 1}}
VARIANTS = {"q-lora": {}, "no-q-lora": {"q_lora": False}, "yarn": YARN, "rope-halves": {"rope_interleave": False},
            "v2-group-limited": {"version": 2}, "v2-greedy": {"version": 2, "topk_method": "greedy"},
            "v2-lite": {"version": 2, "topk_method": "greedy", "q_lora": False}, "v2-yarn": {"version": 2, **YARN}}


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_logits_match_transformers(tmp_path, variant):
    from transformers import AutoModelForCausalLM

    model_dir = make_deepseek(tmp_path, **variant)
    runner, kv = tiny_runner(model_dir)
    assert isinstance(runner.model, DeepseekV3ForCausalLM)
    assert isinstance(runner.model.model.layers[1].mlp, MoE) and not isinstance(runner.model.model.layers[0].mlp, MoE)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    a, b = random_prompts(2, seed=1, lo=20, hi=60)
    batch = make_batch(kv.table, [0, 1], [0, 0], a + b, kv.alloc(len(a) + len(b)), [len(a), len(b)],
                       capture_hidden=(2,))
    with torch.no_grad():
        out = runner.forward(batch, all_logits=True)
        ref_a = ref(torch.tensor([a]), output_hidden_states=True)
        ref_b = ref(torch.tensor([b])).logits[0]
    torch.testing.assert_close(out.logits[:len(a)], ref_a.logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[len(a):], ref_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.captured[2][:len(a)], ref_a.hidden_states[2][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("version", [2, 3])
def test_greedy_decoding_matches_transformers(tmp_path, version):
    """Prefill, then one-token decode steps over the paged cache, batched: transformers' own greedy."""
    model_dir = make_deepseek(tmp_path, version=version)
    eng = Engine(planner=untimed, model_path=str(model_dir), dtype="float32", max_total_tokens=2048)
    batch = random_prompts(3, seed=2)
    outs = eng.generate(input_ids=batch, sampling_params={"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
    assert [o["output_ids"] for o in outs] == [reference_greedy(model_dir, p, 16) for p in batch]


@pytest.mark.parametrize("version", [2, 3])
def test_router_stays_fp32_in_a_bf16_model(tmp_path, version):
    model_dir = make_deepseek(tmp_path, version=version)
    eng = Engine(planner=untimed, model_path=str(model_dir), dtype="bfloat16", max_total_tokens=256)
    model = eng.debug.target.model
    gate = model.model.layers[1].mlp.gate
    assert {p.dtype for p in gate.parameters()} == {torch.float32}
    assert model.model.layers[1].mlp.shared_experts.down_proj.weight.dtype == torch.bfloat16
    assert len(eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})["output_ids"]) == 3


def test_quantized_checkpoints_are_refused(tmp_path):
    model_dir = make_deepseek(tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}     # FP8 is read (tests/test_fp8.py)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="awq-quantized weights.*unquantized or FP8 release"):
        Engine(model_path=str(model_dir), max_total_tokens=256)
