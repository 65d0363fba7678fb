"""One pipeline from every source. DCP is a full source for load (optimizer, extra state) and
migrate (every top-level entry classified); extra state is validated, then applied, for every
source; migrating an fqnckpt checkpoint keeps its optimizer; crafted pickles reach no global
outside the exact allowlist."""

from __future__ import annotations

import json
import pickle
import threading
import warnings

import pytest
import torch
import torch.nn as nn
from snapshot import Snapshot

import checkpoint
from checkpoint.cli.main import main as cli
from checkpoint.errors import (
    AmbiguousSourceError,
    CheckpointError,
    ExtraStateMismatchError,
    MigrationError,
    UnsafePickleError,
)
from checkpoint.storage.opening import open_checkpoint
from tests.helpers import assert_same_state
from tests.helpers import trained


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.enc(x)))


def _fresh(seed: int = 5):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)


def _dcp_save(state, path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _save_layout(layout: str, path, model, opt, sched):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
    )

    if layout == "get_state_dict":  # the DCP tutorial's {"model", "optim"}
        msd, osd = get_state_dict(model, opt)
        _dcp_save({"model": msd, "optim": osd, "lr_scheduler": sched.state_dict()}, path)
    else:  # torchtitan: model keys at the top level, flattened optimizer, training entries
        osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        _dcp_save(
            {
                **get_model_state_dict(model),
                "optimizer": osd,
                "lr_scheduler": sched.state_dict(),
                "train_state": {"step": 2, "ntokens_seen": 64},
                "dataloader": {"sample_idx": 5},
            },
            path,
        )


# -- DCP as a full source --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["get_state_dict", "torchtitan"])
def test_dcp_load_restores_model_optimizer_and_extra_state(tmp_path, layout):
    model, opt, sched = trained(Net, steps=2, scheduler=True)
    _save_layout(layout, tmp_path / "dcp", model, opt, sched)
    m2, o2, s2 = _fresh()
    extra = {"lr_scheduler": s2}
    if layout == "torchtitan":
        extra.update(train_state=None, dataloader=None)
    rep = checkpoint.load(m2, tmp_path / "dcp", optimizer=o2, extra_state=extra)
    assert rep.ok and rep.optimizer_loaded
    assert_same_state(m2.state_dict(), model.state_dict())
    assert_same_state(o2.state_dict(), opt.state_dict())
    assert s2.state_dict()["last_epoch"] == 2 and s2.get_last_lr() == sched.get_last_lr()
    if layout == "torchtitan":
        assert extra["train_state"] == {"step": 2, "ntokens_seen": 64} and extra["dataloader"] == {"sample_idx": 5}
    # The restored run steps exactly like the original.
    for m, o in ((model, opt), (m2, o2)):
        m(torch.ones(1, 3)).sum().backward()
        o.step()
    assert_same_state(m2.state_dict(), model.state_dict())


def test_dcp_load_value_checks_are_the_safetensors_ones(tmp_path):
    """Range-narrowing conversions are checked by value, target unchanged."""
    _dcp_save({"w": torch.tensor([1e6, 1.0]), "i": torch.tensor([2**40 + 7, 3])}, tmp_path / "dcp")
    for name, dt in (("w", torch.float16), ("i", torch.int32)):
        target = {name: torch.zeros(2, dtype=dt)}
        snap = Snapshot(target)
        with pytest.raises(checkpoint.LossyConversionError, match=f"tensor '{name}'"):
            checkpoint.load(target, tmp_path / "dcp", strict=False)
        snap.assert_unchanged()
    got = {"w": torch.zeros(2, dtype=torch.float16)}
    checkpoint.load(got, tmp_path / "dcp", strict=False, allow_lossy=True)
    assert got["w"].tolist() == [float("inf"), 1.0]


def test_torchtitan_dcp_migrates_each_entry_to_its_part(tmp_path):
    model, opt, sched = trained(Net, steps=2, scheduler=True)
    _save_layout("torchtitan", tmp_path / "dcp", model, opt, sched)
    rep = checkpoint.migrate(tmp_path / "dcp", tmp_path / "out")
    assert rep.entry_kinds["optimizer"] == "optimizer"
    assert {k: v for k, v in rep.entry_kinds.items() if v != "model"} == {
        "optimizer": "optimizer", "lr_scheduler": "lr_scheduler", "train_state": "train_state",
        "dataloader": "dataloader",
    }  # fmt: skip
    assert sorted(k for k, v in rep.entry_kinds.items() if v == "model") == sorted(model.state_dict())
    assert rep.extra_state == ["dataloader", "lr_scheduler", "train_state"]
    with open_checkpoint(tmp_path / "out") as r:
        assert sorted(r.keys()) == sorted(model.state_dict())  # no optimizer tensor as a weight
    with open_checkpoint(tmp_path / "out", prefix="optimizer") as r:
        assert sorted(r.keys()) == sorted(
            f"state.{n}.{s}" for n in model.state_dict() for s in ("exp_avg", "exp_avg_sq", "step")
        )
    m2, o2, s2 = _fresh()
    extra = {"lr_scheduler": s2, "train_state": None, "dataloader": None}
    checkpoint.load(m2, tmp_path / "out", optimizer=o2, extra_state=extra)
    assert_same_state(o2.state_dict(), opt.state_dict())
    assert_same_state(m2.state_dict(), model.state_dict())
    assert extra["train_state"] == {"step": 2, "ntokens_seen": 64} and s2.last_epoch == 2


def test_dcp_entries_that_cannot_be_placed_stop_the_migration(tmp_path):
    model = Net()
    _dcp_save({**model.state_dict(), "ema": {"w": torch.ones(2)}}, tmp_path / "a")
    with pytest.raises(AmbiguousSourceError, match="ema"):
        checkpoint.migrate(tmp_path / "a", tmp_path / "oa")
    assert not (tmp_path / "oa").exists()
    # bytes entries (torchtitan's dataloader) are placed: carried exactly as extra state
    _dcp_save({**model.state_dict(), "dataloader": {"blob": b"\x00\x01"}}, tmp_path / "b")
    rep = checkpoint.migrate(tmp_path / "b", tmp_path / "ob")
    assert "dataloader" in rep.extra_state


def test_migrate_of_a_manager_step_keeps_its_optimizer(tmp_path):
    model, opt, sched = trained(Net, steps=2, scheduler=True)
    mgr = checkpoint.CheckpointManager(tmp_path / "run")
    mgr.save(3, model, optimizer=opt, extra_state={"sched": sched})
    mgr.wait()
    rep = checkpoint.migrate(mgr.path(3), tmp_path / "out")
    assert len(rep.optimizer_entries) == 3 * len(model.state_dict()) and rep.extra_state == ["fqnckpt.rng", "sched"]
    m2, o2, s2 = _fresh()
    rng = checkpoint.PerRank(checkpoint.RNGState())  # carried over with the rest of the extra state
    checkpoint.load(m2, tmp_path / "out", optimizer=o2, extra_state={"sched": s2, "fqnckpt.rng": rng})
    assert_same_state(o2.state_dict(), opt.state_dict())
    assert s2.last_epoch == 2


# -- extra state, validate then mutate, for every source ----------------------------------------------


class Counter:
    """A stateful object whose own load_state_dict refuses negative counts."""

    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        if sd["n"] < 0:
            raise ValueError("negative count")
        self.n = sd["n"]


class LockedCounter(Counter):
    """Cannot be deep-copied (holds a lock): its trial load is undone instead."""

    def __init__(self, n: int = 0):
        super().__init__(n)
        self.lock = threading.Lock()

    def load_state_dict(self, sd):
        self.n = sd["n"]  # changes itself, then refuses: the trial must put it back
        if sd["n"] < 0:
            raise ValueError("negative count")


REJECTIONS = {
    # stored extra state, the target that must refuse it
    "class": (lambda o: {"s": torch.optim.lr_scheduler.StepLR(o, 3)}, lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0)),
    "keys": (lambda o: {"s": {"n": 1, "m": 2}}, lambda o: Counter()),
    "own_load": (lambda o: {"s": Counter(-1)}, lambda o: Counter(7)),
    "own_load_nocopy": (lambda o: {"s": LockedCounter(-1)}, lambda o: LockedCounter(7)),
    "kind": (lambda o: {"s": 3}, lambda o: Counter(7)),
}


def _write(source: str, path, model, opt, extra):
    if source == "fqnckpt":
        checkpoint.save(model, path, optimizer=opt, extra_state=extra)
    elif source == "manager":
        mgr = checkpoint.CheckpointManager(path)
        mgr.save(1, model, optimizer=opt, extra_state=extra)
        mgr.wait()
    else:  # DCP: plain state_dicts, the class is not recorded
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        plain = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in extra.items()}
        _dcp_save({"model": msd, "optim": osd, **plain}, path)


CASES = [(s, r) for s in ("fqnckpt", "manager", "dcp") for r in REJECTIONS if not (s == "dcp" and r in ("class", "kind"))]


@pytest.mark.parametrize("source,rejection", CASES)
def test_extra_state_rejection_changes_nothing(tmp_path, source, rejection):
    model, opt, _ = trained(Net, steps=2, scheduler=True)
    stored, target = REJECTIONS[rejection]
    _write(source, tmp_path / "ck", model, opt, {"a": Counter(4), **stored(opt)})
    m2, o2, _ = _fresh()
    extra = {"a": Counter(9), "s": target(o2)}
    snap = Snapshot(m2, o2, extra["a"], extra["s"])
    with pytest.raises(ExtraStateMismatchError, match="extra_state 's'") as e:
        if source == "manager":
            checkpoint.CheckpointManager(tmp_path / "ck").load_latest(m2, o2, extra_state=extra)
        else:
            checkpoint.load(m2, tmp_path / "ck", optimizer=o2, extra_state=extra)
    assert isinstance(e.value, CheckpointError) and e.value.key == "s"
    snap.assert_unchanged()
    assert extra["a"].n == 9 and len(o2.state) == 0


# -- unpickling, exact (module, name) pairs ---------------------------------------------------------


def _su(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b


def _payloads(marker: str) -> dict[str, bytes]:
    cmd = f"touch {marker}".encode()
    fs = b"torch.distributed.checkpoint.filesystem"
    return {
        # protocol 4 resolves dotted names: os.system through a module DCP allows
        "STACK_GLOBAL": b"\x80\x04" + _su(fs.decode()) + _su("os.system") + b"\x93" + _su(cmd.decode()) + b"\x85R.",
        "GLOBAL": b"c" + fs + b"\nos.system\n(S'" + cmd + b"'\ntR.",
        "INST": b"(S'" + cmd + b"'\nios\nsystem\n.",
        "OBJ": b"(cos\nsystem\nS'" + cmd + b"'\no.",
        # allowed callables / classes fed hostile arguments: refused as damage, nothing runs
        "REDUCE": b"ctorch.serialization\n_get_layout\n(S'os.system'\ntR.",
        "BUILD": b"ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81}S'__class__'\ncos\nsystem\nsb.",
    }


@pytest.mark.parametrize("opcode", list(_payloads("x")))
def test_crafted_dcp_metadata_runs_nothing(tmp_path, opcode):
    d = tmp_path / "dcp"
    _dcp_save(nn.Linear(2, 2).state_dict(), d)
    marker = tmp_path / "MARKER"
    (d / ".metadata").write_bytes(_payloads(str(marker))[opcode])
    target = nn.Linear(2, 2)
    snap = Snapshot(target)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(target, d)
    if opcode not in ("REDUCE",):
        assert isinstance(e.value, UnsafePickleError) and ".metadata" in str(e.value)
        assert e.value.globals and e.value.globals[0] in (
            "torch.distributed.checkpoint.filesystem.os.system", "os.system",
        )  # fmt: skip
    assert cli(["inspect", str(d)]) != 0
    assert not marker.exists()
    snap.assert_unchanged()


def test_crafted_torch_pickles_are_refused_naming_the_global(tmp_path):
    marker = tmp_path / "MARKER"
    cmd = f"touch {marker}".encode()
    for name, body in {
        "plain.pt": b"\x80\x02cos\nsystem\n(S'" + cmd + b"'\ntR.",
        "dotted.pt": b"\x80\x02ctorch\nos.system\n(S'" + cmd + b"'\ntR.",
    }.items():
        (tmp_path / name).write_bytes(body)
        with pytest.raises(UnsafePickleError) as e:
            checkpoint.migrate(tmp_path / name, tmp_path / "out")
        assert name in str(e.value) and e.value.globals in (["os.system"], ["torch.os.system"])
        assert cli(["inspect", str(tmp_path / name)]) != 0
    assert not marker.exists()
    # A trusted global is an exact pair too: trusting one name does not open its module.
    with pytest.raises(UnsafePickleError):
        checkpoint.migrate(tmp_path / "plain.pt", tmp_path / "out", trusted_globals=["os.getcwd"])
    assert not marker.exists()
    pickle.loads(pickle.dumps(1))  # the stdlib unpickler is untouched by ours
