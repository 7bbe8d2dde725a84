"""Make the small Hugging Face checkpoints of test_convert and record what transformers and
llama.cpp do with them. Runs in a separate venv, never the project's:

    python -m venv /work/scratch/hfvenv
    /work/scratch/hfvenv/bin/pip install torch==2.13.0 transformers safetensors sentencepiece protobuf numpy
    /work/scratch/hfvenv/bin/python tests/record_hf_checkpoints.py LLAMA_CPP_SRC LLAMA_CPP_BIN [NAME...]

LLAMA_CPP_SRC is llama.cpp's source tree (convert_hf_to_gguf.py and gguf-py), LLAMA_CPP_BIN
the folder of its built tools (llama-perplexity). For each checkpoint (hf_checkpoints.NAMES):

1. its files, into tests/data/hf/NAME/: a tokenizer (llama and gemma3: a small SentencePiece
   BPE model trained here on TinyStories with each family's settings, converted by
   transformers to tokenizer.json; qwen2 and qwen3: Qwen1.5's real vocabulary, llama3: Llama
   3's, each rebuilt by hf_checkpoints), the tokenizer_config.json each family publishes (special tokens, BOS/EOS
   flags, the real chat template), and what `save_pretrained` writes for a 2-layer model of the
   family (config.json, generation_config.json, the shard index for the sharded llama), with
   layout.json (the tensors of each shard; hf_checkpoints draws their values from seeds);
2. the checkpoint is rebuilt from those files by hf_checkpoints.write_checkpoint (as the tests
   rebuild it) and loaded by transformers (no missing or unexpected tensor allowed): its
   tokens and logits (float64) for PROMPT go to reference.json / logits.npz;
3. llama.cpp's convert_hf_to_gguf.py converts it with each --outtype: every metadata key
   (type and value; arrays as item type, length and sha256 of their bytes) and every tensor
   (name, ne, type, sha256 of its bytes) of its output, in order, go to reference.json;
4. llama-perplexity on its F32 output over the first PPL_TEXT_BYTES bytes of wiki.test.raw
   (-c PPL_CTX, one chunk per batch): the running values and the final estimate go to
   reference.json. (With several chunks per batch, llama.cpp's flash attention over several
   KV streams sums in another order than with one: at -b 2048 its numbers differ from these
   by up to 1e-4, and llamapy's equal the one-chunk ones.)
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
import transformers
from safetensors import safe_open

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import hf_checkpoints as H  # noqa: E402

SHARED = HERE.parent.parent / "shared"
PROMPT = "Once upon a time, there was a little robot who loved to paint the sky."
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
N_LOGIT_IDS = 512  # logits recorded per position: these ids (seeded), the full logsumexp, the top ids
PPL_TEXT_BYTES, PPL_CTX = 3000, 128

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
GEMMA_SPECIALS = ["<mask>", "[multimodal]", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                  "<image_soft_token>"]

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
MODELS = {  # config class, model class, its kwargs, dtype of the saved weights, shard size
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(SMALL, vocab_size=1000, max_position_embeddings=4096,
              rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2), torch.float32, "300KB"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(SMALL, vocab_size=151936, max_position_embeddings=32768,
              rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
              tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643), torch.bfloat16, None),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(SMALL, vocab_size=151936, head_dim=32,
              max_position_embeddings=40960, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
              bos_token_id=151643, eos_token_id=151645), torch.float16, None),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(SMALL, vocab_size=128256, max_position_embeddings=131072,
               rms_norm_eps=1e-5, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192},
               tie_word_embeddings=True, bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
               torch.bfloat16, None),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(SMALL, vocab_size=1008, head_dim=16,
               query_pre_attn_scalar=16, sliding_window=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
               bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True), torch.bfloat16, None),
}


def added_token(content: str, special: bool = True) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": special}


def token_entry(content: str) -> dict:
    """A special token as tokenizer_config.json held it until transformers 4.36 (Llama 2's)."""
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False}


def train_spm(dest: Path, family: str) -> None:
    """A 1000-piece SentencePiece BPE model with the family's settings: llama's (a space
    prefix, <unk> <s> </s> first) or gemma's (no space prefix, <pad> <eos> <bos> <unk> first,
    its turn and image markers as user-defined pieces); both split digits and fall back to bytes."""
    text = (SHARED / "data" / "tinystories_sample.txt").read_text()[:300_000].replace("<|endoftext|>", "\n")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "train.txt").write_text(text)
        common = dict(input=str(Path(tmp) / "train.txt"), model_prefix=str(Path(tmp) / "m"), vocab_size=1000,
                      model_type="bpe", character_coverage=1.0, byte_fallback=True, split_digits=True,
                      normalization_rule_name="identity", remove_extra_whitespaces=False,
                      allow_whitespace_only_pieces=True, num_threads=1, minloglevel=2)
        if family == "llama":
            spm.SentencePieceTrainer.train(**common, add_dummy_prefix=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
        else:
            spm.SentencePieceTrainer.train(**common, add_dummy_prefix=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                                           pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
                                           unk_piece="<unk>", user_defined_symbols=GEMMA_SPECIALS)
        shutil.copyfile(Path(tmp) / "m.model", dest / "tokenizer.model")


def tokenizer_files(name: str, dest: Path) -> None:
    """The tokenizer files of checkpoint `name`, as its family publishes them."""
    if name == "llama":
        train_spm(dest, "llama")
        config = {"add_bos_token": True, "add_eos_token": False, "bos_token": token_entry("<s>"),
                  "eos_token": token_entry("</s>"), "unk_token": token_entry("<unk>"), "pad_token": None,
                  "clean_up_tokenization_spaces": False, "legacy": False, "padding_side": "right",
                  "model_max_length": 1000000000000000019884624838656, "sp_model_kwargs": {},
                  "tokenizer_class": "LlamaTokenizer", "chat_template": LLAMA2_TEMPLATE,
                  "added_tokens_decoder": {str(i): added_token(t) for i, t in enumerate(["<unk>", "<s>", "</s>"])}}
    elif name == "gemma3":
        train_spm(dest, "gemma")
        sp = spm.SentencePieceProcessor(model_file=str(dest / "tokenizer.model"))
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", *GEMMA_SPECIALS]
        config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>", "eos_token": "<eos>",
                  "pad_token": "<pad>", "unk_token": "<unk>", "boi_token": "<start_of_image>",
                  "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>",
                  "clean_up_tokenization_spaces": False, "spaces_between_special_tokens": False,
                  "model_max_length": 1000000000000000019884624838656, "sp_model_kwargs": None,
                  "tokenizer_class": "GemmaTokenizer", "use_default_system_prompt": False,
                  "added_tokens_decoder": {str(sp.piece_to_id(t)): added_token(t) for t in specials}}
        shutil.copyfile(HERE / "data" / "gemma3-chat-template.jinja", dest / "chat_template.jinja")
    elif name == "llama3":
        meta = H.gguf_metadata(SHARED / "data" / "vocab" / H.BPE_TOKENIZERS["llama3"].vocab)
        tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
        config = {"added_tokens_decoder": {str(i): added_token(t) for i, t in enumerate(tokens) if types[i] == 3},
                  "bos_token": "<|begin_of_text|>", "clean_up_tokenization_spaces": True, "eos_token": "<|eot_id|>",
                  "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
                  "tokenizer_class": "PreTrainedTokenizerFast",
                  "chat_template": (SHARED / "data" / "chat_templates"
                                    / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text()}
    else:
        template = (SHARED / "data" / "chat_templates"
                    / ("Qwen-Qwen2.5-7B-Instruct.jinja" if name == "qwen2" else "Qwen-Qwen3-0.6B.jinja")).read_text()
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        config = {"add_bos_token": False, "add_prefix_space": False, "bos_token": None,
                  "eos_token": "<|endoftext|>" if name == "qwen2" else "<|im_end|>", "pad_token": "<|endoftext|>",
                  "unk_token": None, "errors": "replace", "split_special_tokens": False,
                  "clean_up_tokenization_spaces": False, "model_max_length": 131072,
                  "tokenizer_class": "Qwen2Tokenizer", "chat_template": template,
                  "added_tokens_decoder": {str(151643 + i): added_token(t) for i, t in enumerate(specials)}}
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    if name in ("llama", "gemma3"):  # transformers converts tokenizer.model to the tokenizer.json it ships with
        with tempfile.TemporaryDirectory() as tmp:
            transformers.AutoTokenizer.from_pretrained(dest).save_pretrained(tmp)
            shutil.copyfile(Path(tmp) / "tokenizer.json", dest / "tokenizer.json")


def as_transformers_v4(config: dict) -> dict:
    """config.json as transformers 4 wrote it (most published checkpoints): rope_theta and
    rope_scaling at the top, torch_dtype."""
    out = {k: v for k, v in config.items() if k not in ("rope_parameters", "dtype")}
    out["rope_theta"] = config["rope_parameters"]["rope_theta"]
    out["rope_scaling"] = None
    out["torch_dtype"] = config["dtype"]
    out["transformers_version"] = "4.43.1"
    return dict(sorted(out.items()))


def model_files(name: str, dest: Path) -> None:
    """config.json, generation_config.json, the shard index and layout.json, from save_pretrained."""
    config_cls, model_cls, kwargs, dtype, shard = MODELS[name]
    config = getattr(transformers, config_cls)(**kwargs)
    model = getattr(transformers, model_cls)(config).to(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, **({"max_shard_size": shard} if shard else {}))
        for f in Path(tmp).glob("*.json"):
            shutil.copyfile(f, dest / f.name)
        files = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(f, framework="pt") as st:
                tensors = []
                for tname in st.keys():
                    t = st.get_tensor(tname)
                    st_dtype = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[t.dtype]
                    data = H.to_dtype(H.tensor_values(name, tname, tuple(t.shape)), st_dtype)
                    tensors.append([tname, st_dtype, list(t.shape), hashlib.sha256(data.tobytes()).hexdigest()])
                files[f.name] = {"metadata": st.metadata(), "tensors": tensors}
    if name == "qwen2":
        config_json = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps(as_transformers_v4(config_json), indent=2) + "\n")
    (dest / "layout.json").write_text(json.dumps({"files": files}, indent=1) + "\n")


def load_model(ckpt: Path, dtype=torch.float64):
    """The checkpoint in transformers (no missing or unexpected tensor allowed)."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise SystemExit(f"{ckpt.name}: transformers did not load every tensor: {problems}")
    return model


def prompt_logits(model, ckpt: Path) -> tuple[list[int], np.ndarray]:
    """The prompt's tokens and the model's logits (float64) for them."""
    ids = transformers.AutoTokenizer.from_pretrained(ckpt)(PROMPT).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
    return ids, logits


def save_logits(path: Path, logits: np.ndarray) -> None:
    """What the tests compare of a (positions, vocabulary) logits array: N_LOGIT_IDS seeded ids,
    each position's top 8 and its logsumexp."""
    vocab = logits.shape[1]
    logit_ids = np.sort(np.random.default_rng(0).choice(vocab, size=min(N_LOGIT_IDS, vocab), replace=False))
    top = np.argsort(-logits, axis=1)[:, :8]
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    np.savez_compressed(path, ids=logit_ids, logits=logits[:, logit_ids].astype(np.float32),
                        top_ids=top, top_logits=np.take_along_axis(logits, top, 1), logsumexp=lse)


def convert(src: Path, ckpt: Path, outtype: str, out: Path, script: str = "convert_hf_to_gguf.py",
            *extra: str) -> None:
    """llama.cpp's converter `script` on `ckpt` (`extra`: more flags, --base for convert_lora_to_gguf.py)."""
    run = subprocess.run([sys.executable, str(src / script), str(ckpt), "--outfile", str(out),
                          "--outtype", outtype, *extra], capture_output=True, text=True,
                         env={"PYTHONPATH": str(src / "gguf-py"), "PATH": "/usr/bin:/bin"})
    if run.returncode:
        raise SystemExit(f"{script} {ckpt.name} --outtype {outtype} failed:\n{run.stderr[-3000:]}")


def perplexity(bin_dir: Path, model: Path, work: Path, *extra: str) -> dict:
    """llama-perplexity's running values and final estimate (`extra`: more flags, --lora). Its
    output goes to files: through pipes, its asynchronous log sometimes loses the last lines
    when the run is quick."""
    text = work / "ppl.txt"
    text.write_bytes((SHARED / "data" / "wiki.test.raw").read_bytes()[:PPL_TEXT_BYTES])
    out, err = work / "ppl.out", work / "ppl.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(PPL_CTX),
                        "-b", str(PPL_CTX), "-t", "2", *extra], stdout=stdout, stderr=stderr)
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", err.read_text())
    if final is None:
        raise SystemExit(f"llama-perplexity on {model.name} failed:\n{err.read_text()[-3000:]}")
    return {"text_bytes": PPL_TEXT_BYTES, "ctx": PPL_CTX, "batch": PPL_CTX, "running": out.read_text().strip(),
            "ppl": float(final.group(1)), "error": float(final.group(2))}


def llama_cpp_version(bin_dir: Path) -> str:
    return subprocess.run([str(bin_dir / "llama-perplexity"), "--version"], capture_output=True,
                          text=True).stderr.strip().splitlines()[0]


def record(name: str, src: Path, bin_dir: Path) -> None:
    dest = H.DATA / name
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    tokenizer_files(name, dest)
    model_files(name, dest)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = H.write_checkpoint(name, Path(tmp) / name, SHARED)
        ids, logits = prompt_logits(load_model(ckpt), ckpt)
        save_logits(dest / "logits.npz", logits)
        listings = {}
        for outtype in OUTTYPES:
            out = Path(tmp) / f"{name}-{outtype}.gguf"
            convert(src, ckpt, outtype, out)
            listings[outtype] = H.gguf_listing(out)
        ppl = perplexity(bin_dir, Path(tmp) / f"{name}-f32.gguf", Path(tmp))
    reference = {"transformers": transformers.__version__, "torch": torch.__version__,
                 "llama_cpp": llama_cpp_version(bin_dir),
                 "prompt": PROMPT, "prompt_ids": ids, "convert_hf_to_gguf": listings, "llama_perplexity": ppl}
    (dest / "reference.json").write_text(json.dumps(reference, indent=1, ensure_ascii=False) + "\n")
    print(f"{name}: {len(ids)} prompt tokens, PPL {ppl['ppl']}, "
          f"{sum(f.stat().st_size for f in dest.iterdir()) // 1024} KB recorded")


def main() -> None:
    src, bin_dir, *names = sys.argv[1:]
    sys.path.insert(0, str(Path(src) / "gguf-py"))
    for name in names or H.NAMES:
        record(name, Path(src), Path(bin_dir))


if __name__ == "__main__":
    main()
