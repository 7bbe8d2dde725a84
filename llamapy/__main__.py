"""`python -m llamapy`: the command-line tools, and `python -m llamapy TOOL ARGS` runs one."""
from __future__ import annotations

import importlib
import sys

from llamapy import __version__
from llamapy.cli import TOOLS


def main(argv: list[str]) -> int:
    if argv and argv[0] in TOOLS:
        sys.argv = [f"llamapy-{argv[0]}", *argv[1:]]
        importlib.import_module(TOOLS[argv[0]][0]).main()
        return 0
    if argv and argv[0] not in ("-h", "--help"):
        print(f"error: unknown tool {argv[0]!r}: use one of {', '.join(TOOLS)}", file=sys.stderr)
        return 2
    print(f"llamapy {__version__}: llama.cpp's runtime and training stack in Python. The tools:\n")
    for name, (_, summary) in TOOLS.items():
        print(f"  llamapy-{name:<12} {summary}")
    print("\n`llamapy-TOOL -h` (or `python -m llamapy TOOL -h`) lists a tool's flags.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
