"""One KV format grammar: engine config, `kvforge plan` and `kvforge eval` read every spelling alike.

`kvforge.ledger.parse_kv_format` owns the alias table; these properties run over every
canonical name, every alias, case and spaces, K/V pairs and @SCALES suffixes, and check
that the three callers resolve each to the same KVCacheFormat and reject the same bad input
with an error naming their own field or flag.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.config import KV_CACHE_DTYPES, CacheConfig
from kvforge.evaluation.kv_quant import Variant
from kvforge.ledger import (
    KV_DTYPE_ALIASES, KV_FORMAT_DTYPES, KV_SCALE_GRANULARITIES, KVCacheFormat, canonical_kv_dtype, parse_kv_format,
)
from kvforge.planner.specs import format_label, plan_kv_format

SPELLINGS = KV_FORMAT_DTYPES + tuple(KV_DTYPE_ALIASES)
MODEL_DTYPES = ("float32", "bfloat16", "float16")


def _cased(name: str, data: st.DataObject) -> str:
    upper = data.draw(st.lists(st.booleans(), min_size=len(name), max_size=len(name)))
    return "".join(c.upper() if u else c for c, u in zip(name, upper))


def _engine(k: str, v: str, scales: str | None, model_dtype: str) -> KVCacheFormat:
    cfg = CacheConfig(kv_cache_dtype="auto", k_cache_dtype=k, v_cache_dtype=v, kv_cache_scale=scales)
    return cfg.cache_format(model_dtype)


def _eval(spec: str, model_dtype: str) -> KVCacheFormat:
    return CacheConfig(**Variant.parse(spec).engine_changes()).cache_format(model_dtype)


def test_alias_table_maps_onto_canonical_names_only():
    assert set(KV_DTYPE_ALIASES.values()) <= set(KV_FORMAT_DTYPES) - {"auto"}
    assert not set(KV_DTYPE_ALIASES) & set(KV_FORMAT_DTYPES)
    assert canonical_kv_dtype("fp8") == canonical_kv_dtype("FP8_E4M3") == "fp8_e4m3"
    assert set(KV_CACHE_DTYPES) == set(SPELLINGS)  # the engine's CLI choices are the same table


@settings(max_examples=150, deadline=None)
@given(st.data(), st.sampled_from(SPELLINGS), st.sampled_from(SPELLINGS),
       st.sampled_from((None, *KV_SCALE_GRANULARITIES)), st.sampled_from(MODEL_DTYPES), st.booleans())
def test_engine_planner_and_eval_agree_on_every_spelling(data, k, v, scales, model_dtype, split):
    body = f"{_cased(k, data)}/{_cased(v, data)}" if split else _cased(k, data)
    v = v if split else k
    spec = f" {body}@{scales} " if scales else body
    parsed = parse_kv_format(spec)
    assert (parsed.k_dtype, parsed.v_dtype) == (canonical_kv_dtype(k), canonical_kv_dtype(v))
    engine = _engine(k, v, scales, model_dtype)
    assert plan_kv_format(spec, model_dtype) == engine == _eval(spec, model_dtype)
    assert engine.k_dtype in KV_FORMAT_DTYPES and engine.v_dtype in KV_FORMAT_DTYPES  # canonical, never an alias


@pytest.mark.parametrize("spec", ["fp7", "int3/fp16", "fp8@block", "a/b/c", "fp8/", "", "@token"])
def test_the_three_callers_reject_alike_naming_their_field(spec):
    for call, field in ((lambda: plan_kv_format(spec, "float16"), "--kv-cache-dtype"),
                        (lambda: Variant.parse(spec), "--formats item"),
                        (lambda: parse_kv_format(spec, "kv_cache_dtype"), "kv_cache_dtype")):
        with pytest.raises(ValueError, match="is not supported; choose one of|must be one of|expected KDTYPE") as exc:
            call()
        assert str(exc.value).startswith(f"{field} ")
    with pytest.raises(ValueError, match="^k_cache_dtype 'fp7': dtype 'fp7' is not supported"):
        CacheConfig(k_cache_dtype="fp7")


def test_table_labels_keep_short_names():
    assert format_label(plan_kv_format("fp8_e4m3", "bfloat16")) == "fp8"
    assert format_label(plan_kv_format("FP8/fp16@tensor", "bfloat16")) == "fp8/fp16@tensor"
    assert format_label(plan_kv_format("auto", "bfloat16")) == "bf16"
