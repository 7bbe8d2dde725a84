"""What the server reports about itself: GET /props (what a client reads to set itself up)
and GET /slots (each slot's state and its last request), in llama-server's shapes."""
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
