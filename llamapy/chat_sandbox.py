"""The Jinja sandbox chat templates run in, with a time, size and memory budget per render.

A chat template is code from a model file or a user's file, rendered without anyone
watching (a training set renders thousands of conversations). jinja2's
ImmutableSandboxedEnvironment keeps it away from Python's internals and caps `range` at
100,000 items, but a template can still loop for hours (two nested ranges, a macro that
calls itself twice) or ask for gigabytes in one operation (`"%0999999999d" % 1`, a string
doubled in a loop, `lipsum(10**7)`).

How the limits are enforced, and why this way:

- A subprocess per render would bound everything but costs milliseconds per render, more
  than the render itself, thousands of times per training set. A watchdog thread cannot
  stop a C call (`str * int`, `"%0999999999d" % 1`) and can interrupt Python only at an
  arbitrary point. So the limits are checked by the template's own code, in process:
- Time and memory: a check that jinja's generated code reaches often: each iteration of
  every `{% for %}` (the code generator wraps the loop's iterable), each call the sandbox
  makes (functions, macros, methods) and each filter. It compares a monotonic clock with
  the deadline (`RenderLimits.seconds`) and, every 10 ms of a render that lasts that long,
  the process's resident memory with its size at the first such check
  (`RenderLimits.memory`: what a template keeps, e.g. a list of a thousand large strings,
  shows only there). Linux only for memory (/proc/self/statm); process-wide, so a render
  beside other busy threads may see their growth too.
- Size: every operation that can make a text or list much larger than its operands is
  checked before it allocates, against `RenderLimits.chars`: `+`, `*`, `**` (and big
  integers), `%` formatting (widths, precisions, `*` widths, each argument),
  `str.format`, `~`, the output and what macros and `{% set %}` blocks capture, the
  string methods and filters that pad, repeat or insert (center, ljust, rjust, zfill,
  expandtabs, replace, join, translate, indent, wordwrap, urlize, format, tojson, sum),
  the conversion of a container to text (a list holding one list 100,000 times prints
  as gigabytes: its printed size is estimated first, stopping at the limit), and counts
  that make items (`lipsum`, `batch`, `slice` and `range` at 100,000, jinja's cap).
  So no single string grows past a small multiple of the limit before the check.
  Filters are never run at compile time (jinja folds constant filter calls), so a
  template's constants are checked like the rest.

What the checks cost is one call and a clock read per loop iteration, call or filter, and
a length per operand: 2 to 12 µs per render (median 4 µs; about 30% of the render itself)
on the real templates in the repository (shared data/chat_templates, tests/data, the
built-in ones) and the conversations of tests/data/llama_cpp_chat_templates.json, and 3%
of what a training sample costs (rendered three times for its loss mask, then tokenized):
bench/chat_template_limits.py, bench/RESULTS.md. The output is identical.

The code generator and the sandbox are extended through jinja2 internals; every one of them
comes from jinja_compat.py, which checks them on import (a jinja2 lacking one: one line).
"""
from __future__ import annotations

import json
import math
import mmap
import re
import threading
import time
from collections.abc import Callable, ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass
from datetime import datetime
from functools import update_wrapper
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from markupsafe import EscapeFormatter, Markup

from .errors import InputError
from .jinja_compat import (
    MAX_RANGE,
    CodeGenerator,
    Frame,
    Namespace,
    SandboxedFormatter,
    generate_lorem_ipsum,
    make_attrgetter,
    namespace_attrs,
    object_type_repr,
    optimizeconst,
)

_SMALL = 1 << 16  # sizes below every limit (RenderLimits.chars is at least this): no need to look at the budget


@dataclass(frozen=True)
class RenderLimits:
    """What one render may use: generous for real templates (a few kB of output in well
    under a millisecond), small enough that a hostile one ends in seconds and megabytes."""

    seconds: float = 5.0        # wall-clock time of one render
    chars: int = 4_000_000      # the output, and any one string or list built on the way
    memory: int = 512 << 20     # bytes the process may grow by during one render

    def __post_init__(self) -> None:
        if not (0 < self.seconds < math.inf and self.chars >= _SMALL and self.memory > 0):
            raise InputError(f"render limits must be a positive time, at least {_SMALL:,} characters and a positive "
                             f"memory size, not {self}")


DEFAULT_LIMITS = RenderLimits()
_INT_BITS = 1 << 16    # the largest integer a template may make (about 19,700 digits)
_PROBE_SECONDS = 0.01  # how often a long render checks its memory


class RenderLimitExceeded(Exception):
    """A render went past its RenderLimits (the message says which); not an error of the
    sandbox's own, so that no filter catches it on the way out."""


class _Budget:
    """One render's limits and deadline; `tick()` is the check the template's code reaches."""

    __slots__ = ("deadline", "limits", "next_check", "rss0")

    def __init__(self, limits: RenderLimits, start: float) -> None:
        self.limits = limits
        self.deadline = start + limits.seconds
        self.next_check = min(self.deadline, start + _PROBE_SECONDS)
        self.rss0: int | None = None

    def tick(self) -> None:
        if time.monotonic() >= self.next_check:
            self.check_now()

    def check_now(self) -> None:
        """The deadline, and the memory every _PROBE_SECONDS."""
        now = time.monotonic()
        if now >= self.deadline:
            raise RenderLimitExceeded(f"it ran longer than {self.limits.seconds:g} s, the time limit of a render")
        self.next_check = min(self.deadline, now + _PROBE_SECONDS)
        rss = _rss()
        if self.rss0 is None:
            self.rss0 = rss
        elif rss - self.rss0 > self.limits.memory:
            raise RenderLimitExceeded(f"it grew the process by {(rss - self.rss0) >> 20} MB, more than the "
                                      f"{self.limits.memory >> 20} MB a render may use")


def _rss() -> int:
    """Resident bytes of this process (0 where /proc is missing: no memory check there)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except OSError:
        return 0


_local = threading.local()
_IDLE = _Budget(DEFAULT_LIMITS, math.inf)  # outside a render (compile-time constants): sizes only


def _budget() -> _Budget:
    return getattr(_local, "budget", None) or _IDLE


def render(template: jinja2.Template, limits: RenderLimits, variables: dict[str, Any]) -> str:
    """`template` rendered with `variables` under `limits` (RenderLimitExceeded past them)."""
    previous = getattr(_local, "budget", None)
    _local.budget = _Budget(limits, time.monotonic())
    try:
        return template.render(variables)
    finally:
        _local.budget = previous


# ---- sizes -------------------------------------------------------------------------------------
def _too_big(what: str, n: float) -> RenderLimitExceeded:
    limit = _budget().limits.chars
    size = f"{n:,.0f}" if n < 1e18 else "an enormous number of"
    return RenderLimitExceeded(f"{what} would make {size} characters or items, more than the {limit:,} "
                               "a render may build")


def _check_size(what: str, n: float) -> None:
    if n > _budget().limits.chars:
        raise _too_big(what, n)


def _printed_size(value: Any, limit: int) -> int:
    """About how many characters str(value) has (a bound up to escapes), counted only
    until it passes `limit`: a list holding one large list many times is never printed."""
    if isinstance(value, str):
        return len(value)
    total, stack = 0, [value]
    while stack and total <= limit:
        x = stack.pop()
        if isinstance(x, (str, bytes)):
            total += len(x) + 3
        elif isinstance(x, int):
            total += x.bit_length() // 3 + 2
        elif isinstance(x, Mapping):
            total += 2 + 4 * len(x)
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset, KeysView, ValuesView, ItemsView)):
            total += 2 + 2 * len(x)
            stack.extend(x)
        elif isinstance(x, Namespace):
            stack.append(namespace_attrs(x))
        else:  # numbers, None, jinja's objects: short
            total += 24
    return total


def _check_printed(what: str, *values: Any) -> None:
    limit = _budget().limits.chars
    total = 0
    for value in values:
        total += _printed_size(value, limit - total)
        if total > limit:
            raise _too_big(what, total)


def _check_int(what: str, bits: int) -> None:
    if bits > _INT_BITS:
        raise RenderLimitExceeded(f"{what} would make a number of about {bits:,} bits, more than the {_INT_BITS:,} "
                                  "a render may build")


def _check_count(what: str, n: Any) -> None:
    if isinstance(n, int) and n > MAX_RANGE:
        raise RenderLimitExceeded(f"{what} of {n:,} is more than the {MAX_RANGE:,} a render may make")


_SEQ = (str, bytes, list, tuple)


def _is_seq(x: Any) -> bool:
    return isinstance(x, _SEQ)


def _is_int(x: Any) -> bool:
    return isinstance(x, int)


# ---- operators ---------------------------------------------------------------------------------
def _add(a: Any, b: Any) -> Any:
    if isinstance(a, _SEQ) and isinstance(b, _SEQ):
        if len(a) + len(b) > _SMALL:
            _check_size("'+'", len(a) + len(b))
    elif isinstance(a, int) and isinstance(b, int):
        _check_int("'+'", max(a.bit_length(), b.bit_length()) + 1)
    return a + b


def _mul(a: Any, b: Any) -> Any:
    if _is_seq(a) and _is_int(b):
        _check_size("'*'", len(a) * b)
    elif _is_int(a) and _is_seq(b):
        _check_size("'*'", a * len(b))
    elif _is_int(a) and _is_int(b):
        _check_int("'*'", a.bit_length() + b.bit_length())
    return a * b


def _pow(a: Any, b: Any) -> Any:
    if _is_int(a) and _is_int(b) and b > 0 and abs(a) > 1:
        _check_int("'**'", a.bit_length() * b)
    return a ** b


# %[(key)][flags][width][.precision][length]type
_PRINTF = re.compile(r"%(?:\(([^)]*)\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.?)", re.DOTALL)


def _number(digits: str) -> float:
    return int(digits) if len(digits) < 19 else math.inf


def _check_printf(what: str, fmt: str, args: Any) -> None:
    """Bound the length of `fmt % args` before Python builds it: the format's own text,
    each field's width and precision, and each argument's printed size."""
    limit = _budget().limits.chars
    mapping = args if isinstance(args, Mapping) else None
    positional = iter(args if isinstance(args, tuple) else (args,))
    total: float = len(fmt)
    for m in _PRINTF.finditer(fmt):
        key, width, precision, conversion = m.groups()
        if conversion == "%":
            continue
        for field in (width, precision):
            if field == "*":
                n = next(positional, 0)
                total += abs(n) if _is_int(n) else 0
            elif field:
                total += _number(field)
        if key is not None:
            value = mapping.get(key) if mapping is not None else None
        else:
            value = next(positional, None)
        total += _printed_size(value, limit)
        if total > limit:
            raise _too_big(what, total)


def _mod(a: Any, b: Any) -> Any:
    if isinstance(a, str):
        _check_printf("'%' formatting", a, b)
    return a % b


_BINOPS = {"+": "checked_add", "*": "checked_mul", "**": "checked_pow", "%": "checked_mod"}


def _concat(pieces: Iterable[str]) -> str:
    """The output, and what a macro or a `{% set %}` block captures, measured before it is
    joined (each piece was bounded when it was made; many of them, by the memory check)."""
    pieces = pieces if isinstance(pieces, list) else list(pieces)
    _check_size("the text rendered", sum(map(len, pieces)))
    return "".join(pieces)


def _finalize(value: Any) -> Any:
    """Every `{{ ... }}` before it is printed: a container's printed size is bounded first."""
    if not isinstance(value, (str, int, float)):
        _check_printed("printing a value", value)
    return value


def _guarded_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    """A `{% for %}` loop's items, with the budget checked before each."""
    budget = _budget()
    for item in iterable:
        if time.monotonic() >= budget.next_check:
            budget.check_now()
        yield item


# ---- string methods called from templates -------------------------------------------------------
def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _replaced_size(s: str | bytes, old: Any, new: Any, count: Any) -> float:
    """Length of s.replace(old, new, count), without making it."""
    if not (isinstance(old, type(s)) and isinstance(new, type(s))):
        return len(s)  # the call fails on its own
    n = s.count(old) if old else len(s) + 1
    if _is_int(count) and count >= 0:
        n = min(n, count)
    return len(s) + n * (len(new) - len(old))


def _width_size(s: Any, args: tuple, kwargs: dict) -> float:
    width = _arg(args, kwargs, 0, "width", 0)
    return width if _is_int(width) else 0


def _expandtabs_size(s: Any, args: tuple, kwargs: dict) -> float:
    tabsize = _arg(args, kwargs, 0, "tabsize", 8)
    return len(s) + s.count("\t" if isinstance(s, str) else b"\t") * max(tabsize, 1) if _is_int(tabsize) else 0


def _translate_size(s: Any, args: tuple, kwargs: dict) -> float:
    table = _arg(args, kwargs, 0, "table")
    if not isinstance(table, Mapping):
        return len(s)
    longest = max((len(v) for v in table.values() if isinstance(v, (str, bytes))), default=1)
    return len(s) * max(longest, 1)


_STR_METHOD_SIZES: dict[str, Callable[[Any, tuple, dict], float]] = {
    "center": _width_size, "ljust": _width_size, "rjust": _width_size, "zfill": _width_size,
    "expandtabs": _expandtabs_size, "translate": _translate_size,
    "replace": lambda s, a, k: _replaced_size(s, _arg(a, k, 0, "old"), _arg(a, k, 1, "new"), _arg(a, k, 2, "count")),
}


def _joined(sep: Any, items: Iterable[Any], what: str) -> list[Any]:
    """`items` as a list, checked: joining them with `sep` stays within the limit."""
    items = list(items)
    limit = _budget().limits.chars
    total = len(sep) * max(len(items) - 1, 0) if isinstance(sep, (str, bytes)) else 0
    for item in items:
        total += _printed_size(item, limit)
        if total > limit:
            raise _too_big(what, total)
    return items


# ---- filters -----------------------------------------------------------------------------------
def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' tojson: plain json.dumps (Jinja's own escapes HTML characters); its
    indent and separators are bounded, as they repeat on every line and item."""
    if indent is not None and not (_is_int(indent) and 0 <= indent <= 16):
        raise RenderLimitExceeded(f"tojson's indent {indent!r} is not one of the 0 to 16 spaces a render may use")
    if separators is not None and not (isinstance(separators, (list, tuple)) and len(separators) == 2
                                       and all(isinstance(s, str) and len(s) <= 16 for s in separators)):
        raise RenderLimitExceeded("tojson's separators are not two strings of at most 16 characters, as a render "
                                  "may use")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@jinja2.pass_environment
def _sum(environment: jinja2.Environment, iterable: Iterable[Any], attribute: Any = None, start: Any = 0) -> Any:
    """jinja's sum with each addition checked (a sum of lists concatenates them)."""
    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    total = start
    for item in iterable:
        total = _add(total, item)
    return total


def _lines(s: Any) -> int:
    return str(s).count("\n") + 1


def _filter_size_checks() -> dict[str, Callable[..., None]]:
    """Per filter, a check of its arguments before it runs: (value, args, kwargs) -> None."""

    def center(value, args, kwargs):
        _check_size("the filter center", _width_size(value, args, kwargs))

    def indent(value, args, kwargs):
        width = _arg(args, kwargs, 0, "width", 4)
        size = len(width) if isinstance(width, str) else width if _is_int(width) else 0
        _check_size("the filter indent", len(str(value)) + _lines(value) * size)

    def wordwrap(value, args, kwargs):
        text = str(value)
        width = _arg(args, kwargs, 0, "width", 79)
        wrap = _arg(args, kwargs, 2, "wrapstring") or "\n"
        lines = min(len(text) + 1, 2 * len(text) // max(width, 1) + _lines(text)) if _is_int(width) else 0
        _check_size("the filter wordwrap", len(text) + lines * len(str(wrap)))

    def urlize(value, args, kwargs):
        text = str(value)
        extra = sum(len(str(_arg(args, kwargs, i, name) or "")) for i, name in ((3, "target"), (4, "rel")))
        _check_size("the filter urlize", 2 * len(text) + (len(text) // 5 + 1) * (48 + extra))

    def replace(value, args, kwargs):
        old, new, count = (_arg(args, kwargs, i, n) for i, n in ((0, "old"), (1, "new"), (2, "count")))
        _check_size("the filter replace", _replaced_size(str(value), str(old), str(new), count))

    def fmt(value, args, kwargs):
        _check_printf("the filter format", str(value), kwargs or args)

    def batch(value, args, kwargs):
        if _arg(args, kwargs, 1, "fill_with") is not None:
            _check_count("the filter batch's linecount", _arg(args, kwargs, 0, "linecount"))

    def slice_(value, args, kwargs):
        _check_count("the filter slice's count", _arg(args, kwargs, 0, "slices"))

    def round_(value, args, kwargs):
        precision = _arg(args, kwargs, 0, "precision", 0)
        if _is_int(precision) and abs(precision) > 1000:
            raise RenderLimitExceeded(f"the filter round's precision {precision:,} is beyond the 1,000 digits "
                                      "a render may ask for")

    return {"center": center, "indent": indent, "wordwrap": wordwrap, "urlize": urlize, "replace": replace,
            "format": fmt, "batch": batch, "slice": slice_, "round": round_}


_FILTER_CHECKS = _filter_size_checks()
# filters that print a non-string value: its printed size is bounded first
_PRINTING_FILTERS = frozenset({"string", "upper", "lower", "title", "capitalize", "trim", "striptags", "wordcount",
                               "wordwrap", "truncate", "center", "indent", "replace", "escape", "e", "forceescape",
                               "safe", "urlencode", "urlize", "format", "tojson", "pprint", "xmlattr"})


def _guarded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """`f` with the budget ticked, its arguments checked and its result's length bounded.
    The wrapper takes the context, which also keeps jinja from running it at compile time."""
    passes = getattr(getattr(f, "jinja_pass_arg", None), "name", None)
    check = _FILTER_CHECKS.get(name)
    printing = name in _PRINTING_FILTERS

    def guarded(context: jinja2.runtime.Context, value: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if time.monotonic() >= budget.next_check:
            budget.check_now()
        if printing and not isinstance(value, str):
            _check_printed(f"the filter {name}", value)
        if check is not None:
            check(value, args, kwargs)
        if name == "join":
            value = _joined(_arg(args, kwargs, 0, "d", ""), value, "the filter join")
        if passes == "context":
            result = f(context, value, *args, **kwargs)
        elif passes == "eval_context":
            result = f(context.eval_ctx, value, *args, **kwargs)
        elif passes == "environment":
            result = f(context.environment, value, *args, **kwargs)
        else:
            result = f(value, *args, **kwargs)
        if isinstance(result, (str, list)) and len(result) > _SMALL:
            _check_size(f"the filter {name}", len(result))
        return result

    return jinja2.pass_context(update_wrapper(guarded, f))  # after update_wrapper, which copies f's pass_*


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # jinja's parameter names
    """jinja's lipsum, with its word count bounded as range is."""
    if _is_int(n) and _is_int(max):
        _check_count("lipsum's word count", n * max)
    return generate_lorem_ipsum(n, html, min, max)


# ---- str.format ----------------------------------------------------------------------------------
# [[fill]align][sign][z][#][0][width][grouping][.precision][type]
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[,_]?(?:\.(\d*))?[a-zA-Z%]?", re.DOTALL)


class _CheckedFormatter(SandboxedFormatter):
    """The sandbox's str.format, with each field's width, precision and value counted."""

    _total: float = 0

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self._total = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        limit = _budget().limits.chars
        m = _FORMAT_SPEC.fullmatch(format_spec)
        widths = [_number(d) for d in m.groups() if d] if m else []
        self._total += max([_printed_size(value, limit), *widths])
        if self._total > limit:
            raise _too_big("str.format", self._total)
        return super().format_field(value, format_spec)


class _CheckedEscapeFormatter(_CheckedFormatter, EscapeFormatter):
    """Markup.format, checked."""


# ---- the environments ----------------------------------------------------------------------------
def _checked_binop(function: str) -> Callable[[CodeGenerator, nodes.BinExpr, Frame], None]:
    """A code generator visitor calling `environment.<function>(left, right)` (the sandbox's
    call_binop, one call shorter: templates add strings all the time)."""

    @optimizeconst
    def visitor(self: CodeGenerator, node: nodes.BinExpr, frame: Frame) -> None:
        self.write(f"environment.{function}(")
        self.visit(node.left, frame)
        self.write(", ")
        self.visit(node.right, frame)
        self.write(")")
    return visitor


_GUARDED_ITER = nodes.EnvironmentAttribute("guarded_iter")  # what visit_For wraps a loop's iterable in


class _CodeGenerator(CodeGenerator):
    """jinja's code generator, with the budget reached from every loop, `~` and the
    operators that can grow a value."""

    visit_Add = _checked_binop(_BINOPS["+"])
    visit_Mul = _checked_binop(_BINOPS["*"])
    visit_Pow = _checked_binop(_BINOPS["**"])
    visit_Mod = _checked_binop(_BINOPS["%"])

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        node.iter = nodes.Call(_GUARDED_ITER, [node.iter], [], None, None, lineno=node.iter.lineno)
        super().visit_For(node, frame)

    def visit_Call(self, node: nodes.Call, frame: Frame, forward_caller: bool = False) -> None:
        if node.node is _GUARDED_ITER:  # a direct call: through the sandbox's `call` it costs a microsecond
            self.write("environment.guarded_iter(")
            self.visit(node.args[0], frame)
            self.write(")")
            return
        super().visit_Call(node, frame, forward_caller=forward_caller)

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile:  # the join upstream picks
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(f"), {join})")


_C_SPACES = " \t\n\v\f\r"  # C isspace(): what llama.cpp's Jinja engine strips


def _trim(value: Any, chars: str | None = None) -> str:
    return str(value).strip(_C_SPACES if chars is None else chars)


class Raised(jinja2.TemplateError):
    """An error the template raised itself (raise_exception): its message is the whole story."""


def _raise_exception(message: Any) -> None:
    _check_printed("raise_exception", message)
    raise Raised(str(message))


def _strftime_now(fmt: str) -> str:
    _check_size("strftime_now", 16 * len(str(fmt)))  # "%c" is 24 characters
    return datetime.now().strftime(fmt)


class _Undefined(jinja2.Undefined):
    """jinja's Undefined, whose error message does not print a key too large to print."""

    @property
    def _undefined_message(self) -> str:
        if self._undefined_hint is None and _printed_size(self._undefined_name, 200) > 200:
            return f"{object_type_repr(self._undefined_obj)} has no such element (a {type(self._undefined_name).__name__})"
        return super()._undefined_message


class PlainEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox for chat templates (trim_blocks, lstrip_blocks, loop controls,
    `raise_exception`, `strftime_now`, its `tojson`), except that stripping whitespace
    (`trim`, `.strip()`, `.lstrip()`, `.rstrip()` without arguments) strips C whitespace as
    llama.cpp does: Python's also strips Unicode spaces (U+00A0, U+3000), which llama.cpp
    keeps, and the ids must be llama.cpp's. Without limits: what TemplateEnvironment's
    output is compared with (tests, bench/chat_template_limits.py)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], **options)
        self.filters["tojson"] = _tojson
        self.filters["trim"] = _trim
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, str) and attribute in ("strip", "lstrip", "rstrip"):
            method = getattr(obj, attribute)
            return lambda chars=None: method(_C_SPACES if chars is None else chars)
        return super().getattr(obj, attribute)


class TemplateEnvironment(PlainEnvironment):
    """The environment chat templates render in: PlainEnvironment with the checks of the
    module docstring (render() sets the budget they check)."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset(_BINOPS)  # never folded at compile time (the visitors call the checks)

    def __init__(self) -> None:
        super().__init__(finalize=_finalize, undefined=_Undefined)
        self.filters["sum"] = _sum
        self.filters = {name: _guarded_filter(name, f) for name, f in self.filters.items()}
        self.globals["lipsum"] = _lipsum
        self.concat = _concat  # type: ignore[method-assign]
        self.guarded_iter = _guarded_iter
        self.checked_concat = _checked_concat
        self.checked_add, self.checked_mul, self.checked_pow, self.checked_mod = _add, _mul, _pow, _mod

    def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _budget().tick()
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, (str, bytes)):
            method = getattr(obj, "__name__", "")
            size = _STR_METHOD_SIZES.get(method)
            if size is not None:
                _check_size(f"str.{method}", size(owner, args, kwargs))
            elif method == "join" and args:
                args = (_joined(owner, args[0], "str.join"), *args[1:])
        return super().call(context, obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """The sandbox's str.format / format_map (jinja's own, with the checked formatter)."""
        if super().wrap_str_format(value) is None:
            return None
        f_self = value.__self__
        formatter = (_CheckedEscapeFormatter(self, escape=f_self.escape) if isinstance(f_self, Markup)
                     else _CheckedFormatter(self))
        is_format_map = value.__name__ == "format_map"

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument and no keyword arguments")
                args, kwargs = (), args[0]
            return type(f_self)(formatter.vformat(f_self, args, kwargs))

        return update_wrapper(wrapper, value)


def _checked_concat(pieces: tuple[Any, ...], join: Callable[[Iterable[Any]], str]) -> str:
    """`~`: the pieces' printed sizes bounded before they are joined."""
    _check_printed("'~'", *pieces)
    return join(pieces)
