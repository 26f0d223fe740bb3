"""Passkey at depth and length (`kvforge eval kv-evict --passkey-lengths`, issue 45) on a tiny random model:
the needle sits at the requested share of the document, bad flag values exit 2, and a run writes its files."""
from __future__ import annotations

import json

import pytest

from kvforge.cli import main
from kvforge.commands.eval_evict import parse_budgets, parse_depths, parse_lengths
from kvforge.evaluation.passkey_depth import build_prompts, depth_prompt, merge_results, render_depth_table
from kvforge.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    return path


@pytest.mark.parametrize("depth", [0, 10, 30, 50, 70, 90, 100])
@pytest.mark.parametrize("length", [300, 1000])
def test_needle_sits_at_the_requested_depth(tiny, depth, length):
    tok = Tokenizer.from_dir(tiny)
    filler = [ord("a") + i % 26 for i in range(length)]  # no digits, so the needle is the only key
    p = depth_prompt(tok, filler, "12345", length, depth)
    assert len(p.ids) == length
    needle = tok.encode("The pass key is 12345. Remember it. 12345 is the pass key.\n", add_special_tokens=False)
    assert p.ids[p.needle_start : p.needle_start + len(needle)] == needle
    head = len(tok.encode("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n",
                          add_special_tokens=False))
    ask = len(tok.encode("\n\nWhat is the pass key? The pass key is", add_special_tokens=False))
    doc = length - head - ask - len(needle)  # the document around the needle
    before = p.needle_start - head  # document tokens before the needle
    assert abs(before - depth / 100 * doc) <= 0.5
    assert p.ids[:head] == tok.encode("There is a pass key hidden inside a lot of irrelevant text. Find it and "
                                      "memorize it.\n\n", add_special_tokens=False)


def test_prompts_of_one_length_share_their_filler_across_depths(tiny):
    tok = Tokenizer.from_dir(tiny)
    prompts = build_prompts(tok, (400, 600), (10, 90), per_depth=2)
    assert [(p.length, p.depth) for p in prompts] == [(400, 10), (400, 90)] * 2 + [(600, 10), (600, 90)] * 2
    assert all(len(p.ids) == p.length for p in prompts)
    a, b = prompts[0], prompts[1]  # same filler, depth 10 and 90: identical up to the shallow needle
    assert a.ids[: a.needle_start] == b.ids[: a.needle_start] and a.key != b.key
    assert prompts[0].ids[a.needle_start + 60 :][:50] != prompts[2].ids[a.needle_start + 60 :][:50]  # prompt 2: new text


def test_parsers():
    assert parse_depths("10,30%, 90") == (10, 30, 90)
    assert parse_lengths("4096,8K,16k") == (4096, 8192, 16384)
    assert parse_budgets("256,1024,10%") == ("256", "1024", "10%")
    for bad in ("", "x", "10,-5", "150", "1.5"):
        with pytest.raises(ValueError, match="--passkey-depths"):
            parse_depths(bad)
    for bad in ("", "4q", "100", "8K,12"):
        with pytest.raises(ValueError, match="--passkey-lengths"):
            parse_lengths(bad)
    for bad in ("0", "10%%", "abc"):
        with pytest.raises(ValueError, match="--passkey-budgets"):
            parse_budgets(bad)


@pytest.mark.parametrize("flag, value", [("--passkey-depths", "10,abc"), ("--passkey-depths", "120"),
                                         ("--passkey-lengths", "4K,x"), ("--passkey-lengths", "64"),
                                         ("--passkey-budgets", "0%")])
def test_cli_rejects_bad_values_with_exit_code_2(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["eval", "kv-evict", flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_cli_rejects_a_length_past_max_model_len(tiny, capsys):
    # the tiny model's max_model_len is 512: 510 prompt tokens + 8 answer tokens do not fit
    assert main(["eval", "kv-evict", "--model", tiny, "--passkey-lengths", "510", "--policies", "none"]) == 2
    assert "--passkey-lengths 510" in capsys.readouterr().err


def test_depth_run_writes_table_json_and_counts_every_cell(tiny, tmp_path, capsys):
    prefix = str(tmp_path / "depth")
    assert main(["eval", "kv-evict", "--model", tiny, "--block-size", "4", "--passkey-lengths", "300,400",
                 "--passkey-depths", "10,90", "--passkey-budgets", "64,50%", "--passkey-prompts", "1",
                 "--policies", "streaming,snapkv", "--save", prefix]) == 0
    out = capsys.readouterr().out
    assert "| full cache | 100% |" in out and "| snapkv | 50% |" in out and "300@90%" in out
    data = json.load(open(prefix + ".json"))
    assert open(prefix + ".txt").read().strip() == out.strip()
    cells = data["cells"]
    # full cache: 2 lengths x 2 depths; each policy: 2 budgets x 2 lengths x 2 depths; one prompt each
    assert len(cells) == 4 + 2 * 8 and all(c["total"] == 1 and len(c["answers"]) == 1 for c in cells)
    assert {c["kept_tokens"] for c in cells if c["budget"] == "50%"} == {148, 200}  # whole blocks of 4
    assert data["refused"] == {}
    merged = merge_results([data, {**data, "lengths": [500], "cells": [{**c, "length": 500} for c in cells if c["length"] == 300]}])
    assert merged.lengths == (300, 400, 500) and merged.found("snapkv", "50%", 500) == merged.found("snapkv", "50%", 300)
    assert "500@90%" in render_depth_table(merged, "tiny")


def test_a_refused_policy_is_reported_and_the_rest_runs(tiny_model_factory, capsys):
    path, _ = tiny_model_factory("mistral_swa")  # every layer windowed: the engine refuses eviction
    assert main(["eval", "kv-evict", "--model", path, "--block-size", "4", "--passkey-lengths", "300",
                 "--passkey-depths", "50", "--passkey-budgets", "64", "--passkey-prompts", "1",
                 "--policies", "snapkv", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "sliding window" in data["refused"]["snapkv"]
    assert [(c["policy"], c["total"]) for c in data["cells"]] == [("full cache", 1)]
