"""``checkpoint.CheckpointManager``: step directories in HF layout, retention (never the one just
written nor the newest complete one), ``latest()`` only on complete checkpoints, errors of a
background save raised by the next call, and SIGKILL during background writes (fault points and
random delays) always leaves ``latest()`` on a complete checkpoint that loads."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint import CheckpointExistsError, CheckpointManager

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import training_crash_worker as cw  # noqa: E402
from tests.snapshot import dir_snapshot as _tree  # noqa: E402


def _sd(step: int):
    g = torch.Generator().manual_seed(step)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(5, generator=g)}


def _visible(root: Path):
    return sorted(n for n in os.listdir(root) if not n.startswith("."))


@pytest.mark.parametrize("use_async", [True, False])
def test_retention_keeps_the_newest_and_load_latest_restores(tmp_path, use_async):
    mgr = CheckpointManager(tmp_path, keep_latest=2, async_save=use_async)
    assert mgr.latest() is None and mgr.load_latest(_sd(0)) is None
    sd = _sd(0)
    for step in range(5):
        sd = {k: v.copy_(_sd(step)[k]) for k, v in sd.items()}
        fut = mgr.save(step * 10, sd, extra_state={"step": step * 10})
        assert (fut is not None) == use_async
        for v in sd.values():
            v.add_(1)  # after the call: not in the checkpoint
    mgr.wait()
    assert _visible(tmp_path) == ["step-00000030", "step-00000040"]
    # Lock files of removed steps are removed too; no staging or removal leftovers.
    assert sorted(os.listdir(tmp_path)) == ["step-00000030", "step-00000040"]
    assert mgr.latest() == str(tmp_path / "step-00000040") and mgr.steps() == [30, 40]
    assert sorted(os.listdir(tmp_path / "step-00000040")) == [
        "extra_state.json", "extra_state.rank-00000-of-00001.json",  # the manager's per-rank RNG states
        "model-00001-of-00001.safetensors", "model.safetensors.index.json",
    ]  # fmt: skip
    target, extra = {k: torch.zeros_like(v) for k, v in sd.items()}, {"step": None}
    assert CheckpointManager(tmp_path).load_latest(target, extra_state=extra) == 40
    assert extra == {"step": 40} and all(torch.equal(target[k], _sd(4)[k]) for k in target)


def test_saving_an_older_step_keeps_the_newest_complete(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_latest=1)
    mgr.save(10, _sd(10))
    mgr.save(5, _sd(5))  # e.g. a rerun from an older step: the newest (10) and the one written stay
    mgr.wait()
    assert _visible(tmp_path) == ["step-00000005", "step-00000010"]
    mgr.save(11, _sd(11))
    mgr.wait()
    assert _visible(tmp_path) == ["step-00000011"]


def test_latest_skips_incomplete_and_hidden_directories(tmp_path):
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, _sd(1))
    mgr.save(2, _sd(2))
    # A newer directory whose shard file is gone (e.g. deleted by hand), one without an index,
    # and a staging directory of a killed save: none of them is a complete checkpoint.
    checkpoint.save(_sd(3), tmp_path / "step-00000003")
    os.remove(tmp_path / "step-00000003" / "model-00001-of-00001.safetensors")
    (tmp_path / "step-00000004").mkdir()
    checkpoint.save(_sd(5), tmp_path / ".step-00000005.fqnckpt-staging-0")
    assert mgr.latest() == str(tmp_path / "step-00000002") and mgr.steps() == [1, 2]
    # A truncated shard (size differs from the index record) is not complete either.
    shard = tmp_path / "step-00000002" / "model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    assert mgr.latest() == str(tmp_path / "step-00000001")


def test_background_error_is_raised_by_the_next_call(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_latest=1)
    (tmp_path / "step-00000007").write_text("not a checkpoint")
    mgr.save(7, _sd(7))  # staged; the commit refuses to replace a file
    with pytest.raises(CheckpointExistsError, match="step-00000007"):
        mgr.save(8, _sd(8))
    assert (tmp_path / "step-00000007").read_text() == "not a checkpoint"
    assert mgr.latest() is None
    mgr.save(8, _sd(8))
    mgr.wait()
    assert mgr.steps() == [8]


def test_bad_arguments():
    with pytest.raises(ValueError, match="keep_latest"):
        CheckpointManager("/nonexistent-unused", keep_latest=0)
    with pytest.raises(ValueError, match="keep_latest"):
        CheckpointManager("/nonexistent-unused", keep_latest=True)


# -- crashes ----------------------------------------------------------------------------------------

BEFORE_COMMIT = ["after_lock", "after_file_create", "after_tensor_write", "after_file_fsync",
                 "before_index_write", "after_staging_fsync", "before_commit_rename"]  # fmt: skip
AFTER_COMMIT = ["after_commit_rename", "manager_before_retention", "removal_after_index"]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="fork + SIGKILL")
def test_kills_during_background_writes_leave_latest_complete(tmp_path):
    rng = random.Random(14)
    trials = [{"root": str(tmp_path / p), "point": p} for p in BEFORE_COMMIT + AFTER_COMMIT]
    # Delays after step 2 is staged; here a step-2 save takes ~0.05 s, so most land mid-write.
    trials += [{"root": str(tmp_path / f"delay-{i}"), "delay": rng.random() * 0.06} for i in range(4)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("FQNCKPT_FAULT_POINT", None)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "training_crash_worker.py"), json.dumps(trials)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ends = json.loads(proc.stdout.strip().splitlines()[-1])
    seen = set()
    for trial, end in zip(trials, ends):
        what = f"{trial} ended {end}"
        if "point" in trial:
            assert end["signaled"], what  # the fault point was reached: killed mid-save
        root = Path(trial["root"])
        mgr = CheckpointManager(root)  # a restarted job: removes leftovers of the killed save
        target = {k: torch.zeros_like(v) for k, v in cw.values(0).items()}
        extra = {"step": None, "rng": None}
        step = mgr.load_latest(target, extra_state=extra)
        if "point" in trial:  # killed before the commit: step 1 is the newest complete, else 2
            assert step == (2 if trial["point"] in AFTER_COMMIT else 1), what
        assert step in (1, 2), what
        assert all(torch.equal(target[k], v) for k, v in cw.values(step).items()), what
        assert extra["step"] == step and checkpoint.verify(mgr.latest()).ok, what
        # Retention ran after step 1 (kept 0, 1); after step 2's commit it may not have run yet.
        assert mgr.steps() in (([0, 1, 2], [1, 2]) if step == 2 else ([0, 1],)), what
        if trial.get("point") == "removal_after_index":  # step 0's index gone, its shards not yet
            assert mgr.steps() == [1, 2], what
        # Nothing half-written is left beside the checkpoints once the job restarted and saved.
        mgr.save(3, target)
        mgr.wait()
        assert not [n for n in os.listdir(root) if n.startswith(".")], what
        seen.add(step)
    assert seen == {1, 2}


def test_foreign_step_names_are_reported_never_used_or_removed(tmp_path):
    """Only names the manager writes are steps: a foreign ``step-*`` entry (other spellings,
    another digit set, a file, a symlink, a hidden entry with the manager's tag on a foreign name)
    is reported, never loaded, never removed by retention."""
    # Complete checkpoints under names the manager never writes, with higher steps than its own.
    foreign_dirs = ["step-abc", "step-00x", "step-5.bak", "step-99", "step-000000099", "step-٠٠٠٠٠٠٩٩"]
    for name in foreign_dirs:
        checkpoint.save(_sd(99), tmp_path / name)
    (tmp_path / "step-00000007").write_bytes(b"a file, not a directory")
    checkpoint.save(_sd(98), tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "step-00000098")
    checkpoint.save(_sd(97), tmp_path / ".step-abc.fqnckpt-deleting-0")  # foreign: not ours to delete
    before = _tree(tmp_path)
    with pytest.warns(checkpoint.ForeignEntryWarning, match="step-abc") as rec:
        mgr = CheckpointManager(tmp_path, keep_latest=1, async_save=False)
    expected = sorted([*foreign_dirs, "step-00000007", "step-00000098"])
    assert mgr.foreign_entries() == expected
    assert all(n in str(rec[0].message) for n in expected)
    assert _tree(tmp_path) == before  # the constructor's clean-up removed nothing foreign
    assert mgr.steps() == [] and mgr.latest() is None
    target = {"a.weight": torch.zeros(4, 3), "b.bias": torch.zeros(5)}
    assert mgr.load_latest(target) is None and torch.count_nonzero(target["a.weight"]) == 0
    mgr.save(1, _sd(1))
    mgr.save(2, _sd(2))  # retention (keep 1) removes step 1 only
    assert mgr.steps() == [2] and mgr.latest() == str(tmp_path / "step-00000002")
    after = _tree(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before
    assert sorted(set(after) - set(before))[0].startswith("step-00000002")
    assert not any(k.startswith("step-00000001") for k in after)
    assert mgr.load_latest(target) == 2
    assert torch.equal(target["a.weight"], _sd(2)["a.weight"])


def test_parse_step_dir_name_round_trips():
    from checkpoint.training.manager import parse_step_dir_name, step_dir_name

    for step in (0, 7, 12345678, 123456789):
        assert parse_step_dir_name(step_dir_name(step)) == step
    for name in ("step-7", "step-000000007", "step-0000000x", "step-00000007.bak", "step-00000007 ",
                 "Step-00000007", "step--0000007", "step-+0000007", "step-٠٠٠٠٠٠٠٧", "step-"):
        assert parse_step_dir_name(name) is None, name
