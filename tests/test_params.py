"""The checked parameter records (ggmlpy/params.py) that AdamW, SGD and TrainParams are made of."""
import json

import numpy as np
import pytest

from ggmlpy.opt import SGD, AdamW, with_alpha
from ggmlpy.params import ParamError
from llamapy.train_params import LoraParams, LRSchedule, TrainParams, param_filter_all, param_filter_lora


@pytest.mark.parametrize("make, message", [
    (lambda: AdamW(alpha=-1e-3), "AdamW.alpha must be >= 0"),
    (lambda: AdamW(beta2=1.5), "AdamW.beta2 must be <= 1"),
    (lambda: AdamW(eps="small"), "AdamW.eps must be a number"),
    (lambda: AdamW(alpha=True), "AdamW.alpha must be a number"),
    (lambda: AdamW(wd=float("nan")), "AdamW.wd must be >= 0"),
    (lambda: SGD(kind="adamw"), "SGD.kind must be one of 'sgd'"),
    (lambda: LRSchedule(lr0=0.0), "LRSchedule.lr0 must be > 0"),
    (lambda: LRSchedule(epochs=1.5), "LRSchedule.epochs must be a whole number"),
    (lambda: LRSchedule(kind="linear"), "LRSchedule.kind must be one of"),
    (lambda: LoraParams(rank=0), "LoraParams.rank must be >= 1"),
    (lambda: LoraParams(rank=8, modules="attn_q"), "LoraParams.modules must be a sequence"),
    (lambda: TrainParams(grad_clip=-1.0), "TrainParams.grad_clip must be > 0"),
    (lambda: TrainParams(param_filter=3), "TrainParams.param_filter must be callable"),
    (lambda: TrainParams(optimizer={"kind": "lion"}), "TrainParams.optimizer: kind must be one of 'adamw', 'sgd'"),
    (lambda: TrainParams(window_bos=1), "TrainParams.window_bos must be True or False"),
])
def test_a_bad_value_is_one_clear_error(make, message):
    with pytest.raises(ParamError, match="^" + message.replace("(", r"\(")) as info:
        make()
    assert info.value.field == message.split(" ")[0].rstrip(":")  # what a command line maps to its flag


def test_an_unknown_field_is_refused():
    with pytest.raises(TypeError, match="beta3"):
        AdamW(beta3=0.5)


def test_values_are_converted_to_the_declared_types():
    a = AdamW(alpha=1, beta1=np.float32(0.5))
    assert type(a.alpha) is float and type(a.beta1) is float and a.beta1 == 0.5
    s = LRSchedule(epochs=np.int64(3), warmup=2.0, half_life=1)
    assert (type(s.epochs), type(s.warmup), type(s.half_life)) == (int, int, float)
    lora = LoraParams(rank=4, modules=["attn_q", "attn_v"])
    assert lora.modules == ("attn_q", "attn_v")


def test_nested_records_come_from_dicts_by_kind():
    p = TrainParams(optimizer={"kind": "sgd", "wd": 0.1}, schedule={"lr0": 1e-3}, lora={"rank": 2})
    assert p.optimizer == SGD(wd=0.1) and p.schedule == LRSchedule(lr0=1e-3) and p.lora.rank == 2
    assert p.param_filter is param_filter_lora  # an adapter is what trains
    assert TrainParams().param_filter is param_filter_all


def test_records_remember_which_fields_the_caller_set():
    assert AdamW(wd=0.1).fields_set == {"wd"}
    assert LRSchedule(lr0=1e-3, warmup=5).as_dict(only_set=True) == {"lr0": 1e-3, "warmup": 5}
    with pytest.raises(ValueError, match="schedule=LRSchedule"):
        TrainParams(optimizer=AdamW(alpha=1e-3))  # the schedule sets the rate
    moved = with_alpha(AdamW(beta1=0.8), 5e-4)
    assert moved.alpha == 5e-4 and moved.beta1 == 0.8 and moved.fields_set == {"beta1", "alpha"}


def test_replace_checks_like_a_new_record():
    p = TrainParams(grad_clip=1.0)
    q = p.replace(n_ctx_train=64)
    assert q.n_ctx_train == 64 and q.grad_clip == 1.0 and p.n_ctx_train == 0
    with pytest.raises(ValueError, match="n_ctx_train must be >= 0"):
        p.replace(n_ctx_train=-1)
    with pytest.raises(ValueError, match="grad_checkpoint_every needs grad_checkpoint=True"):
        p.replace(grad_checkpoint_every=2)


def test_as_dict_is_json_and_makes_the_record_again():
    p = TrainParams(lora=LoraParams(rank=8, modules=("attn_q",)), schedule=LRSchedule(lr0=2e-4, kind="cosine"))
    for record in (p.optimizer, p.schedule, p.lora):
        d = json.loads(json.dumps(record.as_dict()))
        assert type(record)(**d) == record
    assert list(p.schedule.as_dict()) == ["lr0", "lr_min", "decay_epochs", "half_life", "halvings", "epochs", "kind",
                                          "warmup", "cos_restart"]  # a checkpoint's order
    assert p.lora.as_dict(exclude=("seed",)) == {"rank": 8, "alpha": None, "modules": ["attn_q"]}


def test_frozen_records_are_values():
    assert AdamW(wd=0.1) == AdamW(wd=0.1) and hash(AdamW(wd=0.1)) == hash(AdamW(wd=0.1))
    with pytest.raises(AttributeError):
        AdamW().alpha = 1.0
