"""llamapy-server: a model behind llama-server's OpenAI-compatible HTTP API (engine.py: the
slots and the decode loop; app.py: the endpoints; schemas.py: the request bodies and their
ranges; bodies.py: parsing them off the event loop; gate.py: the key and the body limit;
adapters.py: the LoRA adapters loaded; limits.py: the bounds; errors.py: OpenAI's error shape)."""
