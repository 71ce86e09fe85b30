"""EAGLE-3 head training (`spec convert train-eagle3`): the unrolled training computes exactly what the
served draft computes, a few steps lower the loss, a trained head is accepted far more often than an
untrained one, the result loads as an EAGLE3 draft, and checkpoints resume."""

from __future__ import annotations

import json
import shutil
from functools import partial

import pytest
import torch
from typer.testing import CliRunner

from engine import Engine
from spec_tools.convert import ConvertError
from spec_tools.convert.eagle3_data import load_samples
from spec_tools.convert.token_map import eagle3_vocab
from spec_tools.convert.train_eagle3 import (TrainOptions, _target_tensors, evaluate, export_tensors, make_draft_config,
                                         new_draft, train)
from spec_tools.convert.ttt import collate, unrolled
from engine.loader import load_config
from spec_cli.main import app
from tests import eagle_checkpoints as ckpt
from tests.dense_draft import DenseDraft
from tests.planning import untimed
from tests.tiny import make_deepseek, make_model
from tests.training import options, write_prompts


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    prompts = write_prompts(root / "prompts.txt", 24)
    report = train(options(target, root / "head", prompts, max_steps=12, lr=3e-3, save_every=5))
    return root, prompts, report


def test_unrolled_training_is_the_served_draft(target, trained, tmp_path):
    """Step i's output at position t equals the published EAGLE-3 draft computed plainly over the real
    tokens up to t + 1 followed by i drafted tokens fed its own outputs (tests/test_eagle.py)."""
    root, _, _ = trained
    config = load_config(target)
    aux = (2, 2, 1)
    ids, d2t, t2d = eagle3_vocab(range(3, 300), 320)
    embed, head, norm = _target_tensors(target, config)
    draft_config = make_draft_config(config, aux, len(ids))
    draft = new_draft(draft_config, aux, 256, head[ids], norm, seed=0)
    with torch.no_grad():
        for p in draft.parameters():            # away from the init, so every part of the layer matters
            p.add_(torch.randn_like(p) * 0.05)
    torch.save(export_tensors(draft, d2t, t2d), tmp_path / "pytorch_model.bin")
    dense_config = json.loads(draft_config.to_json_string())
    (tmp_path / "config.json").write_text(json.dumps({**dense_config, "rope_theta": 10000.0}))
    dense = DenseDraft(target, tmp_path, "EAGLE3", aux)

    sample = load_samples([(sorted((root / "head" / "data").glob("shard_*.pt"))[0], 1)])[0]
    tokens = sample.ids.tolist()
    with torch.no_grad():
        hidden = dense.target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        batch = collate([sample], 3, t2d, torch.float32, "cpu")
        # The stored features are bfloat16; the comparison takes the exact ones.
        batch.aux[0] = torch.cat([hidden[i][0] for i in aux], -1)[:sample.fed]
        outputs = list(unrolled(draft, embed, batch, 3))
    for t in (sample.prompt_len - 2, sample.prompt_len + 4, sample.fed - 4):
        for i, h in enumerate(outputs):
            ours = draft.lm_head(draft.norm(h[0, t]))
            plain = dense.path_logits(tokens[:t + 2], tokens[t + 2:t + 2 + i])[-1][ids]
            torch.testing.assert_close(ours, plain, atol=1e-4, rtol=1e-4)


def test_a_new_head_starts_from_the_deepest_auxiliary_state(target):
    """fc passes the deepest of the three captured states through (the target's late residual stream),
    whatever the order of the layer ids."""
    config = load_config(target)
    aux = (2, 3, 1)
    embed, head, norm = _target_tensors(target, config)
    draft = new_draft(make_draft_config(config, aux, 10), aux, 64, head[:10], norm, seed=0)
    H = config.hidden_size
    states = torch.randn(5, 3 * H)
    with torch.no_grad():
        torch.testing.assert_close(draft.fc(states), states[:, H:2 * H])


def test_training_lowers_the_loss_and_saves_the_eagle3_layout(target, trained):
    root, _, report = trained
    history = report["history"]
    assert history[0]["step"] == 1 and report["steps"] == 12
    assert history[-1]["loss"] < history[0]["loss"]
    head = root / "head"
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]
    from safetensors.torch import load_file

    names = set(load_file(head / "model.safetensors"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.hidden_norm.weight",
            "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert json.loads((head / "training_report.json").read_text())["steps"] == 12


def test_resume_continues_the_checkpoint(target, trained, tmp_path):
    root, prompts, report = trained
    head = shutil.copytree(root / "head", tmp_path / "head")
    with pytest.raises(ConvertError, match="--resume"):
        train(options(target, head, prompts, max_steps=12))
    with pytest.raises(ConvertError, match="ttt_steps"):
        train(options(target, head, prompts, max_steps=14, ttt_steps=2, resume=True))
    # The data is reused (no generation), training goes on from step 12 with the same history.
    resumed = train(options(target, head, prompts, max_steps=14, lr=3e-3, save_every=5, resume=True))
    assert resumed["steps"] == 14 and resumed["history"][:len(report["history"])] == report["history"]
    assert resumed["generation_s"] < 2


def test_time_budget_alone_bounds_training(target, trained, tmp_path):
    root, prompts, _ = trained
    report = train(options(target, tmp_path / "head", prompts, data_dir=root / "head" / "data", time_budget=0.02))
    assert report["steps"] >= 1 and report["training_s"] >= 1.2
    assert report["training_s"] - 1.2 <= report["s_per_step"] * 3


def test_a_narrower_head_trains_loads_and_serves(target, trained, tmp_path):
    """--intermediate-size: the head's MLP is that wide in the saved checkpoint, and it serves as an
    EAGLE3 draft with the target's output unchanged; widths the w4a8 kernel cannot take are refused."""
    root, prompts, _ = trained
    with pytest.raises(ConvertError, match="multiple of 32"):
        train(options(target, tmp_path / "odd", prompts, data_dir=root / "head" / "data", intermediate_size=48))
    head = tmp_path / "narrow"
    train(options(target, head, prompts, data_dir=root / "head" / "data", max_steps=2, intermediate_size=32))
    from safetensors.torch import load_file

    assert json.loads((head / "config.json").read_text())["intermediate_size"] == 32
    assert load_file(head / "model.safetensors")["midlayer.mlp.gate_proj.weight"].shape[0] == 32
    assert load_config(target).intermediate_size != 32
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    plain = Engine(planner=untimed, model_path=str(target), dtype="float32", max_total_tokens=512).generate(
        input_ids=[[5, 6, 7, 8]], sampling_params=greedy)
    spec = Engine(planner=untimed,
                  model_path=str(target), dtype="float32", max_total_tokens=512, speculative_algorithm="EAGLE3",
                  speculative_draft_model_path=str(head)).generate(input_ids=[[5, 6, 7, 8]], sampling_params=greedy)
    assert spec[0]["output_ids"] == plain[0]["output_ids"]


@pytest.mark.parametrize("arch, extra", [
    ("gemma3", dict(sliding_window=6)),                  # embedding scale, four norms a layer, local windows
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6)),     # sinks, biased experts
    ("deepseek", dict(version=2)),                                                          # MLA
])
def test_a_head_trains_on_other_families(arch, extra, tmp_path):
    """A target of another family (its hidden states, embedding and head read through spec's own model):
    a few steps train, `spec convert draft --check` accepts the head, and it serves losslessly."""
    make = make_deepseek if arch == "deepseek" else partial(make_model, arch=arch)
    target = make(tmp_path / arch, layers=4, **extra)
    head = tmp_path / "head"
    train(options(target, head, write_prompts(tmp_path / "prompts.txt", 24), max_steps=2))
    result = CliRunner().invoke(app, ["convert", "draft", str(head), "-m", str(target), "--check"])
    assert result.exit_code == 0, result.output
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    plain = Engine(planner=untimed, model_path=str(target), dtype="float32", max_total_tokens=512).generate(
        input_ids=prompts, sampling_params=greedy)
    spec = Engine(planner=untimed, model_path=str(target), dtype="float32", max_total_tokens=512,
                  speculative_algorithm="EAGLE3", speculative_draft_model_path=str(head)).generate(
        input_ids=prompts, sampling_params=greedy)
    assert spec[0]["output_ids"] == plain[0]["output_ids"]


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    """A highly regular language: a target whose next token depends on the current one only
    (tests/eagle_checkpoints.py), its lm_head scaled so that each next token is likely (p ~ 0.8), not
    merely the argmax of a flat distribution."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("bigram")
    target = ckpt.make_bigram_target(make_model(root / "target", "llama", layers=4, seed=3))
    weights = load_file(target / "model.safetensors")
    weights["lm_head.weight"] *= 10
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return root, target


def test_trained_head_is_accepted_far_more_than_an_untrained_one(bigram):
    root, target = bigram
    prompts = write_prompts(root / "prompts.txt", 32, seed=1)
    held_out = write_prompts(root / "eval.txt", 4, seed=2).read_text().splitlines()
    # Sampled answers (temperature 1) walk more of the language than the one greedy path.
    result = CliRunner().invoke(app, [
        "convert", "train-eagle3", "-m", str(target), "-o", str(root / "head"), "--prompts", str(prompts),
        "-n", "32", "--max-new-tokens", "48", "--temperature", "1", "--gen-batch", "16", "--draft-vocab", "320",
        "--ttt-steps", "3", "--batch-tokens", "1024", "--max-steps", "60", "--epochs", "100", "--lr", "5e-3",
        "--device", "cpu", "--dtype", "float32", "--precision", "fp32"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "EAGLE-3 head for" in result.output and "Serve with" in result.output
    untrained = train(TrainOptions(model=str(target), output=root / "untrained", prompts=(str(prompts),),
                                   num_prompts=32, max_new_tokens=48, temperature=1.0, gen_batch=16,
                                   data_dir=root / "head" / "data", draft_vocab=320, ttt_steps=3, max_steps=1, lr=0.0,
                                   device="cpu", dtype="float32"))
    assert untrained["generation_s"] < 2           # the same data, reused
    good = evaluate(str(target), root / "head", held_out, 32, "cpu", "float32")
    bad = evaluate(str(target), root / "untrained", held_out, 32, "cpu", "float32")
    assert bad["avg_spec_accept_length"] < 1.5 and good["avg_spec_accept_length"] > 3.5, (bad, good)
    # Served as an EAGLE3 draft, the output is the target's.
    batch = [[5, 6, 7, 8], [40, 41, 42]]
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    plain = Engine(planner=untimed, model_path=str(target), dtype="float32", max_total_tokens=1024).generate(
        input_ids=batch, sampling_params=greedy)
    spec = Engine(planner=untimed,
                  model_path=str(target), dtype="float32", max_total_tokens=1024, speculative_algorithm="EAGLE3",
                  speculative_draft_model_path=str(root / "head")).generate(input_ids=batch, sampling_params=greedy)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
