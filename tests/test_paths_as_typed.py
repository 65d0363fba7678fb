"""Paths as users type them: relative, ``./x/``, trailing slash, ``~`` and a symlinked
parent work for every layout, in ``load`` and every CLI command, and each directory is read as one
source, the same in every command (DCP's ``HuggingFaceStorageWriter(save_distributed=True)``
with consolidation: the consolidated Hugging Face files, not ``sharded/``)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import checkpoint
from tests.helpers import run_cli

SD = {"a.weight": torch.arange(12.0).reshape(4, 3), "b.bias": torch.tensor([1.0, -2.0, 3.5])}


def _write(root):
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    checkpoint.save(SD, root / "ours")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(SD, checkpoint_id=str(root / "dcp"), no_dist=True)
        dcp.save(SD, storage_writer=HuggingFaceStorageWriter(path=str(root / "hf-consolidated"),
                 save_distributed=True, enable_consolidation=True), no_dist=True)  # fmt: skip
        dcp.save(SD, storage_writer=HuggingFaceStorageWriter(path=str(root / "hf-sharded"), save_distributed=True),
                 no_dist=True)  # fmt: skip


FORMATS = {"ours": "fqnckpt", "dcp": "dcp", "hf-consolidated": "safetensors-sharded", "hf-sharded": "dcp-hf-sharded"}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    base = tmp_path_factory.mktemp("typed")
    (base / "real").mkdir()
    _write(base / "real")
    (base / "home").mkdir()
    (base / "home" / "link").symlink_to(base / "real")  # a symlinked parent
    return base


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("typed", ["{n}", "./{n}/", "~/link/{n}", "~/link/{n}/"])
def test_every_command_reads_the_path_as_typed(layouts, monkeypatch, tmp_path, name, typed):
    monkeypatch.chdir(layouts / "real")
    monkeypatch.setenv("HOME", str(layouts / "home"))
    p = typed.format(n=name)
    code, out, err = run_cli("inspect", p, "--json", quiet_warnings=True)
    assert code == 0, (out, err)
    inspected = json.loads(out)["format"]
    code, out, err = run_cli("verify", p, "--json", quiet_warnings=True)
    assert code == 0, (out, err)
    verified = json.loads(out)["format"]
    assert inspected in (FORMATS[name], "safetensors-sharded") and verified == FORMATS[name], (inspected, verified)
    assert run_cli("diff", p, str(layouts / "real" / name), quiet_warnings=True)[0] == 0
    code, out, err = run_cli("migrate", p, str(tmp_path / "out"), quiet_warnings=True)
    assert code == 0, (out, err)
    target = {k: torch.zeros_like(v) for k, v in SD.items()}
    assert checkpoint.load(target, p).ok
    assert all(torch.equal(target[k], v) for k, v in SD.items())


def test_consolidated_layout_one_source_everywhere(layouts, monkeypatch):
    """The sharded/ pieces and the consolidated files must not both be candidates: a damaged
    consolidated file is what every command reports (none silently reads sharded/ instead)."""
    monkeypatch.chdir(layouts)
    import shutil

    shutil.copytree(layouts / "real" / "hf-consolidated", "damaged")
    shard = next(p for p in (layouts / "damaged").glob("model-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-4])  # cut: the consolidated file is unreadable
    assert run_cli("verify", "damaged", quiet_warnings=True)[0] != 0
    assert run_cli("migrate", "damaged", "out", quiet_warnings=True)[0] != 0
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load({k: torch.zeros_like(v) for k, v in SD.items()}, "damaged")
