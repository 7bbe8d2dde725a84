"""A checkpoint's special tokens, BOS/EOS flags, merges and chat template, gathered from its
tokenizer.json, tokenizer_config.json, chat_template.jinja/.json and config.json the way
llama.cpp's gguf-py `SpecialVocab` gathers them, so a converted file holds the same keys.

The order of discovery is kept (it is the order of the keys in the file): tokenizer.json's
post-processor first (which of BOS, EOS and SEP it adds), then tokenizer_config.json (its
add_*_token flags, its special tokens looked up among tokenizer.json's added tokens), then
config.json's *_token_id. A token id already set is never replaced.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llamapy.errors import CheckpointError
from llamapy.gguf_file import ValueType

from .json_file import optional_json, read_json
from .metadata import Meta

DEFAULT_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
# the token types gguf-py writes an id for (none for cls, prefix, suffix, middle), and an add flag for
ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "sep": "seperator_token_id",
           "pad": "padding_token_id", "mask": "mask_token_id", "eot": "eot_token_id", "eom": "eom_token_id"}
ADD_KEYS = ("bos", "eos", "sep")


@dataclass
class SpecialTokens:
    merges: list[str] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)
    add: dict[str, bool] = field(default_factory=dict)
    chat_template: str | list | None = None
    lowercase: bool | None = None
    strip_accents: bool | None = None
    n_vocab: int | None = None
    types: tuple[str, ...] = DEFAULT_TYPES

    def set_id(self, typ: str, tid: Any) -> None:
        """Record a token id (an int below n_vocab) unless one is set for `typ` already."""
        if not isinstance(tid, int) or isinstance(tid, bool):
            return
        if tid < 0:
            raise CheckpointError(f"invalid id {tid} for the {typ} token")
        if (self.n_vocab is None or tid < self.n_vocab) and typ not in self.ids:
            self.ids[typ] = tid

    def write(self, meta: Meta) -> None:
        """The keys, in gguf-py's order: merges, token ids, add flags, chat template(s), normalizer."""
        meta.array("tokenizer.ggml.merges", ValueType.STRING, self.merges)
        for typ, tid in self.ids.items():
            if typ in ID_KEYS:
                meta.u32(f"tokenizer.ggml.{ID_KEYS[typ]}", tid)
        for typ, value in self.add.items():
            if typ in ADD_KEYS:
                meta.bool(f"tokenizer.ggml.add_{typ}_token", value)
        write_chat_template(meta, self.chat_template)
        if self.lowercase is not None:
            meta.bool("tokenizer.ggml.normalizer.lowercase", self.lowercase)
        if self.strip_accents is not None:
            meta.bool("tokenizer.ggml.normalizer.strip_accents", self.strip_accents)


def write_chat_template(meta: Meta, template: str | list | None) -> None:
    """One template, or a list of named ones: "default" is tokenizer.chat_template, the others
    tokenizer.chat_template.NAME (names reduced to letters, digits and _) listed in
    tokenizer.chat_templates."""
    if template is None:
        meta.pop("tokenizer.chat_template", None)
        return
    if isinstance(template, list):
        default, names = None, []
        for choice in template:
            name = "".join(c if c.isascii() and c.isalnum() else "_" for c in choice.get("name", ""))
            text = choice.get("template")
            if name and text is not None:
                if name == "default":
                    default = text
                else:
                    names.append(name)
                    meta.string(f"tokenizer.chat_template.{name}", text)
        meta.array("tokenizer.chat_templates", ValueType.STRING, list(dict.fromkeys(names)))
        if default is None:
            return
        template = default
    meta.string("tokenizer.chat_template", template)


def gather(folder: Path, config: dict, *, load_merges: bool = False, n_vocab: int | None = None,
           types: tuple[str, ...] = DEFAULT_TYPES) -> SpecialTokens:
    """What SpecialVocab finds in `folder` (module docstring)."""
    st = SpecialTokens(n_vocab=n_vocab, types=types)
    tok = optional_json(folder / "tokenizer.json")
    tconf = optional_json(folder / "tokenizer_config.json")
    added: list = []
    if tok is not None:
        if load_merges:
            st.merges = _merges(tok.get("model", {}).get("merges"))
        if normalizer := tok.get("normalizer"):
            _normalizer(st, normalizer)
        added = tok.get("added_tokens", [])
        _post_processor(st, tok.get("post_processor"), tconf)
    if tconf:
        _tokenizer_config(st, folder, tconf, added)
    for typ in st.types:
        tid = config.get(f"{typ}_token_id")
        if tid is None and "text_config" in config:
            tid = config["text_config"].get(f"{typ}_token_id")
        st.set_id(typ, tid)
    if load_merges and not st.merges:
        st.merges = _merges_txt(folder / "merges.txt")
    return st


def _merges(merges: Any) -> list[str]:
    """tokenizer.json's merges as "a b" strings (pairs, the format since transformers 4.45,
    are joined with a space, a space inside a part written as U+0120 as byte-level BPE does)."""
    if not isinstance(merges, list) or not merges:
        return []
    if isinstance(merges[0], str):
        return merges
    if isinstance(merges[0], list) and len(merges[0]) == 2 and isinstance(merges[0][0], str):
        return [" ".join(part.replace(" ", "\u0120") for part in pair) for pair in merges]
    raise CheckpointError("tokenizer.json: merges in an unknown format")


def _merges_txt(path: Path) -> list[str]:
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    if lines and lines[0].strip().startswith("#"):
        lines = lines[1:]
    out = []
    for line in lines:
        parts = line.strip().split(None, 3)
        if len(parts) == 2:
            out.append(f"{parts[0]} {parts[1]}")
    return out


def _normalizer(st: SpecialTokens, normalizer: dict) -> None:
    kind = normalizer.get("type")
    if kind == "Lowercase":
        st.lowercase = True
    elif kind == "StripAccents":
        st.strip_accents = True
    elif kind == "BertNormalizer":
        st.lowercase = normalizer.get("lowercase", st.lowercase)
        st.strip_accents = normalizer.get("strip_accents", st.strip_accents)
    elif kind == "Sequence":
        for inner in normalizer.get("normalizers", []):
            _normalizer(st, inner)


def _special_id(entry: dict) -> Any:
    return entry.get("SpecialToken", {}).get("id")


def _post_processor(st: SpecialTokens, post: dict | None, tconf: dict | None) -> None:
    """Which special tokens tokenizer.json's post-processor adds (gguf-py's reading of it,
    tokenizer_config's bos/eos/cls/sep entries completed from it as gguf-py does)."""
    conf = tconf or {}
    bos, cls, eos, sep = (conf.get(f"{t}_token") for t in ("bos", "cls", "eos", "sep"))
    if not bos and cls and tconf:
        tconf["bos_token"] = bos = cls
    if not eos and sep and tconf:
        tconf["eos_token"] = eos = sep
    if not post:
        return
    for proc in post.get("processors", [post]):
        kind = proc.get("type")
        if kind == "ByteLevel":
            st.add.setdefault("bos", False)
            st.add.setdefault("eos", False)
        elif kind == "RobertaProcessing":
            st.add.update(bos=True, eos=True, sep=True)
            if not cls and tconf:
                tconf["cls_token"] = cls = proc.get("cls", [bos])[0]
            if not sep and tconf:
                tconf["sep_token"] = sep = proc.get("sep", [eos])[0]
        elif kind == "TemplateProcessing":
            bos, cls, eos, sep = _template_processing(st, proc, tconf, bos, cls, eos, sep)


def _template_processing(st: SpecialTokens, proc: dict, tconf: dict | None, bos, cls, eos, sep):
    """A TemplateProcessing's leading token is BOS (or CLS), its trailing one EOS (an EOS that
    differs from tokenizer_config's makes that one EOT, then EOM), a token between the two
    sequences of a pair SEP: gguf-py's crude reading, kept as it is."""
    single, pair = proc.get("single", []), proc.get("pair", [])
    first = last = None
    if len(single) > 1:
        if first := _special_id(single[0]):
            if not tconf:
                bos = first
            elif first not in (bos, cls):
                if not bos:
                    tconf["bos_token"] = bos = first
                if not cls:
                    tconf["cls_token"] = cls = first
            st.add["bos"] = first in (bos, cls)
        if last := _special_id(single[-1]):
            if not tconf:
                eos = last
            elif last != eos:
                for extra in ("eot", "eom"):
                    if extra not in st.types:
                        st.types = (*st.types, extra)
                        tconf[f"{extra}_token"] = eos
                        break
                tconf["eos_token"] = eos = last
            st.add["eos"] = last == eos
    if pair:
        start = 1 if first and _special_id(pair[0]) == first else 0
        stop = -1 if last and _special_id(pair[-1]) == last else None
        middle = pair[start:stop]
        sequences = [entry.get("Sequence", {}).get("id") for entry in middle[:1] + middle[-1:]]
        if sequences == ["A", "B"]:
            middle = middle[1:-1]
            if middle:
                add_sep = False
                if entry := _special_id(middle[0]):
                    if entry in (sep, eos) and not last:
                        add_sep = True
                if len(middle) == 2 and (entry := _special_id(middle[1])) and entry in (sep, eos):
                    add_sep = True
                st.add["sep"] = add_sep
                if add_sep and not sep and tconf:
                    tconf["sep_token"] = eos
    return bos, cls, eos, sep


def _tokenizer_config(st: SpecialTokens, folder: Path, tconf: dict, added: list) -> None:
    """tokenizer_config.json: the chat template, the add_*_token flags (the post-processor's
    win) and the special tokens' ids, looked up among tokenizer.json's added tokens."""
    alternative = None
    jinja, as_json = folder / "chat_template.jinja", folder / "chat_template.json"
    if jinja.is_file():
        alternative = jinja.read_text(encoding="utf-8")
        more = sorted((folder / "additional_chat_templates").glob("*.jinja"))
        if more:
            alternative = [{"name": "default", "template": alternative},
                           *({"name": p.stem, "template": p.read_text(encoding="utf-8")} for p in more)]
    elif as_json.is_file():
        alternative = (read_json(as_json) or {}).get("chat_template")
    template = tconf.get("chat_template", alternative)
    if template is None or isinstance(template, (str, list)):
        st.chat_template = template
    for typ in st.types:
        flag = tconf.get(f"add_{typ}_token")
        if isinstance(flag, bool) and typ not in st.add:
            st.add[typ] = flag
        entry = tconf.get(f"{typ}_token")
        content = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(content, str):
            st.set_id(typ, next((a.get("id") for a in added if a.get("content") == content), None))
