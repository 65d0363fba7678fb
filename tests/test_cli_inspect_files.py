"""``fqnckpt inspect`` of an fqnckpt checkpoint lists every part's files under ``files:`` (the
model's shards, the optimizer's shards, the extra-state files), each named as its index (the
model index's record) names it: plain names locally, the save's token on object storage."""

from __future__ import annotations

import json
import os

import checkpoint
from checkpoint.storage.commit import token_of
from tests.helpers import run_cli, tiny_model, trained


def _saved(where) -> None:
    m, opt = trained(tiny_model())
    checkpoint.save(m, where, optimizer=opt, extra_state={"step": 3, "rng": checkpoint.PerRank(7)}, max_shard_size=64)


def _files_block(out: str) -> list[str]:
    lines = out.splitlines()
    start = lines.index("  files:") + 1
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("    "))
    return lines[start:end]


def test_inspect_lists_the_files_of_every_part(tmp_path, capsys):
    ck = tmp_path / "ck"
    _saved(ck)
    size = {n: os.path.getsize(ck / n) for n in ("extra_state.json", "extra_state.rank-00000-of-00001.json")}
    rc, out, _ = run_cli("inspect", ck, capsys=capsys)
    assert rc == 0
    assert _files_block(out) == [
        "    model-00001-of-00002.safetensors: 2 tensors, 60 B",
        "    model-00002-of-00002.safetensors: 2 tensors, 32 B",
        "    optimizer-00001-of-00004.safetensors: 2 tensors, 52 B",
        "    optimizer-00002-of-00004.safetensors: 3 tensors, 64 B",
        "    optimizer-00003-of-00004.safetensors: 4 tensors, 64 B",
        "    optimizer-00004-of-00004.safetensors: 3 tensors, 20 B",
        f"    extra_state.json: {size['extra_state.json']} B",
        f"    extra_state.rank-00000-of-00001.json: {size['extra_state.rank-00000-of-00001.json']} B",
    ]
    info = json.loads(run_cli("inspect", ck, "--json", capsys=capsys)[1])
    assert info["parts"]["optimizer"]["per_file"] == {
        "optimizer-00001-of-00004.safetensors": {"tensors": 2, "bytes": 52},
        "optimizer-00002-of-00004.safetensors": {"tensors": 3, "bytes": 64},
        "optimizer-00003-of-00004.safetensors": {"tensors": 4, "bytes": 64},
        "optimizer-00004-of-00004.safetensors": {"tensors": 3, "bytes": 20},
    }
    assert info["parts"]["extra_state_files"] == size


def test_inspect_at_a_url_names_the_objects_the_index_records(capsys):
    import fsspec

    url = "memory://inspect-files/ck"
    _saved(url)
    fs = fsspec.filesystem("memory")
    index = json.loads(fs.cat_file("/inspect-files/ck/model.safetensors.index.json"))
    objects = index["metadata"]["fqnckpt"]["objects"]
    opt_index = json.loads(fs.cat_file(f"/inspect-files/ck/{objects['optimizer.safetensors.index.json']}"))
    model_files = sorted(set(index["weight_map"].values()))
    opt_files = sorted(set(opt_index["weight_map"].values()))
    extra = [objects["extra_state.json"], objects["extra_state.rank-00000-of-00001.json"]]
    assert all(token_of(n) is not None for n in model_files + opt_files + extra)  # each the save's token
    rc, out, _ = run_cli("inspect", url, capsys=capsys)
    assert rc == 0
    names = [line.strip().split(":", 1)[0] for line in _files_block(out)]
    assert names == model_files + opt_files + extra
    for n in extra:
        assert f"    {n}: {fs.info(f'/inspect-files/ck/{n}')['size']} B" in _files_block(out)
    fs.rm("/inspect-files", recursive=True)
