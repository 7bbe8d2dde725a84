"""Requests' prompts to token ids, as llama-server reads them (its server-common's
tokenize_input_prompts, format_prompt_infill and the chat template's rendering).

A `prompt` (and an embedding request's `input` / `content`) is one of:

- a text: its tokens, with BOS as the model adds one, special tokens written in it parsed;
- token ids: as given;
- a list mixing texts and token ids: one prompt, the texts tokenized in place (only a text
  in first place gets the BOS);
- a list of any of these (texts, lists of ids, mixed lists): several prompts, one result each.
"""
from __future__ import annotations

from typing import Any

from llamapy.errors import InputError

SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # llama-server's chunk separator without a FIM file-separator token
FIM_REPO = "myproject\n"   # llama-server's project name in the repo-level FIM pattern
FIM_FILE = "filename\n"    # ... and the current file's name


class PromptError(ValueError):
    """A prompt of a shape llama-server does not take."""


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def prompt_list(vocab, prompt: Any, add_special: bool = True) -> list[list[int]]:
    """The token lists of a request's prompt(s) (module docstring)."""
    if isinstance(prompt, list) and not any(_is_token(p) for p in prompt):
        if not prompt:
            raise PromptError('"prompt" must not be empty')
        return [one_prompt(vocab, p, add_special) for p in prompt]
    return [one_prompt(vocab, prompt, add_special)]


def one_prompt(vocab, prompt: Any, add_special: bool = True) -> list[int]:
    """One prompt: a text, token ids, or texts and ids mixed (tokenize_input_subprompt)."""
    if isinstance(prompt, dict) and "prompt_string" in prompt:
        if "multimodal_data" in prompt:
            raise PromptError("Multimodal data provided, but model does not support multimodal requests.")
        return one_prompt(vocab, prompt["prompt_string"], add_special)
    if isinstance(prompt, str):
        return mixed_tokens(vocab, [prompt], add_special)
    if isinstance(prompt, list) and all(isinstance(p, str) or _is_token(p) for p in prompt):
        return mixed_tokens(vocab, prompt, add_special)
    raise PromptError('"prompt" elements must be a string, a list of tokens, a JSON object containing a prompt '
                      "string, or a list of mixed strings & tokens.")


def mixed_tokens(vocab, parts: list[str | int], add_special: bool, parse_special: bool = True) -> list[int]:
    """tokenize_mixed: texts tokenized, ids kept; only a text in first place gets BOS."""
    tokens: list[int] = []
    for i, part in enumerate(parts):
        if isinstance(part, str):
            tokens += [int(t) for t in vocab.tokenize(part, add_special=add_special and i == 0,
                                                      parse_special=parse_special)]
        else:
            tokens.append(int(part))
    return tokens


def check_ids(vocab, tokens: list[int]) -> None:
    bad = next((t for t in tokens if not 0 <= t < vocab.n_tokens), None)
    if bad is not None:
        raise InputError(f"prompt: token ids must be in 0..{vocab.n_tokens - 1} (the vocabulary), not {bad}")


# ---- fill-in-the-middle ---------------------------------------------------------------------------------
def fim_missing(vocab) -> str:
    """llama-server's refusal text for a model without FIM tokens ('' when it has them)."""
    missing = ""
    for name, what in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle")):
        if vocab.fim_ids.get(name) is None:
            missing += f"{what} token is missing. "
    return missing


def infill_tokens(vocab, prefix: str | list, suffix: str | list, extra: list[dict], prompt: list[int], n_batch: int,
                  n_predict: int, n_ctx: int, spm_infill: bool = False) -> list[int]:
    """format_prompt_infill: the repo-level FIM pattern (arXiv 2409.12186)

        [FIM_REP]myproject [FIM_SEP]file0 extra0 ... [FIM_SEP]filename [FIM_PRE]prefix[FIM_SUF]suffix[FIM_MID]prompt

    with the prefix and suffix cut to fit a batch (3:1) and the extra chunks to fill what is
    left of the context, the nearest kept."""
    fim = {name: vocab.fim_ids.get(name) for name in ("fim_pre", "fim_suf", "fim_mid", "fim_rep", "fim_sep")}

    def tok(text: str) -> list[int]:
        return [int(t) for t in vocab.tokenize(text, add_special=False, parse_special=False)]

    prefix_tokens = mixed_tokens(vocab, prefix if isinstance(prefix, list) else [prefix], False, False)
    suffix_tokens = mixed_tokens(vocab, suffix if isinstance(suffix, list) else [suffix], False, False)
    extra_tokens: list[int] = []
    if fim["fim_rep"] is not None:
        extra_tokens += [fim["fim_rep"]] + tok(FIM_REPO)
    for chunk in extra:
        if fim["fim_sep"] is not None:
            extra_tokens += [fim["fim_sep"]] + tok(chunk.get("filename", "tmp") + "\n")
        else:
            extra_tokens += tok(SNIPPET_SEPARATOR)
        extra_tokens += tok(chunk.get("text", ""))
    if fim["fim_sep"] is not None:
        extra_tokens += [fim["fim_sep"]] + tok(FIM_FILE)

    n_prefix_take = min(len(prefix_tokens), 3 * (n_batch // 4))
    n_suffix_take = min(len(suffix_tokens), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))

    head = [fim["fim_pre"]] + prefix_tokens[len(prefix_tokens) - n_prefix_take:] + list(prompt)
    tail = [fim["fim_suf"]] + suffix_tokens[:n_suffix_take]
    first, second = (tail, head) if spm_infill else (head, tail)
    if vocab.add_bos:
        first = [vocab.bos_id] + first
    kept_extra = extra_tokens[len(extra_tokens) - n_extra_take:] if n_extra_take else []
    return kept_extra + first + second + [fim["fim_mid"]]


# ---- chat templates -----------------------------------------------------------------------------------
def rendered_chat(template, vocab, messages: list[dict], tools: list | None = None) -> str:
    """The conversation as llama-server's /apply-template gives it: the template's text with
    the generation prompt (and the tools), less a BOS (EOS) text the tokenizer adds as a token
    itself (common_chat_template_direct_apply)."""
    text = template.render(messages, add_generation_prompt=True, tools=tools)
    bos, eos = template.bos_token, template.eos_token
    start, end = 0, len(text)
    if vocab.add_bos and bos and text.startswith(bos):
        start = len(bos)
    if vocab.add_eos and eos and text.endswith(eos) and end - len(eos) >= start:
        end -= len(eos)
    return text[start:end]
