"""Ownership by record on every byte store (``file://``, ``memory://`` and moto's S3 server on 127.0.0.1): a
commit or a removal deletes only objects an fqnckpt record names (the previous model index, a
staging manifest written before a save's first part), whatever the other objects are called;
two saves racing on one checkpoint leave one whole checkpoint and refuse the later commit; a
removal racing a save leaves the save's checkpoint."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

pytest.importorskip("s3fs")
pytest.importorskip("moto")

import checkpoint  # noqa: E402
from checkpoint.errors import ConcurrentSaveError  # noqa: E402
from checkpoint.storage import commit as remote_commit  # noqa: E402
from tests import backends  # noqa: E402

# Names a user (or another tool) may well give: git short SHAs, content hashes, our own shapes.
USER_NAMES = [
    "notes.0123456789ab.txt",
    "config.1a2b3c4d5e6f.yaml",
    "model.deadbeefcafe.safetensors",
    "model-00001-of-00001.abcdefabcdef.safetensors",
    "optimizer.0123456789ab.safetensors.index.json",
    "extra_state.0123456789ab.json",
    ".fqnckpt-staging.0123456789ab.json",  # our manifest's name, not its content
    "README.md",
]


moto_opts = backends.moto_fixture("rec")


@pytest.fixture(params=["file", "memory", "s3"])
def where(request, moto_opts, tmp_path):
    """``(url, storage_options)`` of a fresh, empty place on each byte store (``file://``: a local
    path, :class:`checkpoint.storage.bytestore.LocalStore` under its commit)."""
    return backends.fresh(request.param, tmp_path, moto_opts, "rec")


@pytest.fixture(params=["memory", "s3"])
def object_store(request, moto_opts, tmp_path):
    """``where`` on the object stores only: their commit is a conditional index write that a
    second save can overtake in the same thread (a local save holds the writer lock instead)."""
    return backends.fresh(request.param, tmp_path, moto_opts, "rec")


_store, _put, _names = backends.store, backends.put, backends.names


def test_user_objects_of_any_name_survive_save_overwrite_and_removal(where):
    url, opts = where
    for n in USER_NAMES:
        _put(url, opts, n, b"the user's own data")
    # A manifest naming objects without its token (the user's README) leads nowhere: the dead
    # manifest itself goes with the first commit, nothing it names does.
    forged = {"token": "00000000beef", "base": "x", "objects": ["README.md", "notes.0123456789ab.txt"]}
    _put(url, opts, ".fqnckpt-staging.00000000beef.json", json.dumps(forged).encode())
    user = set(USER_NAMES)

    first = checkpoint.save({"w": torch.arange(8.0)}, url, storage_options=opts)
    assert _names(url, opts) == user | {"model.safetensors.index.json", *first.weight_map.values()}
    second = checkpoint.save({"w": torch.ones(3)}, url, overwrite=True, storage_options=opts)
    assert _names(url, opts) == user | {"model.safetensors.index.json", *second.weight_map.values()}
    t = {"w": torch.zeros(3)}
    assert checkpoint.load(t, url, storage_options=opts, verify=True).ok and torch.equal(t["w"], torch.ones(3))
    remote_commit.remove_checkpoint(_store(url, opts), unborn=True)
    assert _names(url, opts) == user
    assert all(_store(url, opts).get(n) == b"the user's own data" for n in USER_NAMES if "staging" not in n)


def test_killed_save_leftovers_named_by_its_manifest_only(where, capsys):
    url, opts = where
    checkpoint.save({"w": torch.zeros(4)}, url, storage_options=opts)
    store = _store(url, opts)
    base = remote_commit.index_digest(store.get("model.safetensors.index.json"))
    # What a save killed during its second object leaves: its manifest, its first object and
    # the unfinished writer of the second (an S3 multipart upload, a local partial file).
    names = [f"model-0000{i}-of-00002.a1b2c3d4e5f6.safetensors" for i in (1, 2)]
    dead = {"token": "a1b2c3d4e5f6", "base": base, "objects": names}
    _put(url, opts, ".fqnckpt-staging.a1b2c3d4e5f6.json", json.dumps(dead).encode())
    _put(url, opts, names[0], b"half")
    _put(url, opts, "model-00003-of-00003.a1b2c3d4e5f6.safetensors", b"not in the manifest")
    w = store.open_writer(names[1])
    w.write(b"x" * (6 << 20))
    if hasattr(w, "_submit"):  # the fsspec writer: send a part, so an upload exists
        w._submit()
        for f in w._futures:
            f.result()
    expect_uploads = [names[1]] if store.uploads() else []
    assert url.startswith("memory://") or expect_uploads  # S3 and local disk have unfinished writers
    # fsspec's generic writer (memory://) writes under the final name: a partial object then
    partial = [names[1]] if url.startswith("memory://") else []
    left = remote_commit.leftovers(store)
    assert left == {"staging": [".fqnckpt-staging.a1b2c3d4e5f6.json"], "objects": [names[0], *partial], "uploads": expect_uploads}
    from checkpoint.cli import main as cli_main

    if opts:
        import fsspec.config

        fsspec.config.conf["s3"] = dict(opts)
    capsys.readouterr()
    assert cli_main(["inspect", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["leftovers"] == left
    idx = checkpoint.save({"w": torch.ones(4)}, url, overwrite=True, storage_options=opts)
    assert _names(url, opts) == {
        "model.safetensors.index.json", *idx.weight_map.values(), "model-00003-of-00003.a1b2c3d4e5f6.safetensors"
    }
    assert store.uploads() == [] and remote_commit.leftovers(store) == {"staging": [], "objects": [], "uploads": []}


def _racing(monkeypatch, url, opts, other):
    """Make the next commit at ``url`` find ``other()`` done between its start and its index PUT."""
    real = remote_commit.RemoteCommit.commit
    state = {"armed": True}

    def commit(self, *a, **k):
        if state["armed"]:
            state["armed"] = False
            other()
        return real(self, *a, **k)

    monkeypatch.setattr(remote_commit.RemoteCommit, "commit", commit)


@pytest.mark.parametrize("existing", [False, True])
def test_two_saves_race_one_whole_checkpoint_later_commit_refused(object_store, monkeypatch, existing):
    url, opts = object_store
    if existing:
        checkpoint.save({"w": torch.zeros(5)}, url, storage_options=opts)
    winner = {}

    def other():
        winner["idx"] = checkpoint.save({"w": torch.full((5,), 2.0)}, url, overwrite=True, storage_options=opts)

    _racing(monkeypatch, url, opts, other)
    before_user = {"user.0123456789ab.txt"}
    _put(url, opts, "user.0123456789ab.txt", b"u")
    with pytest.raises(ConcurrentSaveError):
        checkpoint.save({"w": torch.full((5,), 1.0)}, url, overwrite=True, storage_options=opts)
    # The other save's checkpoint is whole; the refused save's objects and manifest are gone.
    assert _names(url, opts) == before_user | {"model.safetensors.index.json", *winner["idx"].weight_map.values()}
    t = {"w": torch.zeros(5)}
    assert checkpoint.load(t, url, storage_options=opts, verify=True).ok and torch.equal(t["w"], torch.full((5,), 2.0))


def test_first_save_refused_when_another_committed_first(object_store, monkeypatch):
    url, opts = object_store
    _racing(monkeypatch, url, opts, lambda: checkpoint.save({"w": torch.ones(2)}, url, storage_options=opts))
    with pytest.raises(ConcurrentSaveError):  # overwrite=False: If-None-Match refuses it
        checkpoint.save({"w": torch.zeros(2)}, url, storage_options=opts)
    t = {"w": torch.zeros(2)}
    assert checkpoint.load(t, url, storage_options=opts).ok and torch.equal(t["w"], torch.ones(2))


def test_removal_racing_a_save_keeps_the_new_checkpoint(object_store, monkeypatch):
    url, opts = object_store
    checkpoint.save({"w": torch.zeros(3)}, url, storage_options=opts)
    store = _store(url, opts)
    real = type(store).get_tagged

    def get_tagged(self, name):
        out = real(self, name)  # the removal read the old index; a save commits right after
        monkeypatch.setattr(type(store), "get_tagged", real)
        checkpoint.save({"w": torch.ones(3)}, url, overwrite=True, storage_options=opts)
        return out

    monkeypatch.setattr(type(store), "get_tagged", get_tagged)
    with pytest.raises(ConcurrentSaveError):
        remote_commit.remove_checkpoint(store)
    t = {"w": torch.zeros(3)}
    assert checkpoint.load(t, url, storage_options=opts, verify=True).ok and torch.equal(t["w"], torch.ones(3))


def test_concurrent_saves_leave_one_whole_checkpoint(where):
    """Four threads save to one checkpoint at once (overwrite=True), on every backend (local: one
    at a time under the writer lock, the last wins; ``memory://`` and S3: atomic compare-and-swap
    of the index): each save commits or raises ConcurrentSaveError; the checkpoint left is whole
    (verify reads every byte), holds the values of a save that returned, and nothing is left
    behind (no staging manifest or directory, no object no index names)."""
    import threading

    url, opts = where
    checkpoint.save({"w": torch.zeros(64)}, url, storage_options=opts)
    barrier, results = threading.Barrier(4), {}

    def one(i):
        barrier.wait()
        try:
            checkpoint.save({"w": torch.full((64,), float(i + 1))}, url, overwrite=True, storage_options=opts)
            results[i] = "ok"
        except ConcurrentSaveError:
            results[i] = "refused"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0, 1, 2, 3] and "ok" in results.values(), results
    assert checkpoint.verify(url, storage_options=opts).ok
    t = {"w": torch.zeros(64)}
    checkpoint.load(t, url, storage_options=opts)
    winner = int(t["w"][0].item()) - 1
    assert results[winner] == "ok" and torch.equal(t["w"], torch.full((64,), float(winner + 1)))
    store = _store(url, opts)
    index = remote_commit.parse_index(store.get("model.safetensors.index.json"))
    assert _names(url, opts) == {"model.safetensors.index.json", *index.files()}
    assert store.uploads() == []


def test_local_removal_waits_for_a_save_holding_the_writer_lock(tmp_path):
    """Local retention racing a save: the removal takes the checkpoint's writer lock, so it runs
    before or after a save, never between its commit and its cleanup (local names are not unique
    per save: a removal in between would delete the new checkpoint's files)."""
    import threading

    path = str(tmp_path / "ck")
    checkpoint.save({"w": torch.zeros(3)}, path)
    store = backends.store(path, None)
    done = threading.Event()
    with store.writer_lock():  # what a save holds from its start to its cleanup
        t = threading.Thread(target=lambda: (remote_commit.remove_checkpoint(store), done.set()))
        t.start()
        assert not done.wait(0.3)
        assert "model.safetensors.index.json" in store.listing()
    t.join(10)
    assert done.is_set() and not (tmp_path / "ck").exists()


class _Killed(BaseException):
    """A process killed at a fault point, in-process: nothing of ours catches a BaseException."""


def test_overwrite_killed_between_index_and_cleanup_leaks_nothing(object_store, monkeypatch, capsys):
    """An overwrite killed right after its index PUT (the commit) and before deleting what it
    replaced: the new checkpoint is whole; the replaced checkpoint's objects are named by the
    killed save's staging manifest (``replaces``), listed by ``inspect`` and removed by the next
    commit there, instead of staying unowned forever."""
    url, opts = object_store
    checkpoint.save({"w": torch.zeros(4)}, url, storage_options=opts)
    first = set(_names(url, opts))
    real = remote_commit.faults.fault_point

    def kill(name):
        if name == "after_index_put":
            raise _Killed
        return real(name)

    monkeypatch.setattr(remote_commit.faults, "fault_point", kill)
    with pytest.raises(_Killed):
        checkpoint.save({"w": torch.ones(4)}, url, overwrite=True, storage_options=opts)
    monkeypatch.setattr(remote_commit.faults, "fault_point", real)
    t = {"w": torch.zeros(4)}
    assert checkpoint.load(t, url, storage_options=opts, verify=True).ok and torch.equal(t["w"], torch.ones(4))
    store = _store(url, opts)
    old_shards = {n for n in first if n.endswith(".safetensors")}
    assert old_shards <= set(store.listing())  # the killed save did not delete them
    assert set(remote_commit.leftovers(store)["objects"]) == old_shards
    third = checkpoint.save({"w": torch.full((4,), 3.0)}, url, overwrite=True, storage_options=opts)
    assert _names(url, opts) == {"model.safetensors.index.json", *third.weight_map.values()}


def test_a_users_file_with_a_name_the_save_writes_is_never_replaced(where):
    """A save (``overwrite`` or not) refuses to replace a file no record of the checkpoint there
    names (here the user's ``config.json``, which a transformers save writes): the same refusal
    on every backend, before anything is written; with the file moved away it goes through."""
    url, opts = where
    _put(url, opts, "config.json", b"the user's")
    specs = [checkpoint.TensorSpec("w", (3,), torch.float32)]
    for overwrite in (False, True):
        with pytest.raises(checkpoint.CheckpointExistsError, match=r"\['config.json'\] exist there"):
            checkpoint.save_streaming(url, specs, lambda s: torch.ones(3), extra_files={"config.json": b"ours"},
                                      overwrite=overwrite, storage_options=opts)  # fmt: skip
        assert _names(url, opts) == {"config.json"} and backends.get(url, opts, "config.json") == b"the user's"
    _store(url, opts).delete(["config.json"])
    checkpoint.save_streaming(url, specs, lambda s: torch.ones(3), extra_files={"config.json": b"ours"}, storage_options=opts)
    assert backends.get(url, opts, "config.json") == b"ours"  # recorded now: an overwrite may replace it
    checkpoint.save_streaming(url, specs, lambda s: torch.ones(3), extra_files={"config.json": b"ours 2"}, overwrite=True,
                              storage_options=opts)  # fmt: skip
    assert backends.get(url, opts, "config.json") == b"ours 2"


def test_retention_keeps_a_users_file_in_a_step(where):
    """The manager's retention removes only what a step's records name, on every backend: a
    user's file in a retired step stays (and so does the step's folder, incomplete, never loaded)."""
    url, opts = where
    mgr = checkpoint.CheckpointManager(url, keep_latest=1, async_save=False, rng_state=False, storage_options=opts)
    mgr.save(1, {"w": torch.zeros(2)})
    step1 = f"{url}/step-00000001"
    _put(step1, opts, "notes.txt", b"mine")
    mgr.save(2, {"w": torch.ones(2)})
    assert mgr.steps() == [2]
    assert _names(step1, opts) == {"notes.txt"} and backends.get(step1, opts, "notes.txt") == b"mine"
    mgr.save(3, {"w": torch.ones(2)})  # the retired step is retried: still only the user's file
    assert mgr.steps() == [3] and _names(step1, opts) == {"notes.txt"}


def test_a_save_owns_only_what_it_wrote_even_with_no_other_file(where):
    """A save that wrote no file but its shards and index still records that (an empty
    ``metadata.fqnckpt.objects``): its overwrite removes none of the files a checkpoint without a
    record would own by name (a user's ``extra_state.json`` / ``migration_report.json`` stay)."""
    url, opts = where
    checkpoint.save({"w": torch.zeros(2)}, url, storage_options=opts)
    _put(url, opts, "extra_state.json", b"mine")
    _put(url, opts, "migration_report.json", b"mine too")
    idx = checkpoint.save({"w": torch.ones(2)}, url, overwrite=True, storage_options=opts)
    assert idx.metadata.fqnckpt.objects == {}
    assert backends.get(url, opts, "extra_state.json") == b"mine"
    assert backends.get(url, opts, "migration_report.json") == b"mine too"


def test_dcp_written_checkpoint_is_owned_by_record_like_ours(where):
    """A checkpoint written by ``dcp.save(storage_writer=StorageWriter(...))`` carries the record
    ``checkpoint.save`` writes (its model index's ``metadata.fqnckpt.objects``, written by the
    same commit), on every backend: what it owns is exactly what it wrote; an overwrite (by DCP
    or by ``checkpoint.save``) and a removal delete only what its records name, never a user's
    object, also one with a name a checkpoint without a record would own (``extra_state.json``);
    ``verify`` and ``checkpoint.load`` read it."""
    import torch.distributed.checkpoint as dcp

    from checkpoint.dcp import StorageWriter

    url, opts = where
    for n in USER_NAMES:
        _put(url, opts, n, b"the user's own data")
    user = set(USER_NAMES)

    def dsave(sd):
        dcp.save(sd, storage_writer=StorageWriter(url, storage_options=opts), no_dist=True)
        return checkpoint.open_checkpoint(url, storage_options=opts)

    with dsave({"w": torch.arange(8.0), "step": 3}) as rd:
        objects = rd.meta.objects
        shards = set(rd.index.files())
    assert set(objects) == {"extra_state.json"}  # the record: the file besides shards and index
    written = {"model.safetensors.index.json", *shards, *objects.values()}
    assert _names(url, opts) == user | written
    assert remote_commit.owned_objects(_store(url, opts)) == written
    with dsave({"w": torch.ones(3)}) as rd:  # DCP's default: overwrite; no extra state this time
        assert rd.meta.objects == {}  # a record, empty: it wrote nothing but shards and index
        shards = set(rd.index.files())
    assert _names(url, opts) == user | {"model.safetensors.index.json", *shards}  # the old extra state went
    _put(url, opts, "extra_state.json", b"mine")  # a name an unrecorded checkpoint would own
    with dsave({"w": torch.full((3,), 2.0)}) as rd:
        shards = set(rd.index.files())
    assert backends.get(url, opts, "extra_state.json") == b"mine"
    assert _names(url, opts) == user | {"extra_state.json", "model.safetensors.index.json", *shards}
    assert checkpoint.verify(url, storage_options=opts).ok
    if opts is None:  # (the CLI takes no storage options: file:// and memory:// here)
        from checkpoint.cli import main as fqnckpt

        assert fqnckpt(["verify", url]) == 0
    t = {"w": torch.zeros(3)}
    assert checkpoint.load(t, url, storage_options=opts, verify=True).ok and torch.equal(t["w"], torch.full((3,), 2.0))
    checkpoint.save({"w": torch.ones(3)}, url, overwrite=True, storage_options=opts)  # ours over DCP's: same rules
    assert backends.get(url, opts, "extra_state.json") == b"mine"
    remote_commit.remove_checkpoint(_store(url, opts), unborn=True)
    assert _names(url, opts) == user | {"extra_state.json"}
    assert all(_store(url, opts).get(n) == b"the user's own data" for n in USER_NAMES if "staging" not in n)
