"""``extra_state`` on save / load: exact values (tensors, inf / nan / -0.0, big ints, nested
containers), stateful objects restored in place, missing / unexpected entries in the LoadReport,
rejections that change nothing, and the pydantic schema of ``extra_state.json``."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import checkpoint
from checkpoint import CheckpointMismatchError, ChecksumMismatchError, CorruptCheckpointError
from checkpoint.training.extra_state import EXTRA_STATE_FILE, ExtraStateFile
from tests.helpers import assert_same_state
from tests.helpers import tiny_model


class Counter:
    """A user object with state_dict / load_state_dict."""

    def __init__(self, n: int = 0):
        self.n, self.history = n, [n]

    def state_dict(self):
        return {"n": self.n, "history": list(self.history)}

    def load_state_dict(self, sd):
        self.n, self.history = sd["n"], list(sd["history"])


def _sched(model):
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _plain_values():
    g = torch.Generator().manual_seed(3)
    return {
        "step": 12,
        "big": 2**80 + 1,
        "neg": -7,
        "floats": [1.0 / 3.0, math.inf, -math.inf, math.nan, -0.0, 5e-324],
        "name": "run-ü",
        "none": None,
        "flag": False,
        "rng": torch.get_rng_state(),
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "i64": torch.tensor([[1 << 62, -3]]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "nested": {"a": (1, [2.5, "x"]), 3: {"deep": [None, True]}},
    }


def test_plain_values_roundtrip_exactly_and_fill_the_callers_dict(tmp_path):
    values = _plain_values()
    checkpoint.save(tiny_model(), tmp_path / "ck", extra_state=values)
    target = {k: None for k in values}
    target_id = id(target)
    report = checkpoint.load(tiny_model(seed=1), tmp_path / "ck", extra_state=target)
    assert id(target) == target_id
    for k in values:
        assert_same_state(target[k], values[k], ordered=True, where=k)
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert {k for k in report.loaded_keys if k.startswith("extra_state.")} == {
        f"extra_state.{k}" for k in values
    }
    # The JSON part follows the pydantic schema.
    doc = ExtraStateFile.model_validate_json((tmp_path / "ck" / EXTRA_STATE_FILE).read_bytes())
    assert sorted(doc.entries) == sorted(values) and not doc.entries["rng"].stateful


def test_stateful_objects_restore_in_place(tmp_path):
    model = tiny_model()
    opt, sched = _sched(model)
    for _ in range(3):
        opt.step()
        sched.step()
    counter = Counter(5)
    counter.history.append(9)
    checkpoint.save(model, tmp_path / "ck", optimizer=opt, extra_state={"sched": sched, "counter": counter})
    model2 = tiny_model(seed=1)
    opt2, sched2 = _sched(model2)
    counter2 = Counter()
    target = {"sched": sched2, "counter": counter2}
    checkpoint.load(model2, tmp_path / "ck", optimizer=opt2, extra_state=target)
    assert target["sched"] is sched2 and target["counter"] is counter2  # restored, not replaced
    assert sched2.state_dict() == sched.state_dict()
    assert sched2.get_last_lr() == sched.get_last_lr() == [0.05]
    assert (counter2.n, counter2.history) == (5, [5, 9])
    opt.step(), sched.step(), opt2.step(), sched2.step()
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_missing_and_unexpected_entries_are_reported_like_tensors(tmp_path):
    model = tiny_model()
    checkpoint.save(model, tmp_path / "ck", extra_state={"step": 3, "old": "x"})
    target = {"step": None, "new": 1.5}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    other = tiny_model(seed=1)
    with pytest.raises(CheckpointMismatchError) as ei:
        checkpoint.load(other, tmp_path / "ck", extra_state=target)
    assert ei.value.report.missing_keys == ["extra_state.new"]
    # a stored entry the caller does not name is left unread: ignorable, never a failure
    assert ei.value.report.ignorable_keys == ["extra_state.old"] and ei.value.report.unexpected_keys == []
    assert target == {"step": None, "new": 1.5}  # strict: nothing changed
    assert not torch.equal(other[0].weight, before["0.weight"])
    report = checkpoint.load(other, tmp_path / "ck", extra_state=target, strict=False)
    assert (report.missing_keys, report.ignorable_keys) == (["extra_state.new"], ["extra_state.old"])
    assert target == {"step": 3, "new": 1.5}
    assert torch.equal(other[0].weight, before["0.weight"])
    only = {"step": None}  # naming a subset of the stored entries is a whole, strict load
    assert checkpoint.load(tiny_model(seed=1), tmp_path / "ck", extra_state=only).ok and only == {"step": 3}


def test_checkpoint_without_extra_state_reports_every_entry_missing(tmp_path):
    checkpoint.save(tiny_model(), tmp_path / "ck")
    report = checkpoint.load(tiny_model(seed=1), tmp_path / "ck", extra_state={"step": 0}, strict=False)
    assert report.missing_keys == ["extra_state.step"] and report.unexpected_keys == []
    # And a load without extra_state= ignores a stored one.
    checkpoint.save(tiny_model(), tmp_path / "ck2", extra_state={"step": 1})
    assert checkpoint.load(tiny_model(seed=1), tmp_path / "ck2").ok


def test_value_that_cannot_be_saved_names_its_path_and_writes_nothing(tmp_path):
    with pytest.raises(TypeError, match=r"nested.*\[1\].*object"):
        checkpoint.save(tiny_model(), tmp_path / "ck", extra_state={"nested": [1, object()]})
    with pytest.raises(TypeError, match="key 3"):
        checkpoint.save(tiny_model(), tmp_path / "ck", extra_state={3: 1})
    with pytest.raises(TypeError, match="dict key"):
        checkpoint.save(tiny_model(), tmp_path / "ck", extra_state={"d": {(1, 2): 3}})
    assert os.listdir(tmp_path) == []


def _flip_in_json(path):
    doc = json.loads(path.read_text())
    doc["entries"]["step"]["value"]["value"] = 4
    path.write_text(json.dumps(doc))


def test_corrupt_or_mismatched_extra_state_is_refused_before_any_change(tmp_path):
    model = tiny_model()
    opt, sched = _sched(model)
    checkpoint.save(model, tmp_path / "ck", extra_state={"step": 3, "sched": sched})
    other = tiny_model(seed=1)
    w = other[0].weight.detach().clone()
    target = {"step": 0}
    _, sched2 = _sched(other)
    with pytest.raises(TypeError, match="'sched' was saved through state_dict"):
        checkpoint.load(other, tmp_path / "ck", extra_state={"step": 0, "sched": 1.0})
    _flip_in_json(tmp_path / "ck" / EXTRA_STATE_FILE)
    with pytest.raises(ChecksumMismatchError, match=EXTRA_STATE_FILE):
        checkpoint.load(other, tmp_path / "ck", extra_state={"step": 0, "sched": sched2})
    (tmp_path / "ck" / EXTRA_STATE_FILE).write_text('{"format": "fqnckpt-extra-state", "entries": []}')
    with pytest.raises(CorruptCheckpointError, match="schema"):
        checkpoint.load(other, tmp_path / "ck", extra_state=target)
    assert target == {"step": 0} and torch.equal(other[0].weight, w)


def test_overwrite_without_extra_state_removes_the_stale_file(tmp_path):
    # extra_state.json is owned by the checkpoint: a later save without extra_state must not leave
    # the old step / RNG state behind for a load to pick up as this checkpoint's.
    d = tmp_path / "ck"
    checkpoint.save({"w": torch.ones(2)}, d, extra_state={"step": 7})
    assert (d / EXTRA_STATE_FILE).is_file()
    (d / "config.json").write_text("{}")
    checkpoint.save({"w": torch.zeros(2)}, d, overwrite=True)
    assert sorted(os.listdir(d)) == sorted(
        ["config.json", "model.safetensors.index.json", "model-00001-of-00001.safetensors"]
    )
    extra: dict = {"step": 0}
    report = checkpoint.load({"w": torch.empty(2)}, d, extra_state=extra, strict=False)
    assert extra == {"step": 0} and "extra_state.step" in report.missing_keys
