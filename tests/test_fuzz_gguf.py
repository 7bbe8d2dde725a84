"""A fuzzer for the GGUF loader (issue 33): 2,000 mutations of stories260K.gguf, the same
ones for a seed (truncations; byte flips in the header, the metadata and the tensor infos;
counts, types, lengths, dimensions, offsets and hyper-parameters set to 0, 1, huge,
negative or nearby values; float hyper-parameters set to NaN, infinities, 0, denormals).

Each mutated file is loaded in-process under a time limit. The outcome must be a
LlamapyError (one line), or a clean load whose tensors all lie inside the file, aligned and
disjoint, whose vocabulary tokenizes and detokenizes, and — for a sample — whose short decode
gives finite logits or a LlamapyError. Anything else (another exception, a hang, a view past
the file) fails the test with the case's mutation, which `mutate(data, layout, random.Random(
SEED * 100_003 + case))` rebuilds."""
from __future__ import annotations

import faulthandler
import itertools
import random
import resource
import struct
from pathlib import Path

import numpy as np
import pytest

import llamapy
from llamapy.errors import LlamapyError

import gguf_craft as C
from test_hostile_gguf import deadline

SEED = 33
N_CASES = 2000
DECODE_SHARE = 0.5        # clean loads that also decode a few tokens
CASE_SECONDS = 10.0       # far above a case's few milliseconds: only a hang reaches it
STUCK_SECONDS = 60.0      # a hang inside C code, which the alarm cannot interrupt, ends the run with its stack
PROMPT = "Once upon a time, there was a little"

# values a field is set to: small, boundaries of 8/16/32/64-bit integers, their negatives
INTERESTING = [0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 33, 63, 64, 255, 256, 4095, 4096, 65535, 65536, 2**31 - 1, 2**31,
               2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -1, -2, -32, -(2**31)]
FLOATS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -1.0, 1.0, 1e-45, 1e-38, 3.4e38, 1e10, 0.5, 2.0]


def mutate(data: bytes, lay: C.Layout, rng: random.Random) -> tuple[bytes, str]:
    """One mutation of the file `data` and a description of it."""
    kind = rng.choice(["truncate", "flip", "flip", "field", "field", "field", "float"])
    if kind == "truncate":
        end = rng.randrange(lay.infos_end + 64) if rng.random() < 0.7 else rng.randrange(len(data))
        return data[:end], f"truncate to {end} bytes"
    if kind == "flip":
        region = rng.choice([(0, 24), (24, lay.kv_end), (lay.kv_end, lay.infos_end)])
        out = bytearray(data)
        changes = []
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(*region)
            new = out[pos] ^ (1 << rng.randrange(8)) if rng.random() < 0.5 else rng.randrange(256)
            changes.append(f"[{pos}] {out[pos]:#04x}->{new:#04x}")
            out[pos] = new
        return bytes(out), "flip " + ", ".join(changes)
    if kind == "float":
        f = rng.choice(lay.floats)  # the norm's epsilon, or a token's score
        value = rng.choice(FLOATS)
        out = bytearray(data)
        struct.pack_into("<f", out, f.pos, value)
        return bytes(out), f"{f.what} = {value}"
    groups = field_groups(lay)
    f = rng.choice(groups[rng.choice(sorted(groups))])
    old = C.read_field(data, f)
    value = rng.choice(INTERESTING) if rng.random() < 0.7 else old + rng.choice([-64, -32, -8, -1, 1, 8, 32, 64])
    return C.patch(data, f, value), f"{f.what} (at {f.pos}) {old} -> {value % (1 << (8 * f.size))}"


def field_groups(lay: C.Layout) -> dict[str, list[C.Field]]:
    """The header's fields by kind (counts, types, lengths, values, dimensions, offsets), so a
    mutation picks a kind first: the 512 token lengths are one kind among ten."""
    groups: dict[str, list[C.Field]] = {}
    for f in lay.fields:
        kind = next((k for k in ("array type", "array length", "string length", "n_dims", "offset", "value", "type")
                     if f.what.endswith(k)), "ne" if "ne[" in f.what else f.what)
        groups.setdefault(kind, []).append(f)
    return groups


def check_views(model: llamapy.Model, size: int) -> None:
    """Every tensor is a view of the mapped file, inside it, aligned, and overlapping no other."""
    spans = []
    for name, t in model.tensors.items():
        assert t.buffer is model.file.data, f"{name} is not a view of the file"
        assert 0 <= t.offset and t.offset + t.nbytes() <= size, f"{name} lies past the end of the file"
        assert t.offset % 32 == 0, f"{name} is misaligned"
        if t.nbytes():
            spans.append((t.offset, t.offset + t.nbytes(), name))
    spans.sort()
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        assert start >= end, f"{a} and {b} overlap"


def decode_a_few(model: llamapy.Model) -> None:
    """Three greedy steps of a short prompt: finite logits, or a LlamapyError."""
    ctx = llamapy.Context(model, n_ctx=32, n_threads=1)
    tokens = model.vocab.tokenize(PROMPT)[:16]
    ctx.decode(llamapy.Batch.from_tokens(tokens))
    for step in range(3):
        logits = ctx.get_logits_ith(-1)
        assert np.isfinite(logits).all(), "non-finite logits"
        tokens.append(int(np.argmax(logits)))
        ctx.decode(llamapy.Batch.from_tokens(tokens[-1:], pos0=len(tokens) - 1))


def run_case(path: Path, data: bytes, decode: bool) -> str:
    """The outcome of loading the mutated `data` (written to `path`): 'refused', 'loaded' or
    'decoded'; an assertion or any other exception escapes."""
    path.write_bytes(data)
    try:
        model = llamapy.load_model(path)
    except LlamapyError as e:
        assert "\n" not in str(e), "a refusal of more than one line"
        return "refused"
    check_views(model, len(data))
    model.vocab.detokenize(model.vocab.tokenize(PROMPT), unparse_special=True)
    if not decode:
        return "loaded"
    try:
        decode_a_few(model)
    except LlamapyError:
        return "refused"
    return "decoded"


@pytest.mark.slow
def test_two_thousand_mutations_load_cleanly_or_are_refused(stories_path, tmp_path):
    data = stories_path.read_bytes()
    lay = C.layout(data)
    decode_a_few(llamapy.load_model(stories_path))  # the kernels compile outside the cases' time limits
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcomes: dict[str, int] = {}
    failures: list[str] = []
    for case in range(N_CASES):
        rng = random.Random(SEED * 100_003 + case)
        mutated, what = mutate(data, lay, rng)
        path = tmp_path / f"case{case}.gguf"
        faulthandler.dump_traceback_later(STUCK_SECONDS, exit=True)
        try:
            with deadline(CASE_SECONDS):
                outcome = run_case(path, mutated, rng.random() < DECODE_SHARE)
        except BaseException as e:  # every other outcome is a finding, a hang (TimeoutError) included
            if isinstance(e, KeyboardInterrupt):
                raise
            failures.append(f"case {case}: {what}: {type(e).__name__}: {str(e)[:300]}")
            outcome = "failed"
        finally:
            faulthandler.cancel_dump_traceback_later()
            path.unlink(missing_ok=True)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"fuzz outcomes of {N_CASES} cases: {outcomes}")
    assert not failures, f"{len(failures)} of {N_CASES} cases failed:\n" + "\n".join(failures[:40])
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert grown_mb < 500, f"the fuzz cases raised the peak memory by {grown_mb:.0f} MB"
    assert outcomes.get("refused", 0) > 0 and outcomes.get("decoded", 0) > 0, outcomes

