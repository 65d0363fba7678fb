"""PerRank extra_state in one process: saved in its own rank file, restored on its rank, re-derived
by its rule on another world size or refused naming it; the manager's RNG states. The 2-rank
cases are in tests/test_training_resume_ranks.py."""

import json
import os
import random

import pytest
import torch

import checkpoint
from checkpoint import PerRank, RNGState
from checkpoint.errors import ChecksumMismatchError, CorruptCheckpointError, ExtraStateMismatchError
from checkpoint.storage.extra_state import extra_state_file_bytes, snapshot_extra_state_parts
from tests.snapshot import Snapshot
from tests.helpers import tiny_model


class Pos:
    def __init__(self, at=0):
        self.at = at

    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, sd):
        self.at = sd["at"]


def test_per_rank_saved_apart_and_restored(tmp_path):
    m = tiny_model(3, 2)
    checkpoint.save(m, tmp_path / "ck", extra_state={"pos": PerRank(Pos(7)), "n": PerRank(5), "step": 3})
    names = sorted(os.listdir(tmp_path / "ck"))
    assert "extra_state.rank-00000-of-00001.json" in names and "extra_state.json" in names
    shared = json.loads((tmp_path / "ck" / "extra_state.json").read_text())
    assert sorted(shared["entries"]) == ["step"] and shared["per_rank"] == {"world_size": 1, "keys": ["n", "pos"]}
    target = {"pos": PerRank(Pos()), "n": PerRank(0), "step": 0}
    rep = checkpoint.load(tiny_model(3, 2), tmp_path / "ck", extra_state=target)
    assert target["pos"].value.at == 7 and target["n"].value == 5 and target["step"] == 3
    assert {"extra_state.pos", "extra_state.n", "extra_state.step"} <= set(rep.loaded_keys)
    # overwrite with fewer per-rank entries: the old rank file is the checkpoint's and goes
    checkpoint.save(m, tmp_path / "ck", extra_state={"step": 4}, overwrite=True)
    assert not any(n.startswith("extra_state.rank-") for n in os.listdir(tmp_path / "ck"))


def test_per_rank_kind_mismatch_and_corruption_change_nothing(tmp_path):
    checkpoint.save(tiny_model(3, 2), tmp_path / "ck", extra_state={"pos": PerRank(Pos(7)), "step": 3})
    m, pos = torch.nn.Linear(3, 2), Pos(1)
    snap = Snapshot(m)
    for target, err, what in (
        ({"pos": Pos(1)}, ExtraStateMismatchError, "per rank"),  # saved PerRank, target plain
        ({"step": PerRank(0)}, ExtraStateMismatchError, "every rank alike"),
        ({"pos": PerRank(3)}, ExtraStateMismatchError, "target is a int"),
    ):
        with pytest.raises(err, match=what):
            checkpoint.load(m, tmp_path / "ck", extra_state=target, strict=False)
        snap.assert_unchanged()
    rank_file = tmp_path / "ck" / "extra_state.rank-00000-of-00001.json"
    rank_file.write_text(rank_file.read_text().replace('"value": 7', '"value": 8'))
    with pytest.raises(ChecksumMismatchError):
        checkpoint.load(m, tmp_path / "ck", extra_state={"pos": PerRank(pos)}, strict=False)
    rank_file.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        checkpoint.load(m, tmp_path / "ck", extra_state={"pos": PerRank(pos)}, strict=False)
    snap.assert_unchanged()
    assert pos.at == 1


def _as_saved_by(path, world, values):
    """Save ``path`` again with the extra-state files ``world`` ranks write for per-rank
    ``values[r]`` (the record names them, as a save on ``world`` ranks would)."""
    files = {}
    for r in range(world):
        shared, mine = snapshot_extra_state_parts({"pos": PerRank(Pos(values[r]))})
        files.update(extra_state_file_bytes(shared, mine, r, world))
    sd = tiny_model(3, 2).state_dict()
    specs = [checkpoint.TensorSpec.of(k, v) for k, v in sd.items()]
    checkpoint.save_streaming(path, specs, lambda s: sd[s.fqn], extra_files=files, overwrite=True)


def test_other_world_size_reshard_rule_or_refusal(tmp_path):
    checkpoint.save(tiny_model(3, 2), tmp_path / "ck", extra_state={"pos": PerRank(Pos(0))})
    _as_saved_by(tmp_path / "ck", 2, [10, 11])
    pos = Pos(1)
    with pytest.raises(ExtraStateMismatchError, match="saved per rank by 2 ranks.*no reshard rule"):
        checkpoint.load(tiny_model(3, 2), tmp_path / "ck", extra_state={"pos": PerRank(pos)})
    assert pos.at == 1
    seen = []

    def rule(saved, rank, world):
        seen.append((saved, rank, world))
        return {"at": sum(s["at"] for s in saved) + rank}

    checkpoint.load(tiny_model(3, 2), tmp_path / "ck", extra_state={"pos": PerRank(pos, reshard=rule)})
    assert seen == [([{"at": 10}, {"at": 11}], 0, 1)] and pos.at == 21


def test_manager_restores_rng_states(tmp_path):
    mgr = checkpoint.CheckpointManager(tmp_path / "run", async_save=False)
    m = tiny_model(3, 2)
    torch.manual_seed(5), random.seed(5)
    mgr.save(1, m, extra_state={"step": 1})
    after_save = (torch.rand(3).tolist(), random.random())
    torch.manual_seed(99), random.seed(99)
    target = {"step": 0}
    assert mgr.load_latest(tiny_model(3, 2), extra_state=target) == 1
    assert target == {"step": 1}  # the manager's entry does not stay in the caller's dict
    assert (torch.rand(3).tolist(), random.random()) == after_save
    assert "extra_state.fqnckpt.rng" in mgr.last_report.loaded_keys
    off = checkpoint.CheckpointManager(tmp_path / "off", async_save=False, rng_state=False)
    off.save(1, m)
    assert not any(n.startswith("extra_state.rank-") for n in os.listdir(off.path(1)))
    # a checkpoint without RNG states loads with the manager's default on
    mgr2 = checkpoint.CheckpointManager(tmp_path / "off", async_save=False)
    assert mgr2.load_latest(tiny_model(3, 2)) == 1


def test_rng_state_through_extra_state_roundtrip(tmp_path):
    torch.manual_seed(3)
    checkpoint.save(tiny_model(3, 2), tmp_path / "ck", extra_state={"rng": PerRank(RNGState())})
    expect = torch.rand(2).tolist()
    torch.manual_seed(4)
    checkpoint.load(tiny_model(3, 2), tmp_path / "ck", extra_state={"rng": PerRank(RNGState())})
    assert torch.rand(2).tolist() == expect


def test_verify_migrate_and_manager_see_per_rank_files(tmp_path):
    ck = tmp_path / "ck"
    checkpoint.save(tiny_model(3, 2), ck, extra_state={"pos": PerRank(Pos(7)), "step": 3})
    assert checkpoint.verify(ck).ok
    # migrate keeps every part of the extra state, per-rank files included
    checkpoint.migrate(ck, tmp_path / "mig")
    target = {"pos": PerRank(Pos()), "step": 0}
    checkpoint.load(tiny_model(3, 2), tmp_path / "mig", extra_state=target)
    assert target["pos"].value.at == 7 and target["step"] == 3
    shared, rank_file = ck / "extra_state.json", ck / "extra_state.rank-00000-of-00001.json"
    good = rank_file.read_bytes()
    for broken in (lambda: rank_file.write_bytes(good.replace(b'"value": 7', b'"value": 8')), rank_file.unlink):
        broken()
        problems = checkpoint.verify(ck).problems
        assert len(problems) == 1 and "extra_state.rank-00000-of-00001.json" in problems[0], problems
        rank_file.write_bytes(good)
    shared.write_text(shared.read_text().replace('"value": 3', '"value": 4'))
    assert "extra_state.json" in " ".join(checkpoint.verify(ck).problems)
    # a manager step whose listed rank file is missing is not complete
    mgr = checkpoint.CheckpointManager(tmp_path / "run", async_save=False)
    mgr.save(1, tiny_model(3, 2))
    mgr.save(2, tiny_model(3, 2))
    os.unlink(os.path.join(mgr.path(2), "extra_state.rank-00000-of-00001.json"))
    assert mgr.steps() == [1] and mgr.latest() == mgr.path(1)
