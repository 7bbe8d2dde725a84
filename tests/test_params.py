"""The parameter records (pydantic models, ggmlpy/records.py) that AdamW, SGD and TrainParams
are made of: what a user relies on, not pydantic itself."""
import numpy as np
import pytest
from pydantic import ValidationError

from ggmlpy.opt import SGD, AdamW, with_alpha
from ggmlpy.records import explain
from llamapy.checkpoint import RunParams
from llamapy.train_params import (LoraParams, LRSchedule, TrainParams, param_filter_all, param_filter_lora,
                                  param_filter_pattern)


@pytest.mark.parametrize("make, message", [
    (lambda: AdamW(alpha=-1e-3), "AdamW.alpha must be >= 0, not -0.001"),
    (lambda: AdamW(beta2=1.5), "AdamW.beta2 must be <= 1, not 1.5"),
    (lambda: AdamW(eps="small"), "AdamW.eps must be a number, not 'small'"),
    (lambda: AdamW(alpha=True), "AdamW.alpha must be a number, not True"),
    (lambda: AdamW(wd=float("nan")), "AdamW.wd must be a finite number, not nan"),
    (lambda: SGD(kind="adamw"), "SGD.kind must be one of 'sgd', not 'adamw'"),
    (lambda: LRSchedule(lr0=0.0), "LRSchedule.lr0 must be > 0, not 0.0"),
    (lambda: LRSchedule(lr0=-1), "LRSchedule.lr0 must be > 0, not -1"),
    (lambda: LRSchedule(epochs=1.5), "LRSchedule.epochs must be a whole number, not 1.5"),
    (lambda: LRSchedule(epochs="3"), "LRSchedule.epochs must be a whole number, not '3'"),
    (lambda: LRSchedule(warmup=False), "LRSchedule.warmup must be a whole number, not False"),
    (lambda: LRSchedule(kind="linear"), "LRSchedule.kind must be one of"),
    (lambda: LoraParams(rank=0), "LoraParams.rank must be >= 1, not 0"),
    (lambda: LoraParams(), "LoraParams.rank is required"),
    (lambda: LoraParams(rank=8, modules="attn_q"), "LoraParams.modules must be a sequence"),
    (lambda: LoraParams(rank=8, modules=["attn_q", 3]), "LoraParams.modules must be a string, not 3"),
    (lambda: TrainParams(grad_clip=-1.0), "TrainParams.grad_clip must be > 0, not -1.0"),
    (lambda: TrainParams(param_filter=3), "TrainParams.param_filter must be callable"),
    (lambda: TrainParams(optimizer={"kind": "lion"}), "TrainParams.optimizer: kind must be one of 'adamw', 'sgd', not 'lion'"),
    (lambda: TrainParams(optimizer={"kind": "sgd", "wd": 2.0}), "SGD.wd must be <= 1, not 2.0"),  # the nested record named
    (lambda: TrainParams(lora={"rank": -2}), "LoraParams.rank must be >= 1, not -2"),
    (lambda: TrainParams(window_bos=1), "TrainParams.window_bos must be True or False, not 1"),
    (lambda: AdamW(beta3=0.5), "AdamW.beta3 is not a field of AdamW"),
])
def test_a_bad_value_is_one_clear_error(make, message):
    with pytest.raises(ValidationError) as info:
        make()
    assert isinstance(info.value, ValueError)
    field, line = explain(info.value)
    assert line.startswith(message) and "\n" not in line
    assert field == message.split(" ")[0].rstrip(":")  # what a command line maps to its flag


@pytest.mark.parametrize("make, message", [
    (lambda: LRSchedule(half_life=1, lr_min=1e-6), "choose either halving (-lr-half) or decay to a minimum"),
    (lambda: LRSchedule(kind="cosine", half_life=2), "-lr-half and -decay-epochs belong to the exp schedule, not cosine"),
    (lambda: LRSchedule(cos_restart=2), "--cos-restart needs --lr-schedule cosine"),
    (lambda: LRSchedule(lr0=1e-4, lr_min=1e-3), "-lr-min 0.001 is above the learning rate 0.0001"),
    (lambda: TrainParams(optimizer=AdamW(alpha=1e-3)), "set the learning rate with schedule=LRSchedule(lr0=...)"),
    (lambda: TrainParams(grad_checkpoint_every=2), "grad_checkpoint_every needs grad_checkpoint=True"),
])
def test_rules_that_tie_fields_together(make, message):
    with pytest.raises(ValidationError) as info:
        make()
    assert explain(info.value)[1] == message or explain(info.value)[1].startswith(message)


def test_numbers_are_converted_to_the_declared_types():
    a = AdamW(alpha=1, beta1=np.float32(0.5))
    assert type(a.alpha) is float and type(a.beta1) is float and a.beta1 == 0.5
    s = LRSchedule(epochs=np.int64(3), warmup=2.0, half_life=1)
    assert (type(s.epochs), type(s.warmup), type(s.half_life)) == (int, int, float)
    assert LoraParams(rank=4, modules=["attn_q", "attn_v"]).modules == ("attn_q", "attn_v")


def test_nested_records_come_from_dicts_by_kind():
    p = TrainParams(optimizer={"kind": "sgd", "wd": 0.1}, schedule={"lr0": 1e-3}, lora={"rank": 2})
    assert p.optimizer == SGD(wd=0.1) and p.schedule == LRSchedule(lr0=1e-3) and p.lora.rank == 2
    assert p.param_filter is param_filter_lora  # an adapter is what trains
    assert TrainParams().param_filter is param_filter_all
    assert TrainParams(optimizer=SGD(wd=0.1)).optimizer.kind == "sgd"


def test_records_remember_which_fields_the_caller_set():
    assert AdamW(wd=0.1).model_fields_set == {"wd"}
    moved = with_alpha(AdamW(beta1=0.8), 5e-4)
    assert moved.alpha == 5e-4 and moved.beta1 == 0.8 and moved.model_fields_set == {"beta1", "alpha"}


def test_replace_checks_like_a_new_record():
    p = TrainParams(grad_clip=1.0)
    q = p.replace(n_ctx_train=64)
    assert q.n_ctx_train == 64 and q.grad_clip == 1.0 and p.n_ctx_train == 0
    assert q.model_fields_set == {"grad_clip", "n_ctx_train"}
    with pytest.raises(ValidationError, match="n_ctx_train"):
        p.replace(n_ctx_train=-1)
    with pytest.raises(ValidationError, match="grad_checkpoint_every needs grad_checkpoint=True"):
        p.replace(grad_checkpoint_every=2)
    with pytest.raises(ValidationError, match="lr0"):
        LRSchedule().replace(lr0=0)
    # the filter an adapter chose follows the adapter
    lora = TrainParams(lora=LoraParams(rank=2))
    assert lora.param_filter is param_filter_lora and lora.replace(lora=None).param_filter is param_filter_all


def test_json_round_trip():
    own_filter = param_filter_pattern("attn_")
    for p in (TrainParams(),
              TrainParams(lora=LoraParams(rank=8, modules=("attn_q",), seed=3), window_bos=True,
                          schedule=LRSchedule(lr0=2e-4, kind="cosine", warmup=5, cos_restart=1), grad_clip=0.5),
              TrainParams(optimizer=SGD(wd=0.01), schedule=LRSchedule(lr0=0.05, half_life=1.5, halvings=2),
                          grad_checkpoint=True, grad_checkpoint_every=2, backward_bf16=False, n_ctx_train=64),
              TrainParams(optimizer=AdamW(beta1=0.8, wd=0.1), param_filter=own_filter)):
        text = p.model_dump_json()
        assert "param_filter" not in text and '"alpha"' not in text.split('"lora"')[0]  # the schedule sets alpha
        q = TrainParams.model_validate_json(text)
        assert q.model_dump() == p.model_dump()  # every field but the (excluded) filter
        if p.param_filter is not own_filter:
            assert q == p
    for record in (AdamW(wd=0.1), SGD(alpha=0.5), LRSchedule(epochs=5), LoraParams(rank=1)):
        assert type(record).model_validate_json(record.model_dump_json()) == record
    run = RunParams(train=TrainParams(lora=LoraParams(rank=2)), n_ctx=32, n_batch=64, n_ubatch=16,
                    trained=[("blk.0.attn_q.weight.lora_a", (64, 2, 1, 1))], shuffle_seed=None)
    assert RunParams.model_validate_json(run.model_dump_json()) == run
    with pytest.raises(ValidationError) as info:  # what a JSON file says is checked too
        TrainParams.model_validate_json('{"lora": {"rank": 0}}')
    assert explain(info.value)[1] == "LoraParams.rank must be >= 1, not 0"


def test_frozen_records_are_values():
    assert AdamW(wd=0.1) == AdamW(wd=0.1) and hash(AdamW(wd=0.1)) == hash(AdamW(wd=0.1))
    with pytest.raises(ValidationError) as info:
        AdamW().alpha = 1.0
    assert explain(info.value)[1].startswith("AdamW.alpha cannot change")
    with pytest.raises(ValidationError):
        LRSchedule().lr0 = 1.0
