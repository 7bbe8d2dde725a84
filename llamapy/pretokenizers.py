"""Pre-tokenizers for byte-level BPE vocabularies, one per `tokenizer.ggml.pre` value.

llama.cpp's llama-vocab.cpp decides, per pre type, which regexes split a text before BPE
merges and a few flags (BOS, spaces, merges); this table holds the same for every type it
knows. Each regex splits every piece left by the previous one; matches and gaps are kept.
"""
from __future__ import annotations

from dataclasses import dataclass

# ---------------------------------------------------------------------------------------
# Pre-tokenizers for BPE vocabs, per tokenizer.ggml.pre (llama.cpp llama-vocab.cpp).
# Each regex splits every piece left by the previous one; matches and gaps are both kept.
# The regexes are llama.cpp's, run by Oniguruma (the engine of `tokenizers`) instead of
# std::regex; where the two would read a regex differently, or where llama.cpp runs
# hand-written code instead of a regex, the entry is written to give llama.cpp's pieces
# and a comment says so.
# ---------------------------------------------------------------------------------------

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_JAIS2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
    r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
)
_QWEN2_WORDS = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + "|" + _QWEN2_WORDS
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_MINICPM5 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SEED_CODER = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BAILINGMOE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
_EXAONE_MOE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
    r"|\s*[\r\n]|\s+(?!\S)|\s+"
)
_GPT4O_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _cased_words(letter: str, suffix: str) -> str:
    """tokenizer.json's upper-then-lower word regex as llama.cpp rewrote it for std::regex:
    "upper" is a `letter` that is not a-z, "lower" one that is not A-Z."""
    upper, lower, lead = rf"(?:(?={letter})[^a-z])", rf"(?:(?={letter})[^A-Z])", r"[^\r\n\p{L}\p{N}]?"
    return f"{lead}{upper}*{lower}+{suffix}|{lead}{upper}+{lower}*{suffix}"


_GPT4O = _cased_words(r"\p{L}", _CONTRACTIONS + "?") + r"|\p{N}{1,3}" + _GPT4O_TAIL
_GRANITE_EMB_MULTI = _cased_words(r"[\p{L}\p{M}]", _CONTRACTIONS + "?") + r"|\p{N}{1,3}" + _GPT4O_TAIL
_TEKKEN = _cased_words(r"\p{L}", "") + r"|\p{N}" + _GPT4O_TAIL
# youtu and tiny_aya pass tokenizer.json's [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+
# alternatives to std::regex unchanged, and llama.cpp reads every \p{L?} as \p{L}; so they are one:
_ANY_CASE_WORD = r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+" + _CONTRACTIONS + "?"
# llama.cpp's digit splitter (afmoe; tiny_aya's "\d{1,3}(?=(?:\d{3})*\b)" runs it too): digit runs
# in groups of three from the right, the text before a run kept joined to its first group.
_DIGIT_GROUPS = r"\P{N}*\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))|\P{N}+"
_KANA_HAN = r"[一-龥\x{3040}-ゟ゠-ヿ]+"
_ASCII_PUNCT_WORD = r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"""
_PUNCT_WORDS = _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+"
# kimi-k2: llama.cpp's hand-written splitter for Kimi's regex: runs of Han (by its code point
# ranges), words of other letters, digits by three, then llama3's punctuation and spaces.
_HAN = (r"\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2B73F}\x{2B740}-\x{2B81F}"
        r"\x{2B820}-\x{2CEAF}\x{2CEB0}-\x{2EBEF}\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}")
_KIMI_K2 = (
    rf"[{_HAN}]+|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}&&[^{_HAN}]]+{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp turns non-ASCII spaces into "\v" before matching regexes that name characters
# (std::regex's \s knows no others), so they fall out of ranges like ࠀ-一 ("&&\S" here).
_CJK = r"[一-龥ࠀ-一가-\x{D7FF}&&\S]+"
_DEEPSEEK_LLM = (
    r"[\r\n]",
    # DeepSeek's letters, as code points: several are singletons that Unicode normalization rewrites
    r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-"
    r"\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-"
    r"\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-"
    r"\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}"
    r"\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-"
    r"\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}"
    r"\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-"
    r"\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}"
    r"\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}"
    r"\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}"
    r"\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-"
    r"\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}"
    r"\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}"
    r"\x{1E900}-\x{1E943}]+",
    r"\s?[!-/:-~！-／：-～‘-‟\x{3000}-。&&\S]+",
    r"\s+\z",  # llama.cpp's "\s+$": std::regex's $ is the end of the piece, Oniguruma's any line end
    _CJK,
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")
_DEEPSEEK3 = (r"\p{N}{1,3}", _KANA_HAN, _PUNCT_WORDS + r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPARK2_5 = (r"\p{N}{1,3}", _KANA_HAN, _PUNCT_WORDS + r"|[\r\n]|\s+(?!\S)|\s+", r"\p{N}")
_YOUTU = (
    r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|" + _KANA_HAN,
    _ANY_CASE_WORD + r"|\p{N}" + _GPT4O_TAIL,
)
_AFMOE = (
    _DIGIT_GROUPS,
    r"[一-鿿㐀-䶿豈-\x{FAFF}\x{3040}-ゟ゠-ヿ･-ﾟ⼀-\x{2FDF}เ-\x{E7F}\x{E80}-\x{EFF}ក-\x{17FF}က-႟ꩠ-ꩿꧠ-\x{A9FF}"
    r"가-\x{D7AF}ᄀ-ᇿ]+",
    _PUNCT_WORDS + r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_CHAMELEON = (
    r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
    r"[\p{P}!-/:-@\[-`{-~]", _GPT2,
)
# superbpe: std::regex's \d is [0-9]; the zero-width matches split digit runs by three from the right
_SUPERBPE = (r"\p{N}+", r"(?=(?:[0-9]{3})+(?![0-9]))")
_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"
_NEWLINE_RUNS = r"[^\n]+|[\n]+"


@dataclass(frozen=True)
class PreTokenizer:
    """llama.cpp's settings for one `tokenizer.ggml.pre` type of a BPE vocab."""

    regexes: tuple[str, ...]
    clean_spaces: bool = True
    ignore_merges: bool = False  # a piece that is a token is taken whole
    add_bos: bool = False
    no_bos: bool = False  # chatglm: llama.cpp drops the default BOS id
    add_sep: bool = False  # rerankers join query and document with SEP (tokenize never adds it)
    byte_encode: bool = True  # False: merges over raw UTF-8, <0xXX> tokens for unknown bytes
    escape_whitespaces: bool = False  # spaces are "▁" in the vocab (SPM-style BPE)
    whole_newline_runs: bool = False  # gemma4: a run of newlines that is a token is not merged
    force_bos: bool = False  # gemma4: BOS is added whatever tokenizer.ggml.add_bos_token says
    merges_optional: bool = False  # kimi-k2 vocabs may come without merges


def _alias(names: str, pre: PreTokenizer) -> dict[str, PreTokenizer]:
    return {name: pre for name in names.split()}


def _keep_spaces(*regexes: str, **flags: bool) -> PreTokenizer:
    """A pre-tokenizer whose detokenize keeps spaces before punctuation (clean_spaces off)."""
    return PreTokenizer(regexes, clean_spaces=False, **flags)


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    **_alias("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
             PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    **_alias("dbrx smaug-bpe", PreTokenizer((_LLAMA3,))),
    "chatglm-bpe": PreTokenizer((_LLAMA3,), no_bos=True),
    **_alias("glm4 glm5", PreTokenizer((_LLAMA3,), no_bos=True, ignore_merges=True)),
    "jais-2": PreTokenizer((_JAIS2,)),
    **_alias("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert "
             "mpt olmo jais exaone4", PreTokenizer((_GPT2,))),
    **_alias("jina-v1-en jina-v2-code roberta-bpe", PreTokenizer((_GPT2,), add_sep=True)),
    **_alias("trillion granite-docling", _keep_spaces(_GPT2)),
    **_alias("starcoder refact codeshell exaone minerva-7b mellum2", PreTokenizer((r"\p{N}", _GPT2))),
    **_alias("command-r smollm", _keep_spaces(r"\p{N}", _GPT2)),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    **_alias("qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open grok-2", _keep_spaces(_QWEN2)),
    **_alias("stablelm2 megrez", PreTokenizer((_QWEN2,))),
    "qwen35": _keep_spaces(_QWEN35),
    "ufakzeka": _keep_spaces(_QWEN2_WORDS),
    "laguna": _keep_spaces(_NEWLINE_RUNS, _QWEN2),
    "minicpm5": PreTokenizer((r"\p{N}{1,3}", _MINICPM5), ignore_merges=True),
    "seed-coder": _keep_spaces(_SEED_CODER),
    **_alias("bailingmoe bailingmoe2 llada-moe", _keep_spaces(_BAILINGMOE)),
    "exaone-moe": PreTokenizer((_EXAONE_MOE,)),
    **_alias("gpt-4o llama4 kanana2 talkie minimax-m2", _keep_spaces(_GPT4O)),
    "granite-embed-multi-97m": _keep_spaces(_GRANITE_EMB_MULTI, ignore_merges=True),
    "tekken": _keep_spaces(_TEKKEN, ignore_merges=True, add_bos=True),
    **_alias("tiny_aya cohere2moe", _keep_spaces(_DIGIT_GROUPS, _ANY_CASE_WORD + r"|\p{N}{1,3}" + _GPT4O_TAIL)),
    "youtu": _keep_spaces(*_YOUTU, ignore_merges=True),
    "kimi-k2": _keep_spaces(_KIMI_K2, merges_optional=True),
    "deepseek-llm": _keep_spaces(*_DEEPSEEK_LLM),
    "deepseek-coder": _keep_spaces(*_DEEPSEEK_CODER),
    **_alias("deepseek-v3 hunyuan-dense joyai-llm hy_v4", _keep_spaces(*_DEEPSEEK3)),
    "spark2_5": _keep_spaces(*_SPARK2_5),
    "afmoe": _keep_spaces(*_AFMOE),
    "superbpe": _keep_spaces(*_SUPERBPE),
    "chameleon": _keep_spaces(*_CHAMELEON, add_bos=True),
    "poro-chat": _keep_spaces(_PORO),
    **_alias("bloom gpt3-finnish", PreTokenizer((_PORO,))),
    "viking": _keep_spaces(_PORO, r"\p{N}"),
    **_alias("gemma4 granite-embed-multi-311m", PreTokenizer(
        (_NEWLINE_RUNS,), byte_encode=False, escape_whitespaces=True, whole_newline_runs=True, force_bos=True)),
    "sarvam-moe": _keep_spaces(_NEWLINE_RUNS, byte_encode=False, escape_whitespaces=True),
    "whitespace": PreTokenizer((r"\S+",), byte_encode=False),
}
