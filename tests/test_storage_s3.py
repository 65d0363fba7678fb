"""Checkpoints on object storage through fsspec, against a real S3 endpoint started here (moto's
server mode on 127.0.0.1, behind :class:`tests.s3_server.FaultProxy` for injected 5xx and
throttling) and ``memory://``: commit without rename (the model index last), ranged reads,
bounded multipart uploads, retries, a kill during upload, the manager's retention, a 2-rank save
with a resharded load (one spawn), and URLs never taken as local paths."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("s3fs")
pytest.importorskip("moto")

import checkpoint  # noqa: E402
from checkpoint import CheckpointManager  # noqa: E402
from checkpoint.errors import (  # noqa: E402
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    LoadError,
    MissingShardError,
    UnsupportedStorageError,
)
from checkpoint.ranks.launch import run_ranks  # noqa: E402
from checkpoint.storage.objstore import TransferConfig, stats  # noqa: E402
from tests.s3_server import SECRET, FaultProxy, make_bucket, start_moto, storage_options  # noqa: E402
from tests.helpers import assert_same_state
from tests.helpers import tiny_model

FAST = TransferConfig(part_size=5 << 20, parts_in_flight=2, retries=3, backoff_s=0.01, max_backoff_s=0.05)


@pytest.fixture(scope="module")
def s3():
    server, port = start_moto()
    make_bucket(port, "bkt")
    proxy = FaultProxy(port)
    yield {"port": port, "opts": storage_options(port), "proxy": proxy, "popts": storage_options(proxy.port)}
    proxy.stop()
    server.stop()


def _objects(url_root: str, opts=None) -> list[str]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url_root, **(opts or {}))
    fs.invalidate_cache()
    return sorted(p[len(root) + 1 :] for p in fs.find(root))


# -- URLs are never local paths ------------------------------------------------------------------


def test_unknown_scheme_refused_everywhere_nothing_written_locally(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    m = tiny_model(6, 5, 3)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    calls = [
        lambda: checkpoint.save(m, "nosuchfs://b/run/ck"),
        lambda: checkpoint.load(m, "nosuchfs://b/run/ck"),
        lambda: checkpoint.verify("nosuchfs://b/run/ck"),
        lambda: checkpoint.open_checkpoint("nosuchfs://b/run/ck"),
        lambda: CheckpointManager("nosuchfs://b/run"),
        lambda: checkpoint.async_save(m, "nosuchfs://b/run/ck"),
        lambda: checkpoint.migrate(str(tmp_path / "x"), "nosuchfs://b/run/ck"),
    ]
    for call in calls:
        with pytest.raises(UnsupportedStorageError) as e:
            call()
        assert e.value.scheme == "nosuchfs"
        assert "'nosuchfs'://" in str(e.value) and "pip install fqnckpt[s3]" in str(e.value)
    assert os.listdir(tmp_path) == []  # no "nosuchfs:" directory, nothing at all
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k])


def test_memory_save_load_overwrite_deletes_only_owned_objects():
    url = "memory://t1/run/ck"
    m, m2 = tiny_model(6, 5, 3, seed=0), tiny_model(6, 5, 3, seed=1)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 6)).sum().backward()
    opt.step()
    first = checkpoint.save(m, url, optimizer=opt, extra_state={"step": 7}, max_shard_size=64)
    import fsspec

    fsspec.filesystem("memory").pipe_file("/t1/run/ck/notes.txt", b"mine")  # not fqnckpt's
    objs = _objects(url)
    token = first.weight_map["0.weight"].split(".")[1]
    with checkpoint.open_checkpoint(url) as r:
        named = set(r.files) | set(r.meta.objects.values())
        with r.open_part("optimizer") as o:
            named |= set(o.files)
    assert set(objs) == named | {"model.safetensors.index.json", "notes.txt"}
    assert {o for o in objs if token not in o} == {"model.safetensors.index.json", "notes.txt"}
    assert set(r.meta.objects) == {"extra_state.json", "optimizer.safetensors.index.json"}
    assert len(r.files) > 1 and len(o.files) > 1
    opt2 = torch.optim.Adam(m2.parameters())
    m2(torch.randn(2, 6)).sum().backward()
    opt2.step()
    extra = {"step": 0}
    report = checkpoint.load(m2, url, optimizer=opt2, extra_state=extra, verify=True)
    assert report.ok and report.optimizer_loaded and extra == {"step": 7}
    assert_same_state(m, m2, ordered=True)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[i]["exp_avg_sq"], s2[i]["exp_avg_sq"]) for i in s1)

    with pytest.raises(CheckpointExistsError):
        checkpoint.save(m2, url)
    assert _objects(url) == objs  # refused: nothing changed
    second = checkpoint.save(m2, url, overwrite=True)
    token2 = second.weight_map["0.weight"].split(".")[1]
    assert _objects(url) == sorted(["model.safetensors.index.json", f"model-00001-of-00001.{token2}.safetensors", "notes.txt"])
    assert checkpoint.verify(url).ok


def test_file_url_is_saved_as_the_local_path(tmp_path, monkeypatch):
    """``file://`` is the local byte store: committed by rename like a plain path (Hugging Face's
    file names, no token), read back through the URL."""
    monkeypatch.chdir(tmp_path)
    m, m2 = tiny_model(6, 5, 3, seed=7), tiny_model(6, 5, 3, seed=8)
    checkpoint.save(m, f"file://{tmp_path}/ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no "file:" directory
    assert sorted(os.listdir(tmp_path / "ck")) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert checkpoint.load(m2, f"file://{tmp_path}/ck").ok
    assert_same_state(m, m2, ordered=True)


def test_commit_marker_index_last_and_missing_objects(s3):
    url, opts = "s3://bkt/marker/ck", s3["opts"]
    m = tiny_model(6, 5, 3, seed=2)
    checkpoint.save(m, url, storage_options=opts)
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    index = json.loads(fs.cat_file("bkt/marker/ck/model.safetensors.index.json"))
    shard = next(iter(index["metadata"]["fqnckpt"]["files"]))
    # An index naming an absent object: refused before any tensor changes.
    fs.rm_file(f"bkt/marker/ck/{shard}")
    target = tiny_model(6, 5, 3, seed=3)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(MissingShardError) as e:
        checkpoint.load(target, url, storage_options=opts)
    assert shard in str(e.value)
    assert_same_state(target.state_dict(), before)
    # Objects without an index are no checkpoint.
    fs.rm_file("bkt/marker/ck/model.safetensors.index.json")
    fs.pipe_file("bkt/marker/ck/model-00001-of-00001.0123456789ab.safetensors", b"x" * 64)
    with pytest.raises(CheckpointNotFoundError):
        checkpoint.load(target, url, storage_options=opts)
    assert_same_state(target.state_dict(), before)
    assert CheckpointManager("s3://bkt/marker", storage_options=opts).steps() == []


def test_remote_reader_offers_the_local_readers_copy_into(tmp_path):
    # copy_into is the documented reader method: callable on a URL's reader too, with the local
    # reader's results.
    url = "memory://t-copy/ck"
    w = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    checkpoint.save({"w": w}, url)
    checkpoint.save({"w": w}, str(tmp_path / "ck"))
    for where in (url, str(tmp_path / "ck")):
        with checkpoint.open_checkpoint(where) as r:
            whole = torch.zeros(6, 8, dtype=torch.float64)
            assert r.copy_into("w", whole) is True and torch.equal(whole, w.double())
            strided = torch.zeros(8, 6).t()  # a non-contiguous target
            assert r.copy_into("w", strided) is True and torch.equal(strided, w)
            block = torch.zeros(2, 3)
            assert r.copy_into("w", block, [slice(1, 3), slice(4, 7)]) is True
            assert torch.equal(block, w[1:3, 4:7])
            assert r.copy_into("w", torch.empty(6, 8, device="meta")) is False  # not on the CPU: nothing read


def test_multipart_bounded_memory_and_ranged_reads(s3):
    url, opts = "s3://bkt/big/ck", s3["opts"]
    w = torch.arange(11 * (1 << 18), dtype=torch.float32).reshape(-1, 1024)  # 11 MiB
    stats.reset()
    checkpoint.save({"w": w, "b": torch.ones(3)}, url, storage_options=opts, transfer=FAST)
    assert stats.parts == 3  # 5 + 5 + ~1 MiB
    assert 0 < stats.peak_buffered <= FAST.part_size * FAST.parts_in_flight
    stats.reset()
    with checkpoint.open_checkpoint(url, storage_options=opts) as r:
        headers = stats.bytes_read
        rows = r.get_slice("w", [slice(100, 164)])  # one rank's Shard(0) block: its bytes only
        assert torch.equal(rows, w[100:164])
        assert stats.bytes_read - headers == 64 * 1024 * 4
        cols = r.get_slice("w", [slice(0, 4), slice(8, 16)])
        assert torch.equal(cols, w[0:4, 8:16])
    target = {"w": torch.zeros_like(w), "b": torch.zeros(3)}
    assert checkpoint.load(target, url, storage_options=opts, verify=True).ok
    assert torch.equal(target["w"], w) and torch.equal(target["b"], torch.ones(3))


def test_injected_5xx_and_throttling_retried_then_named_errors(s3):
    proxy, opts = s3["proxy"], s3["popts"]
    url = "s3://bkt/faults/ck"
    m = tiny_model(6, 5, 3, seed=4)
    proxy.clear()
    proxy.add("PUT", "partNumber=1", 503, times=2)  # throttled (SlowDown)
    proxy.add("PUT", "partNumber=2", 500, times=1)  # InternalError
    proxy.add("PUT", "model.safetensors.index.json", 500, times=2)  # the commit PUT
    big = {"w": torch.randn(1 << 20, 3), "b": torch.ones(2)}  # 12 MiB: 3 parts
    stats.reset()
    checkpoint.save(big, url, storage_options=opts, transfer=FAST)
    assert proxy.hits[("PUT", "partNumber=1")] == 2 and proxy.hits[("PUT", "partNumber=2")] == 1
    assert proxy.hits[("PUT", "model.safetensors.index.json")] == 2
    assert stats.retries >= 3  # each 500 is one of fqnckpt's retries (s3fs itself retries SlowDown)
    proxy.add("GET", "-of-", 500, times=2)  # ranged GETs fail twice, then succeed
    target = {"w": torch.zeros(1 << 20, 3), "b": torch.zeros(2)}
    assert checkpoint.load(target, url, storage_options=opts).ok
    assert torch.equal(target["w"], big["w"])
    assert proxy.hits[("GET", "-of-")] == 2

    # Failing for good: bounded attempts, a named error without credentials, the previous
    # checkpoint intact and readable.
    proxy.clear()
    proxy.add("PUT", "model.safetensors.index.json", 500, times=None)
    with pytest.raises(CheckpointWriteError) as e:
        checkpoint.save(m, url, overwrite=True, storage_options=opts, transfer=FAST)
    assert proxy.hits[("PUT", "model.safetensors.index.json")] == FAST.retries + 1
    assert "after 4 attempts" in str(e.value) and SECRET not in str(e.value) and SECRET not in repr(e.value)
    assert e.value.__cause__ is None or SECRET not in str(e.value.__cause__)
    proxy.clear()
    target = {"w": torch.zeros(1 << 20, 3), "b": torch.zeros(2)}
    assert checkpoint.load(target, url, storage_options=opts).ok and torch.equal(target["w"], big["w"])
    proxy.add("GET", "-of-", 500, times=None)
    before = target["w"].clone()
    with pytest.raises(LoadError) as e:
        checkpoint.load({"w": target["w"], "b": target["b"]}, url, storage_options=opts, transfer=FAST)
    assert "model-00001-of-00001." in e.value.file and "after 4 attempts" in str(e.value)  # its header GET
    assert SECRET not in str(e.value) and torch.equal(target["w"], before)
    report = checkpoint.verify(url, storage_options=opts)
    assert not report.ok and all(SECRET not in p for p in report.problems)
    proxy.clear()


_KILLED = textwrap.dedent(
    """
    import os, sys, torch
    import checkpoint
    checkpoint.save({"x": torch.ones(3)}, sys.argv[2])          # a local path: fsspec stays unloaded
    checkpoint.load({"x": torch.zeros(3)}, sys.argv[2])
    assert "fsspec" not in sys.modules and "s3fs" not in sys.modules, "fsspec imported on the local path"
    print("LOCAL-OK", flush=True)
    from checkpoint.storage.objstore import TransferConfig
    opts = {"endpoint_url": sys.argv[1], "key": "k", "secret": "s"}
    os.environ["FQNCKPT_FAULT_POINT"] = "after_part_upload"
    big = {"w": torch.full((1 << 20, 3), 2.0), "b": torch.ones(2)}
    checkpoint.save(big, "s3://bkt/killed/ck", overwrite=True, storage_options=opts,
                    transfer=TransferConfig(part_size=5 << 20, parts_in_flight=1))
    print("NOT KILLED", flush=True)
    """
)


def test_kill_during_upload_keeps_previous_checkpoint(s3, tmp_path):
    opts, url = s3["opts"], "s3://bkt/killed/ck"
    old = {"w": torch.full((1 << 20, 3), 1.0), "b": torch.zeros(2)}
    checkpoint.save(old, url, storage_options=opts)
    before = _objects(url, opts)
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(
        [sys.executable, "-c", _KILLED, opts["endpoint_url"], str(tmp_path / "local")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert "LOCAL-OK" in p.stdout, p.stderr
    assert p.returncode == -9 and "NOT KILLED" not in p.stdout, p.stderr
    # Killed mid multipart upload: no new object but the staging manifest written before the
    # first part, naming what the save writes; its upload is incomplete (parts stored, unlisted).
    after = _objects(url, opts)
    staging = [o for o in after if o.startswith(".fqnckpt-staging.")]
    assert len(staging) == 1 and sorted(set(after) - set(staging)) == before
    token = staging[0].split(".")[2]
    uploads = _uploads(opts, "killed/ck/")
    assert uploads == [f"killed/ck/model-00001-of-00001.{token}.safetensors"]
    target = {"w": torch.zeros(1 << 20, 3), "b": torch.ones(2)}
    assert checkpoint.load(target, url, storage_options=opts, verify=True).ok
    assert torch.equal(target["w"], old["w"]) and torch.equal(target["b"], old["b"])
    # inspect lists the leftovers; the next overwrite aborts the upload and removes the manifest.
    from checkpoint.storage.commit import leftovers
    from checkpoint.storage.location import resolve

    assert leftovers(resolve(url, opts)) == {"staging": staging, "objects": [], "uploads": [uploads[0].split("/")[-1]]}
    idx = checkpoint.save({"w": torch.ones(4)}, url, overwrite=True, storage_options=opts)
    assert _uploads(opts, "killed/ck/") == []
    assert _objects(url, opts) == sorted(["model.safetensors.index.json", *idx.weight_map.values()])


def _uploads(opts, prefix: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    return sorted(u["Key"] for u in fs.call_s3("list_multipart_uploads", Bucket="bkt", Prefix=prefix).get("Uploads", []))


# -- the manager -----------------------------------------------------------------------------------


def test_manager_retention_and_resume_on_s3(s3):
    opts, root = s3["opts"], "s3://bkt/mgr"
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    fs.pipe_file("bkt/mgr/step-notes.txt", b"foreign")
    # A killed save of step 0: its staging manifest names its object; a same-pattern name no
    # manifest names is the user's and stays.
    fs.pipe_file("bkt/mgr/step-00000000/model-00001-of-00001.0123456789ab.safetensors", b"killed save")
    fs.pipe_file("bkt/mgr/step-00000000/model-00001-of-00001.fedcba987654.safetensors", b"user's")
    fs.pipe_file(
        "bkt/mgr/step-00000000/.fqnckpt-staging.0123456789ab.json",
        json.dumps({"token": "0123456789ab", "base": None, "objects": ["model-00001-of-00001.0123456789ab.safetensors"]}).encode(),
    )
    fs.pipe_file("bkt/mgr/step-00000000/mine.txt", b"not fqnckpt's")
    with pytest.warns(checkpoint.ForeignEntryWarning, match="step-notes.txt"):
        mgr = CheckpointManager(root, keep_latest=2, storage_options=opts)
    m = tiny_model(6, 5, 3, seed=5)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for step in (1, 2, 3):
        m(torch.randn(2, 6)).sum().backward()
        opt.step()
        mgr.save(step, m, opt, extra_state={"step": step})
    mgr.wait()
    assert mgr.steps() == [2, 3] and mgr.latest() == "s3://bkt/mgr/step-00000003"
    assert mgr.foreign_entries() == ["step-notes.txt"]
    objs = _objects(root, opts)
    assert not any(o.startswith("step-00000001/") for o in objs)  # every object of step 1 deleted
    assert "step-notes.txt" in objs and "step-00000000/mine.txt" in objs  # foreign objects stay
    left0 = sorted(o for o in objs if o.startswith("step-00000000/"))  # the killed save's leftover goes
    assert left0 == ["step-00000000/mine.txt", "step-00000000/model-00001-of-00001.fedcba987654.safetensors"]
    m2, extra = tiny_model(6, 5, 3, seed=6), {"step": None}
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    with pytest.warns(checkpoint.ForeignEntryWarning):
        resumed = CheckpointManager(root, storage_options=opts)
    assert resumed.load_latest(m2, opt2, extra_state=extra) == 3 and extra == {"step": 3}
    assert_same_state(m, m2, ordered=True)
    assert all(
        torch.equal(opt.state_dict()["state"][i]["momentum_buffer"], opt2.state_dict()["state"][i]["momentum_buffer"])
        for i in range(4)
    )


# -- two ranks: one spawn, a resharded load --------------------------------------------------------


def _full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(8, 6, generator=g), "v": torch.randn(4, 10, generator=g), "count": torch.arange(5)}


def _two_rank_main(rank, world, endpoint, local):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    opts = {"endpoint_url": endpoint, "key": "k", "secret": "s"}
    mesh = init_device_mesh("cpu", (world,))
    full = _full_state()
    state = {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
        "v": distribute_tensor(full["v"], mesh, [Shard(1)]),
        "count": full["count"].clone(),
    }
    stats.reset()
    mgr = CheckpointManager("s3://bkt/ranks", storage_options=opts, rng_state=False)
    mgr.save(4, state, max_shard_size=100)  # async by default
    mgr.wait()
    uploaded = stats.objects
    # Resharded load on the same 2 ranks: other placements.
    target = {
        "w": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)]),
        "v": distribute_tensor(torch.zeros(4, 10), mesh, [Shard(0)]),
        "count": torch.zeros(5, dtype=torch.int64),
    }
    stats.reset()
    assert mgr.load_latest(target) == 4
    read = stats.bytes_read
    return {
        "refused": _agreed_refusals(rank, state, opts, local),
        "uploaded": uploaded,
        "w": target["w"].to_local().clone(),
        "v": target["v"].to_local().clone(),
        "count": target["count"].clone(),
        "read": read,
    }


def _agreed_refusals(rank, state, opts, local) -> list[tuple[str, bool]]:
    """Refusals every rank must raise alike (not RankAgreementError on all but one): another save
    overtaking a 2-rank S3 save at its commit (ConcurrentSaveError), a local target that exists
    (CheckpointExistsError); with whether the message names the refusal."""
    from checkpoint.storage import commit as commit_mod

    out = []
    url = "s3://bkt/ranks/race"
    checkpoint.save(state, url, storage_options=opts)
    real = commit_mod.RemoteCommit.commit

    def overtaken(self, *a, **k):  # rank 0's commit: a one-process save committed just before
        commit_mod.RemoteCommit.commit = real
        checkpoint.save({"other": torch.ones(2)}, url, overwrite=True, storage_options=opts)
        return real(self, *a, **k)

    commit_mod.RemoteCommit.commit = overtaken
    try:
        checkpoint.save(state, url, overwrite=True, storage_options=opts)
    except Exception as e:  # noqa: BLE001 - the class is the result
        out.append((type(e).__name__, "another save committed" in str(e)))
    finally:
        commit_mod.RemoteCommit.commit = real
    checkpoint.save(state, local, overwrite=True)
    try:
        checkpoint.save(state, local)
    except Exception as e:  # noqa: BLE001
        out.append((type(e).__name__, "already exists" in str(e)))
    return out


@pytest.fixture(scope="module")
def two_ranks(s3):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return run_ranks(_two_rank_main, 2, f"http://127.0.0.1:{s3['port']}", f"{d}/ck", backend="gloo", timeout=120)


def test_two_rank_save_each_rank_uploads_and_resharded_load(two_ranks, s3):
    full = _full_state()
    for rank, res in enumerate(two_ranks):
        # the same named errors on every rank (the rank-agreement exchange carries them)
        assert res["refused"] == [("ConcurrentSaveError", True), ("CheckpointExistsError", True)], (rank, res["refused"])
        assert res["uploaded"] >= 1  # each rank uploaded its own shard files
        assert torch.equal(res["w"], full["w"][:, 3 * rank : 3 * rank + 3])
        assert torch.equal(res["v"], full["v"][2 * rank : 2 * rank + 2])
        assert torch.equal(res["count"], full["count"])
    # One process (world of one) reads the 2-rank checkpoint whole.
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    assert checkpoint.load(target, "s3://bkt/ranks/step-00000004", storage_options=s3["opts"], verify=True).ok
    for k in full:
        assert torch.equal(target[k], full[k]), k
    index = json.loads(
        __import__("s3fs").S3FileSystem(**s3["opts"]).cat_file("bkt/ranks/step-00000004/model.safetensors.index.json")
    )
    assert len(set(index["weight_map"].values())) >= 2  # several files, spread over the ranks


def test_cli_inspect_verify_diff_on_s3_through_fsspec_config(s3, monkeypatch, capsys):
    import fsspec.config

    from checkpoint.cli import main as cli_main

    monkeypatch.setitem(fsspec.config.conf, "s3", dict(s3["opts"]))  # what FSSPEC_S3_* env vars set
    url = "s3://bkt/cli/ck"
    checkpoint.save(tiny_model(6, 5, 3, seed=9), url, storage_options=s3["opts"])
    capsys.readouterr()
    assert cli_main(["inspect", url, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "safetensors-sharded" and data["tensors"] == 4
    assert cli_main(["verify", url]) == 0 and "OK" in capsys.readouterr().out
    checkpoint.save(tiny_model(6, 5, 3, seed=10), "s3://bkt/cli/other", storage_options=s3["opts"])
    capsys.readouterr()
    assert cli_main(["diff", url, "s3://bkt/cli/other"]) == 1  # same keys, other values
    out = capsys.readouterr().out
    assert "differ" in out and SECRET not in out


def test_recipe_migrate_and_load_read_object_storage(s3, tmp_path):
    """migrate(recipe=) and load(recipe=) from s3://: the remote source stage reads the tensors
    (ranged reads counted) and the dims come from the remote config.json; a missing object is
    refused by that stage, the target unchanged."""
    transformers = pytest.importorskip("transformers")
    import fsspec
    import safetensors.torch

    opts = s3["opts"]
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    checkpoint.save(hf, "s3://bkt/conv/hf", storage_options=opts)  # config.json beside the shards
    stats.reset()
    rep = checkpoint.migrate("s3://bkt/conv/hf", tmp_path / "tt", recipe="hf-to-torchtitan-llama3", storage_options=opts)
    assert rep.written and rep.source == "s3://bkt/conv/hf" and (rep.dims["n_heads"], rep.dims["n_kv_heads"]) == (4, 2)
    assert stats.bytes_read >= rep.total_bytes
    (f,) = (tmp_path / "tt").glob("*.safetensors")
    tt = safetensors.torch.load_file(str(f))
    # torchtitan's names of today's layout (the recipe's default output; the layout names are the convert tests')
    assert any(k.startswith("layers.1.") and k.endswith(".wk.weight") for k in tt) and len(tt) == len(hf.state_dict())
    checkpoint.save(tt, "s3://bkt/conv/tt", storage_options=opts)
    fresh = transformers.LlamaForCausalLM(cfg)
    stats.reset()
    assert checkpoint.load(fresh, "s3://bkt/conv/tt", recipe="torchtitan-llama3-to-hf", storage_options=opts).ok
    assert stats.bytes_read >= rep.total_bytes
    assert_same_state(fresh, hf, ordered=True)  # the RoPE permute undone: the original tensors, bit for bit
    fs, root = fsspec.core.url_to_fs("s3://bkt/conv/tt", **opts)
    # Meta's consolidated.NN.pth files on S3 too, with fqnckpt's record of them
    checkpoint.migrate("s3://bkt/conv/hf", "s3://bkt/conv/meta", recipe="hf-to-meta-llama", storage_options=opts)
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("bkt/conv/meta")) == [
        ".fqnckpt-record.json", "consolidated.00.pth", "conversion_report.json", "params.json"]
    meta_sd = torch.load(io.BytesIO(fs.cat_file("bkt/conv/meta/consolidated.00.pth")), weights_only=True)
    assert torch.equal(meta_sd["tok_embeddings.weight"], hf.model.embed_tokens.weight.detach())
    shard = next(p for p in fs.find(root) if p.endswith(".safetensors"))
    fs.rm_file(shard)
    target = transformers.LlamaForCausalLM(cfg)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(MissingShardError):
        checkpoint.load(target, "s3://bkt/conv/tt", recipe="torchtitan-llama3-to-hf", storage_options=opts)
    assert_same_state(target.state_dict(), before)
