"""Run a command in a child process and read its peak RSS (shared by the bench scripts and
tests/test_gemma3.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

_WRAPPER = ("import resource, subprocess, sys;"
            "r = subprocess.run(sys.argv[1:], capture_output=True, text=True);"
            "sys.stdout.write(r.stdout); sys.stderr.write(r.stderr);"
            "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr);"
            "sys.exit(r.returncode)")


def peak_rss_mb(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """Run cmd from checkout `cwd` (on its PYTHONPATH unless `env` is given); its result and
    peak RSS in MB (the largest of the command's processes)."""
    env = env if env is not None else {**os.environ, "PYTHONPATH": str(cwd)}
    r = subprocess.run([sys.executable, "-c", _WRAPPER, *cmd], capture_output=True, text=True, cwd=cwd, env=env)
    kb = int(re.search(r"PEAK_RSS_KB (\d+)", r.stderr).group(1))
    return r, kb / 1024
