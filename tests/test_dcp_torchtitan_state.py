"""torchtitan's real DCP checkpoints: built as torchtitan's ``CheckpointManager.save``
builds them (model state flattened to the top level, ``optimizer`` from
``get_optimizer_state_dict(flatten_optimizer_state_dict=True)``, ``lr_scheduler``, ``dataloader``
holding ``{"dp_rank_0": pickle.dumps(state), "world_size": 1}`` as torchtitan's
``ParallelAwareDataloader.state_dict`` returns it, ``train_state``) plus an entry of any other
name, then ``dcp.save``. Every entry is listed by ``inspect``, carried by ``migrate`` (bytes kept
exactly), compared by ``diff`` and restored by ``load``; the pickled bytes are never unpickled by
us (only the dataloader's own ``load_state_dict`` does, as in torchtitan)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import checkpoint
from tests.helpers import run_cli

LOADER_STATE = {"_num_yielded": 3, "_sampler_iter_yielded": 3, "_sampler_iter_state": None}


class Loader:
    """torchtitan's ParallelAwareDataloader state_dict / load_state_dict, on a plain dict."""

    def __init__(self, state=None):
        self.state = state

    def state_dict(self):
        return {"dp_rank_0": pickle.dumps(self.state), "world_size": 1}

    def load_state_dict(self, sd):
        assert sd["world_size"] == 1
        self.state = pickle.loads(sd["dp_rank_0"])


class TrainState:
    """torchtitan's TrainState: step and tokens seen as tensors."""

    def __init__(self, step=0, ntokens=0):
        self.step, self.ntokens = step, ntokens

    def state_dict(self):
        return {"step": torch.tensor(self.step, dtype=torch.int32), "ntokens_seen": torch.tensor(self.ntokens)}

    def load_state_dict(self, sd):
        self.step, self.ntokens = int(sd["step"]), int(sd["ntokens_seen"])


def _setup(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return model, opt, sched


def torchtitan_checkpoint(path):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model, opt, sched = _setup(0)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
    states = dict(model.state_dict())  # torchtitan: _flattened_model_states_sd
    states["optimizer"] = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    states["lr_scheduler"] = sched.state_dict()
    states["dataloader"] = Loader(LOADER_STATE).state_dict()
    states["train_state"] = TrainState(10, 4096).state_dict()
    states["ft_meta"] = {"replica": "r-1", "loss": 0.25}  # a top-level entry of any other name
    with pytest.warns(UserWarning):  # DCP: no process group, single-process save
        dcp.save(states, checkpoint_id=str(path))
    return model, opt, sched


def test_every_entry_inspected_migrated_diffed_loaded(tmp_path):
    src = tmp_path / "step-10"
    model, opt, sched = torchtitan_checkpoint(src)
    code, out, _ = run_cli("inspect", str(src), "--json")
    assert code == 0
    info = json.loads(out)
    listed = json.dumps(info)
    for name in ("lr_scheduler", "dataloader", "train_state", "ft_meta"):
        assert name in listed, name
    assert "unreadable" not in listed

    code, _, _ = run_cli("migrate", str(src), str(tmp_path / "out"))
    assert code == 0
    doc = json.loads((tmp_path / "out" / "extra_state.json").read_text())
    assert {k for k in doc["entries"]} == {"lr_scheduler", "dataloader", "train_state", "ft_meta"}
    code, out, _ = run_cli("diff", str(src), str(tmp_path / "out"))
    assert code == 0, out

    for where in (src, tmp_path / "out"):  # the DCP checkpoint itself and its migration
        m2, opt2, sched2 = _setup(1)
        loader, ts, meta = Loader(), TrainState(), {}
        extra = {"lr_scheduler": sched2, "dataloader": loader, "train_state": ts, "ft_meta": None}
        rep = checkpoint.load(m2, where, optimizer=opt2, extra_state=extra)
        assert rep.ok, rep
        assert loader.state == LOADER_STATE and (ts.step, ts.ntokens) == (10, 4096)
        assert extra["ft_meta"] == {"replica": "r-1", "loss": 0.25}
        assert sched2.state_dict() == sched.state_dict()
        assert all(torch.equal(a, b) for a, b in zip(m2.state_dict().values(), model.state_dict().values()))

        # no need to name every entry: the scheduler alone, strict, the rest left unread
        m3, _, sched3 = _setup(3)
        rep = checkpoint.load(m3, where, extra_state={"lr_scheduler": sched3})
        assert rep.ok and "extra_state.dataloader" in rep.ignorable_keys
        assert sched3.state_dict() == sched.state_dict()

    # the migrated bytes are exactly torchtitan's pickle.dumps bytes, kept as data
    got = {"dataloader": None}
    assert checkpoint.load(_setup(2)[0], tmp_path / "out", extra_state=got).ok
    assert got["dataloader"]["dp_rank_0"] == pickle.dumps(LOADER_STATE)


def test_changed_dataloader_bytes_are_a_difference(tmp_path, monkeypatch):
    torchtitan_checkpoint(tmp_path / "a")
    monkeypatch.setattr(Loader, "state_dict", lambda self: {"dp_rank_0": pickle.dumps({"_num_yielded": 4}), "world_size": 1})
    torchtitan_checkpoint(tmp_path / "b")
    code, out, _ = run_cli("diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 1 and "value differs (1): ['dataloader']" in out, out
    code, _, _ = run_cli("migrate", str(tmp_path / "b"), str(tmp_path / "b-out"))
    assert code == 0
    code, out, _ = run_cli("diff", str(tmp_path / "a"), str(tmp_path / "b-out"))
    assert code == 1 and "dataloader" in out, out
