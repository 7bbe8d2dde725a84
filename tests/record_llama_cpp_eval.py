"""Record llama-perplexity's HellaSwag, Winogrande and multiple-choice runs, for
test_evaluation.py.

    python tests/record_llama_cpp_eval.py LLAMA_CPP_BIN_DIR

For each model (stories260K on the task files of tests/eval_tasks.py, Gemma 3 270M Q4_K_M
on their small versions: tests/data/eval_*), each format and each case (two batch sizes, all
tasks and a random few):
what `llama-perplexity -m MODEL -f FILE --KIND [...]` prints on stdout (its per-task lines)
and its closing lines on stderr, to tests/data/llama_cpp_eval_MODEL.json, with the sha256
of each task file. Also the task choices of std::mt19937 with libstdc++'s distributions
(a small C++ program, compiled with the system's g++) to tests/data/llama_cpp_eval_rng.json.
"""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from conftest import shared_path  # noqa: E402
from eval_tasks import FILES, SMALL_FILES  # noqa: E402

DATA = Path(__file__).parent / "data"
FLAG = {"hellaswag": "--hellaswag", "winogrande": "--winogrande", "multiple-choice": "--multiple-choice"}
# model -> its task files and the random few of its --KIND-tasks cases
MODELS = {"stories260K": (FILES, {"hellaswag": 20, "winogrande": 30, "multiple-choice": 20}),
          "gemma3": (SMALL_FILES, {"hellaswag": 2, "winogrande": 3, "multiple-choice": 2})}
BATCHES = ("2048", "32")
FINAL = re.compile(r"((?:Final |Random chance: ).*)$", re.M)  # after its log lines' time and level
THREADS = ["-t", "1"]  # llama.cpp's numbers do not depend on it; its OpenMP threads spin on a busy machine


def cases(name: str) -> list[dict]:
    """(kind, file, extra flags) of every recorded run of a model."""
    files, few = MODELS[name]
    out = []
    for kind in FILES:
        for b in BATCHES:
            out.append({"kind": kind, "file": files[kind], "args": ["-b", b]})
            out.append({"kind": kind, "file": files[kind], "args": ["-b", b, f"{FLAG[kind]}-tasks", str(few[kind])]})
    return out


def file_flag(kind: str) -> str:
    """-bf for the binary multiple-choice file (as its users give it), -f for the texts."""
    return "-bf" if kind == "multiple-choice" else "-f"


def model_path(name: str) -> Path:
    if name == "gemma3":
        from llamapy.defaults import default_model_path
        return Path(default_model_path(print))
    return shared_path("models", f"{name}.gguf")


def run(bin_dir: Path, model: Path, case: dict) -> dict:
    """One run: its stdout, and its closing lines (stderr). Into files, not pipes: through a
    pipe, llama.cpp's log thread loses the last lines when the process exits; again when the
    output still lacks its end."""
    kind = case["kind"]
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(model), file_flag(kind), str(DATA / case["file"]), FLAG[kind],
           *case["args"], *THREADS]
    with tempfile.TemporaryDirectory() as work:
        out_path, err_path = Path(work) / "out", Path(work) / "err"
        for _ in range(5):
            with out_path.open("w") as out, err_path.open("w") as err:
                subprocess.run(cmd, stdout=out, stderr=err, check=True)
            stdout, stderr = out_path.read_text(), err_path.read_text()
            if stdout.endswith("\n\n") and (kind != "multiple-choice" or FINAL.search(stderr)):
                return {**case, "stdout": stdout, "final": FINAL.findall(stderr)}
    raise RuntimeError(f"{' '.join(cmd)}: stdout never ended")


RNG_PROGRAM = r"""
#include <cstdio>
#include <random>
#include <vector>
// llama-perplexity's two ways of choosing tasks, for (available, wanted) pairs from argv
int main(int argc, char ** argv) {
    for (int a = 1; a + 1 < argc; a += 2) {
        size_t n = std::atoi(argv[a]), k = std::atoi(argv[a + 1]);
        std::mt19937 rng(1);
        std::vector<size_t> left(n);
        for (size_t i = 0; i < n; ++i) left[i] = i;
        printf("uniform");
        for (size_t i = 0; i < k && i < n; ++i) {
            std::uniform_int_distribution<size_t> dist(0, left.size() - 1);
            size_t j = dist(rng);
            printf(" %zu", left[j]);
            left.erase(left.begin() + j);
        }
        std::mt19937 rng2(1);
        std::vector<int> aux(n);
        for (size_t i = 0; i < n; ++i) aux[i] = i;
        float scale = 1.f/(1.f + (float)std::mt19937::max());
        printf("\nscaled");
        for (size_t i = 0; i < k; ++i) {
            int j = (int)(scale * rng2() * aux.size());
            printf(" %d", aux[j]);
            aux[j] = aux.back();
            aux.pop_back();
        }
        printf("\n");
    }
}
"""
RNG_CASES = [(10, 10), (1000, 25), (10042, 400), (1267, 100), (40, 39), (3, 2)]


def record_rng(work: Path) -> None:
    source, exe = work / "rng.cpp", work / "rng"
    source.write_text(RNG_PROGRAM)
    subprocess.run(["g++", "-O2", "-o", str(exe), str(source)], check=True)
    argv = [str(v) for case in RNG_CASES for v in case]
    lines = subprocess.run([str(exe), *argv], capture_output=True, text=True, check=True).stdout.splitlines()
    out = []
    for (n, k), uniform, scaled in zip(RNG_CASES, lines[0::2], lines[1::2]):
        out.append({"available": n, "wanted": k, "hellaswag": [int(v) for v in uniform.split()[1:]],
                    "scaled": [int(v) for v in scaled.split()[1:]]})
    (DATA / "llama_cpp_eval_rng.json").write_text(json.dumps(out) + "\n")


def main(bin_dir: Path) -> None:
    for name in MODELS:
        model = model_path(name)
        runs = [run(bin_dir, model, case) for case in cases(name)]
        files = {case["file"]: hashlib.sha256((DATA / case["file"]).read_bytes()).hexdigest() for case in runs}
        record = {"model": model.name, "threads": THREADS, "files": files, "runs": runs}
        (DATA / f"llama_cpp_eval_{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"{name}: {len(runs)} runs")
    with tempfile.TemporaryDirectory() as work:
        record_rng(Path(work))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
