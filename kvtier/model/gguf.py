"""Load a llama.cpp GGUF file as a ModelSpec, float32 Hugging Face-named weights and a Tokenizer.

Primitives: `load_gguf(path)` reads the file once with `gguf.GGUFReader`; `_spec` maps metadata to
hyperparameters, `_weights` dequantizes and renames tensors (undoing llama.cpp's Q/K row
permutation), `_tokenizer` rebuilds the tokenizer from metadata: byte-level BPE for
`tokenizer.ggml.model == "gpt2"`, SentencePiece-style BPE with byte fallback for `"llama"`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import tokenizers
import torch
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers.models import BPE

from kvtier.errors import ModelLoadError
from kvtier.model.loaded import SUPPORTED_ARCHITECTURES as ARCHITECTURES
from kvtier.model.loaded import LoadedModel, weights_digest
from kvtier.model.spec import ModelSpec
from kvtier.model.tokenizer import Tokenizer, byte_alphabet

_PERMUTED = ("llama", "mistral")  # llama.cpp's converter permutes Q/K rows for these only
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ROPE_FREQS = "rope_freqs.weight"  # llama3 rope: per-frequency divisors instead of config keys
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regex its merges were learned with (absent: GPT-2's own regex).
_PRE_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def load_gguf(path: Path) -> LoadedModel:
    """Read `path` fully into memory as float32 tensors; the file is not needed afterwards."""
    reader = _open(path)
    arch = _get(reader, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"'{path}' holds a '{arch}' model; kvtier runs GGUF architectures "
            f"{', '.join(ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    try:
        tokenizer = _tokenizer(reader, path)
        spec = _spec(reader, arch, tensors, path)
        weights = _weights(tensors, spec, path)
    except (ValueError, IndexError, KeyError, TypeError, OSError) as e:
        # metadata of the wrong type, token ids past the vocabulary, tensor shapes that disagree
        raise ModelLoadError(
            f"malformed GGUF file '{path}' ({type(e).__name__}: {e}); re-convert or re-download it"
        ) from e
    return LoadedModel(spec, weights, tokenizer, weights_digest([path]), str(path))


def _open(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the parser raises anything from ValueError to struct.error
        raise ModelLoadError(
            f"cannot read '{path}' as a GGUF file ({type(e).__name__}: {e}); is it a complete, "
            "uncorrupted llama.cpp model file?"
        ) from e


_MISSING: Any = object()


def _get(reader: gguf.GGUFReader, key: str, path: Path, default: Any = _MISSING) -> Any:
    field = reader.fields.get(key)
    if field is not None:
        return field.contents()
    if default is _MISSING:
        raise ModelLoadError(f"GGUF file '{path}' lacks metadata key '{key}'; re-convert the model")
    return default


def _spec(reader: gguf.GGUFReader, arch: str, tensors: dict[str, Any], path: Path) -> ModelSpec:
    def get(key: str, default: Any = _MISSING) -> Any:
        return _get(reader, f"{arch}.{key}", path, default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", 0) or get("rope.dimension_count", 0) or 0)
    head_dim = head_dim or hidden // heads
    rotary = get("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ModelLoadError(
            f"'{path}' rotates {rotary} of {head_dim} head dims; kvtier supports full rotary only"
        )
    vocab = get("vocab_size", None)  # else the embedding's rows, else the token list's length
    if not vocab and "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    vocab = vocab or len(_get(reader, "tokenizer.ggml.tokens", path, ()))
    theta = _f32(get("rope.freq_base", 10000.0))
    return ModelSpec(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(get, tensors, theta, head_dim, path),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        name=str(_get(reader, "general.name", path, "") or path.stem),
    )


def _f32(value: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(
    get: Any, tensors: dict[str, Any], theta: float, head_dim: int, path: Path
) -> dict[str, Any] | None:
    """HF-style rope_scaling from `rope.scaling.*` keys or a llama3 `rope_freqs` tensor."""
    original = get("rope.scaling.original_context_length", None)
    if _ROPE_FREQS in tensors:
        divisors = np.asarray(gguf.quants.dequantize(tensors[_ROPE_FREQS].data,
                                                     tensors[_ROPE_FREQS].tensor_type))
        return _llama3_from_divisors(divisors.astype(np.float64), theta, head_dim, original, path)
    kind = get("rope.scaling.type", None)
    factor = get("rope.scaling.factor", None) or get("rope.scale_linear", None)
    if kind == "none" or (kind is None and not factor):
        return None
    if kind in (None, "linear"):  # None: older files wrote only `rope.scale_linear`
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": _f32(factor)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise ModelLoadError(
        f"'{path}' uses rope scaling '{kind}'; kvtier supports none, linear, yarn and llama3"
    )


def _llama3_from_divisors(
    divisors: np.ndarray, theta: float, head_dim: int, original: int | None, path: Path
) -> dict[str, Any] | None:
    """Recover Llama-3 rope parameters from llama.cpp's per-frequency divisors, checking the fit.

    Only ratios of (original context, low, high) are observable, so the usual Llama-3.x choice
    is tried and accepted only if it reproduces every stored divisor.
    """
    if np.allclose(divisors, 1.0):
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = _f32(divisors.max())
    for context in dict.fromkeys([int(original or 8192), 8192]):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0)):
            scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                       "high_freq_factor": high, "original_max_position_embeddings": context}
            if divisors.shape == inv_freq.shape and np.allclose(
                llama3_divisors(inv_freq, scaling), divisors, rtol=1e-4
            ):
                return scaling
    raise ModelLoadError(
        f"'{path}' stores llama3 rope frequencies ({_ROPE_FREQS}) that match no known Llama-3 "
        "rope scaling; llama3 rope from this GGUF is not supported yet, load the Hugging Face "
        "directory instead"
    )


def llama3_divisors(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    """What Llama-3 rope divides each base frequency by (1 for short waves, `factor` for long)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv_freq
    smooth = np.clip((context / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / factor + smooth)


def _weights(tensors: dict[str, Any], spec: ModelSpec, path: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name == _ROPE_FREQS:
            continue
        hf_name = _hf_name(name, path)
        w = _dequantize(tensor, path)
        if spec.architecture in _PERMUTED and ".q_proj." in hf_name:
            w = unpermute_rows(w, spec.num_attention_heads)
        elif spec.architecture in _PERMUTED and ".k_proj." in hf_name:
            w = unpermute_rows(w, spec.num_key_value_heads)
        weights[hf_name] = torch.from_numpy(w)
    return weights


def _hf_name(name: str, path: Path) -> str:
    block = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if block and block[2] in _BLOCK_NAMES:
        return f"model.layers.{block[1]}.{_BLOCK_NAMES[block[2]]}.{block[3]}"
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ModelLoadError(
        f"GGUF file '{path}' has tensor '{name}', which a llama/mistral/qwen2 decoder does not use"
    )


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    """float32 array in torch layout: GGUF lists dims innermost-first, so the shape is reversed."""
    try:
        flat = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(
            f"tensor '{tensor.name}' in '{path}' is {tensor.tensor_type.name}, which gguf "
            "cannot dequantize; use a file quantized as F32/F16/BF16/Q8_0/Q4_0/Q4_1/K-quants"
        ) from e
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.array(flat, dtype=np.float32).reshape(shape)  # a copy: the reader's map is read-only


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of the two rotary halves (rows of a Q/K weight or bias).

    llama.cpp stored `w.reshape(n_head, 2, r, ...).swapaxes(1, 2)`; this is its inverse.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer(reader: gguf.GGUFReader, path: Path) -> Tokenizer:
    kind = _get(reader, "tokenizer.ggml.model", path)
    tokens: list[str] = list(_get(reader, "tokenizer.ggml.tokens", path))
    types = list(_get(reader, "tokenizer.ggml.token_type", path, [1] * len(tokens)))
    merges = _get(reader, "tokenizer.ggml.merges", path, None)
    if kind == "gpt2":
        backend = _byte_level(tokens, merges or [], _get(reader, "tokenizer.ggml.pre", path, ""))
        add_bos = bool(_get(reader, "tokenizer.ggml.add_bos_token", path, False))
    elif kind == "llama":
        scores = _get(reader, "tokenizer.ggml.scores", path, None)
        if merges is None and scores is None:
            raise ModelLoadError(f"'{path}' has a SentencePiece vocabulary but no scores or merges")
        unk = _get(reader, "tokenizer.ggml.unknown_token_id", path, None)
        backend = _sentencepiece(
            tokens, merges, scores, None if unk is None else tokens[unk],
            bool(_get(reader, "tokenizer.ggml.add_space_prefix", path, True)),
        )
        add_bos = bool(_get(reader, "tokenizer.ggml.add_bos_token", path, True))
    else:
        raise ModelLoadError(
            f"'{path}' uses tokenizer '{kind}'; kvtier builds 'gpt2' (byte-level BPE) and 'llama' "
            "(SentencePiece) tokenizers"
        )
    _add_special(backend, tokens, types, byte_level=kind == "gpt2")
    bos, eos, eot = (
        _get(reader, f"tokenizer.ggml.{k}_token_id", path, None) for k in ("bos", "eos", "eot")
    )
    special = {f"{k}_token": tokens[i] for k, i in (("bos", bos), ("eos", eos)) if i is not None}
    return Tokenizer(
        backend=backend,
        bos_token_id=bos,
        eos_token_ids=tuple(dict.fromkeys(i for i in (eos, eot) if i is not None)),
        chat_template=_get(reader, "tokenizer.chat_template", path, None),
        add_bos_token=add_bos,
        special_tokens=special,
    )


def _byte_level(tokens: list[str], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    # A token written with characters outside the byte alphabet is respelled byte by byte.
    vocab = {
        t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode()): i
        for i, t in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(BPE(vocab, pairs, continuing_subword_prefix="",
                                       end_of_word_suffix="", fuse_unk=False))
    if pre in _PRE_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre == "smollm":  # learned on single digits, then GPT-2's regex
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(
    tokens: list[str], merges: list[str] | None, scores: list[float] | None, unk: str | None,
    add_space_prefix: bool,
) -> tokenizers.Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges is not None:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        pairs = merges_from_scores(vocab, dict(zip(tokens, scores or [], strict=False)))
    backend = tokenizers.Tokenizer(BPE(vocab, pairs, unk_token=unk, fuse_unk=True,
                                       byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    if unk is not None:
        backend.add_special_tokens([AddedToken(unk, special=True, normalized=False)])
    return backend


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece GGUFs store no merges: each split of a piece into two pieces is a merge,
    ranked by the piece's score (best first), then longer left and right parts first."""
    found: list[tuple[float, str, str]] = []
    for piece, score in scores.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        splits = [(a, b) for a, b in splits if a in vocab and b in vocab]
        splits.sort(key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))
        found.extend((score, a, b) for a, b in splits)
    found.sort(key=lambda m: (-m[0], -len(m[1]), -len(m[2])))
    return [(a, b) for _, a, b in found]


def _add_special(
    backend: tokenizers.Tokenizer, tokens: list[str], types: list[int], byte_level: bool
) -> None:
    """Control tokens become special, user-defined ones plain added tokens: both stay whole.

    In a byte-level vocabulary a control token spelled outside the byte alphabet is a llama.cpp
    mislabel and is skipped, as transformers does.
    """
    spelled = set(byte_alphabet().values()) if byte_level else None
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _CONTROL and (spelled is None or set(t) <= spelled)
    ]
    vocab = backend.get_vocab(with_added_tokens=False)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _USER_DEFINED and t in vocab
    ]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)
