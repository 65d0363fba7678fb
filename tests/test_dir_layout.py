"""One rule for a directory holding DCP's ``.metadata`` beside a safetensors checkpoint's
``model.safetensors.index.json`` / ``model.safetensors``: every entry point refuses it with the same
``AmbiguousSourceError`` naming both files (``checkpoint/storage/dir_layout.py``), and so is
``.metadata`` beside ``pytorch_model.bin`` (what transformers reads when there is no
``model.safetensors``)."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import checkpoint
from checkpoint.cli.main import EXIT_BAD_INPUT, main
from checkpoint.dcp import StorageReader
from checkpoint.errors import AmbiguousSourceError, UnsafePathError
from checkpoint.sources import open_source, sniff
from snapshot import Snapshot, dir_snapshot


def _mixed(tmp_path, safetensors_entry: str):
    d = tmp_path / "mixed"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, checkpoint_id=str(d))
    if safetensors_entry == "model.safetensors.index.json":
        other = torch.nn.Linear(2, 2)
        checkpoint.save(other, tmp_path / "st")
        for f in (tmp_path / "st").iterdir():
            shutil.copy(f, d / f.name)
    else:
        save_file({"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("entry", ["model.safetensors.index.json", "model.safetensors"])
def test_every_entry_point_refuses_dcp_metadata_beside_safetensors(tmp_path, capsys, entry):
    d = _mixed(tmp_path, entry)
    want = (f"{d}: holds both a DCP checkpoint (.metadata) and a safetensors checkpoint ({entry}); "
            "DCP and Hugging Face readers would read different checkpoints from it: remove one of them "
            f"or move it to a directory of its own; choices for the path: ['.metadata', '{entry}']")  # fmt: skip
    before = dir_snapshot(d)
    model = torch.nn.Linear(2, 2)
    snap = Snapshot(model)

    for call in (lambda: checkpoint.load(model, d), lambda: checkpoint.verify(d), lambda: sniff(d),
                 lambda: open_source(d), lambda: checkpoint.open_checkpoint(d)):  # fmt: skip
        with pytest.raises(AmbiguousSourceError) as e:
            call()
        assert str(e.value) == want
        assert e.value.file == str(d) and e.value.choices == [".metadata", entry]
    target = {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}
    with pytest.raises(BaseException) as e:  # DCP wraps ours in its CheckpointException
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, storage_reader=StorageReader(str(d)))
    assert want in str(e.value)
    assert torch.equal(target["weight"], torch.zeros(2, 2)) and torch.equal(target["bias"], torch.zeros(2))
    for argv in (["inspect", str(d)], ["verify", str(d)], ["diff", str(d), str(d)],
                 ["migrate", str(d), str(tmp_path / "out")]):  # fmt: skip
        rc = main(["--json", *argv])
        out = capsys.readouterr()
        assert rc == EXIT_BAD_INPUT, (argv, out)
        data = json.loads(out.out)
        assert (data["error"], data["file"], data["message"]) == ("AmbiguousSourceError", str(d), want)
    assert not (tmp_path / "out").exists()
    snap.assert_unchanged()
    assert dir_snapshot(d) == before


def test_dcp_alone_and_index_alone_still_read(tmp_path):
    d = _mixed(tmp_path, "model.safetensors")
    (d / "model.safetensors").unlink()
    m = torch.nn.Linear(2, 2)
    checkpoint.load(m, d)
    assert torch.equal(m.weight, torch.ones(2, 2))
    (d / ".metadata").unlink()
    save_file({"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, str(d / "model.safetensors"))
    checkpoint.load(m, d)
    assert torch.equal(m.weight, torch.zeros(2, 2))


@pytest.mark.parametrize("link", ["/nonexistent/.metadata", "../outside.metadata"])
def test_a_metadata_symlink_leading_outside_is_refused_by_every_reader(tmp_path, capsys, link):
    # Every reader refuses it alike: load, verify, inspect, open_checkpoint and the DCP
    # StorageReader (none reads the index beside it and says OK).
    d = tmp_path / "ck"
    checkpoint.save(torch.nn.Linear(2, 2), d)
    (tmp_path / "outside.metadata").write_bytes(b"not ours")
    (d / ".metadata").symlink_to(link)
    def listing():  # the link itself, not its target (dir_snapshot follows links)
        return {p.name: (os.readlink(p) if p.is_symlink() else p.read_bytes()) for p in d.iterdir()}

    before = listing()
    model = torch.nn.Linear(2, 2)
    snap = Snapshot(model)
    for call in (lambda: checkpoint.load(model, d), lambda: sniff(d), lambda: open_source(d),
                 lambda: checkpoint.open_checkpoint(d)):  # fmt: skip
        with pytest.raises(UnsafePathError, match=r"'\.metadata' .* is a symlink to .*, outside the checkpoint directory"):
            call()
    report = checkpoint.verify(d)  # verify reports what it finds (exit 1 in the CLI)
    assert not report.ok and len(report.problems) == 1 and report.problems[0].startswith("UnsafePathError: index entry '.metadata'")
    target = {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}
    with pytest.raises(BaseException, match="outside the checkpoint directory"):  # DCP wraps ours
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, storage_reader=StorageReader(str(d)))
    assert torch.equal(target["weight"], torch.zeros(2, 2))
    for argv in (["inspect", str(d)], ["verify", str(d)], ["diff", str(d), str(d)]):
        rc = main(["--json", *argv])
        out = capsys.readouterr()
        assert rc != 0 and "UnsafePathError" in out.out, (argv, out)
    snap.assert_unchanged()
    assert listing() == before


@pytest.mark.parametrize("entry", ["pytorch_model.bin", "pytorch_model.bin.index.json"])
def test_dcp_metadata_beside_pytorch_model_bin_is_refused(tmp_path, entry):
    d = tmp_path / "mixed"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, checkpoint_id=str(d))
    torch.save({"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, d / "pytorch_model.bin")
    if entry.endswith(".json"):
        (d / entry).write_text('{"metadata": {}, "weight_map": {"weight": "pytorch_model.bin", "bias": "pytorch_model.bin"}}')
    present = [entry, "pytorch_model.bin"] if entry.endswith(".json") else [entry]
    want = (f"{d}: holds both a DCP checkpoint (.metadata) and a pickle checkpoint ({entry}); "
            "DCP and Hugging Face readers would read different checkpoints from it: remove one of them "
            f"or move it to a directory of its own; choices for the path: {['.metadata', *present]}")  # fmt: skip
    model = torch.nn.Linear(2, 2)
    snap, before = Snapshot(model), dir_snapshot(d)
    for call in (lambda: checkpoint.load(model, d), lambda: checkpoint.verify(d), lambda: sniff(d),
                 lambda: checkpoint.migrate(d, tmp_path / "out")):  # fmt: skip
        with pytest.raises(AmbiguousSourceError) as e:
            call()
        assert str(e.value) == want and e.value.choices == [".metadata", *present]
    snap.assert_unchanged()
    assert dir_snapshot(d) == before and not (tmp_path / "out").exists()
    os.remove(d / ".metadata")  # the pickle alone: read
    for f in d.glob("*.json"):
        f.unlink()
    checkpoint.load(model, d)
    assert torch.equal(model.weight, torch.zeros(2, 2))
