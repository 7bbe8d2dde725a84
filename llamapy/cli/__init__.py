"""The command-line tools: thin front ends over the library (parsing, printing, exit codes),
one argument layer (args.py) with llama.cpp's flags."""

# name -> (module, what it does); pyproject.toml's scripts are `llamapy-<name>`
TOOLS = {
    "cli": ("llamapy.cli.completion", "generate text or chat, as llama-completion / llama-cli"),
    "perplexity": ("llamapy.cli.perplexity", "perplexity of a model on a text, as llama-perplexity"),
    "finetune": ("llamapy.cli.finetune", "finetune a model (full or LoRA) on a text or samples"),
    "train": ("llamapy.cli.train", "train a new model from nothing on a text"),
    "export-lora": ("llamapy.cli.export_lora", "merge LoRA adapters into a model, as llama-export-lora"),
    "server": ("llamapy.cli.server", "serve a model over HTTP with OpenAI's API, as llama-server"),
    "quantize": ("llamapy.cli.quantize", "quantize a model, as llama-quantize (the same bytes)"),
    "convert": ("llamapy.cli.convert", "convert a Hugging Face checkpoint to GGUF, as convert_hf_to_gguf.py"),
    "tokenize": ("llamapy.cli.tokenize", "tokenize a corpus once into token shards (--data DIR of the trainers)"),
}
