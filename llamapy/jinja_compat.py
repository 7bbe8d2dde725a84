"""Everything the chat-template sandbox (chat_sandbox.py) reaches in jinja2 beyond its public
API, in one place, checked when this module is imported, so that a jinja2 that moved one of
them fails with one line naming it instead of a template rendering unchecked or a traceback
from deep inside a render. pyproject.toml pins the jinja2 series this was written against
(`SUPPORTED`); `missing()` names what an installed jinja2 lacks (tests/test_jinja_compat.py).

What the sandbox needs and why:
- the code generator (`CodeGenerator`, `Frame`, `optimizeconst`) and its visitors for `for`,
  calls, `~` and the binary operators, which it overrides so that a template's own code
  reaches the render budget; the names the generated code calls (`str_join`, `markup_join`);
- the sandbox's `MAX_RANGE`, `SandboxedFormatter`, `wrap_str_format`, `intercepted_binops`
  and `call`, which the checked formatter and environment extend;
- `Namespace`'s private attribute dict and `Undefined`'s private fields, read to size them;
- `make_attrgetter`, `generate_lorem_ipsum`, `object_type_repr`: jinja's own helpers behind
  the `sum` filter, `lipsum` and the undefined-value message, reused so output is jinja's.
"""
from __future__ import annotations

import importlib

import jinja2
import jinja2.compiler
import jinja2.filters
import jinja2.nodes
import jinja2.runtime
import jinja2.sandbox
import jinja2.utils

from .errors import LlamapyError

SUPPORTED = ">=3.1,<3.2"  # the jinja2 series the sandbox is known to work with (pyproject.toml's pin)

# (module, attribute path): every jinja2 name beyond the public API the sandbox uses
_NEEDED = (
    ("jinja2.compiler", "CodeGenerator"), ("jinja2.compiler", "Frame"), ("jinja2.compiler", "optimizeconst"),
    ("jinja2.compiler", "CodeGenerator.visit_For"), ("jinja2.compiler", "CodeGenerator.visit_Call"),
    ("jinja2.compiler", "CodeGenerator.visit_Concat"), ("jinja2.compiler", "CodeGenerator.write"),
    ("jinja2.compiler", "CodeGenerator.visit"),
    ("jinja2.nodes", "EnvironmentAttribute"), ("jinja2.nodes", "Call"),
    ("jinja2.sandbox", "MAX_RANGE"), ("jinja2.sandbox", "SandboxedFormatter"),
    ("jinja2.sandbox", "SandboxedEnvironment.intercepted_binops"),
    ("jinja2.sandbox", "SandboxedEnvironment.wrap_str_format"), ("jinja2.sandbox", "SandboxedEnvironment.call"),
    ("jinja2.utils", "Namespace"), ("jinja2.utils", "generate_lorem_ipsum"), ("jinja2.utils", "object_type_repr"),
    ("jinja2.filters", "make_attrgetter"),
    ("jinja2.runtime", "Undefined._undefined_message"),
    ("jinja2", "Environment.code_generator_class"),
)
# names jinja's generated code must find in a template's namespace (the sandbox's `~` calls them)
_EXPORTED = ("str_join", "markup_join")


class JinjaVersionError(LlamapyError):
    """The installed jinja2 lacks internals the chat-template sandbox is built on."""


def _has(module: str, path: str) -> bool:
    obj = importlib.import_module(module)
    for part in path.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _instance_fields() -> list[str]:
    """The private fields of jinja objects the sandbox reads (set per instance, not on the class)."""
    lacking = []
    try:
        object.__getattribute__(jinja2.utils.Namespace(), "_Namespace__attrs")
    except AttributeError:
        lacking.append("jinja2.utils.Namespace._Namespace__attrs")
    undefined = jinja2.runtime.Undefined(hint=None, obj=None, name="x")
    lacking += [f"jinja2.runtime.Undefined.{name}" for name in ("_undefined_hint", "_undefined_obj", "_undefined_name")
                if not hasattr(undefined, name)]
    return lacking


def missing() -> list[str]:
    """The jinja2 internals the sandbox uses that the installed jinja2 lacks (empty: all there)."""
    lacking = [f"{module}.{path}" for module, path in _NEEDED if not _has(module, path)]
    lacking += [f"jinja2.runtime.exported[{name!r}]" for name in _EXPORTED if name not in jinja2.runtime.exported]
    try:
        lacking += _instance_fields()
    except Exception as e:  # a jinja2 whose constructors changed
        lacking.append(f"jinja2.utils.Namespace / jinja2.runtime.Undefined as constructed here ({e})")
    return lacking


def check() -> None:
    """Raise JinjaVersionError with one line when the installed jinja2 lacks what the sandbox uses."""
    lacking = missing()
    if lacking:
        raise JinjaVersionError(
            f"jinja2 {getattr(jinja2, '__version__', '?')} lacks {', '.join(lacking)}, which llamapy's chat-template "
            f"sandbox is built on: install jinja2{SUPPORTED} (pip install 'jinja2{SUPPORTED}')")


check()

CodeGenerator = jinja2.compiler.CodeGenerator
Frame = jinja2.compiler.Frame
optimizeconst = jinja2.compiler.optimizeconst
MAX_RANGE = jinja2.sandbox.MAX_RANGE
SandboxedFormatter = jinja2.sandbox.SandboxedFormatter
Namespace = jinja2.utils.Namespace
generate_lorem_ipsum = jinja2.utils.generate_lorem_ipsum
object_type_repr = jinja2.utils.object_type_repr
make_attrgetter = jinja2.filters.make_attrgetter


def namespace_attrs(value: Namespace) -> dict:
    """A jinja `namespace()`'s attributes (kept in a private dict its __getattribute__ guards)."""
    return getattr(value, "_Namespace__attrs", {})
