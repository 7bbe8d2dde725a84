"""llama-server's native answer shapes (/completion, /completions, /infill): the final
result (`content`, `tokens`, `stop_type`, `timings`, `generation_settings`, ...), the stream's
partial results, `completion_probabilities`, and the generation settings a request ran with
(also /props' defaults and /slots' `params`).

Floats a llama.cpp record holds as C floats are reported as llama-server prints them: the
float's exact value (0.8 is 0.800000011920929).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .completion_path import Result
from .engine import Done, TokenOut
from .openai_shapes import timings
from .sampler_order import DEFAULT_ORDER

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # "no seed given" (each request then draws its own)
DRY_SEQUENCE_BREAKERS = ["\n", ":", "\"", "*"]

# llama.cpp's parameters of the samplers and features llamapy has not: their values that turn
# them off (what llama-server reports by default; a request asking for others is refused)
OFF_SETTINGS = {"top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1, "dry_multiplier": 0.0,
                "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64, "mirostat": 0,
                "mirostat_tau": 5.0, "mirostat_eta": 0.1, "adaptive_target": -1.0, "adaptive_decay": 0.9}
FLOAT_SETTINGS = frozenset({"temperature", "dynatemp_range", "dynatemp_exponent", "top_p", "min_p", "top_n_sigma",
                            "xtc_probability", "xtc_threshold", "typical_p", "repeat_penalty", "presence_penalty",
                            "frequency_penalty", "dry_multiplier", "dry_base", "mirostat_tau", "mirostat_eta",
                            "adaptive_target", "adaptive_decay"})
# what /props and /slots leave out of a request's settings (llama-server's only_metrics)
NOT_METRICS = frozenset({"dry_sequence_breakers", "stop", "logit_bias", "grammar", "grammar_lazy", "grammar_triggers",
                         "preserved_tokens"})


def c_float(x: float) -> float:
    """A value as a C float holds it, printed as a double (llama-server's JSON); one beyond
    float's range is inf, as a C cast makes it."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def generation_settings(options: dict, *, seed: int | None, n_predict: int, stop: tuple[str, ...], stream: bool,
                        n_probs: int, min_keep: int, ignore_eos: bool, order: tuple[str, ...] | None,
                        lora: tuple[float, ...], logit_bias: dict[int, float]) -> dict:
    """task_params::to_json: the settings a request runs with (`options`: Server.sampling's)."""
    values = {"seed": LLAMA_DEFAULT_SEED if seed is None else seed % 2**32,
              "temperature": options["temperature"], "dynatemp_range": options["dynatemp_range"],
              "dynatemp_exponent": options["dynatemp_exp"], "top_k": options["top_k"], "top_p": options["top_p"],
              "min_p": options["min_p"], "top_n_sigma": OFF_SETTINGS["top_n_sigma"],
              "xtc_probability": OFF_SETTINGS["xtc_probability"], "xtc_threshold": OFF_SETTINGS["xtc_threshold"],
              "typical_p": options["typical_p"], "repeat_last_n": options["repeat_last_n"],
              "repeat_penalty": options["repeat_penalty"], "presence_penalty": options["presence_penalty"],
              "frequency_penalty": options["frequency_penalty"]}
    values.update({k: OFF_SETTINGS[k] for k in ("dry_multiplier", "dry_base", "dry_allowed_length",
                                                "dry_penalty_last_n")})
    values["dry_sequence_breakers"] = list(DRY_SEQUENCE_BREAKERS)
    values.update({k: OFF_SETTINGS[k] for k in ("mirostat", "mirostat_tau", "mirostat_eta", "adaptive_target",
                                                "adaptive_decay")})
    values.update({"stop": list(stop), "max_tokens": n_predict, "n_predict": n_predict, "n_keep": 0, "n_discard": 0,
                   "ignore_eos": ignore_eos, "stream": stream,
                   "logit_bias": [{"bias": _json_float(b), "token": t} for t, b in logit_bias.items()],
                   "n_probs": n_probs, "min_keep": min_keep, "grammar": "", "grammar_lazy": False,
                   "grammar_triggers": [], "preserved_tokens": [],
                   "samplers": list(order if order is not None else DEFAULT_ORDER),
                   "timings_per_token": False, "post_sampling_probs": False, "backend_sampling": False,
                   "lora": [{"id": i, "scale": c_float(s)} for i, s in enumerate(lora)]})
    return {k: _json_float(v) if k in FLOAT_SETTINGS else v for k, v in values.items()}


def metrics_settings(settings: dict) -> dict:
    """The settings as /props and /slots report them (llama-server's only_metrics)."""
    return {k: v for k, v in settings.items() if k not in NOT_METRICS}


def _json_float(x: float) -> float | None:
    """A C float as JSON: -inf (a banned token) or a setting beyond float's range has no JSON
    number, and llama-server's JSON library writes null."""
    value = c_float(x)
    return value if math.isfinite(value) else None


def nested_values(paths: list[str], answer: dict) -> dict:
    """json_get_nested_values: only the `response_fields` asked for ("a/b" reads answer["a"]["b"]
    and is reported under "a/b"), those missing left out."""
    picked = {}
    for path in paths:
        current: Any = answer
        for key in path.split("/"):
            if not isinstance(current, dict) or key not in current:
                break
            current = current[key]
        else:
            picked[path] = current
    return picked


class NativeShape:
    """/completion's answers for one request of one or more prompts (module docstring)."""
    done_line = ""

    def __init__(self, server, jobs: list, settings: dict, *, model: str, return_tokens: bool, n_probs: int,
                 response_fields: list[str] | None, stream: bool) -> None:
        self.server, self.jobs, self.settings, self.model = server, jobs, settings, model
        self.return_tokens, self.n_probs, self.fields, self.stream = return_tokens, n_probs, response_fields, stream
        self.n_sampled = [0] * len(jobs)
        self.new_line = [False] * len(jobs)  # a streamed text had a newline

    # ---- probabilities ------------------------------------------------------------------------------
    def _candidate(self, token: int, logprob: float) -> dict:
        piece = self.server.piece(token)
        return {"id": token, "token": _whole_characters(piece), "bytes": list(piece), "logprob": logprob}

    def probability(self, out: TokenOut) -> dict:
        """One entry of completion_probabilities: the token as sent (its text may be held back
        for a stop string: then ""), and its n_probs most likely alternatives."""
        text = out.text.encode("utf-8")
        return {"id": out.token, "token": _whole_characters(text), "bytes": list(text), "logprob": out.logprob,
                "top_logprobs": [self._candidate(t, lp) for t, lp in out.top or []]}

    # ---- stream -------------------------------------------------------------------------------------
    def head(self) -> list[dict]:
        return []

    def chunk(self, index: int, out: TokenOut) -> dict | None:
        self.n_sampled[index] += 1
        self.new_line[index] |= "\n" in out.text
        if not out.complete:  # llama-server sends a token cut inside a character with the next one
            return None
        job = self.jobs[index]
        chunk = {"index": index, "content": out.text, "tokens": [out.token], "stop": False, "id_slot": job.slot,
                 "tokens_predicted": self.n_sampled[index], "tokens_evaluated": len(job.tokens)}
        if self.n_probs:
            chunk["completion_probabilities"] = [self.probability(out)]
        return chunk

    def tail(self, index: int, done: Done) -> list[dict]:
        return [self._final(index, Result([], done), streamed=True)]

    # ---- whole --------------------------------------------------------------------------------------
    def whole(self, results: list[Result]) -> dict | list[dict]:
        answers = [self._final(i, r, streamed=False) for i, r in enumerate(results)]
        return answers[0] if len(answers) == 1 else answers

    def _final(self, index: int, result: Result, streamed: bool) -> dict:
        done, outs, job = result.done, result.outs, self.jobs[index]
        answer = {"index": index, "content": "".join(o.text for o in outs),
                  "tokens": [o.token for o in outs] if self.return_tokens and not streamed else [],
                  "id_slot": done.id_slot, "stop": True, "model": self.model, "tokens_predicted": done.n_decoded,
                  "tokens_evaluated": done.n_prompt, "generation_settings": self.settings,
                  "prompt": self.server.vocab.detokenize(job.tokens, remove_special=False, unparse_special=True),
                  "has_new_line": self.new_line[index] or any("\n" in o.text for o in outs),
                  "truncated": done.truncated,
                  "stop_type": done.stop_type, "stopping_word": done.stopping_word, "tokens_cached": done.tokens_cached,
                  "timings": timings(done)}
        if self.n_probs and not streamed:
            probs = [self.probability(o) for o in outs if o.complete]
            if done.stop_type == "word":  # the stop string's tokens are not the answer's
                n_stop = len(self.server.vocab.tokenize(done.stopping_word, add_special=False))
                probs = probs[:len(probs) - min(len(probs), n_stop)]
            if probs:
                answer["completion_probabilities"] = probs
        return nested_values(self.fields, answer) if self.fields else answer


def _whole_characters(data: bytes) -> str:
    """validate_utf8: the text less a multi-byte character cut at its end."""
    n = len(data)
    for i in range(1, min(4, n) + 1):
        c = data[n - i]
        if (c & 0xE0) == 0xC0 and i < 2 or (c & 0xF0) == 0xE0 and i < 3 or (c & 0xF8) == 0xF0 and i < 4:
            n -= i
            break
    return data[:n].decode("utf-8", "replace")
