"""The one argument layer of the command-line tools: llama.cpp's flag conventions on typer.

A flag is declared once, as a typed alias made by `flag()`: its names (llama.cpp's, short
forms first), its help group, its help text, and its environment variable where llama.cpp
has one (`LLAMA_ARG_CTX_SIZE`). A tool's command is a typer function whose parameters use
those aliases, with the tool's own default; flags several tools share travel as a dataclass
of such fields (`TrainingArgs`) that `Tool.command` spreads into the signature.

What typer alone would get wrong for llama.cpp users, `Tool.main` settles before click
parses: click splits an undeclared `-ngl` into `-n gl`, so every token that looks like a
flag must be one the tool declares, one of llama.cpp's flags this runtime notes or refuses
(`llama_cpp.py`), or it is refused by name; flags whose value may be left out (`-lr-half`)
get their bare value; click's multi-line usage errors become one line. Every tool has `-h`,
`--version`, `-v`, `-lv N`, `--log-disable` and `--log-file`, and prints its help grouped by
purpose, in plain text that wraps instead of truncating at any width.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import typer.core

from llamapy.errors import InputError

from . import common
from .llama_cpp import LlamaCppFlag, llama_cpp_flags

# help groups, in the order --help shows them
COMMON = "Common"
GENERATION = "Generation"
SAMPLING = "Sampling"
CHAT = "Chat"
PERPLEXITY = "Perplexity"
TRAINING = "Training"
SCHEDULE = "Learning rate"
LORA = "LoRA"
DATA = "Data"
CHECKPOINTS = "Checkpoints"
MODEL_SHAPE = "New model"
QUANTIZE = "Quantization"
OUTPUT = "Output"
LOGGING = "Logging"
GROUPS = (COMMON, GENERATION, SAMPLING, CHAT, PERPLEXITY, TRAINING, SCHEDULE, LORA, DATA, CHECKPOINTS, MODEL_SHAPE,
          QUANTIZE, OUTPUT, LOGGING)


def flag(*names: str, help: str, group: str = COMMON, env: str | None = None, metavar: str | None = None,
         bare: str | None = None, show_default: bool | str = True, path: str | None = None,
         paths_of: Callable[[Any], list] | None = None, replaced_by: str | None = None, **checks: Any) -> Any:
    """A flag's declaration: typer's Option with llama.cpp's names, its help group and text and
    its environment variable. `bare`: the value of the flag given without one (`-lr-half`);
    `path`: "read", "write" or "append" (a log), the role of the file(s) it names (paths.py),
    `paths_of` turning its value into them and `replaced_by` the write flag allowed onto it;
    `checks`: typer's own (min=, max=)."""
    info = typer.Option(*names, help=help, rich_help_panel=group, envvar=env, show_envvar=env is not None,
                        metavar=metavar, show_default=show_default, **checks)
    info.bare_value = bare
    info.path_role = (path, paths_of or (lambda value: [value]), replaced_by) if path else None
    return info


# ---- logging, common to every tool -----------------------------------------------------------
Verbose = Annotated[bool, flag("-v", "--verbose", "--log-verbose", group=LOGGING, show_default=False,
                               help="print everything, debug lines included (as -lv 4)")]
Verbosity = Annotated[Optional[int], flag("-lv", "--verbosity", "--log-verbosity", group=LOGGING, metavar="N",
                                          env="LLAMA_ARG_LOG_VERBOSITY", show_default=False,
                                          help="lines up to this level: 1 errors, 2 warnings, 3 info (default), "
                                               "4 debug")]
LogDisable = Annotated[bool, flag("--log-disable", group=LOGGING, show_default=False,
                                  help="no log lines (errors still print; results still go to stdout)")]
LogFile = Annotated[Optional[Path], flag("--log-file", group=LOGGING, metavar="FNAME", env="LLAMA_ARG_LOG_FILE",
                                         show_default=False, path="append",
                                         help="also write the log lines to this file (appended to)")]


def _print_version(value: bool) -> None:
    if value:
        import llamapy
        print(f"{Path(sys.argv[0]).name} (llamapy {llamapy.__version__}, Python {sys.version.split()[0]})")
        raise typer.Exit()


Version = Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True, rich_help_panel=LOGGING,
                                       help="print the version and exit")]

HELP = ("-h", "--help", "--usage")
_LOGGING = {"verbose": (Verbose, False), "verbosity": (Verbosity, None), "log_disable": (LogDisable, False),
            "log_file": (LogFile, None), "version": (Version, False)}


class ToolCommand(typer.core.TyperCommand):
    """A typer command whose help lists the options by group, in plain text that wraps."""

    def format_options(self, ctx: typer.Context, formatter: Any) -> None:
        groups: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                group = getattr(param, "rich_help_panel", None) or COMMON
                groups.setdefault(group, []).append(record)
        for group in sorted(groups, key=lambda g: GROUPS.index(g) if g in GROUPS else len(GROUPS)):
            with formatter.section(group):
                formatter.write_dl(groups[group], col_max=34)

    def format_epilog(self, ctx: typer.Context, formatter: Any) -> None:
        tool: Tool = ctx.find_root().command.tool  # type: ignore[attr-defined]
        noted = [name for name in ("-ngl", "-dev", "-tb", "-C", "--numa", "-lm") if name in tool.llama_cpp]
        formatter.write_paragraph()
        formatter.write_text(f"llama.cpp's other flags for its {', '.join(tool.llama_cpp_tools)} tool: the ones "
                             f"that do not apply here ({', '.join(noted)}, ...) are accepted with a note, the "
                             "others are refused by name.")


@dataclass(frozen=True)
class _Option:
    """What the pre-scan needs of a declared option."""

    takes_value: bool
    bare: str | None


class Tool:
    """One command-line tool: a typer command with llama.cpp's conventions (module docstring).

    `llama_cpp`: the llama.cpp tools whose flags this one accepts (see llama_cpp.py);
    `distributed`: a tool whose ranks train together under MPI and meet before training
    (common.meet), so that a rank's error there ends every rank with one line."""

    def __init__(self, name: str, llama_cpp: Sequence[str], distributed: bool = False) -> None:
        self.name = name
        self.distributed = distributed
        self.llama_cpp_tools = tuple(llama_cpp)
        self.app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
        self._command: typer.core.TyperCommand | None = None
        self.llama_cpp: dict[str, LlamaCppFlag] = {}

    def command(self, function: Callable[..., None] | None = None, **defaults: Any) -> Any:
        """Register `function` as the tool's command (`@tool.command`, or `@tool.command(name=default)`
        to change the defaults of spread flags). Its parameters annotated with a flag set (a
        dataclass whose fields carry `flag_field` metadata) receive an instance built from the
        spread flags; the logging flags are added and handled here."""
        if function is None:
            return functools.partial(self.command, **defaults)
        signature = inspect.signature(function, eval_str=True)
        own, sets = [], {}
        for name, p in signature.parameters.items():
            if dataclasses.is_dataclass(p.annotation):
                sets[name] = p.annotation
            else:
                own.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))
        spread = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.metadata["option"],
                                    default=defaults.get(f.name, f.default))
                  for cls in sets.values() for f in dataclasses.fields(cls)]
        logging = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=alias, default=default)
                   for name, (alias, default) in _LOGGING.items()]
        context = inspect.Parameter("typer_context", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
        parameters = own + spread + logging + [context]

        @functools.wraps(function)
        def run(**values: Any) -> None:
            _check_finite(values["typer_context"], values)
            self._register_paths(values["typer_context"], values)
            common.configure_logging(**{name: values.pop(name) for name in _LOGGING if name != "version"})
            values.pop("version")
            common.prepare_numba()
            for note in self._notes:
                common.log(note)
            typer_context = values.pop("typer_context")
            common.parsed_flags = _parsed_flags(typer_context, values, getattr(self, "_args", []))
            common.debug(_describe_flags(typer_context, values))
            for name, cls in sets.items():
                values[name] = cls(**{f.name: values.pop(f.name) for f in dataclasses.fields(cls)})
            common.command_begins()  # its first log line opens the log file, after it declared its paths
            function(**values)

        run.__signature__ = signature.replace(parameters=parameters)
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        self._bare = {p.name: getattr(typing_option(p.annotation), "bare_value", None) for p in parameters}
        self._path_roles = {p.name: typing_option(p.annotation).path_role for p in parameters
                            if getattr(typing_option(p.annotation), "path_role", None)}
        self.app.command(cls=ToolCommand, context_settings={"help_option_names": list(HELP),
                                                            "max_content_width": 100})(run)
        return function

    def _register_paths(self, ctx: typer.Context, values: dict[str, Any]) -> None:
        """The run's paths (common.paths()): the flags' reads first, then their writes and the
        log file."""
        names = {param.name: param.opts[0] for param in ctx.command.params}
        plan = common.new_paths()
        for wanted in ("read", "write", "append"):
            for name, (role, paths_of, replaced_by) in self._path_roles.items():
                if role == wanted and values.get(name) not in (None, [], ()):
                    for path in paths_of(values[name]):
                        if role == "read":
                            plan.read(names[name], path, replaced_by)
                        else:
                            plan.write(names[name], path, appends=role == "append")

    def click_command(self) -> typer.core.TyperCommand:
        if self._command is None:
            self._command = typer.main.get_command(self.app)
            self._command.tool = self  # type: ignore[attr-defined]
            self.llama_cpp = llama_cpp_flags(self.llama_cpp_tools, declared=self.declared())
        return self._command

    def declared(self) -> dict[str, _Option]:
        """Every name of every option the tool declares."""
        options = {name: _Option(False, None) for name in HELP}
        for param in self.click_command().params:
            if isinstance(param, typer.core.TyperOption):
                takes_value = not param.is_flag and not param.count
                for name in (*param.opts, *param.secondary_opts):
                    options[name] = _Option(takes_value, self._bare.get(param.name))
        return options

    def prescan(self, argv: Sequence[str]) -> tuple[list[str], list[str]]:
        """The arguments click should see, and the notes about llama.cpp flags that have no
        effect here. Raises InputError for a flag refused or unknown (module docstring)."""
        declared = self.declared()
        out, notes, i = [], [], 0
        while i < len(argv):
            token = argv[i]
            if token == "--":
                out += argv[i:]
                break
            name = token.split("=", 1)[0] if token.startswith("--") else token
            if name in declared:
                option = declared[name]
                out.append(token)
                i += 1
                if option.takes_value and "=" not in token:
                    if option.bare is not None and (i == len(argv) or not _is_number(argv[i])):
                        out.append(option.bare)
                    elif i < len(argv):
                        out.append(argv[i])
                        i += 1
                continue
            if name in self.llama_cpp:
                known = self.llama_cpp[name]
                values = [] if "=" in token else list(argv[i + 1:i + 1 + known.n_values])
                if len(values) < known.n_values and "=" not in token:
                    raise InputError(f"{name} needs a value")
                if known.refuse:
                    raise InputError(f"{name}: {known.why}")
                notes.append(f"note: {' '.join([token, *values])}: no effect: {known.why}")
                i += 1 + len(values)
                continue
            if token.startswith("-") and len(token) > 1 and not _is_number(token):
                close = difflib.get_close_matches(name, list(declared), n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise InputError(f"unknown flag {name} ({self.name} -h lists the flags{hint})")
            out.append(token)
            i += 1
        return out, notes

    def main(self, argv: Sequence[str] | None = None) -> None:
        """Run the tool on `argv` (default: the command line): one line and a non-zero exit for
        every error, never a traceback."""
        argv = list(sys.argv[1:] if argv is None else argv)
        command = self.click_command()
        self._notes: list[str] = []
        common.configure_logging()  # a run in a longer process (tests, Python) starts from the defaults

        def run() -> None:
            args, self._notes = self.prescan(argv)
            self._args = args
            try:
                command.main(args, prog_name=self.name, standalone_mode=False)
            except typer.Exit as e:
                if e.exit_code:
                    raise SystemExit(e.exit_code) from None
            except typer.Abort:
                raise KeyboardInterrupt from None
            except typer.TyperException as e:  # click's usage errors, as typer raises them
                raise InputError(_one_line(e)) from None
            common.command_ends()
        if self.distributed:
            common.begin_setup()
        try:
            common.guarded(run)()
        finally:
            common.close_log()


def _check_finite(ctx: typer.Context, values: dict[str, Any]) -> None:
    """No flag takes nan or inf: a number given is finite (ranges are each flag's min/max)."""
    for param in ctx.command.params:
        value = values.get(param.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"{param.opts[0]} must be a finite number, not {value}")


def _describe_flags(ctx: typer.Context, values: dict[str, Any]) -> str:
    """-v's line: each flag that is not at its default, and where its value came from."""
    given = []
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        if param.name in values and source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            where = param.envvar if source.name == "ENVIRONMENT" else "command line"
            value = values[param.name]
            shown = str(value) if isinstance(value, (Path, int, float)) else repr(value)
            given.append(f"{param.opts[0]} {shown} ({where})")
    return "flags: " + (", ".join(given) or "all at their defaults")


def _parsed_flags(ctx: typer.Context, values: dict[str, Any], argv: Sequence[str]) -> dict[str, tuple[str, Any]]:
    """Every option's value by its parameter name, with the flag as the user gave it: the
    name typed on the command line (`-c`, `--ctx-size`), the environment variable it came
    from, or (at its default) its long name; a flag pair (`--shuffle/--no-shuffle`) by its
    first name."""
    typed = {token.split("=", 1)[0] if token.startswith("--") else token for token in argv if token.startswith("-")}
    out = {}
    for param in ctx.command.params:
        if param.name not in values or not isinstance(param, typer.core.TyperOption):
            continue
        source = ctx.get_parameter_source(param.name)
        given = [name for name in param.opts if name in typed]
        if source is not None and source.name == "ENVIRONMENT" and isinstance(param.envvar, str):
            label = param.envvar
        elif given and not param.secondary_opts:
            label = given[0]
        else:
            label = next((name for name in param.opts if name.startswith("--")), param.opts[0])
        out[param.name] = (label, values[param.name])
    return out


def typing_option(annotation: Any) -> Any:
    """The typer OptionInfo inside an Annotated alias (None if there is none)."""
    for meta in getattr(annotation, "__metadata__", ()):
        if isinstance(meta, typer.models.OptionInfo):
            return meta
    return None


def flag_field(option: Any, default: Any, sets: tuple[str, ...] = ()) -> Any:
    """A field of a flag set: its option (an alias made with `flag`), its default, and the
    record fields it sets ("LRSchedule.lr0"), so that a record's refusal names the flag."""
    return dataclasses.field(default=default, metadata={"option": option, "sets": sets})


def as_flag(cls: type, field_name: str, message: str) -> str:
    """A record's refusal (`message` starts with its field, "LRSchedule.lr0 must be > 0, ...")
    as the command line's user knows it: the flag of `cls` that sets the field in its place."""
    for f in dataclasses.fields(cls):
        if field_name in f.metadata.get("sets", ()) and message.startswith(field_name):
            return flag_names(cls, f.name)[0] + message[len(field_name):]
    return message


def flag_names(cls: type, field: str) -> tuple[str, ...]:
    """The names of the flag that sets `field` of the flag set `cls`."""
    option = typing_option(next(f for f in dataclasses.fields(cls) if f.name == field).metadata["option"])
    return tuple(d for d in (option.default, *option.param_decls) if isinstance(d, str) and d.startswith("-"))


def _one_line(e: typer.TyperException) -> str:
    """click's usage error in one line, its option named once by its first name."""
    message = " ".join(e.format_message().split())
    message = re.sub(r"'(-[^']+)'(?: / '[^']+')*(?: \(env var: '[^']+'\))?", r"\1", message)
    bound = re.fullmatch(r"Invalid value for (-\S+): Input should be (greater|less) than( or equal to)? (\S+)", message)
    if bound:  # typer's range check, worded as the other numeric refusals ("--layer must be >= 1")
        flag, side, equal, limit = bound.groups()
        return f"{flag} must be {'>' if side == 'greater' else '<'}{'=' if equal else ''} {limit}"
    return message[0].lower() + message[1:] if message else "bad command line"


def _is_number(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False
