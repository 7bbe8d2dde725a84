"""llamapy-server: a model behind llama-server's HTTP API, its native endpoints and OpenAI's
(engine.py: the slots and the decode loop; app.py: the endpoints, small handlers; service.py:
what they share, requests made into the engine's jobs and their events collected;
completion_path.py: the one path every completion answers through, in the shapes of
openai_shapes.py and native_shapes.py; embedding_shapes.py, status.py: the other answers
(/props, /v1/models, /slots, /metrics); prompts.py: prompts, infill prompts and chat
renderings to tokens and text; sampler_order.py: a request's sampler order; schemas.py,
native_schemas.py: the request bodies and their ranges; bodies.py: parsing them off the event
loop; gate.py: the key and the body limit; access_log.py: a log line per request;
adapters.py: the LoRA adapters loaded; limits.py: the bounds; errors.py: OpenAI's error
shape)."""
