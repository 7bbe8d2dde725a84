"""Chat templates: conversations rendered to text and token ids, with a mask of what to learn.

A template is Jinja, as Hugging Face models publish it in `tokenizer.chat_template` (which
GGUF files copy). It runs in a jinja2 sandbox set up as transformers sets it up (trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, its `tojson`), with the
variables templates expect: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`,
`tools` (OpenAI's tool list, or None; llamapy/tool_calls reads the calls back). One difference: whitespace is stripped as llama.cpp's Jinja engine strips it
(ASCII only), so the text is the one llama.cpp renders at inference.

Templates are code from model files, rendered unattended (a training set renders thousands
of conversations), so every render has a budget (`RenderLimits`: a few seconds, a few
million characters, bounded memory) checked by the template's own code as it runs; past it,
one InputError names the template and the limit. chat_sandbox.py says how, and why neither
a subprocess per render nor a watchdog thread. Models without a
template can use one of llama.cpp's built-in templates by name (`ChatTemplate.named`),
written here in Jinja so they render what llama.cpp renders.

Token ids follow llama.cpp (common_chat_templates_apply, then tokenizing the prompt with
special tokens parsed): a BOS (EOS) the template writes is dropped when the tokenizer adds
one itself, so it is never doubled.

The training mask is True exactly on the tokens of assistant turns. Each assistant message
i is located by rendering, as TRL does: the turn starts where `messages[:i]` with the
generation prompt (the assistant header) stops agreeing with `messages[:i+1]`, and ends
where `messages[:i+1]` stops agreeing with the whole conversation (its end, unless the
template closes a conversation with text it does not write between turns, like Phi-3's EOS).
A template that renders a turn differently once later messages follow (Qwen3 drops the
empty <think> block from earlier turns) gives an InputError instead of a wrong mask.
A token belongs to a turn when its last byte does, so a token that merges the header's last
characters with the content's first ones is learned. What the template writes after the
turn's last end-of-generation token (the newline after chatml's `<|im_end|>` or gemma's
`<end_of_turn>`) is not learned: the model stops at that token.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import numpy as np

from .chat_sandbox import DEFAULT_LIMITS, Raised, RenderLimitExceeded, RenderLimits, TemplateEnvironment, render
from .errors import InputError
from .vocab import Vocab

if TYPE_CHECKING:
    from .model import Model

Message = dict[str, Any]

# llama.cpp's built-in templates (src/llama-chat.cpp, llm_chat_apply_template) as Jinja.
NAMED_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"),
    "llama3": (
        "{%- for message in messages -%}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
        "{{- (message['content'] | trim) + '<|eot_id|>' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"),
    "gemma": (  # no system role: system texts go before the next user turn
        "{%- set ns = namespace(system='') -%}"
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' -%}"
        "{%- set ns.system = ns.system + (message['content'] | trim) -%}"
        "{%- else -%}"
        "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
        "{{- '<start_of_turn>' + role + '\\n' -}}"
        "{%- if ns.system and role != 'model' -%}{{- ns.system + '\\n\\n' -}}{%- set ns.system = '' -%}{%- endif -%}"
        "{{- (message['content'] | trim) + '<end_of_turn>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"),
    "phi3": (
        "{%- for message in messages -%}"
        "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"),
}
# what llama.cpp renders a conversation with when the model has no template (common_chat_templates_init)
FALLBACK_TEMPLATE = "chatml"

for _name, _space in (("mistral-v7", " "), ("mistral-v7-tekken", "")):  # no generation prompt in llama.cpp
    NAMED_TEMPLATES[_name] = (
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' -%}"
        f"{{{{- '[SYSTEM_PROMPT]{_space}' + message['content'] + '[/SYSTEM_PROMPT]' -}}}}"
        "{%- elif message['role'] == 'user' -%}"
        f"{{{{- '[INST]{_space}' + message['content'] + '[/INST]' -}}}}"
        "{%- else -%}"
        f"{{{{- '{_space}' + message['content'] + '</s>' -}}}}"
        "{%- endif -%}"
        "{%- endfor -%}")


_ENV = TemplateEnvironment()
MAX_SOURCE_CHARS = 256 * 1024  # about a second to compile at worst; the largest real templates are ~20 kB


def _one_line(text: Any, limit: int = 300) -> str:
    """An error message on one line, cut short (a template can raise a megabyte of text)."""
    line = " ".join(str(text)[:4 * limit].splitlines()).strip()
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _special_text(vocab: Vocab, token: int | None) -> str:
    """A special token's text as llama.cpp gives it to templates (its piece, special rendered)."""
    return "" if token is None else vocab.token_to_piece(token, special=True).decode("utf-8", "replace")


class ChatTemplate:
    """A Jinja chat template, ready to render conversations and tokenize them for training."""

    def __init__(self, source: str, name: str = "chat template", bos_token: str = "", eos_token: str = "",
                 limits: RenderLimits = DEFAULT_LIMITS) -> None:
        self.source = source
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.limits = limits
        if len(source) > MAX_SOURCE_CHARS:  # compiling takes time in proportion, outside any render's budget
            raise InputError(f"{name} has {len(source):,} characters, more than the {MAX_SOURCE_CHARS:,} a chat "
                             "template may have (real ones have a few thousand)")
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise InputError(f"{name} is not a valid Jinja template (line {exc.lineno}): {_one_line(exc.message)}"
                             ) from None
        except (RecursionError, SyntaxError) as exc:  # what Python cannot compile (IndentationError among them)
            raise InputError(f"{name} nests blocks or expressions too deeply to compile ({type(exc).__name__})"
                             ) from None

    @classmethod
    def from_model(cls, model: Model) -> ChatTemplate:
        """The template the model file carries (tokenizer.chat_template), with its BOS/EOS texts."""
        source = model.file.get("tokenizer.chat_template")
        if not isinstance(source, str) or not source:
            raise InputError(f"{model.path} has no chat template (tokenizer.chat_template); name a built-in one "
                             f"({', '.join(NAMED_TEMPLATES)}) or give a template file")
        return cls(source, f"chat template of {model.path.name}", *cls._specials(model.vocab))

    @classmethod
    def from_file(cls, path: str | os.PathLike, vocab: Vocab | None = None) -> ChatTemplate:
        """A template from a .jinja file; `vocab` gives the bos_token/eos_token texts."""
        path = Path(path)
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"cannot read chat template {path}: {getattr(exc, 'strerror', None) or exc}") from None
        return cls(source, f"chat template {path}", *cls._specials(vocab))

    @classmethod
    def named(cls, name: str, vocab: Vocab | None = None) -> ChatTemplate:
        """One of llama.cpp's built-in templates (its --chat-template names), for models without one."""
        if name not in NAMED_TEMPLATES:
            raise InputError(f"unknown chat template {name!r}; built-in templates: {', '.join(NAMED_TEMPLATES)}")
        return cls(NAMED_TEMPLATES[name], f"chat template {name}", *cls._specials(vocab))

    @classmethod
    def for_model(cls, model: Model, choice: str | os.PathLike | None = None) -> tuple[ChatTemplate, str | None]:
        """The template for `model`'s conversations and, when it is not the one asked for or
        carried by the model, a note saying which it is: `choice` is a built-in name or a
        Jinja file; without it, the model's own template, else chatml, as llama.cpp falls
        back. A model file without a template is most often a base model, which continues
        text rather than answering: the note says so, since its chat answers will look broken."""
        if choice is not None:
            if str(choice) in NAMED_TEMPLATES:
                return cls.named(str(choice), model.vocab), None
            if not Path(choice).is_file():
                raise InputError(f"chat template {choice!r} is neither a built-in name "
                                 f"({', '.join(NAMED_TEMPLATES)}) nor a file")
            return cls.from_file(choice, model.vocab), None
        own = model.file.get("tokenizer.chat_template")
        if isinstance(own, str) and own:
            return cls.from_model(model), None
        name = model.path.name if model.path else "the model"
        return cls.named(FALLBACK_TEMPLATE, model.vocab), (
            f"{name} has no chat template: using the built-in {FALLBACK_TEMPLATE!r}, as llama.cpp does "
            "(--chat-template to choose another); a model without one is likely a base model, not trained to chat, "
            "so its answers may be nonsense until it is finetuned on chats")

    @staticmethod
    def _specials(vocab: Vocab | None) -> tuple[str, str]:
        return ("", "") if vocab is None else (_special_text(vocab, vocab.bos_id), _special_text(vocab, vocab.eos_id))

    # -- rendering -------------------------------------------------------------------

    def render(self, messages: list[Message], add_generation_prompt: bool = False, tools: list | None = None) -> str:
        """The conversation as the model reads it (with the tools it may call); InputError (one
        line) if the template fails."""
        return self._render(messages, add_generation_prompt, self.bos_token, self.eos_token, tools)

    def _render(self, messages: list[Message], add_generation_prompt: bool, bos_token: str, eos_token: str,
                tools: list | None = None) -> str:
        try:
            return render(self._template, self.limits, {"messages": messages, "add_generation_prompt":
                          add_generation_prompt, "bos_token": bos_token, "eos_token": eos_token,
                          "tools": tools or None})
        except RenderLimitExceeded as exc:
            raise InputError(f"{self.name}: rendering stopped: {exc}") from None
        except Raised as exc:
            raise InputError(f"{self.name}: {_one_line(exc.message)}") from None
        except Exception as exc:  # the template is code: any error it hits is its failure on these messages
            raise InputError(f"{self.name} failed to render: {type(exc).__name__}: {_one_line(exc)}") from None

    # -- tokens and loss mask ----------------------------------------------------------

    def tokenize(self, vocab: Vocab, messages: list[Message], add_generation_prompt: bool = False,
                 tools: list | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (int32) of the rendered conversation, as llama.cpp gets them, and the mask
        (bool) of the tokens to learn: the assistant turns (see the module docstring)."""
        bos, eos = self._specials(vocab)

        def render(msgs: list[Message], gen: bool) -> str:
            return self._render(msgs, gen, bos, eos, tools)

        text = render(messages, add_generation_prompt)
        spans = self._assistant_spans(messages, text, render)
        # llama.cpp drops a BOS/EOS text the tokenizer will add as a token (common_chat_template_direct_apply).
        start, end = 0, len(text)
        if vocab.add_bos and bos and text.startswith(bos):
            start = len(bos)
        if vocab.add_eos and eos and text.endswith(eos) and end - len(eos) >= start:
            end -= len(eos)
        body = vocab.tokenize(text[start:end], add_special=False, parse_special=True)
        base = len(text[:start].encode("utf-8"))
        ids = [vocab.bos_id] if vocab.add_bos else []
        ends = [base] if vocab.add_bos else []  # the added BOS stands for the dropped text, if any
        ids += body
        ends += [base + e for e in _token_ends(vocab, body, text[start:end].encode("utf-8"))]
        if vocab.add_eos:
            ids.append(vocab.eos_id)
            ends.append(len(text.encode("utf-8")))
        return np.asarray(ids, dtype=np.int32), self._mask(vocab, ids, ends, text, spans)

    def tokenize_pair(self, vocab: Vocab, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
        """A prompt/completion sample: one user turn and the assistant turn that answers it."""
        return self.tokenize(vocab, [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}])

    def _assistant_spans(self, messages: list[Message], text: str, render) -> list[tuple[int, int]]:
        """Character ranges of the assistant turns in `text` (content and end-of-turn marker)."""
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            done = render(messages[:i + 1], False)
            start = len(os.path.commonprefix([render(messages[:i], True), done]))
            end = len(os.path.commonprefix([done, text]))  # what closes a conversation (Phi-3's EOS) is not the turn's
            content = message.get("content")
            if end <= start or (isinstance(content, str) and content.strip() not in text[start:end]):
                raise InputError(f"{self.name}: assistant message {i + 1} cannot be located for the loss mask (the "
                                 "template renders it differently once later messages follow, or alters its content)")
            spans.append((start, end))
        return spans

    @staticmethod
    def _mask(vocab: Vocab, ids: list[int], ends: list[int], text: str, spans: list[tuple[int, int]]) -> np.ndarray:
        """True for the tokens whose last byte lies in an assistant span, up to its last end-of-generation token."""
        mask = np.zeros(len(ids), dtype=bool)
        end = np.asarray(ends, dtype=np.int64)
        start = np.concatenate([[0], end[:-1]]).astype(np.int64)
        for first, last in spans:
            lo, hi = len(text[:first].encode("utf-8")), len(text[:last].encode("utf-8"))
            inside = np.flatnonzero((start < end) & (end > lo) & (end <= hi))
            eog = [k for k in inside if vocab.is_eog(ids[k])]
            mask[inside[inside <= eog[-1]] if eog else inside] = True
        return mask


def _token_ends(vocab: Vocab, ids: list[int], data: bytes) -> list[int]:
    """Byte offset in `data` where each token's text ends.

    Pieces are matched to the text in order. Where a piece is not next in the text, it is
    looked for further on without its leading space: llama.cpp adds the SPM space prefix
    after special tokens, which may also strip the whitespace beside them (Phi-3's RSTRIP),
    and drops characters no token covers.
    """
    ends, pos = [], 0
    for token in ids:
        piece = vocab.token_to_piece(token, special=True)
        if data.startswith(piece, pos):
            pos += len(piece)
        else:
            core = piece[1:] if piece[:1] == b" " else piece
            found = data.find(core, pos) if core else -1
            if found >= 0:
                pos = found + len(core)
        ends.append(pos)
    return ends
