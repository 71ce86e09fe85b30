"""The prompt source `magpie` (the target writes its own requests): the context it samples from is the
one answers are generated in, what it keeps is finished, long enough and new, and its prompts are stored
and reused so that training data stays valid across runs."""

from __future__ import annotations

import json
import types
from dataclasses import replace

import pytest

from spec_tools.convert import ConvertError, magpie
from spec_tools.convert.generate import chat_prompt_ids
from spec_tools.convert.train_eagle3 import Silent, _aux_layers, _data
from engine.loader import load_config, load_tokenizer
from tests.training import options, write_prompts


def test_prefix_is_how_every_chat_prompt_begins(target):
    tokenizer = load_tokenizer(target)
    prefix = magpie.user_turn_prefix(tokenizer)
    assert tokenizer.decode(prefix) == "<|user|>"
    for ids in chat_prompt_ids(tokenizer, ["the quick brown fox", "one two"]):
        assert ids[:len(prefix)] == prefix


def test_a_tokenizer_without_chat_template_is_refused(target):
    tokenizer = load_tokenizer(target)
    tokenizer.chat_template = None
    with pytest.raises(ConvertError, match="no chat template"):
        magpie.user_turn_prefix(tokenizer)


class _Words:
    """A tokenizer stand-in: id i decodes to word i."""
    chat_template = "{{ messages[0]['content'] }}"

    def apply_chat_template(self, messages, tokenize):
        return "prefix " + messages[0]["content"]

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [0] * len(text.split())}

    def decode(self, ids, skip_special_tokens):
        return " ".join(f"w{i}" for i in ids)


def _fake_generation(monkeypatch, outputs):
    """generate_groups answering prompt i (by seed index) with outputs[i] = (token ids, finish type)."""
    firsts = []

    def generate_groups(engine, prompt_ids, gen, group, *, first_index=0, on_step=None):
        firsts.append(first_index)
        yield [types.SimpleNamespace(output_ids=outputs[i][0], finish_reason=types.SimpleNamespace(type=outputs[i][1]))
               for i in range(first_index, first_index + len(prompt_ids))]

    monkeypatch.setattr(magpie, "generate_groups", generate_groups)
    return firsts


def test_keeps_finished_long_enough_distinct_requests_up_to_count(monkeypatch):
    outputs = [([1, 2, 3, 4], "stop"), ([1, 2, 3, 4], "stop"),            # a repeat
               ([5, 6, 7, 8, 9], "length"),                                # cut off
               ([5, 6], "stop"),                                           # too short
               ([5, 6, 7, 8], "stop"), ([9, 8, 7, 6], "stop"), ([1, 1, 1, 1], "stop"), ([2, 2, 2, 2], "stop")]
    firsts = _fake_generation(monkeypatch, outputs)
    engine = types.SimpleNamespace(tokenizer=_Words())
    got, tried = magpie.write_prompts(engine, 3, magpie.MagpieSettings("m"), group=4)
    assert got == ["w1 w2 w3 w4", "w5 w6 w7 w8", "w9 w8 w7 w6"] and tried == 8
    assert firsts == [0, 4]              # the second group samples with new seeds


def test_gives_up_after_four_tries_a_prompt(monkeypatch):
    firsts = _fake_generation(monkeypatch, [([1, 2, 3, 4], "stop")] * 40)
    engine = types.SimpleNamespace(tokenizer=_Words())
    assert magpie.write_prompts(engine, 5, magpie.MagpieSettings("m"), group=8) == (["w1 w2 w3 w4"], 20)
    assert firsts == [0, 8, 16]          # 20 tries in all, the last group cut to 4
    _fake_generation(monkeypatch, [([1, 2, 3, 4], "length")] * 20)
    with pytest.raises(ConvertError, match="no usable requests in 20 tries"):
        magpie.write_prompts(engine, 5, magpie.MagpieSettings("m"), group=8)


def test_training_data_reuses_the_stored_prompts(target, tmp_path, monkeypatch):
    calls = []

    def write(engine, count, settings, group, on_kept=None, kept=(), tried=0):
        calls.append((count, settings))
        return [f"one two three {w}" for w in ("four", "five", "six", "seven", "eight", "nine")[:count]], 4 * count

    monkeypatch.setattr(magpie, "write_prompts", write)
    prompts = write_prompts(tmp_path / "p.txt", 8)
    opts = replace(options(target, tmp_path / "head", prompts, num_prompts=10), prompts=("magpie", str(prompts)))
    aux = _aux_layers(load_config(target), target)
    first = _data(opts, target, aux, "cpu", Silent())
    assert calls == [(5, magpie.MagpieSettings(str(target), 0))]
    stored = json.loads((opts.data_path / "magpie.json").read_text())["prompts"]
    assert len(first) == 10 and stored[:2] == ["one two three four", "one two three five"]
    again = _data(opts, target, aux, "cpu", Silent())
    assert len(calls) == 1 and [s.ids.tolist() for s in again] == [s.ids.tolist() for s in first]



def test_a_longer_list_extends_the_stored_one(tmp_path, monkeypatch):
    """More prompts than stored: the stored ones first, then requests sampled with seeds past those
    already tried (not a new list from seed 0), so that data answering the shorter list stays valid."""
    outputs = [([i, i, i, i], "stop") for i in range(40)]
    firsts = _fake_generation(monkeypatch, outputs)
    engine = types.SimpleNamespace(tokenizer=_Words())
    path, settings = tmp_path / "magpie.json", magpie.MagpieSettings("m")
    short = magpie.cached_prompts(path, 3, settings, lambda: engine, group=4)
    assert short == ["w0 w0 w0 w0", "w1 w1 w1 w1", "w2 w2 w2 w2"] and firsts == [0]
    kept = []
    longer = magpie.cached_prompts(path, 6, settings, lambda: engine, group=4, on_kept=kept.append)
    assert sum(kept) == 6 and kept[0] == 3          # progress counts the stored prompts too
    assert longer[:3] == short and longer[3:] == ["w4 w4 w4 w4", "w5 w5 w5 w5", "w6 w6 w6 w6"]
    assert firsts == [0, 4]
    assert magpie.cached_prompts(path, 2, settings, lambda: engine, group=4) == short[:2] and firsts == [0, 4]
    assert json.loads(path.read_text())["tried"] == 8


def test_magpie_tasks_begins_each_request_with_an_opening_in_turn(tmp_path, monkeypatch):
    """Sample i is fed the user turn's prefix and OPENINGS[i % len]; the kept request is the opening
    and what the target wrote after it. Its prompts file is its own, with the openings in its settings."""
    fed = []

    def generate_groups(engine, prompt_ids, gen, group, *, first_index=0, on_step=None):
        fed.extend(prompt_ids)
        yield [types.SimpleNamespace(output_ids=[7, 8, 9, 10 + first_index + i],
                                     finish_reason=types.SimpleNamespace(type="stop"))
               for i in range(len(prompt_ids))]

    class Openings(_Words):
        def __call__(self, text, add_special_tokens):
            return {"input_ids": [100 + magpie.OPENINGS.index(text)] if text in magpie.OPENINGS else [0]}

    monkeypatch.setattr(magpie, "generate_groups", generate_groups)
    engine = types.SimpleNamespace(tokenizer=Openings())
    settings = magpie.settings(magpie.TASKS, "m")
    count = len(magpie.OPENINGS) + 2
    got = magpie.cached_prompts(tmp_path / "magpie-tasks.json", count, settings, lambda: engine, group=count)
    starts = [ids[-1] for ids in fed]
    assert starts == [100 + i % len(magpie.OPENINGS) for i in range(count)]
    assert all(ids[:-1] == fed[0][:-1] for ids in fed)                 # the same user-turn prefix
    assert got[:2] == ["w100 w7 w8 w9 w10", "w101 w7 w8 w9 w11"] and got[-1].startswith("w101 ")
    stored = json.loads((tmp_path / "magpie-tasks.json").read_text())["settings"]
    assert stored["openings"] == list(magpie.OPENINGS)
    assert "openings" not in magpie.settings(magpie.MAGPIE, "m").stored()    # plain magpie's files as before
    assert magpie.sources(["instructions", magpie.TASKS, magpie.MAGPIE]) == [magpie.MAGPIE, magpie.TASKS]
