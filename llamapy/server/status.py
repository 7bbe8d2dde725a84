"""What the server reports about itself: GET /props (what a client reads to set itself up),
GET /v1/models, GET /slots (each slot's state and its last request) and GET /metrics (its
counters, in Prometheus' text format), in llama-server's shapes."""
from __future__ import annotations

from .native_shapes import metrics_settings


def props(server, slots: bool, metrics: bool, version: str) -> dict:
    """llama-server's /props: the requests' default settings, the slots, the model, its chat
    template and special tokens, what the server serves."""
    engine, vocab = server.engine, server.vocab

    def token_text(token: int | None) -> str:
        return "" if token is None else vocab.token_to_piece(token, True).decode("utf-8", "replace")

    return {"default_generation_settings": {"params": metrics_settings(server.default_settings()),
                                            "n_ctx": engine.n_ctx_slot},
            "total_slots": len(engine.slots), "model_alias": server.alias, "model_path": server.model_path,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": slots, "endpoint_props": False, "endpoint_metrics": metrics,
            "chat_template": server.template.source, "bos_token": token_text(vocab.bos_id),
            "eos_token": token_text(vocab.eos_id), "build_info": f"llamapy {version}", "is_sleeping": False}


def slot_states(engine) -> list[dict]:
    """llama-server's /slots (its metrics form), with llamapy's cache counts: `n_cached` tokens
    in the slot's cache, `n_cells` cells of its KV stream in use, its adapters' scales."""
    states = []
    for s in engine.slots:
        state = {"id": s.id, "n_ctx": engine.n_ctx_slot, "speculative": False, "is_processing": s.busy}
        job = s.last_job
        if job is not None:
            remaining = -1 if job.max_tokens < 0 else job.max_tokens - s.n_sampled
            state.update({"id_task": job.id, "n_prompt_tokens": len(s.cached),
                          "n_prompt_tokens_processed": s.n_read - s.n_cached, "n_prompt_tokens_cache": s.n_cached,
                          "params": metrics_settings(job.settings),
                          "next_token": [{"has_next_token": s.busy, "has_new_line": s.has_new_line,
                                          "n_remain": remaining, "n_decoded": s.n_sampled}]})
        else:
            state["id_task"] = -1
        state.update({"n_cached": len(s.cached), "n_cells": engine.cells_used(s),
                      "lora": [{"id": i, "scale": x} for i, x in enumerate(s.lora)]})
        states.append(state)
    return states


def model_list(server) -> dict:
    """OpenAI's /v1/models: the one model served, with llama-server's `meta` sizes."""
    engine = server.engine
    hp = engine.ctx.model.hparams
    return {"object": "list", "data": [{
        "id": server.alias, "object": "model", "created": server.created, "owned_by": "llamapy",
        "meta": {"n_vocab": hp.n_vocab, "n_ctx_train": hp.n_ctx_train, "n_embd": hp.n_embd,
                 "n_ctx_slot": engine.n_ctx_slot, "n_slots": len(engine.slots)}}]}


def metrics_text(engine) -> str:
    """llama-server's /metrics: its counters and gauges under its `llamacpp:` names."""
    m = engine.metrics
    busy = sum(s.busy for s in engine.slots)
    rows = [
        ("prompt_tokens_total", "counter", m.prompt_tokens, "Number of prompt tokens processed."),
        ("prompt_seconds_total", "counter", m.prompt_seconds, "Prompt process time"),
        ("tokens_predicted_total", "counter", m.predicted_tokens, "Number of generation tokens processed."),
        ("tokens_predicted_seconds_total", "counter", m.predicted_seconds, "Predict process time"),
        ("n_decode_total", "counter", m.n_decode, "Total number of llama_decode() calls"),
        ("n_busy_slots_per_decode", "counter", m.n_busy_slots / max(m.n_decode, 1),
         "Average number of busy slots per llama_decode() call"),
        ("prompt_tokens_seconds", "gauge", m.prompt_tokens / m.prompt_seconds if m.prompt_seconds else 0.0,
         "Average prompt throughput in tokens/s."),
        ("predicted_tokens_seconds", "gauge",
         m.predicted_tokens / m.predicted_seconds if m.predicted_seconds else 0.0,
         "Average generation throughput in tokens/s."),
        ("requests_processing", "gauge", busy, "Number of requests processing."),
        ("requests_deferred", "gauge", engine.n_waiting, "Number of requests deferred."),
    ]
    return "".join(f"# HELP llamacpp:{name} {help_}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {value}\n"
                   for name, kind, value, help_ in rows)
