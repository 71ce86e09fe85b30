"""`spec convert token-map` and `spec convert draft`: token maps count, order and cover as they say and
serve unchanged output; drafts in every published layout convert, validate and serve exactly as the
originals do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine import Engine
from spec_tools.convert.token_map import build_token_map, chat_special_ids, count_ids, coverage, eagle3_vocab
from engine.loader import load_tokenizer
from engine.speculative.token_map import load_token_map
from spec_cli.main import app
from tests import eagle_checkpoints as ckpt
from tests.planning import untimed
from tests.tiny import make_model

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)


def run(*args: str):
    return CliRunner().invoke(app, list(args), prog_name="spec", env={"COLUMNS": "200"})


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(k),), generator=g).tolist() for k in torch.randint(4, 30, (n,), generator=g)]


@pytest.fixture(scope="module")
def plain(target):
    batch = prompts(4)
    outs = Engine(planner=untimed, model_path=str(target), dtype="float32", max_total_tokens=2048).generate(
        input_ids=batch, sampling_params=GREEDY)
    return batch, [o["output_ids"] for o in outs]


def generate(target, algorithm, draft, batch, **kw):
    eng = Engine(planner=untimed,
                 model_path=str(target), dtype="float32", max_total_tokens=2048, speculative_algorithm=algorithm,
                 speculative_draft_model_path=str(draft), **TREE, **kw)
    outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
    return [o["output_ids"] for o in outs], [o["meta_info"]["spec_verify_ct"] for o in outs], eng


# ------------------------------------------------------------------------------------------------ token maps
def test_counts_give_order_ties_forced_ids_and_coverage():
    counts = count_ids([[5, 5, 5, 2, 2], [9, 2], [7]], vocab_size=12)
    assert counts.tolist() == [0, 0, 3, 0, 0, 3, 0, 1, 0, 1, 0, 0]
    assert build_token_map(counts, 3) == [2, 5, 7]                # ties by id: 2 before 5, 7 before 9
    assert build_token_map(counts, 3, always=[11]) == [2, 5, 11]   # forced in, least frequent out, at the end
    assert build_token_map(counts, 6) == [2, 5, 7, 9, 0, 1]        # unseen ids fill by id order
    assert coverage(counts, [2, 5]) == pytest.approx(6 / 8)
    ids, d2t, t2d = eagle3_vocab([9, 2, 5], 12)
    assert ids.tolist() == [2, 5, 9] and (torch.arange(3) + d2t).tolist() == [2, 5, 9]
    assert t2d.nonzero().flatten().tolist() == [2, 5, 9]


def test_token_map_command_counts_the_corpus(target, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 30 + "one two three four five\n" * 5)
    out = tmp_path / "map.pt"
    result = run("convert", "token-map", "--model", str(target), "--dataset", str(corpus), "--size", "12", "-o", str(out))
    assert result.exit_code == 0, result.output
    tok = load_tokenizer(target)
    ids = load_token_map(out, 320).tolist()
    expected = torch.bincount(torch.tensor(tok(corpus.read_text(), add_special_tokens=False)["input_ids"]), minlength=320)
    assert len(ids) == 12 and 1 in ids                                  # EOS always in
    frequent = [i for i in ids if i != 1]
    assert [int(expected[i]) for i in frequent] == sorted((int(expected[i]) for i in frequent), reverse=True)
    assert int(expected[frequent[-1]]) >= int(expected.sort(descending=True).values[len(frequent) - 1])
    share = float(expected[torch.tensor(ids)].sum() / expected.sum())
    assert f"{share:.2%}" in result.output
    assert f"spec serve --model {target} --algo STANDALONE" in result.output


def test_token_map_of_a_target_the_engine_refuses_suggests_no_serve_command(target, tmp_path):
    """A map needs only the tokenizer (a Mamba's, say); the closing hint must not name a spec serve
    command that would be refused."""
    other = tmp_path / "other"
    shutil.copytree(target, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["MambaForCausalLM"]}))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 3)
    result = run("convert", "token-map", "--model", str(other), "--dataset", str(corpus), "--size", "12",
                 "-o", str(tmp_path / "map.pt"))
    assert result.exit_code == 0, result.output
    assert "spec serve" not in result.output and "does not serve" in result.output


def test_chat_special_ids_are_the_templates(target):
    tok = load_tokenizer(target)
    assert chat_special_ids(tok, [1]) == [1]       # the tiny template writes only </s> (EOS) as a special token


def test_map_from_question_jsonl_serves_unchanged_output(target, plain, tmp_path):
    rows = [{"question_id": i, "category": "x", "turns": [f"tell me about {w}"], "reference": ["the fox"]}
            for i, w in enumerate(["foxes", "dogs", "numbers one two three"])]
    data = tmp_path / "question.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "freq.pt"
    assert run("convert", "token-map", "-m", str(target), "-d", str(data), "--size", "64", "-o", str(out)).exit_code == 0
    batch, expected = plain
    draft = ckpt.save_eagle_repo(tmp_path / "eagle", *ckpt.eagle_tensors(target, seed=1))
    outs, verifies, eng = generate(target, "EAGLE", draft, batch, speculative_token_map=str(out))
    assert outs == expected and all(v > 0 for v in verifies)
    assert eng.debug.drafter.model.head.ids.tolist() == torch.load(out)


def test_map_from_generations(target, tmp_path):
    out = tmp_path / "gen.pt"
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("hello there\nthe quick brown fox\n")
    result = run("convert", "token-map", "-m", str(target), "-d", str(prompts_file), "--from-generations",
                 "--max-new-tokens", "8", "--size", "40", "-o", str(out), "--dtype", "float32")
    assert result.exit_code == 0, result.output
    assert "tokens the target generated for 2 prompts" in result.output
    assert len(load_token_map(out, 320)) == 40


def test_map_from_prompts_the_target_writes(target, tmp_path, monkeypatch):
    from spec_tools.convert import magpie

    written = []
    monkeypatch.setattr(magpie, "write_prompts", lambda engine, count, settings, group, on_kept=None:
                        (written.append(count) or ["one two three four", "five six seven eight"][:count], 4 * count))
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("hello there\nthe quick brown fox\n")
    common = ("convert", "token-map", "-m", str(target), "-d", "magpie", "-d", str(prompts_file), "-n", "4",
              "--size", "40", "-o", str(tmp_path / "m.pt"))
    refused = run(*common)
    assert refused.exit_code == 2 and "add --from-generations" in refused.output and not written
    result = run(*common, "--from-generations", "--max-new-tokens", "8", "--dtype", "float32")
    assert result.exit_code == 0, result.output
    assert written == [2] and "tokens the target generated for 4 prompts" in result.output


# ------------------------------------------------------------------------------------------------ drafts
def speculators_copy(eagle3_dir: Path, out: Path) -> Path:
    """The same EAGLE-3 weights as vLLM speculators stores them."""
    config = json.loads((eagle3_dir / "config.json").read_text())
    tensors = torch.load(eagle3_dir / "pytorch_model.bin")
    out.mkdir()
    layer = {k: v for k, v in config.items() if k not in ("architectures", "draft_vocab_size")}
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "norm_before_residual": False,
        "draft_vocab_size": config["draft_vocab_size"], "transformer_layer_config": layer,
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}}}))
    from safetensors.torch import save_file

    save_file({k.replace("midlayer.", "layers.0."): v.contiguous() for k, v in tensors.items()},
              str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def layouts(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    config, tensors = ckpt.eagle_tensors(target, seed=1)
    eagle3 = ckpt.save_eagle3(root / "eagle3", target, seed=2)
    return {"repo": ("EAGLE", ckpt.save_eagle_repo(root / "repo", config, tensors), None),
            "sglang": ("EAGLE", ckpt.save_sglang_eagle(root / "sglang", target, config, tensors), None),
            "eagle3": ("EAGLE3", eagle3, None),
            "speculators": ("EAGLE3", speculators_copy(eagle3, root / "speculators"), eagle3)}


@pytest.mark.parametrize("layout", ["repo", "sglang", "eagle3", "speculators"])
def test_published_layouts_convert_and_serve_as_the_originals(target, plain, layouts, layout, tmp_path):
    algorithm, source, original = layouts[layout]
    out = tmp_path / "converted"
    result = run("convert", "draft", str(source), "--model", str(target), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "FAIL" not in result.output and "embedding copy" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    batch, expected = plain
    converted = generate(target, algorithm, out, batch)
    reference = generate(target, algorithm, original or source, batch)
    assert converted[0] == reference[0] == expected
    assert converted[1] == reference[1]           # the same drafts: the same number of verifications
    # Converting the converted draft changes nothing.
    again = tmp_path / "again"
    assert run("convert", "draft", str(out), "--model", str(target), "-o", str(again)).exit_code == 0
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_token_map_becomes_the_eagle3_vocabulary(target, plain, layouts, tmp_path):
    _, source, _ = layouts["eagle3"]
    original = set((torch.arange(200) + torch.load(source / "pytorch_model.bin")["d2t"]).tolist())
    wanted = sorted(original)[::2] + [i for i in range(320) if i not in original][:7]
    torch.save(wanted, tmp_path / "map.pt")
    out = tmp_path / "small"
    result = run("convert", "draft", str(source), "-m", str(target), "--token-map", str(tmp_path / "map.pt"), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "draft vocabulary 200 -> 100 tokens (7 map ids are not in the draft's vocabulary" in result.output
    batch, expected = plain
    outs, _, eng = generate(target, "EAGLE3", out, batch)
    assert outs == expected
    assert eng.debug.drafter.model.head.ids.tolist() == sorted(original)[::2]
    # Each kept row is the original head's row for that token.
    from safetensors.torch import load_file

    head = torch.load(source / "pytorch_model.bin")["lm_head.weight"]
    assert torch.equal(load_file(out / "model.safetensors")["lm_head.weight"], head[::2])


def test_token_map_is_saved_beside_eagle_drafts(target, layouts, tmp_path):
    torch.save(list(range(100, 200)), tmp_path / "map.pt")
    result = run("convert", "draft", str(layouts["repo"][1]), "-m", str(target), "--token-map",
                 str(tmp_path / "map.pt"), "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert torch.load(tmp_path / "out" / "token_map.pt") == list(range(100, 200))
    assert "--speculative-token-map" in result.output


def test_mismatched_drafts_fail_with_a_report(target, tmp_path):
    config, tensors = ckpt.eagle_tensors(target, hidden=32)
    narrow = ckpt.save_eagle_repo(tmp_path / "narrow", config, tensors)
    result = run("convert", "draft", str(narrow), "-m", str(target), "-o", str(tmp_path / "out"))
    assert result.exit_code == 2
    assert "hidden size" in result.output and "FAIL" in result.output and "does not fit this target" in result.output
    assert not (tmp_path / "out").exists()
    # A draft made for another target of the same shape: its embedding copy differs (a warning).
    other = make_model(tmp_path / "other", "llama", layers=4, seed=5)
    draft = ckpt.save_eagle3(tmp_path / "other_draft", other, seed=2)
    result = run("convert", "draft", str(draft), "-m", str(target), "--check")
    assert result.exit_code == 0 and "differs" in result.output and "warning" in result.output
    # Layer ids beyond the target's layers.
    far = ckpt.save_eagle3(tmp_path / "far", target, aux_layer_ids=[0, 1, 9])
    result = run("convert", "draft", str(far), "-m", str(target), "--check")
    assert result.exit_code == 2 and "below the target's 4 layers" in result.output


def test_unsupported_speculators_variant_is_refused(target, layouts, tmp_path):
    copy = speculators_copy(layouts["eagle3"][1], tmp_path / "spec")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "norm_before_residual": True}))
    result = run("convert", "draft", str(copy), "-m", str(target), "-o", str(tmp_path / "out"))
    assert result.exit_code == 2 and "norm_before_residual" in result.output


def test_an_ordinary_model_is_not_a_draft(target, tmp_path):
    result = run("convert", "draft", str(target), "-m", str(target), "-o", str(tmp_path / "out"))
    assert result.exit_code == 2 and "STANDALONE" in result.output
