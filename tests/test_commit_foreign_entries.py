"""Hostile entries named like the local commit's records: a FIFO (or other non-regular file) where
a commit manifest or a staging marker of ours would be is not a record of ours. It is never
opened (opening a FIFO for reading blocks until a writer comes), never removed, and the reader or
writer goes on as if it were not there."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest
import torch

import checkpoint
from checkpoint.cli.main import EXIT_BAD_INPUT
from checkpoint.cli.main import main as cli_main

TOKEN = "ab" * 16


def _tree(root) -> dict[str, object]:
    """Every entry under ``root``: regular files by their bytes, anything else by its kind
    (a FIFO is never opened here)."""
    out: dict[str, object] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            mode = os.lstat(p).st_mode
            if stat.S_ISREG(mode):
                with open(p, "rb") as f:
                    out[os.path.relpath(p, root)] = f.read()
            else:
                out[os.path.relpath(p, root)] = stat.S_IFMT(mode)
    return out


class _FifoWatch:
    """Writers that keep opening ``fifo`` (so a reader that opens it never blocks the test) and log
    each open: a log left afterwards means the code under test opened the FIFO."""

    def __init__(self, fifo, log):
        self.fifo, self.log = fifo, log

    def __enter__(self):
        self.proc = subprocess.Popen(["sh", "-c", 'while :; do : > "$0"; echo >> "$1"; done', str(self.fifo), str(self.log)])
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()

    @property
    def opened(self) -> bool:
        return os.path.exists(self.log)


def test_fifo_as_commit_manifest_is_not_a_commit(tmp_path):
    ck = tmp_path / "ck"
    checkpoint.save({"x": torch.arange(3.0)}, ck)
    commit_dir = ck / f".fqnckpt-commit-{TOKEN}"
    commit_dir.mkdir()
    os.mkfifo(commit_dir / ".fqnckpt-manifest.json")
    before = _tree(tmp_path)
    t = {"x": torch.zeros(3)}
    with _FifoWatch(commit_dir / ".fqnckpt-manifest.json", tmp_path.parent / f"{tmp_path.name}.log") as w:
        checkpoint.load(t, ck)
        assert torch.equal(t["x"], torch.arange(3.0))
        assert _tree(tmp_path) == before  # a reader changes nothing
        checkpoint.recover(ck)
        checkpoint.save({"x": torch.full((3,), 7.0)}, ck, overwrite=True)
    assert not w.opened
    after = _tree(tmp_path)
    assert after[f"ck/.fqnckpt-commit-{TOKEN}/.fqnckpt-manifest.json"] == stat.S_IFIFO  # not ours: stays
    t = {"x": torch.zeros(3)}
    checkpoint.load(t, ck)
    assert torch.equal(t["x"], torch.full((3,), 7.0))


def test_fifo_as_staging_marker_in_a_checkpoint_is_not_ours(tmp_path):
    ck = tmp_path / "ck"
    checkpoint.save({"x": torch.arange(3.0)}, ck)
    os.mkfifo(ck / ".fqnckpt-staging.json")
    with _FifoWatch(ck / ".fqnckpt-staging.json", tmp_path.parent / f"{tmp_path.name}.log") as w:
        checkpoint.recover(ck)
        checkpoint.save({"x": torch.full((3,), 5.0)}, ck, overwrite=True)
    assert not w.opened
    assert _tree(ck)[".fqnckpt-staging.json"] == stat.S_IFIFO
    t = {"x": torch.zeros(3)}
    checkpoint.load(t, ck)
    assert torch.equal(t["x"], torch.full((3,), 5.0))


@pytest.mark.parametrize("rel", ["missing/a/ck", "afile/ck"])
def test_recover_where_no_save_can_be_creates_nothing(tmp_path, capsys, rel):
    (tmp_path / "afile").write_bytes(b"mine")
    before = _tree(tmp_path)
    with pytest.raises(checkpoint.CheckpointNotFoundError, match=str(tmp_path / rel)):
        checkpoint.recover(tmp_path / rel)
    assert _tree(tmp_path) == before
    capsys.readouterr()
    assert cli_main(["recover", str(tmp_path / rel)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert str(tmp_path / rel) in err and "Traceback" not in err
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("rel", ["afile", "afile/run"])
def test_manager_root_on_a_file_is_refused_naming_it(tmp_path, rel):
    from checkpoint.training.manager import CheckpointManager

    (tmp_path / "afile").write_bytes(b"mine")
    before = _tree(tmp_path)
    with pytest.raises(checkpoint.CheckpointExistsError, match=str(tmp_path / rel)):
        CheckpointManager(tmp_path / rel, async_save=False)
    assert _tree(tmp_path) == before


def test_checkpoint_removed_while_being_listed_is_not_found(tmp_path, monkeypatch):
    """A directory removed (a retention, ``rm -r``) between the reader's first look and its
    listing: CheckpointNotFoundError naming it, never a bare FileNotFoundError."""
    from checkpoint.sources import sniffing

    d = tmp_path / "gone"

    def removed_meanwhile(p):
        (d / "notes.txt").unlink()
        d.rmdir()
        return False

    monkeypatch.setattr(sniffing, "is_dcp", removed_meanwhile)
    d.mkdir()
    (d / "notes.txt").write_bytes(b"x")
    with pytest.raises(checkpoint.CheckpointNotFoundError, match=f"{d}.*removed while"):
        sniffing.sniff(d)
    d.mkdir()
    (d / "notes.txt").write_bytes(b"x")
    with pytest.raises(checkpoint.CheckpointNotFoundError, match=str(d)):
        checkpoint.load({"x": torch.zeros(2)}, d)
    assert not d.exists()


def test_a_load_begun_where_nothing_was_never_reads_a_later_checkpoint(tmp_path, monkeypatch):
    """The reader's view starts where nothing is yet: a checkpoint committed there after (here by
    another thread between the view and the opens) is not this view's; without the directory's
    lock a retention could remove its parts under the reader. Nothing is read, nothing written."""
    import threading

    from checkpoint import loading

    ck = tmp_path / "ck"
    opened = loading.open_load_reader

    def committed_meanwhile(path, **kw):
        t = threading.Thread(target=checkpoint.save, args=({"x": torch.ones(3)}, ck), kwargs={"extra_state": {"step": 1}})
        t.start()
        t.join()
        return opened(path, **kw)

    monkeypatch.setattr(loading, "open_load_reader", committed_meanwhile)
    target, extra = {"x": torch.zeros(3)}, {"step": 0}
    with pytest.raises(checkpoint.CheckpointNotFoundError, match=str(ck)):
        checkpoint.load(target, ck, extra_state=extra)
    assert torch.equal(target["x"], torch.zeros(3)) and extra == {"step": 0}
    assert not ck.exists()


def test_load_of_a_directory_removed_while_its_format_is_sniffed(tmp_path, monkeypatch):
    """``load`` asks first whether the directory is DCP's; removed right then (a retention racing
    the load): CheckpointNotFoundError naming it, never a bare FileNotFoundError."""
    from checkpoint.sources import dcp

    d = tmp_path / "gone"
    d.mkdir()
    (d / "notes.txt").write_bytes(b"x")

    def removed_meanwhile(p):
        (d / "notes.txt").unlink()
        d.rmdir()
        return False

    def lists_it(p):  # the listing that meets the directory gone (os.scandir, as glob does)
        return bool(list(os.scandir(p)))

    monkeypatch.setattr(dcp, "is_dcp", removed_meanwhile)
    monkeypatch.setattr(dcp, "is_dcp_hf", lists_it)
    with pytest.raises(checkpoint.CheckpointNotFoundError, match=str(d)):
        checkpoint.load({"x": torch.zeros(2)}, d)
    assert not d.exists()


def test_a_view_on_a_directory_replaced_while_opening_is_refused(tmp_path, monkeypatch):
    """The reader opened the directory, which a retention then removed and a save made anew
    before the reader's lock was taken: that lock would guard the removed directory only, so the
    view refuses (CheckpointNotFoundError) instead of reading the new one unguarded."""
    import shutil
    import threading

    from checkpoint.storage import local_commit

    ck = tmp_path / "ck"
    checkpoint.save({"x": torch.ones(3)}, ck)
    flock = local_commit._flock
    state = {"done": False}

    def replaced_first(fd, op):
        if not state["done"]:
            state["done"] = True
            shutil.rmtree(ck)
            t = threading.Thread(target=checkpoint.save, args=({"x": torch.full((3,), 2.0)}, ck))
            t.start()
            t.join()
        flock(fd, op)

    monkeypatch.setattr(local_commit, "_flock", replaced_first)
    target = {"x": torch.zeros(3)}
    with pytest.raises(checkpoint.CheckpointNotFoundError, match=f"{ck}.*removed while"):
        checkpoint.load(target, ck)
    assert torch.equal(target["x"], torch.zeros(3))
    monkeypatch.setattr(local_commit, "_flock", flock)
    checkpoint.load(target, ck)
    assert torch.equal(target["x"], torch.full((3,), 2.0))


def test_directory_in_the_way_of_an_interrupted_commit_is_named(tmp_path, capsys):
    """A save killed after its commit point; then a directory is made where one of its files
    goes. recover, the next save and the CLI name that directory (CheckpointExistsError) and move
    nothing; once it is moved away, recover completes the commit."""
    ck = tmp_path / "ck"
    checkpoint.save({"x": torch.ones(3)}, ck, extra_state={"step": 1})
    pid = os.fork()
    if pid == 0:
        try:
            os.environ["FQNCKPT_FAULT_POINT"] = "after_commit_rename"
            checkpoint.save({"x": torch.full((3,), 2.0)}, ck, overwrite=True, extra_state={"step": 2})
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    (ck / "extra_state.json").unlink()
    (ck / "extra_state.json").mkdir()
    (tmp_path / ".ck.fqnckpt-lock").unlink(missing_ok=True)  # the killed save's: the next writer's unlinks it
    before = _tree(tmp_path)
    blocked = str(ck / "extra_state.json")
    with pytest.raises(checkpoint.CheckpointExistsError, match=blocked):
        checkpoint.recover(ck)
    with pytest.raises(checkpoint.CheckpointExistsError, match=blocked):
        checkpoint.save({"x": torch.zeros(3)}, ck, overwrite=True)
    capsys.readouterr()
    assert cli_main(["recover", str(ck)]) != 0
    assert blocked in capsys.readouterr().err
    assert _tree(tmp_path) == before
    (ck / "extra_state.json").rmdir()
    checkpoint.recover(ck)
    target, extra = {"x": torch.zeros(3)}, {"step": 0}
    checkpoint.load(target, ck, extra_state=extra)
    assert torch.equal(target["x"], torch.full((3,), 2.0)) and extra == {"step": 2}
