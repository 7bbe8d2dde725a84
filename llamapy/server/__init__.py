"""llamapy-server: a model behind llama-server's OpenAI-compatible HTTP API (engine.py: the
slots and the decode loop; app.py: the endpoints; schemas.py: the request bodies)."""
