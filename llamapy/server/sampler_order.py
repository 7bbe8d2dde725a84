"""A request's `samplers`: the order its sampler chain applies llama.cpp's samplers in.

llama-server takes the order as a list of names (canonical, kebab-case, without dashes, or
the aliases nucleus, temp, typ; any case) or a string of one character each (common's
sampler chars). Its chain is then: the logit biases, the named samplers in that order, and a
draw (`dist`); a temperature <= 0 makes the `temperature` step keep only the most likely
token, so from there the chain is greedy.

Of llama.cpp's samplers, `dry`, `top_n_sigma` and `xtc` have no form here: they are taken
where a request leaves them off (their parameters at the values that disable them, which the
request schema enforces), so llama-server's default order is accepted as sent. `infill` and
`adaptive_p`, which change the draw itself, are refused, and so is a name llama.cpp does not
know (llama-server drops it with a warning in its log, which a client never sees).
"""
from __future__ import annotations

from llamapy.sampling import (Dist, Greedy, LogitBias, MinP, Penalties, SamplerChain, Temp, TempExt, TopK, TopP,
                              Typical)

CANONICAL = ("dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature", "xtc", "infill", "penalties",
             "adaptive_p")
CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p", "t": "temperature",
         "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}
DEFAULT_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
NO_OP_HERE = frozenset({"dry", "top_n_sigma", "xtc"})  # off at the parameters a request may send
REFUSED = {"infill": "the infill sampler", "adaptive_p": "adaptive-p sampling"}


def _names() -> dict[str, str]:
    """Every spelling llama.cpp accepts -> its canonical name."""
    names = {name: name for name in CANONICAL}
    for name in CANONICAL:
        if "_" in name:
            names[name.replace("_", "-")] = name
            names[name.replace("_", "")] = name
    names.update(nucleus="top_p", temp="temperature", typ="typ_p")
    return names


NAMES = _names()


def sampler_order(given: list[str] | str) -> tuple[str, ...]:
    """The canonical names of a request's `samplers` (names, or a string of sampler chars);
    ValueError naming what is unknown or refused."""
    if isinstance(given, str):
        unknown = sorted({c for c in given if c not in CHARS})
        if unknown:
            raise ValueError(f"unknown sampler character(s) {', '.join(map(repr, unknown))} (known: "
                             f"{', '.join(f'{c}={n}' for c, n in CHARS.items())})")
        order = tuple(CHARS[c] for c in given)
    else:
        unknown = [name for name in given if name.lower() not in NAMES]
        if unknown:
            raise ValueError(f"unknown sampler name(s) {', '.join(map(repr, unknown))} (known: {', '.join(CANONICAL)})")
        order = tuple(NAMES[name.lower()] for name in given)
    for name in order:
        if name in REFUSED:
            raise ValueError(f"{REFUSED[name]} ({name}) is not supported by llamapy-server")
    return order


def ordered_chain(n_vocab: int, order: tuple[str, ...], *, temperature: float = 0.8, top_k: int = 40,
                  top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0, repeat_penalty: float = 1.0,
                  repeat_last_n: int = 64, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                  dynatemp_range: float = 0.0, dynatemp_exp: float = 1.0, seed: int = 0,
                  logit_bias: dict[int, float] | None = None, min_keep: int = 0) -> SamplerChain:
    """llama.cpp's common_sampler chain for `order` (sampler_order's names), with the samplers
    that would change nothing left out."""
    chain = SamplerChain()
    if logit_bias:
        chain.add(LogitBias(n_vocab, logit_bias))
    keep = max(min_keep, 1)
    for name in order:
        if name == "penalties" and (repeat_penalty != 1.0 or frequency_penalty != 0.0 or presence_penalty != 0.0):
            chain.add(Penalties(repeat_last_n, repeat_penalty, frequency_penalty, presence_penalty))
        elif name == "top_k" and top_k > 0:
            chain.add(TopK(top_k))
        elif name == "typ_p" and typical_p < 1.0:
            chain.add(Typical(typical_p, keep))
        elif name == "top_p" and top_p < 1.0:
            chain.add(TopP(top_p, keep))
        elif name == "min_p" and min_p > 0.0:
            chain.add(MinP(min_p, keep))
        elif name == "temperature":
            if temperature <= 0:  # only the most likely token is left: the draw is greedy
                return chain.add(Greedy())
            chain.add(TempExt(temperature, dynatemp_range, dynatemp_exp) if dynatemp_range > 0 else Temp(temperature))
    return chain.add(Dist(seed))
