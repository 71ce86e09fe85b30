"""EAGLE-3 training data that accumulates (spec_tools/convert/eagle3_data.py): a larger -n answers only the
new prompts, a smaller one reads a prefix without generating, and data made from other prompts or
settings is refused saying what differs; training resumes onto the grown data."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from spec_tools.convert import ConvertError, generate
from spec_tools.convert import train_eagle3 as te
from spec_tools.convert.corpus import load_prompts, written_share
from spec_tools.convert.data_manifest import data_shards
from spec_tools.convert.train_eagle3 import Silent, _aux_layers, _data, train
from engine.loader import load_config
from tests.training import options, write_prompts


@pytest.fixture
def answered(monkeypatch):
    """Counts the prompts the engine is asked to answer."""
    asked = []
    real = generate.generate_groups

    def counting(engine, prompt_ids, *args, **kw):
        asked.append(len(prompt_ids))
        yield from real(engine, prompt_ids, *args, **kw)

    monkeypatch.setattr("spec_tools.convert.eagle3_data.generate_groups", counting)
    return asked


def run_data(target, opts):
    return _data(opts, target, _aux_layers(load_config(target), target), "cpu", Silent())


def ids(samples):
    return [s.ids.tolist() for s in samples]


def test_data_grows_and_a_smaller_n_reads_a_prefix(target, tmp_path, answered, monkeypatch):
    prompts = write_prompts(tmp_path / "p.txt", 20)
    opts = options(target, tmp_path / "head", prompts, num_prompts=6, gen_batch=2, max_new_tokens=8)
    first = run_data(target, opts)
    manifest = json.loads((opts.data_path / "manifest.json").read_text())
    assert answered == [6] and [s["prompts"] for s in manifest["shards"]] == [6]
    grown = run_data(target, replace(opts, num_prompts=20))
    assert answered == [6, 14]                       # only the new prompts, in new shards of 8
    manifest = json.loads((opts.data_path / "manifest.json").read_text())
    assert [s["prompts"] for s in manifest["shards"]] == [6, 8, 6] and len(grown) == 20
    assert ids(grown[:6]) == ids(first)

    def no_engine(*args, **kw):
        raise AssertionError("a prefix of the stored data needs no generation")

    monkeypatch.setattr(te, "generation_engine", no_engine)
    for n in (20, 11, 3):                            # 11 ends inside the second shard
        assert ids(run_data(target, replace(opts, num_prompts=n))) == ids(grown[:n])


def test_data_made_otherwise_is_refused_saying_what_differs(target, tmp_path, answered):
    prompts = write_prompts(tmp_path / "p.txt", 8)
    opts = options(target, tmp_path / "head", prompts, num_prompts=4, max_new_tokens=8)
    run_data(target, opts)
    with pytest.raises(ConvertError, match=r"temperature 0.0 there, 1.0 now.*another --data-dir"):
        run_data(target, replace(opts, temperature=1.0))
    with pytest.raises(ConvertError, match="max_new_tokens 8 there, 16 now"):
        run_data(target, replace(opts, max_new_tokens=16))
    with pytest.raises(ConvertError, match="dtype 'float32' there, 'bfloat16' now"):
        run_data(target, replace(opts, dtype="bfloat16"))
    other = write_prompts(tmp_path / "other.txt", 8, seed=5)
    with pytest.raises(ConvertError, match="prompt 1 of this run is not the one it answered"):
        run_data(target, replace(opts, prompts=(str(other),), num_prompts=2))
    assert answered == [4]                           # refused before any generation


def test_other_settings_are_refused_before_magpie_writes_prompts(target, tmp_path, monkeypatch):
    from spec_tools.convert import magpie

    calls = []

    def write(engine, count, settings, group, on_kept=None, kept=(), tried=0):
        calls.append(count)
        return [f"one two three {i}" for i in range(count)], count

    monkeypatch.setattr(magpie, "write_prompts", write)
    prompts = write_prompts(tmp_path / "p.txt", 8)
    opts = replace(options(target, tmp_path / "head", prompts, num_prompts=4, max_new_tokens=8),
                   prompts=("magpie", str(prompts)))
    run_data(target, opts)
    with pytest.raises(ConvertError, match="temperature 0.0 there, 1.0 now"):
        run_data(target, replace(opts, num_prompts=8, temperature=1.0))
    assert calls == [2]                              # not asked for the 4 the larger run would need


def test_an_older_data_directory_is_carried_over(target, tmp_path):
    """A manifest from before data could grow (one digest over all prompts) gets per-prompt digests
    when a run with the same settings has all its prompts first; then it grows as any other."""
    import hashlib

    prompts = write_prompts(tmp_path / "p.txt", 8)
    opts = options(target, tmp_path / "head", prompts, num_prompts=4, max_new_tokens=8)
    first = run_data(target, opts)
    path = opts.data_path / "manifest.json"
    manifest = json.loads(path.read_text())
    texts = prompts.read_text().splitlines()[:5]           # made for 5, stopped after 4
    old_spec = {k: manifest["spec"][k] for k in ("model", "aux_layers", "generation")}
    old = {"spec": {**old_spec, "prompts_sha": hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:16],
                    "group": 32},
           "shards": [{k: s[k] for k in ("file", "prompts", "samples", "tokens")} for s in manifest["shards"]]}
    path.write_text(json.dumps(old))
    for n, temperature in ((4, 0.0), (5, 0.5)):
        with pytest.raises(ConvertError, match="older spec.*-n at least as large"):
            run_data(target, replace(opts, num_prompts=n, temperature=temperature))
    assert ids(run_data(target, replace(opts, num_prompts=6))[:4]) == ids(first)
    now = json.loads(path.read_text())
    assert now["spec"] == manifest["spec"] and now["shards"][0] == manifest["shards"][0]


def test_a_damaged_data_directory_is_named(target, tmp_path):
    prompts = write_prompts(tmp_path / "p.txt", 8)
    opts = options(target, tmp_path / "head", prompts, num_prompts=4, max_new_tokens=8)
    run_data(target, opts)
    (opts.data_path / "shard_00000.pt").unlink()
    with pytest.raises(ConvertError, match="shard_00000.pt is missing.*delete"):
        run_data(target, opts)
    (opts.data_path / "manifest.json").write_text("{")
    with pytest.raises(ConvertError, match="manifest.json is not valid JSON"):
        run_data(target, opts)


def test_prompts_without_a_sample_are_skipped_by_offset(tmp_path):
    manifest = {"shards": [{"file": "a.pt", "prompts": 4, "skipped": [1]},
                           {"file": "b.pt", "prompts": 4, "skipped": [0, 3]}]}
    for name in ("a.pt", "b.pt"):
        (tmp_path / name).touch()
    assert [n for _, n in data_shards(tmp_path, manifest, 8)] == [3, 2]
    assert [n for _, n in data_shards(tmp_path, manifest, 6)] == [3, 1]
    assert [n for _, n in data_shards(tmp_path, manifest, 1)] == [1]
    assert [n for _, n in data_shards(tmp_path, manifest, 2)] == [1]


def test_prompt_mixes_are_prefix_stable(tmp_path):
    """The prompts of a larger -n begin with those of a smaller one, for every mix of sources (magpie's
    list, written per run, takes its share of -n, as train_eagle3 asks it)."""
    from spec_tools.convert import magpie

    file = write_prompts(tmp_path / "p.txt", 50)
    written = [f"written request {i}" for i in range(400)]
    for sources in ([str(file)], ["instructions"], ["magpie", "instructions"], ["magpie", str(file), "instructions"]):
        def mix(n):
            return load_prompts(sources, n, {"magpie": written[:written_share(sources, n, magpie.sources(sources))]})
        longest = mix(300)
        for n in (1, 7, 64, 151):
            assert mix(n) == longest[:n], (sources, n)


def test_magpie_fills_the_turns_of_sources_that_run_out(tmp_path):
    """-n beyond what the fixed sources hold: magpie writes the rest, so the mix has -n prompts (it wrote
    -n / sources before, and the run silently trained on fewer)."""
    short, long = write_prompts(tmp_path / "short.txt", 10), write_prompts(tmp_path / "long.txt", 1000, seed=1)
    assert written_share(["magpie", str(long)], 300, ["magpie"]) == 150          # its turn alone
    # 10 rounds of three, then rounds of two: 145 rounds for 300 prompts.
    assert written_share(["magpie", str(short), str(long)], 300, ["magpie"]) == 145
    assert written_share(["magpie", str(short)], 300, ["magpie"]) == 290
    assert written_share([str(short)], 300, []) == 0
    written = [f"written request {i}" for i in range(400)]
    for sources in (["magpie", str(short)], ["magpie", str(short), str(long)]):
        prompts = load_prompts(sources, 300, {"magpie": written[:written_share(sources, 300, ["magpie"])]})
        assert len(prompts) == 300 and len(set(prompts)) == 300


def test_training_resumes_onto_grown_data(target, tmp_path):
    prompts = write_prompts(tmp_path / "p.txt", 24)
    first = train(options(target, tmp_path / "head", prompts, num_prompts=12, max_steps=3, save_every=1))
    assert first["data"]["samples"] == 12
    head = shutil.copytree(tmp_path / "head", tmp_path / "again")
    with pytest.raises(ConvertError, match="--resume: the checkpoint has trained 3 steps.*Raise them"):
        train(options(target, head, prompts, num_prompts=24, max_steps=3, resume=True))
    grown = train(options(target, head, prompts, num_prompts=24, max_steps=5, resume=True))
    assert grown["data"]["samples"] == 24 and grown["steps"] == 5
    assert grown["history"][:len(first["history"])] == first["history"]
    manifest = json.loads((head / "data" / "manifest.json").read_text())
    assert [s["prompts"] for s in manifest["shards"]] == [12, 12]
    before = torch.load(tmp_path / "head" / "checkpoint.pt", weights_only=True)
    after = torch.load(head / "checkpoint.pt", weights_only=True)
    # The grown data starts a new epoch: the old one's order (over 12 samples) means nothing now.
    assert (before["epoch"], before["batch_in_epoch"], before["samples"]) == (1, 1, 12)
    assert (after["epoch"], after["batch_in_epoch"], after["samples"]) == (2, 2, 24)


def test_command_line_grows_the_data_and_refuses_other_settings(target, tmp_path):
    from typer.testing import CliRunner

    from spec_cli.main import app

    prompts = write_prompts(tmp_path / "p.txt", 8)

    def run(n, out, *extra):
        return CliRunner().invoke(app, [
            "convert", "train-eagle3", "-m", str(target), "-o", str(tmp_path / out), "--prompts", str(prompts),
            "-n", str(n), "--data-dir", str(tmp_path / "data"), "--max-new-tokens", "8", "--draft-vocab", "64",
            "--max-steps", "1", "--device", "cpu", "--dtype", "float32", "--precision", "fp32", *extra],
            env={"COLUMNS": "200"})

    assert run(4, "a", "--quantization", "none").exit_code == 0
    grown = run(8, "b")                                   # auto is none for this (not GGUF) target: the same data
    assert grown.exit_code == 0, grown.output
    assert "8 answers" in grown.output
    refused = run(8, "c", "--temperature", "0.5")
    assert refused.exit_code == 2 and "temperature 0.0 there, 0.5 now" in refused.output
    assert "Traceback" not in refused.output


def test_the_next_group_runs_before_a_group_is_handed_back(target):
    """Groups come back in order with their own requests, but the batch does not drain at a group's
    end: the next group is already queued (and the answers are those of one big group)."""
    from spec_tools.convert.generate import Generation, generate_groups, generation_engine

    engine = generation_engine(str(target), 2, 12, "float32", "cpu")
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(6)]
    gen = Generation(max_new_tokens=12)
    busy, outputs = [], []
    for reqs in generate_groups(engine, prompts, gen, 2):
        busy.append(engine.has_work)
        outputs += [r.output_ids for r in reqs]
    assert busy == [True, True, False]
    whole = next(generate_groups(engine, prompts, gen, 6))
    assert outputs == [r.output_ids for r in whole] and len(outputs) == 6


def test_a_gguf_generates_as_served_unless_asked(tmp_path, monkeypatch):
    """auto answers as spec serve would serve a 4-bit GGUF (its own 4-bit groups, the head's on-policy
    data); float32 stays the exact reference; an explicit format (the faster dense bf16) is kept."""
    from spec_tools.convert.generate import generation_format
    from engine.loader import convert_gguf
    from engine.models.prepack import native_bf16
    from spec_kernels import cpu_w4a8
    from tests.gguf_files import gguf_tokenizer, tiny_llama, write_tiny_gguf

    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = gguf_tokenizer()
    path = tmp_path / "tiny.Q4_1.gguf"
    write_tiny_gguf(path, tiny_llama(len(tokenizer)), tokenizer, {p: "Q4_1" for p in ("q_proj", "up_proj")})
    converted = convert_gguf(path)
    config = load_config(converted)
    native = "bfloat16" if native_bf16("cpu") else "float32"
    served = "w4a8" if cpu_w4a8.kernel_name() == "avx512-vnni" else "int4"
    assert generation_format(converted, config, "auto", "auto", "cpu") == (native, served)
    assert generation_format(converted, config, "auto", "float32", "cpu") == ("float32", "none")
    assert generation_format(converted, config, "none", "bfloat16", "cpu") == ("bfloat16", "none")
    assert generation_format(converted, config, "w8a8_int8", "auto", "cpu") == (native, "w8a8_int8")


def test_answers_that_are_not_the_targets_are_refused(target, tmp_path, monkeypatch):
    """After generating, a few new samples go back through the target: fp32 data agrees everywhere,
    data whose stored argmax is not the target's is refused before any training."""
    from spec_tools.convert import eagle3_data

    prompts = write_prompts(tmp_path / "p.txt", 6)
    opts = options(target, tmp_path / "head", prompts, num_prompts=6, gen_batch=2, max_new_tokens=8)
    samples = run_data(target, opts)
    engine = generate.generation_engine(str(target), 2, 8, "float32", "cpu", "none")
    assert eagle3_data.answer_agreement(engine, samples) == 1.0
    real = eagle3_data.captured_sample

    def off_by_one(req):
        sample = real(req)
        sample["argmax"][sample["prompt_len"] - 1:] += 1
        return sample

    monkeypatch.setattr(eagle3_data, "captured_sample", off_by_one)
    with pytest.raises(ConvertError, match="not what the target produces"):
        run_data(target, replace(opts, data_dir=tmp_path / "bad"))


def test_a_larger_n_than_the_sources_hold_is_said(target, tmp_path):
    prompts = write_prompts(tmp_path / "p.txt", 4)
    opts = options(target, tmp_path / "head", prompts, num_prompts=6, gen_batch=2, max_new_tokens=4)
    said = []

    class Said(Silent):
        def log(self, message):
            said.append(message)

    samples = _data(opts, target, _aux_layers(load_config(target), target), "cpu", Said())
    assert len(samples) == 4
    assert any(m.startswith("-n 6:") and "hold 4 prompts" in m for m in said), said
