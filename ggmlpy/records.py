"""Hyper-parameter records: pydantic models whose fields are checked when they are made.

The optimizers' and training's parameters (`AdamW`, `SGD`, `LRSchedule`, `TrainParams`, ...)
derive from `Record`: keyword-only, unknown fields refused (`extra="forbid"`), frozen unless
a class says otherwise, bounds as `Field(ge=, gt=, le=)`, rules that tie fields together as
`model_validator(mode="after")`. The field types below keep numbers honest: a bool or a
string is not a number, a float with a fraction is not a whole number, an int is a float.

A bad value raises pydantic's `ValidationError` (a ValueError); `explain(e)` turns it into
the record field it names ("LRSchedule.lr0") and one line ("LRSchedule.lr0 must be > 0,
not -1.0"), which a command line can reword with the flag that set the field.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import AllowInfNan, BaseModel, BeforeValidator, ConfigDict, Strict, StrictBool, StrictStr, ValidationError
from pydantic_core import PydanticCustomError

__all__ = ["Bool", "Float", "Int", "Record", "Str", "explain"]


def _whole_number(value: Any) -> Any:
    if isinstance(value, (bool, str, bytes)):  # pydantic's lax int would take True and "3"
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


Int = Annotated[int, BeforeValidator(_whole_number)]  # 3, 3.0, numpy integers; not 2.5, True or "3"
Float = Annotated[float, Strict(), AllowInfNan(False)]  # finite; ints and numpy floats accepted
Bool = StrictBool
Str = StrictStr


class Record(BaseModel):
    """Base of the parameter records (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    _by_name: ClassVar[dict[str, type[Record]]] = {}

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        Record._by_name[cls.__name__] = cls

    def replace(self, **changes: Any) -> Record:
        """A copy with `changes`, checked like a new record (pydantic's model_copy(update=) is
        not); its fields set (`model_fields_set`) are this one's and the changed ones."""
        return type(self)(**{**{name: getattr(self, name) for name in self.model_fields_set}, **changes})


# how each kind of pydantic error reads: "<field> must be ..."
_EXPECTED = {
    "greater_than": "> {gt:g}", "greater_than_equal": ">= {ge:g}", "less_than": "< {lt:g}",
    "less_than_equal": "<= {le:g}", "finite_number": "a finite number",
    "int_type": "a whole number", "int_from_float": "a whole number", "int_parsing": "a whole number",
    "float_type": "a number", "float_parsing": "a number", "bool_type": "True or False",
    "string_type": "a string", "literal_error": "one of {expected}", "callable_type": "callable",
    "tuple_type": "a sequence", "list_type": "a sequence", "model_type": "a {class_name}",
    "dict_type": "a dict", "none_required": "None",
}


def explain(e: ValidationError) -> tuple[str, str]:
    """(the record field a ValidationError names, e.g. "LRSchedule.lr0"; one line saying what is
    wrong, e.g. "LRSchedule.lr0 must be > 0, not -1.0"). Only the first error is told; a rule
    that ties fields together reads as its own message."""
    error = e.errors(include_url=False)[0]
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    where, choices = _field_name(e.title, error["loc"])
    if kind == "value_error":  # a model_validator's rule (or a field validator's ValueError)
        return where, str(ctx.get("error", error["msg"]))
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tag = ctx.get("discriminator", "kind").strip("'")
        given = ctx.get("tag", value.get(tag) if isinstance(value, dict) else None)
        return where, f"{where}: {tag} must be one of {', '.join(map(repr, choices))}, not {given!r}"
    if kind == "extra_forbidden":
        return where, f"{where} is not a field of {where.rsplit('.', 1)[0]}"
    if kind == "missing":
        return where, f"{where} is required"
    if kind == "frozen_instance" or kind == "frozen_field":
        return where, f"{where} cannot change: make a copy with .replace({where.rsplit('.', 1)[-1]}=...)"
    if kind in _EXPECTED:
        try:
            expected = _EXPECTED[kind].format(**ctx)
        except (KeyError, ValueError):
            expected = None
        if expected is not None:
            return where, f"{where} must be {expected}, not {value!r}"
    return where, f"{where}: {error['msg']}, not {value!r}"


def _nested_records(annotation: Any) -> list[type[Record]]:
    """The Record classes in a field's annotation (X, X | None, X | Y, Annotated[...])."""
    if isinstance(annotation, type) and issubclass(annotation, Record):
        return [annotation]
    return [r for arg in getattr(annotation, "__args__", ()) for r in _nested_records(arg)]


def _field_name(title: str, loc: tuple[int | str, ...]) -> tuple[str, dict[str, type[Record]]]:
    """The field a pydantic error location points at, named after the record that owns it
    (TrainParams' ("optimizer", "sgd", "wd") is "SGD.wd"; list indices are left out), and
    the records by `kind` that the field may hold."""
    owner: type[Record] | None = Record._by_name.get(title)
    name, choices = title, {}
    for part in loc:
        if isinstance(part, int):
            continue
        if owner is None and part in choices:  # a discriminated union's tag
            owner, name = choices[part], choices[part].__name__
            continue
        field = owner.model_fields.get(part) if owner is not None else None
        name = f"{owner.__name__ if owner is not None else name}.{part}"
        if field is None:
            owner, choices = None, {}
            continue
        records = _nested_records(field.annotation)
        owner = records[0] if len(records) == 1 else None
        choices = {r.model_fields["kind"].default: r for r in records if "kind" in r.model_fields}
    return name, choices
