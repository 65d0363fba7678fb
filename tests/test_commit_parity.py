"""The commit protocol's promises, the same on every backend: a plain local path, ``file://``,
``memory://`` and moto's S3 server (127.0.0.1).

- A save, an overwrite and a removal touch only what a record of ours names and still matches;
  entries named like our staging / commit entries that are not ours stay, byte for byte.
- Readers (load, ``open_checkpoint``, verify, the CLI's inspect / verify / diff) change nothing.
- A checkpoint holds only what its own save wrote: another run's optimizer or extra state beside
  it is refused without ``overwrite`` and never read as its parts with it.
- Side files (``config.json``, ``generation_config.json``) stay across an overwrite that writes
  none; a removal deletes them only while unedited.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("s3fs")
pytest.importorskip("moto")

import checkpoint  # noqa: E402
from checkpoint.cli.main import main as cli_main  # noqa: E402
from checkpoint.storage.commit import remove_checkpoint  # noqa: E402
from tests import backends  # noqa: E402
from tests.helpers import tiny_model, trained

moto_opts = backends.moto_fixture("cpar")
BACKENDS = ["local", "file", "memory", "s3"]


@pytest.fixture(params=BACKENDS)
def root(request, tmp_path, moto_opts):
    return backends.fresh(request.param, tmp_path, moto_opts, "cpar")


def _fs(url: str, opts):
    import fsspec.core

    return fsspec.core.url_to_fs(url, **(opts or {}))


def snapshot(url: str, opts) -> dict[str, bytes]:
    """Every object (file) under ``url``, recursively, with its bytes; empty directories as b''."""
    fs, path = _fs(url, opts)
    path = path.rstrip("/")
    out = {}
    for p, info in fs.find(path, withdirs=True, detail=True).items():
        rel = p[len(path) :].lstrip("/")
        if rel:
            out[rel] = b"" if info["type"] == "directory" else fs.cat_file(p)
    return out


def put(url: str, opts, rel: str, data: bytes) -> None:
    """Write ``data`` at ``url/rel`` as a user (or another tool) would (``rel`` may hold ``/``)."""
    fs, path = _fs(url, opts)
    full = f"{path.rstrip('/')}/{rel}"
    parent = full.rsplit("/", 1)[0]
    if not fs.exists(parent):
        fs.makedirs(parent, exist_ok=True)
    fs.pipe_file(full, data)


def _kw(opts):
    return {"storage_options": opts} if opts else {}


def test_another_runs_parts_are_never_adopted(root, tmp_path, capsys):
    base, opts = root
    m, opt = trained(tiny_model(4, 4, seed=0), torch.optim.Adam, lr=0.5)
    other = tmp_path / "other_run"
    checkpoint.save(m, other, optimizer=opt, extra_state={"step": 777})
    dst = f"{base}/dst"
    for name in sorted(os.listdir(other)):  # another run's parts, under the names its readers open
        if name.startswith(("optimizer", "extra_state")):
            put(dst, opts, name, (other / name).read_bytes())
    before = snapshot(base, opts)
    fresh = torch.nn.Linear(4, 4)
    with pytest.raises(checkpoint.CheckpointExistsError, match=r"extra_state.json.*optimizer.safetensors.index.json"):
        checkpoint.save(fresh, dst, **_kw(opts))
    assert snapshot(base, opts) == before
    checkpoint.save(fresh, dst, overwrite=True, **_kw(opts))  # theirs stay; ours records no such parts
    after = snapshot(base, opts)
    assert {k: v for k, v in after.items() if k in before} == before
    target, opt3 = torch.nn.Linear(4, 4), None
    opt3 = torch.optim.Adam(target.parameters(), lr=0.1)
    with pytest.raises(checkpoint.CheckpointNotFoundError, match="saved without optimizer"):
        checkpoint.load(target, dst, optimizer=opt3, **_kw(opts))
    assert opt3.state == {} and opt3.param_groups[0]["lr"] == 0.1
    extra = {"step": 0}
    with pytest.raises(checkpoint.CheckpointMismatchError, match="extra_state.step"):
        checkpoint.load(torch.nn.Linear(4, 4), dst, extra_state=extra, **_kw(opts))
    assert extra == {"step": 0}
    assert snapshot(base, opts) == after


# Entries a user may well have, named like ours: beside the checkpoint and inside it.
NAMED_LIKE_OURS = {
    "ck/.fqnckpt-staging-notes/precious.txt": b"user data",
    "ck/.fqnckpt-commit-note": b"not a commit",
    "ck/.fqnckpt-staging.0123456789ab.json": b"not a manifest",
    "ck/.fqnckpt-staging-0123456789abcdef0123456789abcdef/precious.txt": b"no marker: not ours",
    # A commit directory whose manifest does not name its token: not ours, never rolled forward.
    "ck/.fqnckpt-commit-0123456789abcdef0123456789abcdef/.fqnckpt-manifest.json": json.dumps(
        {"token": "f" * 32, "files": ["model.safetensors.index.json"], "remove": {"config.json": None}}
    ).encode(),
    "ck/.fqnckpt-commit-0123456789abcdef0123456789abcdef/model.safetensors.index.json": b"{}",
    "ck/config.json": b'{"model_type": "mine"}',
    ".ck.fqnckpt-old-2024/precious.txt": b"user data",
    ".ck.fqnckpt-staging-backup/precious.txt": b"user data",
}


def test_entries_named_like_ours_stay_and_readers_change_nothing(root, capsys):
    base, opts = root
    ck = f"{base}/ck"
    checkpoint.save({"x": torch.ones(3)}, ck, **_kw(opts))
    for rel, data in NAMED_LIKE_OURS.items():
        put(base, opts, rel, data)
    before = snapshot(base, opts)
    t = {"x": torch.zeros(3)}
    checkpoint.load(t, ck, **_kw(opts))
    assert torch.equal(t["x"], torch.ones(3))
    with checkpoint.open_checkpoint(ck, storage_options=opts) as r:
        assert torch.equal(r.get("x"), torch.ones(3))
    assert checkpoint.verify(ck, **_kw(opts)).ok
    if opts:
        import fsspec.config

        fsspec.config.conf["s3"] = dict(opts)  # the CLI takes fsspec's configuration
    try:
        for argv in (["verify", ck], ["inspect", ck], ["diff", ck, ck]):
            capsys.readouterr()
            assert cli_main(argv) == 0, argv
        assert snapshot(base, opts) == before  # readers never write
        checkpoint.save({"x": torch.full((3,), 2.0)}, ck, overwrite=True, **_kw(opts))
        after = snapshot(base, opts)
        assert {rel: after.get(rel) for rel in NAMED_LIKE_OURS} == NAMED_LIKE_OURS
        checkpoint.load(t, ck, **_kw(opts))
        assert torch.equal(t["x"], torch.full((3,), 2.0))
        assert checkpoint.verify(ck, **_kw(opts)).ok
    finally:
        if opts:
            fsspec.config.conf.pop("s3", None)


def test_side_files_stay_across_overwrite_and_go_only_unedited(root):
    base, opts = root
    ck = f"{base}/ck"
    specs = [checkpoint.TensorSpec("w", (3,), torch.float32)]
    side = {"config.json": b'{"model_type": "llama"}', "generation_config.json": b'{"do_sample": false}'}
    checkpoint.save_streaming(ck, specs, lambda s: torch.ones(3), extra_files=side, **_kw(opts))
    edited = b'{"model_type": "llama", "my_note": "edited"}'
    put(ck, opts, "config.json", edited)
    checkpoint.save({"w": torch.zeros(3)}, ck, overwrite=True, **_kw(opts))  # writes no side file
    snap = snapshot(ck, opts)
    assert snap["config.json"] == edited and snap["generation_config.json"] == side["generation_config.json"]
    checkpoint.save({"w": torch.zeros(3)}, ck, overwrite=True, **_kw(opts))  # and again: still the checkpoint's
    snap = snapshot(ck, opts)
    assert snap["config.json"] == edited and snap["generation_config.json"] == side["generation_config.json"]
    remove_checkpoint(backends.store(ck, opts))
    assert snapshot(ck, opts) == {"config.json": edited}  # the edited one stays, the unedited one goes


# Kill points on every backend a child process can share with the test: a point a backend never
# reaches lets the save finish (then the new checkpoint is there). memory:// lives in one process.
KILL_POINTS = ("after_tensor_write", "after_commit_rename", "after_first_move", "after_part_upload", "after_index_put")


@pytest.mark.parametrize("backend", ["local", "file", "s3"])
def test_kill_at_fault_points_leaves_old_or_new(backend, tmp_path, moto_opts):
    base, opts = backends.fresh(backend, tmp_path, moto_opts, "cpar")
    ck = f"{base}/ck"
    old = {f"t{i}": torch.full((64,), float(i)) for i in range(4)}
    new = {f"t{i}": torch.full((64,), 100.0 + i) for i in range(4)}
    for point in KILL_POINTS:
        checkpoint.save(old, ck, overwrite=True, max_shard_size=600, **_kw(opts))
        put(ck, opts, "config.json", b'{"mine": 1}')
        pid = os.fork()
        if pid == 0:  # the child saves new with the fault armed; SIGKILL at the point
            try:
                os.environ["FQNCKPT_FAULT_POINT"] = point
                checkpoint.save(new, ck, overwrite=True, max_shard_size=300, **_kw(opts))
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        before = snapshot(base, opts)
        t = {k: torch.zeros(64) for k in old}
        try:
            checkpoint.load(t, ck, **_kw(opts))
        except checkpoint.InterruptedCommitError:
            assert snapshot(base, opts) == before, point  # the reader changed nothing
            checkpoint.recover(ck, storage_options=opts)
            checkpoint.load(t, ck, **_kw(opts))
        got_old = all(torch.equal(t[k], old[k]) for k in old)
        got_new = all(torch.equal(t[k], new[k]) for k in new)
        assert got_old or got_new, point
        assert checkpoint.verify(ck, **_kw(opts)).ok, point
        assert snapshot(ck, opts)["config.json"] == b'{"mine": 1}', point
    checkpoint.save(new, ck, overwrite=True, **_kw(opts))  # the next save cleans up what kills left
    names = set(snapshot(ck, opts))
    assert not any(n.startswith(".") for n in names), names


def test_fifos_named_like_our_records_are_no_records(tmp_path):
    """A FIFO where a marker or a commit manifest would be is no record of ours: saves, recover and
    readers neither block on it nor remove it (run in a child process: blocking fails the test
    through its timeout)."""
    import stat as stat_
    import subprocess
    import sys

    ck = tmp_path / "ck"
    checkpoint.save({"x": torch.ones(3)}, ck)
    staging, commit = ck / (".fqnckpt-staging-" + "a" * 32), ck / (".fqnckpt-commit-" + "b" * 32)
    staging.mkdir()
    commit.mkdir()
    os.mkfifo(staging / ".fqnckpt-staging.json")
    os.mkfifo(commit / ".fqnckpt-manifest.json")
    os.mkfifo(ck / ".fqnckpt-staging.0123456789ab.json")  # the object-store manifest's name
    script = (
        "import sys, torch, checkpoint\n"
        "ck = sys.argv[1]; t = {'x': torch.zeros(3)}\n"
        "checkpoint.load(t, ck); checkpoint.recover(ck)\n"
        "checkpoint.save({'x': torch.full((3,), 2.0)}, ck, overwrite=True)\n"
        "checkpoint.load(t, ck); assert torch.equal(t['x'], torch.full((3,), 2.0)); print('OK')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script, str(ck)], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.strip() == "OK", out.stderr
    assert stat_.S_ISFIFO(os.lstat(staging / ".fqnckpt-staging.json").st_mode)
    assert stat_.S_ISFIFO(os.lstat(commit / ".fqnckpt-manifest.json").st_mode)


def test_a_save_killed_before_its_marker_leaves_nothing_the_next_save_keeps(tmp_path):
    """Killed between creating its staging directory and writing its marker, a save leaves an
    empty directory (or one holding an empty marker file) of the exact name form: the next save
    removes it, as nothing in it is anyone's; one holding anything else stays."""
    ck = tmp_path / "ck"
    checkpoint.save({"x": torch.ones(2)}, ck)
    empty, marker_only, kept = (ck / (".fqnckpt-staging-" + c * 32) for c in "cde")
    beside = tmp_path / (".ck.fqnckpt-staging-" + "f" * 32)
    for d in (empty, marker_only, kept, beside):
        d.mkdir()
    (marker_only / ".fqnckpt-staging.json").touch()
    (kept / "notes.txt").write_text("mine")
    checkpoint.save({"x": torch.zeros(2)}, ck, overwrite=True)
    assert not empty.exists() and not marker_only.exists() and not beside.exists()
    assert (kept / "notes.txt").read_text() == "mine"


def test_recover_says_what_it_completed_and_removed(tmp_path, capsys):
    ck = tmp_path / "ck"
    old = {f"t{i}": torch.full((64,), float(i)) for i in range(4)}
    checkpoint.save(old, ck, max_shard_size=300)
    for point, key in (("after_first_move", "completed"), ("after_tensor_write", "removed")):
        pid = os.fork()
        if pid == 0:
            try:
                os.environ["FQNCKPT_FAULT_POINT"] = point
                checkpoint.save({k: v + 100 for k, v in old.items()}, ck, overwrite=True, max_shard_size=300)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        left = sorted(n for n in os.listdir(ck) if n.startswith(".fqnckpt-"))
        assert len(left) == 1, (point, left)
        capsys.readouterr()
        assert cli_main(["recover", str(ck), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)[key] == left, point
        assert not any(n.startswith(".fqnckpt-") for n in os.listdir(ck))
    assert checkpoint.recover(tmp_path / "nothing") == {"completed": [], "removed": []}
    assert not (tmp_path / "nothing").exists()
