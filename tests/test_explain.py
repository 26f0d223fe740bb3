"""Prefix-miss diagnosis: `kvforge.kv.explain`, `LLM.explain_prefix_miss` and `kvforge cache explain`.

The pure tests use one token per character, so every index below can be checked by eye.
"""
from __future__ import annotations

import json

import pytest

from kvforge.cli import main
from kvforge.kv.explain import explain

SYSTEM = "You are a helpful assistant for ACME. Follow the policies below carefully and cite sources. " * 2


def enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def dec(ids) -> str:
    return "".join(map(chr, ids))


def _explain(a: str, b: str, block_size: int = 16, **kw):
    return explain(enc(a), enc(b), block_size, dec, a, b, **kw)


def test_divergence_token_block_and_hits():
    a, b = "abcdefgh" * 4 + "X-tail", "abcdefgh" * 4 + "Y-tail"
    r = _explain(a, b, block_size=8)
    assert (r.common_tokens, r.diverge_token, r.diverge_block) == (32, 32, 4)
    assert (r.token_a, r.token_b) == (ord("X"), ord("Y"))
    assert r.hit_blocks == 4 and r.hit_tokens == 32
    assert r.text_before == "abcdefgh" and r.text_a == "X-tail" and r.text_b == "Y-tail"
    assert "index 32 in block 4" in r.render()


def test_hits_stop_at_the_block_holding_the_first_difference():
    a = "0123456789abcdefghij"
    b = "0123456789abcdeZghij"  # differs at 15: block 3 of 4-token blocks
    r = _explain(a, b, block_size=4)
    assert (r.diverge_token, r.diverge_block, r.hit_blocks) == (15, 3, 3)


def test_identical_prompts_recompute_the_last_token_and_salt_isolates():
    r = _explain("x" * 32, "x" * 32, block_size=8)
    assert r.diverge_token is None and r.hit_blocks == 3 and r.prompt_blocks_b == 3
    assert "always recomputed" in r.render()
    salted = _explain("x" * 32, "x" * 32, block_size=8, salt_a="tenant-a", salt_b="tenant-b")
    assert salted.hit_blocks == 0 and salted.salt_differs and "cache_salt differs" in salted.render()
    assert _explain("x" * 32, "x" * 32, block_size=8, salt_a="t", salt_b="t").hit_blocks == 3


def test_prefix_prompt_extends_the_other():
    r = _explain("y" * 20, "y" * 40, block_size=8)
    assert r.diverge_token is None and r.hit_blocks == 2  # A holds only 2 full blocks


@pytest.mark.parametrize(
    "head_a, head_b, kind",
    [
        ("Time 10:42:07\n", "Time 10:43:15\n", "timestamp"),
        ("Session 3f2b8c1e-1a2b-4c3d-8e9f-0a1b2c3d4e5f.\n", "Session 9a8b7c6d-5e4f-4a3b-2c1d-0e9f8a7b6c5d.\n", "uuid"),
        ("Date 2024-05-01.\n", "Date 2024-05-02.\n", "timestamp"),
        ("Turn 7 follows.\n", "Turn 8 follows.\n", "counter"),
        ("System rules. \n", "System rules.\n", "whitespace"),
    ],
)
def test_dynamic_first_block_is_flagged(head_a, head_b, kind):
    r = _explain(head_a + SYSTEM + "User: hi", head_b + SYSTEM + "User: hello")
    assert r.diverge_block == 0 and r.hit_blocks == 0
    assert r.dynamic is not None and r.dynamic.kind.startswith(kind)
    assert r.dynamic.lost_blocks >= (len(SYSTEM) // 16) - 1
    assert len(r.warnings) == 1 and "first block" in r.warnings[0] and "Move dynamic content" in r.warnings[0]


def test_no_dynamic_warning_when_prompts_simply_differ_at_the_end():
    r = _explain(SYSTEM + "User: what is the capital of France?", SYSTEM + "User: how tall is Everest?")
    assert r.dynamic is None and not r.warnings and r.hit_blocks == len(SYSTEM + "User: ") // 16


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="block_size"):
        explain([1, 2], [1, 2], 0)
    with pytest.raises(ValueError, match="prompt B"):
        explain([1, 2], [], 4)


# ---- through a real tokenizer: the LLM entry and the CLI -----------------------------------------------
def test_llm_explain_prefix_miss_uses_engine_tokenizer_and_block_size(tiny_model_factory):
    from kvforge import LLM

    path, _ = tiny_model_factory("llama_gqa")
    llm = LLM(model=path, num_kv_blocks=128, block_size=4, log_ledger=False)
    a = "Current time: 10:42:07\n" + SYSTEM
    b = "Current time: 10:43:15\n" + SYSTEM
    r = llm.explain_prefix_miss(a, b)
    assert r.block_size == 4 and r.diverge_token == a.index("2:07") and r.dynamic.kind == "timestamp"
    # the diagnosis agrees with what the cache really does
    llm.generate(a)
    (out,) = llm.generate(b)
    assert out.num_cached_tokens == r.hit_tokens


def test_cli_cache_explain_text_json_files_and_errors(tiny_model_factory, tmp_path, capsys):
    path, _ = tiny_model_factory("llama_gqa")
    a, b = "Time 10:42:07\n" + SYSTEM, "Time 10:43:15\n" + SYSTEM
    assert main(["cache", "explain", a, b, "--model", path, "--block-size", "4"]) == 0
    text = capsys.readouterr().out
    assert "first differing token: index 9 in block 2" in text and "timestamp" in text
    (tmp_path / "a.txt").write_text(a)
    (tmp_path / "b.txt").write_text(b)
    assert main(["cache", "explain", "--file-a", str(tmp_path / "a.txt"), "--file-b", str(tmp_path / "b.txt"),
                 "--model", path, "--block-size", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["diverge_token"], report["diverge_block"], report["hit_blocks"]) == (9, 2, 2)
    assert report["dynamic"]["kind"] == "timestamp" and report["warnings"]
    assert main(["cache", "explain", a, "--model", path]) == 2
    assert "prompt B is missing" in capsys.readouterr().err
    assert main(["cache", "explain", a, b, "--model", path, "--block-size", "0"]) == 2
    assert "--block-size" in capsys.readouterr().err
    assert main(["cache", "explain", a, "--file-b", str(tmp_path / "nope.txt"), "--model", path]) == 2
    assert "--file-b" in capsys.readouterr().err
