"""One write pipeline (checkpoint.write): ``checkpoint.save``, ``async_save``, DCP's ``StorageWriter``
and ``migrate`` (from a torch pickle and from a DCP directory) write the same checkpoint for the
same tensors: the same shard file names and bytes, the same index (weight map, total size, each
file's record with its header and tensor digests). On two ranks the same holds for DTensors split
over the ranks (``Shard(0)``, ``Shard(1)``, ``_StridedShard``, ``Replicate`` and a plain tensor),
whose digests are joined from the chunks each rank hashed (small digest chunks, so chunks cross
the ranks' bytes); and ``async_save`` stages each byte a rank writes exactly once across the ranks
(a ``_StridedShard`` shard included). No front door writes a file of its own: a rule of the
pipeline (plan, parts, digests, index) that one of them re-implemented would show here."""

from __future__ import annotations

import json
import os

import torch
import xxhash

import checkpoint
from checkpoint.ranks.launch import run_ranks
from checkpoint.storage.format import IndexFile, index_name


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layers.0.weight": torch.randn(300, 40, generator=g),
        "layers.0.bias": torch.randn(40, generator=g).to(torch.bfloat16),
        "layers.1.counts": torch.randint(0, 1 << 40, (7, 3), generator=g),
        "layers.1.mask": torch.rand(5, 6, generator=g) > 0.5,
        "scale": torch.tensor(0.25, dtype=torch.float64),
    }


def _shards(path) -> dict[str, bytes]:
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path)) if n.endswith(".safetensors")}


def _index(path) -> IndexFile:
    return IndexFile.model_validate_json(open(os.path.join(path, index_name()), "rb").read())


def _what_must_agree(path) -> tuple:
    """Shard bytes and the parts of the index every front door writes alike (not the record of
    the other files a save wrote: a migration also writes its report)."""
    idx = _index(path)
    meta = idx.metadata.fqnckpt
    files = {n: r.model_dump() for n, r in meta.files.items()}
    return _shards(path), idx.weight_map, idx.metadata.total_size, files, meta.tensor_digest_chunk, meta.alias_groups


def _xxh(t: torch.Tensor, chunk: int) -> str:
    """Format version 3's digest of ``t``'s bytes, from xxhash itself (the oracle)."""
    b = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    if len(b) <= chunk:
        return xxhash.xxh3_128_hexdigest(b)
    return xxhash.xxh3_128_hexdigest(b"".join(xxhash.xxh3_128_digest(b[i : i + chunk]) for i in range(0, len(b), chunk)))


def test_every_front_door_writes_the_same_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from checkpoint.dcp import StorageWriter
    from checkpoint.training.async_save import AsyncSaver

    state = _state()
    ref = tmp_path / "save"
    checkpoint.save(state, ref)
    saver = AsyncSaver()
    try:
        saver.save(state, tmp_path / "async").result()
    finally:
        saver.close()
    dcp.save(dict(state), storage_writer=StorageWriter(tmp_path / "dcp_writer"))
    torch.save(state, tmp_path / "state.pt")
    checkpoint.migrate(tmp_path / "state.pt", tmp_path / "from_pt")
    dcp.save(dict(state), storage_writer=FileSystemWriter(str(tmp_path / "torch_dcp")))
    checkpoint.migrate(tmp_path / "torch_dcp", tmp_path / "from_dcp")

    want = _what_must_agree(ref)
    shards, weight_map, _, files, chunk, _ = want
    assert list(shards) == ["model-00001-of-00001.safetensors"]
    assert set(weight_map) == set(state)
    assert files["model-00001-of-00001.safetensors"]["tensors"] == {k: _xxh(v, chunk) for k, v in state.items()}
    for other in ("async", "dcp_writer", "from_pt", "from_dcp"):
        got = _what_must_agree(tmp_path / other)
        assert got[0] == want[0], other  # the shard files, byte for byte
        assert got[1:] == want[1:], other
        assert checkpoint.verify(tmp_path / other).ok, other
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    checkpoint.load(loaded, tmp_path / "dcp_writer")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


_FULL = {"rows": (64, 33), "cols": (8, 512), "strided": (8, 6), "rep": (9, 40), "plain": (3, 5)}


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {k: torch.randn(*s, generator=g) for k, s in _FULL.items()}


def _two_rank_front_doors(rank, world, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from checkpoint.dcp import SavePlanner, StorageWriter
    from checkpoint.storage import digest
    from checkpoint.training.async_save import AsyncSaver

    digest.TENSOR_CHUNK = 100  # several chunks per rank's bytes, some crossing into the other rank's
    mesh = init_device_mesh("cpu", (world,))
    pl = {"rows": [Shard(0)], "cols": [Shard(1)], "strided": [_StridedShard(0, split_factor=2)], "rep": [Replicate()]}
    sd = {k: distribute_tensor(v, mesh, pl[k], src_data_rank=None) if k in pl else v for k, v in _full().items()}
    checkpoint.save(sd, os.path.join(root, "save"))
    saver = AsyncSaver()
    try:
        fut = saver.save(sd, os.path.join(root, "async"))
        staged = fut.staging_bytes
        fut.result()
    finally:
        saver.close()
    dcp.save(dict(sd), storage_writer=StorageWriter(os.path.join(root, "dcp_writer")), planner=SavePlanner())
    return staged


def test_two_ranks_front_doors_write_the_same_checkpoint(tmp_path):
    staged = run_ranks(_two_rank_front_doors, 2, str(tmp_path), backend="gloo", timeout=120)
    full = _full()
    # each byte is staged by the one rank that writes it (a _StridedShard shard too)
    assert sum(staged) == sum(v.numel() * v.element_size() for v in full.values())
    want = _what_must_agree(tmp_path / "save")
    assert want[3]["model-00001-of-00001.safetensors"]["tensors"] == {k: _xxh(v, 100) for k, v in full.items()}
    assert want[4] == 100
    for other in ("async", "dcp_writer"):
        got = _what_must_agree(tmp_path / other)
        assert got[0] == want[0], other
        assert got[1:] == want[1:], other
    loaded = {k: torch.zeros_like(v) for k, v in full.items()}
    checkpoint.load(loaded, tmp_path / "dcp_writer")
    assert all(torch.equal(loaded[k], v) for k, v in full.items())


def _modules() -> dict[str, str]:
    """``{dotted module name: file}`` of the package code (fqn, checkpoint, autoparallel)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = {}
    for pkg in ("fqn", "checkpoint", "autoparallel"):
        for d, _, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                if f.endswith(".py"):
                    name = os.path.relpath(os.path.join(d, f), root)[:-3].replace(os.sep, ".")
                    out[name.removesuffix(".__init__")] = os.path.join(d, f)
    return out


def _imports(mods: dict[str, str]) -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """Each module's imports of package modules (anywhere in it, function bodies included), and
    every use of another module's private name: ``from m import _x`` or ``m._x`` on a module
    imported by name."""
    import ast

    edges: dict[str, set[str]] = {}
    private: list[tuple[str, str]] = []
    for mod, path in mods.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        by_name: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = mod.split(".") if path.endswith("__init__.py") else mod.split(".")[:-1]
                target = node.module if node.level == 0 else ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                for a in node.names:
                    full = f"{target}.{a.name}"
                    if full in mods:
                        by_name[a.asname or a.name] = full
                        edges.setdefault(mod, set()).add(full)
                    elif target in mods:
                        edges.setdefault(mod, set()).add(target)
                        if a.name.startswith("_") and not a.name.startswith("__") and target != mod:
                            private.append((mod, full))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods:
                        edges.setdefault(mod, set()).add(a.name)
                        by_name[a.asname or a.name] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = by_name.get(node.value.id) if isinstance(node.value, ast.Name) else None
                if owner is not None and owner != mod:
                    private.append((mod, f"{owner}.{node.attr}"))
    return edges, private


def test_write_side_uses_no_private_names_of_other_modules_and_nothing_imports_in_a_cycle():
    mods = _modules()
    edges, private = _imports(mods)
    write_side = ("checkpoint.write", "checkpoint.saving", "checkpoint.dcp.writer", "checkpoint.training.async_save",
                  "checkpoint.migrating", "checkpoint.convert.api")  # fmt: skip
    assert [p for p in private if p[0].startswith(write_side)] == []
    # no import cycle among the package's modules
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        seen[m] = 1
        for n in sorted(edges.get(m, ())):
            assert seen.get(n) != 1, " -> ".join(path[path.index(n):] + [m, n]) if n in path else (m, n)
            if n not in seen:
                visit(n, path + [m])
        seen[m] = 2

    for m in sorted(mods):
        if m not in seen:
            visit(m, [])


def test_one_process_writer_records_the_digest_of_every_size_class(tmp_path, monkeypatch):
    """A single-process save stages small tensors, writes a tensor of one digest chunk straight
    from its memory and a larger one in chunks, its hash inline or on the hash thread: every way
    records the digest of the bytes in the file, and the checkpoint loads back exact with
    ``verify=True``."""
    from checkpoint.storage import digest
    from checkpoint.storage.writer import SequentialFileWriter

    g = torch.Generator().manual_seed(1)
    chunk = digest.TENSOR_CHUNK
    sizes = {"a.staged": 2048, "b.one_chunk": 64 << 10, "c.below_chunk": chunk // 4 - 1, "d.chunk": chunk // 4,
             "e.two_chunks": chunk // 4 + 1, "f.many_chunks": 5 * chunk // 4 + 3, "g.staged_after": 16}  # fmt: skip
    sd = {k: torch.randn(n, generator=g) for k, n in sizes.items()}
    for inline in (True, False):
        monkeypatch.setattr(SequentialFileWriter, "HASH_INLINE", inline)
        path = tmp_path / f"inline-{inline}"
        checkpoint.save(sd, path)
        (name, data), = _shards(path).items()
        record = _index(path).metadata.fqnckpt.files[name]
        n = int.from_bytes(data[:8], "little")
        head = json.loads(data[8 : 8 + n])
        for k, v in sd.items():
            b, e = head[k]["data_offsets"]
            stored = data[8 + n + b : 8 + n + e]
            assert stored == v.numpy().tobytes(), k
            assert record.tensors[k] == digest.tensor_hexdigest(stored), k
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        checkpoint.load(out, path, verify=True)
        assert all(torch.equal(out[k], sd[k]) for k in sd)
