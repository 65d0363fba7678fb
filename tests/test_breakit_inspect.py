"""A crafted model index whose record (``metadata.fqnckpt.objects``) names an extra-state
per-rank file outside the checkpoint (``../x``, an absolute path, a NUL): ``fqnckpt inspect``
and ``checkpoint.load`` refuse it as :class:`UnsafePathError` naming the entry and the
checkpoint (``verify`` reports it so), as they refuse such a name for ``extra_state.json`` or a
shard, and never read the file outside.
An optimizer index or ``extra_state.json`` that the model index's record names but that is gone
(locally or at a URL) is named as missing by inspect, load and verify (they took the checkpoint
for one saved without it: inspect and verify passed, load said "saved without optimizer=?")."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import checkpoint
from checkpoint.errors import UnsafePathError
from checkpoint.storage.digest import INDEX_FIELD
from tests.helpers import run_cli, tiny_model

RANK_FILE = "extra_state.rank-00000-of-00001.json"


def _crafted(tmp_path, target: str):
    ck = tmp_path / "ck"
    checkpoint.save(tiny_model(), ck, extra_state={"step": 3, "rng": checkpoint.PerRank(7)})
    shutil.copy(ck / RANK_FILE, tmp_path / "outside.json")
    p = ck / "model.safetensors.index.json"
    index = json.loads(p.read_text())
    index["metadata"]["fqnckpt"]["objects"][RANK_FILE] = target.replace("{root}", str(tmp_path))
    index["metadata"]["fqnckpt"].pop(INDEX_FIELD)  # a crafted index need not carry its digest
    p.write_text(json.dumps(index))
    return ck


TARGETS = ["../outside.json", "{root}/outside.json", "outside\x00.json"]


@pytest.mark.parametrize("target", TARGETS, ids=["dotdot", "absolute", "nul"])
def test_inspect_refuses_a_rank_file_recorded_outside_the_checkpoint(tmp_path, capsys, target):
    ck = _crafted(tmp_path, target)
    rc, out, err = run_cli("inspect", ck, capsys=capsys)
    assert rc != 0 and "outside.json" not in out
    assert f"index entry {target.replace('{root}', str(tmp_path))!r} of {ck} is refused" in err, err


@pytest.mark.parametrize("target", TARGETS, ids=["dotdot", "absolute", "nul"])
def test_load_and_verify_refuse_a_rank_file_recorded_outside_the_checkpoint(tmp_path, target):
    ck = _crafted(tmp_path, target)
    entry = target.replace("{root}", str(tmp_path))
    with pytest.raises(UnsafePathError) as e:
        checkpoint.load(tiny_model(), ck, extra_state={"step": 0, "rng": checkpoint.PerRank(0)})
    assert e.value.entry == entry and e.value.path == str(ck)
    report = checkpoint.verify(ck)  # verify reports what it finds
    assert f"UnsafePathError: index entry {entry!r} of {ck} is refused" in "\n".join(report.problems), report.problems


@pytest.mark.parametrize("part", ["optimizer.safetensors.index.json", "extra_state.json"])
@pytest.mark.parametrize("where", ["local", "url"])
def test_a_recorded_part_removed_since_the_save_is_named_by_every_reader(tmp_path, capsys, part, where):
    import fsspec

    from checkpoint.errors import MissingShardError
    from tests.helpers import trained

    ck = str(tmp_path / "ck") if where == "local" else f"memory://breakit-parts-{part}/ck"
    m, opt = trained(tiny_model())
    checkpoint.save(m, ck, optimizer=opt, extra_state={"step": 3})
    if where == "local":
        os.remove(os.path.join(ck, part))
        obj = part
    else:
        fs, root = fsspec.filesystem("memory"), "/" + ck.removeprefix("memory://")
        obj = json.loads(fs.cat_file(f"{root}/model.safetensors.index.json"))["metadata"]["fqnckpt"]["objects"][part]
        fs.rm(f"{root}/{obj}")
    try:
        rc, out, err = run_cli("inspect", ck, capsys=capsys)
        assert rc != 0 and f"missing on disk: [{obj!r}]" in err, (out, err)
        m2, opt2 = trained(tiny_model())
        with pytest.raises(MissingShardError) as e:
            checkpoint.load(m2, ck, optimizer=opt2, extra_state={"step": 0})
        assert e.value.shards == [obj]
        report = checkpoint.verify(ck)
        assert not report.ok and f"missing on disk: [{obj!r}]" in "\n".join(report.problems), report.problems
    finally:
        if where == "url":
            fsspec.filesystem("memory").rm("/" + ck.removeprefix("memory://").split("/")[0], recursive=True)
