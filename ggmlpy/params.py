"""Hyper-parameter records: dataclasses whose fields are checked when they are made.

The optimizers' and training's parameters (`AdamW`, `SGD`, `LRSchedule`, `TrainParams`, ...)
are keyword-only dataclasses deriving from `Params`. A field's annotation says what it
accepts (bool, int, float, str, a Literal, `X | None`, `tuple[str, ...]`, a callable, another
Params class or a union of them told apart by their `kind` field), `param(default, ge=, gt=,
le=)` adds bounds, and a class's `check()` adds what ties fields together. A bad value raises
one ParamError (a ValueError) naming the class and field. Numbers are converted (an int where a float is
expected), a dict becomes a nested record, anything else is refused.

Why not pydantic, which did this before: importing it and building these few schemas cost a
training process 8.6 MB, a quarter of issue 16's 36 MB budget for all that training adds.
(typer 0.29 imports it too, for every CLI option: pyproject keeps typer below 0.29.)
"""
from __future__ import annotations

import collections.abc
import dataclasses
import numbers
import types
import typing
from typing import Any, Literal, Union

__all__ = ["ParamError", "Params", "param"]

_BOUNDS = {"ge": (lambda v, b: v >= b, ">="), "gt": (lambda v, b: v > b, ">"), "le": (lambda v, b: v <= b, "<=")}


class ParamError(ValueError):
    """A value a record refuses. `field` names it ("AdamW.wd"); the message starts with that
    name (a command line can put the flag that set the field in its place)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _refused(where: str, expected: str, value: Any) -> ParamError:
    return ParamError(where, f"{where} must be {expected}, not {value!r}")


def param(default: Any = dataclasses.MISSING, *, default_factory: collections.abc.Callable[[], Any] | None = None,
          ge: float | None = None, gt: float | None = None, le: float | None = None) -> Any:
    """A field with bounds: param(1e-3, ge=0) accepts numbers >= 0 (and None, when the
    annotation allows it)."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le)) if v is not None}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=bounds)
    return dataclasses.field(default=default, metadata=bounds)


class Params:
    """Base of the parameter records (keyword-only dataclasses); see the module docstring."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "Params":
        self = super().__new__(cls)
        object.__setattr__(self, "_fields_set", frozenset(kwargs))  # __new__ sees __init__'s keywords
        return self

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = _convert(getattr(self, f.name), _hints(type(self))[f.name], f"{type(self).__name__}.{f.name}")
            for key, bound in f.metadata.items():
                ok, sign = _BOUNDS[key]
                if value is not None and not ok(value, bound):
                    raise _refused(f"{type(self).__name__}.{f.name}", f"{sign} {bound:g}", value)
            object.__setattr__(self, f.name, value)
        self.check()

    def check(self) -> None:
        """Rules that tie fields together (raise ValueError); runs after the fields' own checks."""

    @property
    def fields_set(self) -> frozenset[str]:
        """The fields the caller gave (the others hold their defaults)."""
        return getattr(self, "_fields_set", frozenset())

    def as_dict(self, *, exclude: tuple[str, ...] = (), only_set: bool = False) -> dict[str, Any]:
        """The fields as JSON-ready values (nested records as dicts, tuples as lists), in
        definition order; `only_set`: the fields the caller gave."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in exclude and (not only_set or f.name in self.fields_set)}

    def replace(self, **changes: Any) -> "Params":
        """A copy with `changes`, checked like a new record; the fields set are this one's and
        the changed ones."""
        copy = dataclasses.replace(self, **changes)
        object.__setattr__(copy, "_fields_set", self.fields_set | frozenset(changes))
        return copy


def _plain(value: Any) -> Any:
    if isinstance(value, Params):
        return value.as_dict()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _convert(value: Any, hint: Any, where: str) -> Any:
    """`value` as `hint` says, or ParamError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        records = [a for a in options if isinstance(a, type) and issubclass(a, Params)]
        if len(records) > 1 and isinstance(value, dict):  # a union of records: the one whose kind it names
            by_kind = {_hints(r)["kind"].__args__[0]: r for r in records}
            if value.get("kind") not in by_kind:
                raise ParamError(where, f"{where}: kind must be one of {', '.join(map(repr, by_kind))}, "
                                        f"not {value.get('kind')!r}")
            return by_kind[value["kind"]](**value)
        errors = []
        for option in options:
            try:
                return _convert(value, option, where)
            except ParamError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        if value not in args:
            raise _refused(where, f"one of {', '.join(map(repr, args))}", value)
        return value
    if origin is tuple:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise _refused(where, "a sequence", value)
        return tuple(_convert(v, args[0], where) for v in value)
    if origin is collections.abc.Callable:
        if not callable(value):
            raise _refused(where, "callable", value)
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise _refused(where, "True or False", value)
        return value
    if hint is int:
        whole = isinstance(value, numbers.Integral) or isinstance(value, numbers.Real) and float(value).is_integer()
        if isinstance(value, bool) or not whole:
            raise _refused(where, "a whole number", value)
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _refused(where, "a number", value)
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise _refused(where, "a string", value)
        return value
    if isinstance(hint, type) and issubclass(hint, Params):
        if isinstance(value, dict):
            return hint(**value)
        if not isinstance(value, hint):
            raise _refused(where, f"a {hint.__name__}", value)
        return value
    if isinstance(hint, type) and not isinstance(value, hint):
        raise _refused(where, f"a {hint.__name__}", value)
    return value
