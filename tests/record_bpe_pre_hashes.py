"""Record how llama.cpp's convert_hf_to_gguf.py names the pre-tokenizer of a BPE tokenizer,
for llamapy.convert (the table is data the converter ships, as llama.cpp's converter does):

    python tests/record_bpe_pre_hashes.py LLAMA_CPP_SRC

convert_hf_to_gguf.py encodes a fixed text (`chktxt`) with the checkpoint's tokenizer and looks
the sha256 of the token ids up in a table of known tokenizers (`get_vocab_base_pre`, in
conversion/base.py). Both go to llamapy/convert/bpe_pre_hashes.json, in the table's order
(a hash listed twice keeps its last name, as the `if` chain there does).
"""
from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "llamapy" / "convert" / "bpe_pre_hashes.json"


def main(src: Path) -> None:
    text = (src / "conversion" / "base.py").read_text()
    body = text[text.index("def get_vocab_base_pre"):text.index("# Marker: End get_vocab_base_pre")]
    chktxt = ast.literal_eval(re.search(r"chktxt = (.*)\n", body).group(1))
    pairs = re.findall(r'if chkhsh == "([0-9a-f]{64})":\s*\n(?:\s*#.*\n)*\s*res = "([^"]+)"', body)
    if len(pairs) != body.count("if chkhsh =="):
        raise SystemExit("some hash entries of get_vocab_base_pre were not understood")
    OUT.write_text(json.dumps({"source": f"llama.cpp conversion/base.py get_vocab_base_pre ({len(pairs)} entries; "
                                         f"recorded by tests/record_bpe_pre_hashes.py)",
                               "chktxt": chktxt, "hashes": dict(pairs)}, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
