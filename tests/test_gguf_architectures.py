"""GGUF loading of Gemma 2, Gemma 3, DeepSeek-V2/V3 and of sentencepiece ("llama") GGUF tokenizers.

Each tiny random HF model is written as GGUF the way llama.cpp's converter does
(tests/gguf_export.py: Gemma norms stored as w + 1, DeepSeek experts stacked and
kv_b_proj kept or split into k_b/v_b, f32 tensors). kvforge loads the GGUF and must
reproduce the original weights, the HF config facts it runs on, and transformers'
greedy tokens (a batch of prompts longer than Gemma's window) and logits (fp32).
Sentencepiece tokenizers are checked against sentencepiece itself (the reference
llama.cpp imitates), transformers' GGUF conversion and hand-worked cases.
"""
from __future__ import annotations

import io
import os

import pytest
import torch
from gguf import GGUFReader
from safetensors.torch import load_file

from conftest import assert_no_leaks
from gguf_export import (export_model, sentencepiece_vocab, tiny_spm_vocab, write_metadata_only,
                         write_spm_tokenizer_gguf)
from kvforge import LLM, SamplingParams
from kvforge.config import ModelConfig
from kvforge.engine.detokenizer import IncrementalDetokenizer
from kvforge.models.gemma import rope_by_layer_type
from kvforge.models.loader import load_checkpoint
from kvforge.tokenizer import Tokenizer
from tiny_models import FAMILIES, VOCAB, build_tiny_model, hf_greedy, write_byte_tokenizer

transformers = pytest.importorskip("transformers")

PROMPTS = [list(range(10, 60)), [5, 17, 99, 3, 8, 200, 45], [i % 250 for i in range(31, 71)]]
NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)



@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a busy 2-core machine spinning threads cost 100x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# id -> (tiny_models family or "deepseek_v3", GGUF arch, config overrides, export options)
CASES = {
    # GGUF has no query_pre_attn_scalar (llama.cpp: head_dim below 27B); Gemma 2's converter drops lm_head
    "gemma2": ("gemma2", "gemma2", {"query_pre_attn_scalar": 16, "tie_word_embeddings": True}, {}),
    # llama.cpp hard-codes Gemma 3's pattern (5 local, 1 global); global rope linear x8, untied lm_head
    "gemma3": ("gemma3_linear", "gemma3", {"num_hidden_layers": 6, "sliding_window_pattern": 6,
                                           "final_logit_softcapping": 10.0}, {}),
    "deepseek_v2-kv_b": ("deepseek_v2", "deepseek2", {}, {"split_kv_b": False}),
    "deepseek_v2_yarn-k_b_v_b": ("deepseek_v2_yarn", "deepseek2", {}, {"split_kv_b": True}),
    "deepseek_v3-k_b_v_b": ("deepseek_v3", "deepseek2", {}, {"split_kv_b": True}),
}


def _build_deepseek_v3(path: str):
    """DeepSeek-V3 routing (sigmoid, noaux_tc, score-correction bias), which llama.cpp files as deepseek2.

    The tiny V2 (q_lora, YaRN-free) shapes, with V3's grouped routing over 8 experts.
    """
    mla = {k: v for k, v in FAMILIES["deepseek_v2_yarn"][1].items() if k not in ("topk_method", "rope_parameters")}
    cfg = transformers.DeepseekV3Config(**{
        **mla, "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "n_routed_experts": 8, "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
        "max_position_embeddings": 512, "rope_interleave": True, "bos_token_id": None, "eos_token_id": 256,
        "pad_token_id": None, "tie_word_embeddings": False})
    torch.manual_seed(1)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # random weights and a non-zero routing bias, as build_tiny_model does for others
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    """(case, HF folder, GGUF path, transformers model) with random norm weights, so (1 + w) and +1 matter."""
    family, arch, overrides, export_kw = CASES[request.param]
    folder = str(tmp_path_factory.mktemp(request.param))
    if family == "deepseek_v3":
        hf = _build_deepseek_v3(folder)
    else:
        hf = build_tiny_model(folder, family, **overrides)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if arch.startswith("gemma") else 1.0, 0.3)
    hf.save_pretrained(folder)
    gguf = export_model(folder, hf.config, os.path.join(folder, "model.gguf"), arch, **export_kw)
    return request.param, folder, gguf, hf


def test_weights_round_trip(converted):
    """Every HF tensor comes back (norm -1, experts unstacked, kv_b rejoined) from a GGUF that really differs."""
    case, folder, gguf, _ = converted
    want = load_file(os.path.join(folder, "model.safetensors"))
    got = load_checkpoint(gguf).weights
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, atol=1e-6, rtol=0, msg=name)
    stored = {t.name: t for t in GGUFReader(gguf).tensors}  # guard against a vacuous round trip
    assert any(n.endswith("_exps.weight") for n in stored) == case.startswith("deepseek")
    assert ("blk.0.attn_k_b.weight" in stored) == ("k_b_v_b" in case)
    assert ("blk.0.attn_kv_b.weight" in stored) == case.endswith("-kv_b")
    if case.startswith("gemma"):
        raw_norm = torch.from_numpy(stored["blk.0.ffn_norm.weight"].data.copy())
        torch.testing.assert_close(raw_norm, want["model.layers.0.pre_feedforward_layernorm.weight"] + 1)


def _ropes(cfg: ModelConfig) -> dict:
    """(theta, scaling type, factor) per layer type; the two config spellings differ only in form."""
    return {kind: (theta, (s or {}).get("rope_type"), (s or {}).get("factor"))
            for kind, (theta, s) in rope_by_layer_type(cfg).items()}


def _fields(cfg: dict, names: tuple[str, ...]) -> dict:
    """The named entries; an absent expert group count means one group (as kvforge's router reads it)."""
    return {k: cfg.get(k) or (1 if k in ("n_group", "topk_group") else cfg.get(k)) for k in names}


_DEEPSEEK_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                    "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                    "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group")


def test_config_matches_hf(converted):
    """The synthesized config gives kvforge the same model facts as the original config.json."""
    case, folder, gguf, hf = converted
    ours = ModelConfig.from_hf(load_checkpoint(gguf).hf_config)
    ref = ModelConfig.from_hf(hf.config.to_dict())
    assert (ours.architecture, ours.model_type) == (ref.architecture, ref.model_type)
    for attr in ("num_layers", "num_heads", "head_dim", "sliding_windows", "mla_latent_dim",
                 "tie_word_embeddings", "intermediate_size", "rms_norm_eps"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    if not ref.mla_latent_dim:  # MLA ignores it (and HF's V3 config default of 128 is meaningless here)
        assert ours.num_kv_heads == ref.num_kv_heads
    if case.startswith("gemma"):
        assert _ropes(ours) == _ropes(ref)
        for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            assert ours.extra.get(key) == ref.extra.get(key), key
    else:
        assert _fields(ours.extra, _DEEPSEEK_FIELDS) == _fields(ref.extra, _DEEPSEEK_FIELDS)
        expected_method = ref.extra.get("topk_method") or "noaux_tc"  # HF's V3 config has none: noaux_tc
        assert ours.extra["topk_method"] == expected_method
        if ref.rope_scaling:
            assert ours.rope_scaling["rope_type"] == ref.rope_scaling["rope_type"]
            numeric = {k: v for k, v in ref.rope_scaling.items() if k != "rope_type"}
            assert {k: ours.rope_scaling[k] for k in numeric} == pytest.approx(numeric)
        else:
            assert ours.rope_scaling is None


def test_greedy_and_logits_match_transformers(converted):
    _, _, gguf, hf = converted
    llm = LLM(model=gguf, log_ledger=False, dtype="float32", num_kv_blocks=64, block_size=4)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, NEW) for p in PROMPTS]
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPTS[0]])).logits[0]
    assert (llm.engine.prompt_logits(PROMPTS[0]) - expected).abs().max().item() < 1e-4
    assert_no_leaks(llm.engine)


# ---- hyper-parameters llama.cpp implies instead of storing ------------------------------


def _gemma_meta(layers: int, hidden: int, heads: int, head_dim: int, **extra) -> dict:
    return {"block_count": layers, "embedding_length": hidden, "feed_forward_length": 4 * hidden,
            "attention.head_count": heads, "attention.head_count_kv": heads // 2, "attention.key_length": head_dim,
            "attention.value_length": head_dim, "vocab_size": 1000, **extra}


@pytest.mark.parametrize(("arch", "layers", "hidden", "heads", "head_dim", "extra", "scalar", "windows"), [
    # 27B sizes: scale by hidden/heads (HF's query_pre_attn_scalar 144 and 168), not head_dim 128
    ("gemma2", 46, 4608, 32, 128, {}, 144, [4096, None] * 23),  # no window stored: llama.cpp's 4096
    ("gemma3", 62, 5376, 32, 128, {"attention.sliding_window": 1024, "rope.freq_base_swa": 20000.0},
     168, ([1024] * 5 + [None]) * 10 + [1024] * 2),
    ("gemma3", 26, 1152, 4, 256, {}, 256, []),  # no window stored: every layer global
])
def test_gemma_implied_hyperparameters(tmp_path, arch, layers, hidden, heads, head_dim, extra, scalar, windows):
    path = write_metadata_only(str(tmp_path / "meta.gguf"), arch, _gemma_meta(layers, hidden, heads, head_dim,
                                                                               **extra))
    from kvforge.models.gguf_loader import gguf_hf_config

    cfg = ModelConfig.from_hf(gguf_hf_config(GGUFReader(path)))
    assert cfg.extra["query_pre_attn_scalar"] == scalar
    assert list(cfg.sliding_windows) == windows
    if arch == "gemma3":
        local = extra.get("rope.freq_base_swa", 10000.0)
        assert rope_by_layer_type(cfg)["sliding_attention"][0] == local


# ---- sentencepiece ("llama") tokenizers ---------------------------------------------------

CORPUS = """The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.
A naïve café owner in 東京 serves crème brûlée and coffee every morning 😀.
Tokenizers split text into pieces: words, subwords, and sometimes single bytes.
    Indented lines, double  spaces, and trailing spaces   matter to sentencepiece.
Numbers like 12345 and 3.14159 appear too, with punctuation!? (and brackets).
東京 is the capital of Japan; Paris is the capital of France. Café au lait, s'il vous plaît.
""" * 3
TEXTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "naïve café 東京 😀", "東京東京 is 12345 3.14159",
    "line\nbreak\n\n", "a  b   c", "trailing   ", "\ttab", "Ω unseen 🙂 ∑", "",
    " ", "  two leading spaces", " one leading",
]
LEADING_SPACE = {" ", "  two leading spaces", " one leading"}


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """(sentencepiece processor, kvforge Tokenizer from its GGUF, GGUF path): a BPE model trained like Llama's."""
    sentencepiece = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()), model_writer=buf, vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, character_coverage=1.0, allow_whitespace_only_pieces=True, split_digits=True,
        user_defined_symbols=["<tool>"], unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=1)
    sp = sentencepiece.SentencePieceProcessor(model_proto=buf.getvalue())
    tokens, scores, types = sentencepiece_vocab(sp, user_defined=frozenset({"<tool>"}))
    path = write_spm_tokenizer_gguf(str(tmp_path_factory.mktemp("spm") / "tok.gguf"), tokens, scores, types,
                                    bos=1, eos=2, unk=0)
    return sp, Tokenizer.from_gguf(GGUFReader(path)), path


def test_spm_tokenizer_matches_sentencepiece(spm):
    """Ids, decoded text and round trips equal sentencepiece's (spaces, newlines, byte fallback, CJK, emoji)."""
    sp, tok, _ = spm
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids) == text
    assert tok.encode("Hello") == [1, *sp.encode("Hello")]  # llama.cpp adds BOS unless the file says not to
    assert tok.decode([1, *sp.encode("Hello"), 2]) == "Hello"
    unseen = tok.encode("Ω", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in unseen] == ["\u2581", "<0xCE>", "<0xA9>"]


def test_spm_streaming_detokenization(spm):
    """Streamed one id at a time (byte pieces split characters), the text equals the whole decode."""
    _, tok, _ = spm
    text = "Hello world, naïve 東京 😀 Ω  end"
    ids = tok.encode(text, add_special_tokens=False)
    for cut in (0, 3):  # no prompt (the prefix space is dropped) / a prompt ending mid-word
        detok = IncrementalDetokenizer(tok, ids[:cut])
        streamed = "".join(detok.push([i]) for i in ids[cut:]) + detok.flush()
        assert tok.decode(ids[:cut]) + streamed == text


def test_spm_tokenizer_matches_transformers_gguf(spm):
    """transformers' own GGUF conversion agrees on text that does not start with a space.

    (On leading spaces its Metaspace adds no dummy "▁" before an existing one; sentencepiece and
    llama.cpp do, and the test above holds kvforge to them.)
    """
    sp, tok, path = spm
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in TEXTS:
        if text not in LEADING_SPACE:
            assert tok.encode(text) == ref.encode(text), text
            assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)


def test_spm_special_and_user_defined_tokens(spm):
    """Control and user-defined tokens are matched whole; the text after them gets llama.cpp's space prefix."""
    sp, tok, _ = spm
    tool, eos = sp.piece_to_id("<tool>"), 2
    ids = tok.encode("call<tool>now</s>", add_special_tokens=False)
    assert ids == [*sp.encode("call"), tool, *sp.encode("now"), eos]
    assert tok.decode(ids) == "call<tool> now"  # eos skipped; "now" was encoded as " now", as llama.cpp does
    assert tok.decode(ids, skip_special_tokens=False) == "call<tool> now</s>"
    assert eos in tok.all_special_ids and tool not in tok.all_special_ids


def test_spm_flags_and_hand_worked_merges(tmp_path):
    """A tiny vocabulary where merges follow scores, bytes fill gaps, and the GGUF flags are honoured."""
    tokens, scores, types = tiny_spm_vocab(300)
    plain = Tokenizer.from_gguf(GGUFReader(write_spm_tokenizer_gguf(
        str(tmp_path / "a.gguf"), tokens, scores, types, bos=2, eos=1, unk=3)))
    ids = plain.encode("the  é", add_special_tokens=False)
    # ▁t (best score) then ▁th then ▁the; no "▁▁" piece; é is not a piece -> its two UTF-8 bytes
    assert [plain.id_to_token(i) for i in ids] == ["\u2581the", "\u2581", "\u2581", "<0xC3>", "<0xA9>"]
    assert plain.decode(ids) == "the  é"
    flagged = Tokenizer.from_gguf(GGUFReader(write_spm_tokenizer_gguf(
        str(tmp_path / "b.gguf"), tokens, scores, types, bos=2, eos=1, unk=3, add_space_prefix=False,
        add_bos=False, add_eos=True)))
    ids = flagged.encode("the")
    assert [flagged.id_to_token(i) for i in ids] == ["th", "e", "<eos>"]  # no prefix, no BOS, EOS appended
    assert flagged.decode(ids) == "the" and flagged.encode("the", add_special_tokens=False) == ids[:-1]


def test_spm_merges_rank_by_score_over_every_split(tmp_path):
    """Scores, not ids, order the merges, and a piece forms from any two pieces it splits into."""
    chars = list("abcxyz")
    pieces = [("xy", -6.0), ("yz", -2.0),  # "yz" scores better though listed later: x|yz, not xy|z
              ("ab", -1.0), ("bc", -5.0), ("abc", -3.0)]  # "abc" from ab+c, its second split, not a+bc
    tokens = ["<unk>", "<s>", "</s>", *chars, *(p for p, _ in pieces)]
    scores = [0.0, 0.0, 0.0, *[-10.0] * len(chars), *(s for _, s in pieces)]
    types = [2, 3, 3, *[1] * (len(chars) + len(pieces))]
    tok = Tokenizer.from_gguf(GGUFReader(write_spm_tokenizer_gguf(
        str(tmp_path / "m.gguf"), tokens, scores, types, bos=1, eos=2, unk=0, add_space_prefix=False)))
    spell = [tok.id_to_token(i) for i in tok.encode("xyz abc", add_special_tokens=False)]
    assert spell == ["x", "yz", "<unk>", "abc"]  # no "▁" piece and no byte pieces: unknown


# ---- bad input -----------------------------------------------------------------------------


def test_unsupported_architecture_and_tokenizer_are_named(tmp_path):
    path = write_metadata_only(str(tmp_path / "mamba.gguf"), "mamba", {"block_count": 1})
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'.*deepseek2.*gemma2.*gemma3"):
        load_checkpoint(path)
    path = write_metadata_only(str(tmp_path / "bert.gguf"), "gemma2", {"block_count": 1},
                               tokenizer={"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="tokenizer model 'bert' is not supported"):
        Tokenizer.from_gguf(GGUFReader(path))


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_gemma3_five_bit_blocks_run_on_their_own_codes(tmp_path, qtype):
    """llama.cpp's Q4_K_M files store rows that are not whole 256-weight super-blocks as Q5_0 (Gemma 3 270M's q,
    k, gate and up); Q5_1 / Q5_K files are five-bit throughout. `quantization="gguf"` keeps them as int8 codes
    in groups of 32 (Q5_1 / Q5_K with an offset per group): every linear layer runs on the file's own codes,
    and the greedy tokens equal those of the same file dequantized to fp32 and run by the float kernels."""
    from gguf import GGMLQuantizationType

    from kvforge.models.linear import Linear

    hf = build_tiny_model(str(tmp_path), "gemma3_linear", num_hidden_layers=2, sliding_window_pattern=2)
    path = export_model(str(tmp_path), hf.config, str(tmp_path / f"{qtype}.gguf"), "gemma3",
                        quantize=GGMLQuantizationType[qtype])
    assert {t.tensor_type.name for t in GGUFReader(path).tensors if t.name.startswith("blk.") and
            len(t.shape) == 2} == {qtype}
    opts = dict(dtype="float32", enable_prefix_caching=False, num_kv_blocks=32, log_ledger=False)
    kept, dense = LLM(model=path, quantization="gguf", **opts), LLM(model=path, **opts)
    layers = [m for n, m in kept.engine.model.named_modules() if isinstance(m, Linear) and ".layers." in n]
    assert layers and all(m.quant_weight is not None and m.quant_weight.bits == 8 and m.quant_weight.group == 32
                          for m in layers)
    got = [o.outputs[0].token_ids for o in kept.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
    want = [o.outputs[0].token_ids for o in dense.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
    assert got == want
