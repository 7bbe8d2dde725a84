"""OpenAI's answer shapes for the completion path: chat completions and text completions,
whole or as stream chunks, with OpenAI's `usage` and llama-server's `timings` (its extra
field in both). A chat with tools answers with `tool_calls` (streamed: the words as they
come, each call whole once the reply has ended) and finish_reason "tool_calls"."""
from __future__ import annotations

import itertools
import secrets
import time

from llamapy.tool_calls import CallStream, ToolUse

from .completion_path import DONE_LINE, Result
from .engine import Done, TokenOut


def usage(done: Done) -> dict:
    """OpenAI's usage, counted as llama-server counts (an end-of-generation token is one of the
    completion's tokens)."""
    return {"prompt_tokens": done.n_prompt, "completion_tokens": done.n_decoded,
            "total_tokens": done.n_prompt + done.n_decoded,
            "prompt_tokens_details": {"cached_tokens": done.n_cached}}


def timings(done: Done) -> dict:
    """llama-server's `timings` object (its server_slot_stats): the first token comes with
    the prompt's logits, so the generation rates count the steps after it."""
    n_new = done.n_prompt - done.n_cached
    prompt_ms, predicted_ms = done.t_prompt * 1e3, done.t_generate * 1e3
    steps = max(done.n_decoded - 1, 0)
    return {"cache_n": done.n_cached, "prompt_n": n_new, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / n_new if n_new else 0.0,
            "prompt_per_second": 1e3 / prompt_ms * n_new if prompt_ms > 0 else 0.0,
            "predicted_n": done.n_decoded, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
            "predicted_per_second": 1e3 / predicted_ms * steps if predicted_ms > 0 else 0.0}


class ChatShape:
    """/v1/chat/completions: `chat.completion` objects, or their chunks (the role first)."""
    done_line = DONE_LINE

    def __init__(self, server, model: str, logprobs: bool, include_usage: bool, tools: ToolUse | None = None) -> None:
        self.server, self.logprobs, self.include_usage = server, logprobs, include_usage
        self.head_fields = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": model}
        self.syntax = tools.syntax if tools is not None else None
        self.calls = CallStream(self.syntax) if self.syntax is not None else None

    def _chunk(self, delta: dict, finish: str | None = None, logprobs: list | None = None, **more) -> dict:
        choice = {"index": 0, "delta": delta, "finish_reason": finish,
                  "logprobs": {"content": logprobs} if logprobs else None}
        return {**self.head_fields, "object": "chat.completion.chunk", "choices": [choice], **more}

    def head(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": None})]

    def chunk(self, index: int, out: TokenOut) -> dict | None:
        logprobs = [self.server.chat_logprob(out)] if out.logprob is not None and not out.eog else None
        text = out.text if self.calls is None else self.calls.feed(out.text)
        return self._chunk({"content": text}, logprobs=logprobs) if text or logprobs else None

    def tail(self, index: int, done: Done) -> list[dict]:
        chunks, finish = [], done.finish_reason
        if self.calls is not None:
            reply = self.calls.finish()
            if reply.content:
                chunks.append(self._chunk({"content": reply.content}))
            for i, call in enumerate(reply.calls):
                chunks.append(self._chunk({"tool_calls": [{"index": i, **call.openai()}]}))
            finish = "tool_calls" if reply.calls else finish
        chunks.append(self._chunk({}, finish, timings=timings(done)))
        if self.include_usage:
            chunks.append({**self.head_fields, "object": "chat.completion.chunk", "choices": [], "usage": usage(done)})
        return chunks

    def whole(self, results: list[Result]) -> dict:
        outs, done = results[0].outs, results[0].done
        logprobs = [self.server.chat_logprob(o) for o in outs if o.logprob is not None and not o.eog]
        text = "".join(o.text for o in outs)
        message, finish = {"role": "assistant", "content": text}, done.finish_reason
        reply = self.syntax.parse(text) if self.syntax is not None else None
        if reply is not None and reply.calls:
            message = {"role": "assistant", "content": reply.content.strip() or None,
                       "tool_calls": [call.openai() for call in reply.calls]}
            finish = "tool_calls"
        choice = {"index": 0, "message": message, "finish_reason": finish,
                  "logprobs": {"content": logprobs} if self.logprobs else None}
        return {**self.head_fields, "object": "chat.completion", "choices": [choice], "usage": usage(done),
                "timings": timings(done)}


class CompletionShape:
    """/v1/completions: `text_completion` objects, or their chunks (logprobs with text offsets)."""
    done_line = DONE_LINE

    def __init__(self, server, model: str, logprobs: int | None, include_usage: bool) -> None:
        self.server, self.logprobs, self.include_usage = server, logprobs, include_usage
        self.head_fields = {"id": f"cmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": model,
                            "object": "text_completion"}
        self.offset = 0  # where the next streamed token's text starts

    def _logprobs_of(self, outs: list[TokenOut], offset: int) -> dict | None:
        if self.logprobs is None:
            return None
        piece = self.server.piece
        pieces = [piece(o.token).decode("utf-8", "replace") for o in outs]
        offsets = list(itertools.accumulate([offset] + [len(p) for p in pieces[:-1]])) if pieces else []
        return {"tokens": pieces, "token_logprobs": [o.logprob for o in outs],
                "top_logprobs": [{piece(t).decode("utf-8", "replace"): lp for t, lp in o.top or []} for o in outs],
                "text_offset": offsets}

    def head(self) -> list[dict]:
        return []

    def chunk(self, index: int, out: TokenOut) -> dict | None:
        if not out.text and (out.logprob is None or out.eog):
            return None
        scored = [out] if out.logprob is not None and not out.eog else []
        chunk = {**self.head_fields, "choices": [{"index": 0, "text": out.text, "finish_reason": None,
                                                  "logprobs": self._logprobs_of(scored, self.offset)}]}
        self.offset += len(out.text)
        return chunk

    def tail(self, index: int, done: Done) -> list[dict]:
        chunks = [{**self.head_fields, "choices": [{"index": 0, "text": "", "finish_reason": done.finish_reason,
                                                    "logprobs": None}], "timings": timings(done)}]
        if self.include_usage:
            chunks.append({**self.head_fields, "choices": [], "usage": usage(done)})
        return chunks

    def whole(self, results: list[Result]) -> dict:
        outs, done = results[0].outs, results[0].done
        scored = [o for o in outs if o.logprob is not None and not o.eog]
        choice = {"index": 0, "text": "".join(o.text for o in outs), "finish_reason": done.finish_reason,
                  "logprobs": self._logprobs_of(scored, 0)}
        return {**self.head_fields, "choices": [choice], "usage": usage(done), "timings": timings(done)}
