"""The tokenizer of a GGUF file, from its metadata (tokenizer.ggml.*), as a `tokenizers` Tokenizer.

llama.cpp's "gpt2" tokenizer model is byte-level BPE: the vocabulary (tokenizer.ggml.tokens, already in the
byte-to-unicode alphabet), its merges ("a b" strings) and a pre-tokenizer regex chosen by tokenizer.ggml.pre
(llama.cpp's llama-vocab.cpp lists them; the common ones are here, any other gets GPT-2's).

Its "llama" model is SentencePiece's BPE (Mixtral, Llama 2): pieces with scores, spaces as "▁" and one before the
text (tokenizer.ggml.add_space_prefix, default true), characters outside the vocabulary as their UTF-8 bytes'
<0xXX> pieces. Each step merges the adjacent pair whose joined piece scores highest; as a `tokenizers` BPE that is
the merges ranked by the joined piece's score, which is how transformers converts such a model, and matches
sentencepiece's and llama.cpp's own tokens (tests/test_gguf.py, tests/test_gguf_llama_cpp.py).

Control and user-defined tokens (token types 3 and 4) are special: matched whole, dropped when decoding. Other
tokenizer models are not built: the model then takes token ids only.
"""

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from hybridjit.gguf_file import GGUFFile
from hybridjit.tokenizer import Tokenizer

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
# o200k (gpt-oss, MiniMax-M2): letter runs split by case, a contraction their suffix, a "/" after punctuation kept
_O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[一-龥\u3040-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+",
)
# tokenizer.ggml.pre -> the regexes that split text before byte-level BPE, in order.
PRE_TOKENIZER_REGEXES = {
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "deepseek-v3": _DEEPSEEK_V3,
    "kimi-k2": (_LLAMA3,),
    "glm4": (_LLAMA3,),  # llama.cpp's CHATGLM4 split is Llama 3's
    "gpt-4o": (_O200K,),
    "minimax-m2": (_O200K,),
}
_SPECIAL_TYPES = (3, 4)  # llama.cpp's token types CONTROL and USER_DEFINED


def _pre_tokenizer(pre: str):
    regexes = PRE_TOKENIZER_REGEXES.get(pre)
    if regexes is None:  # "gpt2", "default", and those not listed: GPT-2's own split
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _byte_level_bpe(g: GGUFFile, tokens: list[str]) -> HFTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in g.key("tokenizer.ggml.merges", [])]
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = _pre_tokenizer(g.key("tokenizer.ggml.pre", "gpt2"))
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(g: GGUFFile, tokens: list[str]) -> HFTokenizer:
    scores = g.key("tokenizer.ggml.scores")
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    # Every split of a piece into two pieces is a merge, ranked by the joined piece's score (higher first), then by
    # the joined piece's id and the split pieces' ids, as transformers' SentencePieceExtractor orders them.
    merges = []
    for piece, i in vocab.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges += [(-scores[i], i, vocab[left], vocab[right], left, right) for left, right in splits]
    merges.sort(key=lambda m: m[:4])
    unk = g.key("tokenizer.ggml.unknown_token_id", None)
    tok = HFTokenizer(models.BPE(
        vocab=vocab, merges=[m[4:] for m in merges], unk_token=None if unk is None else tokens[unk],
        fuse_unk=True, byte_fallback=True,
    ))  # fmt: skip
    prefix = bool(g.key("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence(
        [*([normalizers.Prepend("▁")] if prefix else []), normalizers.Replace(" ", "▁")]
    )
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if prefix else []),
    ])  # fmt: skip
    return tok


_MODELS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def gguf_tokenizer(g: GGUFFile) -> Tokenizer | None:
    """The file's tokenizer, or None where it has none we build (see the module docstring)."""
    build = _MODELS.get(g.key("tokenizer.ggml.model", None))
    if build is None:
        return None
    tokens = g.key("tokenizer.ggml.tokens")
    tok = build(g, tokens)
    types = g.key("tokenizer.ggml.token_type", [])
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t in _SPECIAL_TYPES]
    )
    bos = g.key("tokenizer.ggml.bos_token_id", None)
    add_bos = bool(g.key("tokenizer.ggml.add_bos_token", False))
    return Tokenizer.from_tokenizer(tok, bos, add_bos, chat_template=g.key("tokenizer.chat_template", None))
