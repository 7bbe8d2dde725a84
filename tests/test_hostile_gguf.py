"""Crafted and corrupt GGUF files (issue 33): each is refused with one line naming the
problem (a LlamapyError from load_model, `error: ...` and a non-zero exit from a tool) and
never ends in a traceback, a hang, unbounded memory or a read outside a tensor's bytes.

The files are made in tmp_path from stories260K: rewritten with changed metadata or tensors
(gguf_craft.parts / write), or with header bytes patched at fields found by gguf_craft's own
parser of the header."""
from __future__ import annotations

import contextlib
import re
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import llamapy
from ggmlpy import GGMLType
from llamapy.errors import LlamapyError
from llamapy.gguf_file import MetaValue, ValueType
from llamapy.lora import LoraAdapter

import gguf_craft as C
from conftest import REPO_ROOT

PER_CASE_SECONDS = 30


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail the test instead of hanging when the block takes longer than `seconds`."""
    def expire(signum, frame):
        raise TimeoutError(f"no result after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def refusal(path: Path) -> str:
    """The one line load_model refuses `path` with (failing on success, another exception or a hang)."""
    with deadline(PER_CASE_SECONDS), pytest.raises(LlamapyError) as error:
        llamapy.load_model(path)
    message = str(error.value)
    assert message and "\n" not in message
    return message


# ---- the files -------------------------------------------------------------------------------
Make = Callable[[Path, Path], Path]  # (stories260K, tmp_path) -> the crafted file


def with_meta(**changes: MetaValue | None) -> Make:
    """stories260K with metadata keys (dots written as __) set, or removed when None."""
    def make(source: Path, tmp: Path) -> Path:
        meta, tensors = C.parts(source)
        for key, value in changes.items():
            key = key.replace("__", ".")
            if value is None:
                meta.pop(key)
            else:
                meta[key] = value
        return C.write(tmp / "crafted.gguf", meta, tensors)
    return make


def with_tensors(edit: Callable[[list[C.TensorOut]], list[C.TensorOut]]) -> Make:
    """stories260K with its list of tensors changed by edit()."""
    def make(source: Path, tmp: Path) -> Path:
        meta, tensors = C.parts(source)
        return C.write(tmp / "crafted.gguf", meta, edit(tensors))
    return make


def with_tensor(name: str, new: Callable[[], C.TensorOut | None], at_end: bool = False) -> Make:
    """stories260K with tensor `name` replaced by new() (dropped when None), in place or last."""
    def edit(tensors: list[C.TensorOut]) -> list[C.TensorOut]:
        kept = [t for t in tensors if t.name != name]
        t = new()
        if t is not None:
            kept.insert(len(kept) if at_end else [x.name for x in tensors].index(name), t)
        return kept
    return with_tensors(edit)


def patched(edit: Callable[[bytes, C.Layout], bytes]) -> Make:
    """stories260K's bytes changed by edit(data, layout of its header)."""
    def make(source: Path, tmp: Path) -> Path:
        data = source.read_bytes()
        path = tmp / "crafted.gguf"
        path.write_bytes(edit(data, C.layout(data)))
        return path
    return make


def field(pick: Callable[[C.Layout], C.Field], value: int) -> Make:
    return patched(lambda data, lay: C.patch(data, pick(lay), value))


def f32_array(values) -> MetaValue:
    return MetaValue(ValueType.ARRAY, ValueType.FLOAT32, np.asarray(values, np.float32))


def token_types(value: int) -> MetaValue:
    return MetaValue(ValueType.ARRAY, ValueType.INT32, np.full(512, value, np.int32))


def f32_tensor(name: str, shape: tuple[int, ...], dtype=np.float32) -> Callable[[], C.TensorOut]:
    """A tensor of zeros of numpy `shape` (ne reversed)."""
    return lambda: C.tensor(name, np.zeros(shape, dtype))


EMBD, NORM, Q, K = "token_embd.weight", "blk.0.attn_norm.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight"
U64_MAX = 2**64 - 1

# (case, file, what the refusal says)
CASES: list[tuple[str, Make, str]] = [
    # tensors whose shape or type does not fit what the hyper-parameters imply
    ("embeddings with fewer rows than the vocabulary", with_tensor(EMBD, f32_tensor(EMBD, (256, 64))),
     r"'token_embd.weight' has shape \[64, 256\], but the hyper-parameters make it \[64, 512\]"),
    ("embeddings of one row at the end of the file", with_tensor(EMBD, f32_tensor(EMBD, (1, 64)), at_end=True),
     r"'token_embd.weight' has shape \[64\], but the hyper-parameters make it \[64, 512\]"),
    ("embeddings missing", with_tensor(EMBD, lambda: None), "required tensor 'token_embd.weight' is missing"),
    ("a 0-dimensional norm", with_tensor(NORM, lambda: C.tensor(NORM, np.ones(1, np.float32), GGMLType.F32, ())),
     r"'blk.0.attn_norm.weight' has shape \[1\], but the hyper-parameters make it \[64\]"),
    ("a norm of 0 values", with_tensor(NORM, lambda: C.tensor(NORM, np.ones(0, np.float32), GGMLType.F32, (0,))),
     r"'blk.0.attn_norm.weight' has shape \[0\]"),
    ("a norm with a second dimension", with_tensor(NORM, f32_tensor(NORM, (2, 64))), r"shape \[64, 2\]"),
    ("an I32 weight matrix", with_tensor(Q, f32_tensor(Q, (64, 64), np.int32)),
     "'blk.0.attn_q.weight' is I32, which llamapy does not use for a matrix"),
    ("an F64 norm", with_tensor(NORM, f32_tensor(NORM, (64,), np.float64)),
     "'blk.0.attn_norm.weight' is F64, which llamapy does not use for a vector"),
    ("a Q8_0 norm", with_tensor(NORM, lambda: C.tensor(NORM, np.zeros(68, np.uint8), GGMLType.Q8_0, (64,))),
     "is Q8_0, which llamapy does not use for a vector"),
    ("a type that does not fit the bytes", field(lambda lay: lay.tensor_types[Q], GGMLType.F16),
     "bytes before tensor 'blk.0.attn_k.weight' belong to no tensor"),
    ("dimensions that do not fit the bytes", field(lambda lay: lay.tensor_dims[Q][1], 32),
     "bytes before tensor 'blk.0.attn_k.weight' belong to no tensor"),
    ("a last tensor typed shorter than its bytes",  # F32 bytes declared F16: half of them would be read as F16
     with_tensor("output.weight", lambda: C.tensor("output.weight", np.zeros((512, 64), np.float32), GGMLType.F16,
                                                   (64, 512)), at_end=True),
     "65536 bytes after tensor 'output.weight' belong to no tensor"),
    ("feed_forward_length disagreeing with the tensors", with_meta(llama__feed_forward_length=C.u32(100)),
     r"'blk.0.ffn_gate.weight' has shape \[64, 172\], but the hyper-parameters make it \[64, 100\]"),
    ("head_count_kv disagreeing with the tensors", with_meta(llama__attention__head_count_kv=C.u32(2)),
     r"'blk.0.attn_k.weight' has shape \[64, 32\], but the hyper-parameters make it \[64, 16\]"),
    ("head_count disagreeing with the rope dimensions", with_meta(llama__attention__head_count=C.u32(4)),
     "llama needs rope.dimension_count .8. equal to the head size .K 16, V 16."),
    ("embedding_length disagreeing with the tensors",
     with_meta(llama__embedding_length=C.u32(32), llama__rope__dimension_count=C.u32(4)),
     r"'token_embd.weight' has shape \[64, 512\], but the hyper-parameters make it \[32, 512\]"),
    ("block_count below the layers present", with_meta(llama__block_count=C.u32(4)),
     "tensor 'blk.4.attn_q.weight' .and 8 more. is not part of a llama model"),
    ("block_count above the layers present", with_meta(llama__block_count=C.u32(6)),
     "required tensor 'blk.5.attn_norm.weight' is missing"),
    ("a tensor name twice", with_tensors(lambda ts: ts + [ts[-1]]), "tensor .blk.4.ffn_norm.weight. appears twice"),
    # where tensors lie in the file
    ("two tensors sharing bytes",
     patched(lambda d, lay: C.patch(d, lay.tensor_offsets[K], C.read_field(d, lay.tensor_offsets[Q]))),
     r"tensors .blk.0.attn_[qk].weight. and .blk.0.attn_[qk].weight. share bytes"),
    ("a misaligned offset", patched(lambda d, lay: C.patch(d, lay.tensor_offsets[K], C.read_field(d, lay.tensor_offsets[K]) + 4)),
     "the offset .* of tensor 'blk.0.attn_k.weight' is not a multiple of the alignment 32"),
    ("an offset past the end", field(lambda lay: lay.tensor_offsets[K], 2**40),
     "'blk.0.attn_k.weight' .* extends past the end of the file"),
    ("an offset that wraps around", field(lambda lay: lay.tensor_offsets[K], U64_MAX - 31), "extends past the end"),
    ("a truncated file", patched(lambda d, lay: d[:-1000]), "extends past the end of the file"),
    ("a truncated header", patched(lambda d, lay: d[:lay.kv_end - 3]), "truncated"),
    ("an empty file", patched(lambda d, lay: b""), "is not a GGUF file"),
    ("a huge dimension", patched(lambda d, lay: C.patch(d, lay.tensor_dims[EMBD][1], 2**62)), "extends past the end"),
    ("a negative dimension", patched(lambda d, lay: C.patch(d, lay.tensor_dims[EMBD][1], -1)), "negative dimension"),
    ("dimensions whose product overflows int64",
     patched(lambda d, lay: C.patch(C.patch(d, lay.tensor_dims[EMBD][0], 2**32), lay.tensor_dims[EMBD][1], 2**32)),
     "extends past the end"),
    ("five dimensions", field(lambda lay: next(f for f in lay.fields if f.what == f"{EMBD} n_dims"), 5),
     "tensor 'token_embd.weight' has 5 dimensions"),
    ("an unknown tensor type", field(lambda lay: lay.tensor_types[EMBD], 99), "tensor 'token_embd.weight' has unknown type 99"),
    ("rows not a multiple of the type's block", field(lambda lay: lay.tensor_types["blk.0.ffn_down.weight"], GGMLType.Q8_0),
     "rows of 172 q8_0 values, not a multiple of its block size 32"),
    # the header's counts, lengths and types
    ("10^18 tensors", field(lambda lay: lay.fields[0], 10**18), "implausible counts"),
    ("2^63 keys", field(lambda lay: lay.fields[1], 2**63), "implausible counts"),
    ("a key length past the end", field(lambda lay: lay.fields[2], 2**60), "runs past the end of the file"),
    ("an array of 2^61 tokens",
     field(lambda lay: next(f for f in lay.fields if f.what == "tokenizer.ggml.tokens array length"), 2**61),
     "runs past the end of the file"),
    ("an array of 2^40 floats",
     field(lambda lay: next(f for f in lay.fields if f.what == "tokenizer.ggml.scores array length"), 2**40),
     "runs past the end of the file"),
    ("an unknown value type", field(lambda lay: next(f for f in lay.fields if f.what == "general.name type"), 13),
     "unknown value type 13"),
    ("an unknown array item type",
     field(lambda lay: next(f for f in lay.fields if f.what == "tokenizer.ggml.scores array type"), 77),
     "unknown array item type 77"),
    ("5,000 nested arrays", patched(lambda d, lay: C.add_raw_kv(d, "general.nested", ValueType.ARRAY,
                                                                C.nested_arrays(5000))),
     "arrays nested deeper than 4 levels"),
    ("a key twice", patched(lambda d, lay: C.add_raw_kv(d, "general.name", ValueType.STRING, struct.pack("<Q", 1) + b"x")),
     "metadata key 'general.name' appears twice"),
    ("version 1", field(lambda lay: C.Field(4, 4, "version"), 1), "GGUF version 1 is not supported"),
    ("a big-endian file", field(lambda lay: C.Field(4, 4, "version"), 3 << 24), "big-endian"),
    ("bad magic", patched(lambda d, lay: b"GGUG" + d[4:]), "is not a GGUF file"),
    ("general.alignment a string", with_meta(general__alignment=C.string("32")),
     "general.alignment is a STRING, expected UINT32"),
    ("general.alignment a UINT64", with_meta(general__alignment=MetaValue(ValueType.UINT64, None, 32)),
     "general.alignment is a UINT64, expected UINT32"),
    ("general.alignment 0", patched(lambda d, lay: C.add_raw_kv(d, "general.alignment", ValueType.UINT32,
                                                                struct.pack("<I", 0))), "not a power of two"),
    ("general.alignment 48", patched(lambda d, lay: C.add_raw_kv(d, "general.alignment", ValueType.UINT32,
                                                                 struct.pack("<I", 48))), "not a power of two"),
    # metadata of the wrong type
    ("block_count a string", with_meta(llama__block_count=C.string("5")),
     "metadata llama.block_count is a STRING, expected an integer"),
    ("block_count a float", with_meta(llama__block_count=C.f32(5.0)),
     "metadata llama.block_count is a FLOAT32, expected an integer"),
    ("head_count an array", with_meta(llama__attention__head_count=MetaValue(ValueType.ARRAY, ValueType.UINT32,
                                                                             np.full(5, 8, np.uint32))),
     "metadata llama.attention.head_count is an ARRAY of UINT32, expected an integer"),
    ("rms_eps a string", with_meta(llama__attention__layer_norm_rms_epsilon=C.string("1e-5")), "expected a number"),
    ("general.architecture a number", with_meta(general__architecture=C.u32(1)),
     "metadata general.architecture is a UINT32, expected a string"),
    ("general.architecture an array", with_meta(general__architecture=MetaValue(ValueType.ARRAY, ValueType.STRING,
                                                                                ["llama"])), "expected a string"),
    ("tokenizer.ggml.model a number", with_meta(tokenizer__ggml__model=C.u32(1)),
     "metadata tokenizer.ggml.model is a UINT32, expected a string"),
    ("add_bos_token a string", with_meta(tokenizer__ggml__add_bos_token=C.string("false")),
     "tokenizer.ggml.add_bos_token is a STRING, expected a boolean"),
    ("bos_token_id a string", with_meta(tokenizer__ggml__bos_token_id=C.string("1")),
     "tokenizer.ggml.bos_token_id is a STRING, expected an integer"),
    ("token types as UINT8", with_meta(tokenizer__ggml__token_type=MetaValue(ValueType.ARRAY, ValueType.UINT8,
                                                                            np.ones(512, np.uint8))),
     "tokenizer.ggml.token_type has type"),
    ("fewer token types than tokens", with_meta(tokenizer__ggml__token_type=MetaValue(
        ValueType.ARRAY, ValueType.INT32, np.ones(100, np.int32))), "has 100 entries for 512 tokens"),
    ("no tokens", with_meta(tokenizer__ggml__tokens=MetaValue(ValueType.ARRAY, ValueType.STRING, [])),
     "no tokenizer.ggml.tokens list"),
    ("every token typed BYTE", with_meta(tokenizer__ggml__token_type=token_types(6)),
     r"token 0 \('<unk>'\) is typed BYTE .* not a byte <0xXX>"),
    # hyper-parameters out of range
    ("block_count 10^9", with_meta(llama__block_count=C.u32(10**9)),
     "llama.block_count = 1000000000, but the file holds only 48 tensors"),
    ("block_count 0", with_meta(llama__block_count=C.u32(0)), r"llama.block_count = 0 is out of range"),
    ("block_count 2^40", with_meta(llama__block_count=MetaValue(ValueType.UINT64, None, 2**40)),
     r"out of range \(must be in 1..2147483647\)"),
    ("head_count 0", with_meta(llama__attention__head_count=C.u32(0)), "head_count = 0 is out of range"),
    ("head_count_kv 0", with_meta(llama__attention__head_count_kv=C.u32(0)), "head_count_kv = 0 is out of range"),
    ("head_count_kv not dividing head_count", with_meta(llama__attention__head_count_kv=C.u32(3)),
     "n_head 8 is not a multiple of n_head_kv 3"),
    ("head_count not dividing embedding_length", with_meta(llama__attention__head_count=C.u32(7)),
     "n_embd 64 is not divisible by n_head 7"),
    ("embedding_length 0", with_meta(llama__embedding_length=C.u32(0)), "embedding_length = 0 is out of range"),
    ("context_length 0", with_meta(llama__context_length=C.u32(0)), "context_length = 0 is out of range"),
    ("feed_forward_length negative", with_meta(llama__feed_forward_length=MetaValue(ValueType.INT32, None, -5)),
     "feed_forward_length = -5 is out of range"),
    ("key_length 0", with_meta(llama__attention__key_length=C.u32(0)), "key_length = 0 is out of range"),
    ("rope.dimension_count 0", with_meta(llama__rope__dimension_count=C.u32(0)),
     r"rope.dimension_count = 0 is out of range \(must be in 2..8\)"),
    ("rope.dimension_count odd", with_meta(llama__rope__dimension_count=C.u32(7)), "is odd: RoPE rotates pairs"),
    ("rope.dimension_count above the head size", with_meta(llama__rope__dimension_count=C.u32(16)),
     "must be in 2..8"),
    ("rms_eps NaN", with_meta(llama__attention__layer_norm_rms_epsilon=C.f32(float("nan"))),
     "layer_norm_rms_epsilon = nan is out of range .must be a finite float32."),
    ("rms_eps negative", with_meta(llama__attention__layer_norm_rms_epsilon=C.f32(-1.0)),
     r"layer_norm_rms_epsilon = -1.0 is out of range \(must be above 0.0\)"),
    ("rms_eps 0", with_meta(llama__attention__layer_norm_rms_epsilon=C.f32(0.0)), "must be above 0.0"),
    ("rms_eps 1e300 (FLOAT64)", with_meta(llama__attention__layer_norm_rms_epsilon=MetaValue(ValueType.FLOAT64, None,
                                                                                             1e300)),
     "must be a finite float32"),
    ("rope.freq_base 0", with_meta(llama__rope__freq_base=C.f32(0.0)),
     r"rope.freq_base = 0.0 is out of range \(must be at least 1.0\)"),
    ("rope.freq_base infinite", with_meta(llama__rope__freq_base=C.f32(float("inf"))), "must be a finite float32"),
    ("rope.scaling.factor -1", with_meta(llama__rope__scaling__factor=C.f32(-1.0)),
     r"rope.scaling.factor = -1.0 is out of range \(must be at least 0.0\)"),
    ("rope.scaling.factor 1e-40", with_meta(llama__rope__scaling__factor=C.f32(1e-40)),
     "hyper-parameter rope_freq_scale = .* is not a finite float32"),
]


@pytest.mark.parametrize("make, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_crafted_file_is_refused_in_one_line(stories_path, tmp_path, make: Make, expected: str):
    message = refusal(make(stories_path, tmp_path))
    assert re.search(expected, message), message


@pytest.mark.parametrize("token_type", [0, 1, 2, 3, 4, 5])
def test_a_vocabulary_of_one_token_type_works_or_is_refused(stories_path, tmp_path, token_type: int):
    """Every token NORMAL, CONTROL, UNUSED, ... (BYTE is refused above, types outside llama.cpp's
    0..6 in test_hostile_vocab.py): tokenizing, rendering every piece and decoding work, with
    finite logits."""
    path = with_meta(tokenizer__ggml__token_type=token_types(token_type))(stories_path, tmp_path)
    with deadline(PER_CASE_SECONDS):
        model = llamapy.load_model(path)
        tokens = model.vocab.tokenize("Once upon a time, <s> there </s> was", parse_special=True)
        model.vocab.detokenize(tokens, unparse_special=True)
        for token in range(model.vocab.n_tokens):
            model.vocab.token_to_piece(token, special=True)
        ctx = llamapy.Context(model, n_ctx=64, n_threads=1)
        ctx.decode(llamapy.Batch.from_tokens(tokens))
    assert np.isfinite(ctx.get_logits()).all()


# ---- the tools --------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["embeddings with fewer rows than the vocabulary", "5,000 nested arrays",
                                  "rms_eps NaN", "two tensors sharing bytes", "head_count_kv 0"])
def test_a_tool_prints_one_error_line(stories_path, tmp_path, capsys, case: str):
    from llamapy.cli.perplexity import tool
    make, expected = next(c[1:] for c in CASES if c[0] == case)
    path = make(stories_path, tmp_path)
    with deadline(PER_CASE_SECONDS), pytest.raises(SystemExit) as done:
        tool.main(["-m", str(path), "-p", "Once upon a time, there was a little girl.", "-c", "8"])
    err = capsys.readouterr().err
    assert done.value.code != 0 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.search(expected, errors[0]), err


def test_a_billion_layers_in_a_small_file_allocate_nothing(stories_path, tmp_path):
    """block_count = 10^9 once grew to 5.7 GB before `out of memory`: now the count is
    refused against the tensors present before anything is planned from it. Run under a 2 GB
    address-space limit (a safety net for the machine), the process grows by little past what
    importing the tool took (numba compiling an import-time kernel on a stale cache is not the
    file's doing)."""
    path = with_meta(llama__block_count=C.u32(10**9))(stories_path, tmp_path)
    code = ("import resource, sys\n"
            "from llamapy.cli.perplexity import tool\n"
            "print('import-kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
            "try:\n"
            "    tool.main(sys.argv[1:])\n"
            "finally:\n"
            "    print('peak-kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n")

    def limit_memory() -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    proc = subprocess.run([sys.executable, "-c", code, "-m", str(path), "-p", "Once upon a time"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120, preexec_fn=limit_memory, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "error: " in proc.stderr and "block_count = 1000000000, but the file holds only 48 tensors" in proc.stderr
    kb = {key: int(value) for key, value in re.findall(r"^(import|peak)-kb (\d+)$", proc.stderr, re.M)}
    assert (kb["peak"] - kb["import"]) / 1024 < 100, proc.stderr


# ---- adapters and checkpoints are GGUF files too -----------------------------------------------
@pytest.fixture(scope="module")
def model(stories_path):
    return llamapy.load_model(stories_path)


@pytest.fixture
def adapter_file(model, tmp_path) -> Path:
    return LoraAdapter.new(model, rank=2, modules=["attn_q", "ffn_down"], seed=0).save(tmp_path / "adapter.gguf")


def rewritten(path: Path, edit: Callable[[dict, list[C.TensorOut]], None]) -> Path:
    meta, tensors = C.parts(path)
    edit(meta, tensors)
    return C.write(path.with_name("crafted.gguf"), meta, tensors)


def replace_tensor(name: str, values: np.ndarray) -> Callable[[dict, list[C.TensorOut]], None]:
    def edit(meta: dict, tensors: list[C.TensorOut]) -> None:
        tensors[[t.name for t in tensors].index(name)] = C.tensor(name, values)
    return edit


def set_meta(key: str, value: MetaValue) -> Callable[[dict, list[C.TensorOut]], None]:
    return lambda meta, tensors: meta.__setitem__(key, value)


A, B = "blk.0.attn_q.weight.lora_a", "blk.0.attn_q.weight.lora_b"
ADAPTER_CASES: list[tuple[str, Callable[[Path], Path], str]] = [
    ("rank 0", lambda p: rewritten(p, lambda m, ts: (replace_tensor(A, np.zeros((0, 64), np.float32))(m, ts),
                                                     replace_tensor(B, np.zeros((64, 0), np.float32))(m, ts))),
     "do not fit"),
    ("A for another input size", lambda p: rewritten(p, replace_tensor(A, np.zeros((2, 32), np.float32))),
     "do not fit"),
    ("A with a third dimension", lambda p: rewritten(p, replace_tensor(A, np.zeros((3, 2, 64), np.float32))),
     "do not fit"),
    ("B of another rank", lambda p: rewritten(p, replace_tensor(B, np.zeros((64, 3), np.float32))), "do not fit"),
    ("an I32 A", lambda p: rewritten(p, replace_tensor(A, np.zeros((2, 64), np.int32))), "F32 or F16 expected"),
    ("alpha NaN", lambda p: rewritten(p, set_meta("adapter.lora.alpha", C.f32(float("nan")))),
     "adapter.lora.alpha = nan is out of range"),
    ("alpha a string", lambda p: rewritten(p, set_meta("adapter.lora.alpha", C.string("8"))),
     "adapter.lora.alpha is a STRING, expected a number"),
    ("general.type a number", lambda p: rewritten(p, set_meta("general.type", C.u32(1))),
     "general.type is a UINT32, expected a string"),
    ("A and B sharing bytes", lambda p: patch_file(p, lambda d, lay: C.patch(d, lay.tensor_offsets[B],
                                                                            C.read_field(d, lay.tensor_offsets[A]))),
     "share bytes"),
    ("a misaligned A", lambda p: patch_file(p, lambda d, lay: C.patch(d, lay.tensor_offsets[A],
                                                                      C.read_field(d, lay.tensor_offsets[A]) + 8)),
     "not a multiple of the alignment"),
    ("a truncated adapter", lambda p: patch_file(p, lambda d, lay: d[:-100]), "extends past the end"),
    ("nested arrays", lambda p: patch_file(p, lambda d, lay: C.add_raw_kv(d, "x", ValueType.ARRAY,
                                                                          C.nested_arrays(100))), "nested deeper"),
    ("an adapter of the output layer", lambda p: rewritten(p, lambda m, ts: ts.extend([
        C.tensor("output.weight.lora_a", np.zeros((2, 64), np.float32)),
        C.tensor("output.weight.lora_b", np.zeros((512, 2), np.float32))])),
     "'output.weight' is not a matrix llamapy applies adapters to"),
    ("an adapter of a norm", lambda p: rewritten(p, lambda m, ts: ts.extend([
        C.tensor("blk.0.attn_norm.weight.lora_a", np.zeros((2, 64), np.float32)),
        C.tensor("blk.0.attn_norm.weight.lora_b", np.zeros((1, 2), np.float32))])),
     "'blk.0.attn_norm.weight' is not a matrix llamapy applies adapters to"),
]


def patch_file(path: Path, edit: Callable[[bytes, C.Layout], bytes]) -> Path:
    data = path.read_bytes()
    out = path.with_name("crafted.gguf")
    out.write_bytes(edit(data, C.layout(data)))
    return out


@pytest.mark.parametrize("make, expected", [c[1:] for c in ADAPTER_CASES], ids=[c[0] for c in ADAPTER_CASES])
def test_a_crafted_adapter_is_refused_in_one_line(model, adapter_file, make, expected: str):
    LoraAdapter.load(adapter_file, model)  # the file before the change is a good one
    with deadline(PER_CASE_SECONDS), pytest.raises(LlamapyError) as error:
        LoraAdapter.load(make(adapter_file), model)
    assert "\n" not in str(error.value) and re.search(expected, str(error.value)), error.value


def test_a_crafted_adapter_is_one_line_from_a_tool(stories_path, adapter_file, capsys):
    from llamapy.cli.perplexity import tool
    bad = ADAPTER_CASES[0][1](adapter_file)
    with deadline(PER_CASE_SECONDS), pytest.raises(SystemExit) as done:
        tool.main(["-m", str(stories_path), "--lora", str(bad), "-p", "Once upon a time, there was.", "-c", "8"])
    err = capsys.readouterr().err
    assert done.value.code != 0 and "Traceback" not in err and "error: " in err and "do not fit" in err, err


@pytest.mark.parametrize("damage, expected", [
    (lambda d, lay: C.patch(d, lay.tensor_offsets["opt.m"], C.read_field(d, lay.tensor_offsets["param.w"])),
     "share bytes"),
    (lambda d, lay: C.add_raw_kv(d, "llamapy.checkpoint.x", ValueType.ARRAY, C.nested_arrays(5000)),
     "nested deeper"),
    (lambda d, lay: C.patch(d, lay.tensor_dims["param.w"][0], 2**40), "extends past the end"),
], ids=["tensors sharing bytes", "nested arrays", "a huge tensor"])
def test_a_damaged_checkpoint_is_refused_in_one_line(tmp_path, damage, expected: str):
    """Checkpoints are read through the same checks (what they then hold is checkpoint.py's)."""
    from llamapy.checkpoint import load_checkpoint
    meta = {"general.architecture": C.string("llamapy-checkpoint")}
    good = C.write(tmp_path / "ckpt.gguf", meta, [C.tensor("param.w", np.ones((4, 8), np.float32)),
                                                  C.tensor("opt.m", np.zeros((4, 8), np.float32))])
    bad = patch_file(good, damage)
    with deadline(PER_CASE_SECONDS), pytest.raises(LlamapyError) as error:
        load_checkpoint(bad)
    assert "\n" not in str(error.value) and re.search(expected, str(error.value)), error.value
