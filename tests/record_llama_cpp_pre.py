"""Record llama.cpp's tokenization for every `tokenizer.ggml.pre` type, for test_vocab.

    python tests/record_llama_cpp_pre.py LIBLLAMA_SO LLAMA_VOCAB_CPP

No llama.cpp test file exists for most pre types, so this runs llama.cpp itself: for each
name in LLAMA_VOCAB_CPP (src/llama-vocab.cpp), the pair vocab of
test_vocab.pair_bpe_metadata is written to a temporary GGUF with that pre name, loaded
vocab-only by LIBLLAMA_SO through ctypes, and asked to tokenize test_vocab.PRE_TEXTS and
detokenize CLEAN_PROBE. The result goes to tests/data/llama_cpp_pre_tokenizers.json.
`ModelParams` mirrors llama_model_params of the llama.cpp version recorded (check llama.h).
"""
from __future__ import annotations

import ctypes as C
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).parent))
from test_vocab import CLEAN_PROBE, PRE_GOLDEN, PRE_TEXTS, pair_bpe_metadata  # noqa: E402


class ModelParams(C.Structure):
    _fields_ = [("devices", C.c_void_p), ("tensor_buft_overrides", C.c_void_p), ("n_gpu_layers", C.c_int32),
                ("split_mode", C.c_int), ("load_mode", C.c_int), ("lazy_mode", C.c_int), ("main_gpu", C.c_int32),
                ("tensor_split", C.c_void_p), ("progress_callback", C.c_void_p),
                ("progress_callback_user_data", C.c_void_p), ("kv_overrides", C.c_void_p),
                ("vocab_only", C.c_bool), ("check_tensors", C.c_bool), ("use_extra_bufts", C.c_bool),
                ("no_host", C.c_bool), ("no_alloc", C.c_bool), ("load_mtp", C.c_bool)]


def load_library(path: str) -> C.CDLL:
    lib = C.CDLL(path)
    log = C.CFUNCTYPE(None, C.c_int, C.c_char_p, C.c_void_p)(lambda level, text, data: None)
    lib._quiet = log  # keep the callback alive
    lib.llama_log_set(log, None)
    lib.llama_backend_init()
    lib.llama_model_default_params.restype = ModelParams
    lib.llama_model_load_from_file.restype = C.c_void_p
    lib.llama_model_load_from_file.argtypes = [C.c_char_p, ModelParams]
    lib.llama_model_free.argtypes = [C.c_void_p]
    lib.llama_model_get_vocab.restype = C.c_void_p
    lib.llama_model_get_vocab.argtypes = [C.c_void_p]
    lib.llama_tokenize.argtypes = [C.c_void_p, C.c_char_p, C.c_int32, C.POINTER(C.c_int32), C.c_int32, C.c_bool,
                                   C.c_bool]
    lib.llama_detokenize.argtypes = [C.c_void_p, C.POINTER(C.c_int32), C.c_int32, C.c_char_p, C.c_int32, C.c_bool,
                                     C.c_bool]
    lib.llama_vocab_bos.argtypes = [C.c_void_p]
    for name in ("add_bos", "add_sep"):
        getattr(lib, f"llama_vocab_get_{name}").argtypes = [C.c_void_p]
        getattr(lib, f"llama_vocab_get_{name}").restype = C.c_bool
    return lib


def tokenize(lib: C.CDLL, vocab: int, text: str) -> list[int]:
    data = text.encode()
    out = (C.c_int32 * (len(data) + 8))()
    n = lib.llama_tokenize(vocab, data, len(data), out, len(out), False, False)
    assert n >= 0
    return list(out[:n])


def detokenize(lib: C.CDLL, vocab: int, ids: list[int]) -> str:
    arr = (C.c_int32 * max(1, len(ids)))(*ids)
    out = C.create_string_buffer(64 + 64 * len(ids))
    n = lib.llama_detokenize(vocab, arr, len(ids), out, len(out), False, False)
    assert n >= 0
    return out.raw[:n].decode("utf-8", "replace")


def write_gguf(path: Path, pre: str) -> None:
    meta = pair_bpe_metadata(pre)
    writer = gguf.GGUFWriter(str(path), meta["general.architecture"].value)
    for key, v in meta.items():
        if key == "general.architecture":
            continue
        value = v.value.tolist() if hasattr(v.value, "tolist") else v.value
        sub = gguf.GGUFValueType(v.sub_type) if v.sub_type is not None else None
        writer.add_key_value(key, value, gguf.GGUFValueType(v.type), sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def record(lib: C.CDLL, path: Path, pre: str) -> dict:
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"llama.cpp cannot load the vocab with pre {pre!r}"
    vocab = lib.llama_model_get_vocab(model)
    # llama.cpp aborts (GGML_ASSERT in find_bpe_rank) when a "whitespace" piece holds a space
    ids = [None if pre == "whitespace" and " " in t else " ".join(map(str, tokenize(lib, vocab, t)))
           for t in PRE_TEXTS]
    bos = lib.llama_vocab_bos(vocab)
    rec = {"add_bos": lib.llama_vocab_get_add_bos(vocab), "bos": None if bos < 0 else bos,
           "add_sep": lib.llama_vocab_get_add_sep(vocab),
           "clean_probe": detokenize(lib, vocab, tokenize(lib, vocab, CLEAN_PROBE)), "ids": ids}
    lib.llama_model_free(model)
    return rec


def main(lib_path: str, source: str) -> None:
    lib = load_library(lib_path)
    names = list(dict.fromkeys(re.findall(r'tokenizer_pre == "([^"]+)"', Path(source).read_text())))
    records: list[dict] = []
    index: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            path = Path(tmp) / f"{name}.gguf"
            write_gguf(path, name)
            rec = record(lib, path, name)
            index[name] = records.index(rec) if rec in records else len(records)
            if index[name] == len(records):
                records.append(rec)
    commit = subprocess.run(["git", "-C", str(Path(source).parent), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown commit"
    out = {"source": f"llama.cpp {commit} (libllama through ctypes)", "texts": PRE_TEXTS,
           "clean_probe": CLEAN_PROBE, "pre": index, "records": records}
    PRE_GOLDEN.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"{len(names)} pre types, {len(records)} distinct results -> {PRE_GOLDEN}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
