"""Every read is checked: a one-byte edit of a shard's header (a dtype or a shape, data untouched)
and a flipped data byte are refused by name on every read path (``checkpoint.load`` into plain,
converting and DTensor targets, ``get``, ``get_slice``, ``copy_into``, the migration source,
``migrate``, ``dcp.load`` through our reader, the CLI) and placement (``Shard(0)``, ``Shard(1)``,
``_StridedShard``, ``Replicate``, plain), peft's adapter file is digested like a shard, and the
names saved and loaded are the ones the model's own ``state_dict()`` gives, its hooks included.

Every refusal leaves the targets as they were: the digests are checked before any copy (on
several ranks, every rank's outcome is agreed first).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp

import checkpoint
from checkpoint.cli import main as cli_main
from checkpoint.dcp import StorageReader
from checkpoint.errors import ChecksumMismatchError, CorruptCheckpointError
from checkpoint.sources import open_source
from checkpoint.storage.opening import open_checkpoint
from tests.helpers import trained
from tests.snapshot import Snapshot

SHARD = "model-00001-of-00001.safetensors"
KINDS = ["header dtype", "header shape", "data"]


def reference() -> dict[str, torch.Tensor]:
    """``w``: small (one digest chunk); ``big``: 2 MiB + (three 1 MiB chunks of format 3)."""
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 16, generator=g), "big": torch.randn(1024, 520, generator=g), "b": torch.randn(5, generator=g)}


def _header(p) -> tuple[int, dict]:
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


def corrupt(ck, kind: str, key: str = "w", at: str = "middle") -> None:
    """Shard ``SHARD`` changed in place: ``header dtype``: ``w``'s dtype ``"F32"`` -> ``"I32"``
    (one byte); ``header shape``: its shape ``[8,16]`` -> ``[16,8]`` (same byte size, so
    safetensors accepts both); ``data``: one bit of ``key``'s middle byte (``at="start"``: its
    101st byte)."""
    p = ck / SHARD
    raw = bytearray(p.read_bytes())
    n, head = _header(p)
    if kind == "data":
        b, e = head[key]["data_offsets"]
        raw[8 + n + ((b + e) // 2 if at == "middle" else b + 100)] ^= 0x10
    else:
        at = raw.index(b'"w"', 8, 8 + n)
        old, new = (b'"F32"', b'"I32"') if kind == "header dtype" else (b"[8,16]", b"[16,8]")
        if kind == "header shape" and raw.find(old, at, at + 80) < 0:
            old, new = b"[8, 16]", b"[16, 8]"
        i = raw.index(old, at, at + 80)
        raw[i : i + len(old)] = new
    p.write_bytes(bytes(raw))


def saved(tmp_path, kind: str | None, key: str = "w", at: str = "middle"):
    ck = tmp_path / f"ck-{kind or 'clean'}-{key}-{at}".replace(" ", "-")
    checkpoint.save(reference(), ck)
    if kind is not None:
        corrupt(ck, kind, key, at)
    return ck


def _refused(exc: BaseException, kind: str, key: str) -> None:
    """``exc`` names the shard file, and for a data flip the tensor."""
    text = f"{type(exc).__name__}: {exc}"
    assert SHARD in text, text
    if kind == "data":
        assert f"'{key}'" in text or getattr(exc, "key", None) == key, text


def test_header_edit_keeps_byte_sizes():
    """The corruptions are what safetensors itself accepts: same byte sizes (so only the digest can
    tell), and each is one changed region of the header."""
    ref = reference()["w"]
    assert torch.zeros(8, 16, dtype=torch.int32).nbytes == ref.nbytes
    assert torch.zeros(16, 8).nbytes == ref.nbytes


# -- one process: every read path ------------------------------------------------------------------


def _readers(ck, out_dir, kind: str | None = None):
    """(name, read) for every read path of one process; read() returns the tensor it loaded. A
    path that writes into targets and refuses the checkpoint (an edited header, a flipped data
    byte) leaves every target as it was: the digests are checked before any copy."""

    def load(dtype=torch.float32, **kw):
        target = {k: torch.zeros(v.shape, dtype=dtype) for k, v in reference().items()}
        with unchanged_on_refusal(target):
            checkpoint.load(target, ck, **kw)
        return target

    yield "load", lambda: load()["w"]
    yield "load float64", lambda: load(torch.float64)["w"].float()
    yield "load verify", lambda: load(verify=True)["w"]
    yield "get", lambda: open_checkpoint(ck).get("w")
    yield "get_slice columns", lambda: open_checkpoint(ck).get_slice("w", [slice(None), slice(3, 11)])
    yield "copy_into", lambda: _copy_into(ck)
    yield "migration source", lambda: open_source(ck).get("w")
    yield "migrate", lambda: _migrated(ck, out_dir)

    def via_dcp():
        target = {k: torch.zeros_like(v) for k, v in reference().items()}
        with unchanged_on_refusal(target):
            dcp.load(target, storage_reader=StorageReader(str(ck)), no_dist=True)
        return target["w"]

    yield "dcp.load", via_dcp


CheckpointErrors = (CorruptCheckpointError, ChecksumMismatchError)


@contextlib.contextmanager
def unchanged_on_refusal(targets):
    """Whatever the block raises, ``targets`` (a dict of tensors) hold what they held before."""
    snap = Snapshot(targets)
    try:
        yield
    except BaseException:
        snap.assert_unchanged()
        raise


def _copy_into(ck):
    out = torch.zeros(8, 16)
    with open_checkpoint(ck) as r, unchanged_on_refusal({"w": out}):
        r.copy_into("w", out, check=True)
    return out


def _migrated(ck, out_dir):
    checkpoint.migrate(ck, out_dir)
    return open_checkpoint(out_dir).get("w")


@pytest.mark.parametrize("mapped", [True, False], ids=["leased-mapping", "preadv"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_read_path_refuses_a_changed_shard(tmp_path, kind, mapped, monkeypatch):
    """Each read path refuses the edited header or flipped byte with an error of ours naming
    the file (and the tensor, for data); a header edit is refused before any target changes
    (a reader trusting the edited header reads ``F32`` bytes as ``I32``: 1.0 becomes
    1065353216.0). The clean checkpoint reads exactly. Both ways of reading the bytes: from a
    mapping under a read lease (every file mapped, whatever its size) and with ``preadv`` only."""
    from checkpoint.storage import leased
    from checkpoint.storage import reader as reader_module

    if mapped:
        monkeypatch.setattr(reader_module, "_MAP_MIN", 0)
    else:
        monkeypatch.setattr(leased, "enabled", False)
    clean = saved(tmp_path, None)
    for name, read in _readers(clean, tmp_path / "out-clean"):
        want = reference()["w"][:, 3:11] if name == "get_slice columns" else reference()["w"]
        assert torch.equal(read(), want), name
    ck = saved(tmp_path, kind)
    for name, read in _readers(ck, tmp_path / f"out-{name_of(kind)}", kind):
        with pytest.raises(BaseException) as err:  # noqa: PT011 - checked below (DCP's wrapper is a BaseException)
            read()
        e = err.value
        if name == "dcp.load":  # DCP wraps a reader's error in its CheckpointException (its text kept)
            assert "xxh3-128 digest" in str(e), (name, e)
        else:
            assert isinstance(e, CheckpointErrors), (name, type(e), e)
        _refused(e, kind, "w")
    assert not (tmp_path / f"out-{name_of(kind)}").exists()  # migrate wrote nothing


def name_of(kind: str) -> str:
    return kind.replace(" ", "-")


@pytest.mark.parametrize("kind", KINDS)
def test_cli_refuses_a_changed_shard(tmp_path, capsys, kind):
    """``fqnckpt verify`` reports the file; ``fqnckpt diff`` against the clean checkpoint (which
    reads every tensor) refuses it by name instead of reporting values."""
    clean, ck = saved(tmp_path, None), saved(tmp_path, kind)
    assert cli_main(["verify", str(clean)]) == 0
    capsys.readouterr()
    assert cli_main(["verify", str(ck)]) == 1
    out = capsys.readouterr()
    assert SHARD in out.out + out.err
    code = cli_main(["diff", str(clean), str(ck)])
    out = capsys.readouterr()
    assert code == 2 and SHARD in out.err and "xxh3-128 digest" in out.err, (code, out)
    if kind == "data":
        assert "tensor 'w'" in out.err, out


def test_flipped_byte_of_a_chunked_tensor_refused_by_a_column_read(tmp_path):
    """A tensor of several digest chunks read as a column block (``get_slice`` of every row, the
    ``Shard(1)`` read) is hashed whole on the way: a flipped byte is refused naming it."""
    ck = saved(tmp_path, "data", "big")
    with pytest.raises(CorruptCheckpointError) as err:
        open_checkpoint(ck).get_slice("big", [slice(None), slice(0, 260)])
    assert err.value.key == "big" and SHARD in str(err.value)
    clean = saved(tmp_path, None)
    assert torch.equal(open_checkpoint(clean).get_slice("big", [slice(None), slice(0, 260)]), reference()["big"][:, :260])


@pytest.mark.parametrize("kind", ["header dtype", "data"])
def test_optimizer_part_is_checked_like_the_model_part(tmp_path, kind):
    """The optimizer part's shard (``optimizer-*.safetensors``) passes the same checks: an edited
    header (its first tensor's dtype) is refused on open, before the module or the optimizer
    changes; a flipped byte of a state tensor is refused naming file and tensor, the module and
    the optimizer unchanged too (every digest is checked before the first copy)."""
    m, opt = trained(lambda: torch.nn.Linear(4, 3), torch.optim.Adam, lr=0.1)
    ck = tmp_path / "ck"
    checkpoint.save(m, ck, optimizer=opt)
    (shard,) = [f for f in os.listdir(ck) if f.startswith("optimizer-") and f.endswith(".safetensors")]
    f = ck / shard
    raw = bytearray(f.read_bytes())
    n, head = _header(f)
    key = min((k for k in head if k != "__metadata__" and head[k]["dtype"] == "F32"),
              key=lambda k: head[k]["data_offsets"][0])  # fmt: skip
    if kind == "data":
        b, e = head[key]["data_offsets"]
        raw[8 + n + (b + e) // 2] ^= 0x10
    else:
        i = raw.index(b'"F32"', raw.index(json.dumps(key).encode(), 8, 8 + n))
        raw[i : i + 5] = b'"I32"'
    f.write_bytes(bytes(raw))
    back = torch.nn.Linear(4, 3)
    opt2 = torch.optim.Adam(back.parameters(), lr=0.5)
    snap = Snapshot(dict(back.named_parameters()))
    with pytest.raises(CorruptCheckpointError) as err:
        checkpoint.load(back, ck, optimizer=opt2)
    assert shard in str(err.value)
    if kind == "data":
        assert err.value.key == key
    snap.assert_unchanged()
    assert opt2.state_dict()["state"] == {} and opt2.param_groups[0]["lr"] == 0.5


def test_remote_reader_checks_the_header_digest(tmp_path):
    """A checkpoint on object storage (``memory://``): a dtype edited in its shard's header is
    refused by ``load`` and ``open_checkpoint(...).get`` naming the object; ``verify`` reports it."""
    import fsspec

    url = f"memory://read-checks-{tmp_path.name}/ck"
    checkpoint.save(reference(), url)
    fs = fsspec.filesystem("memory")
    (path,) = [p for p in fs.find(f"/read-checks-{tmp_path.name}/ck") if p.endswith(".safetensors")]  # this save's object
    shard = path.rsplit("/", 1)[1]
    raw = bytearray(fs.cat(path))
    at = raw.index(b'"w"')
    i = raw.index(b'"F32"', at)
    raw[i : i + 5] = b'"I32"'
    fs.pipe(path, bytes(raw))
    target = {k: torch.zeros_like(v) for k, v in reference().items()}
    snap = Snapshot(target)
    for read in (lambda: checkpoint.load(target, url), lambda: checkpoint.open_checkpoint(url).get("w")):
        with pytest.raises(CorruptCheckpointError, match="header bytes differ from the index's xxh3-128 digest") as err:
            read()
        assert shard in str(err.value)
    snap.assert_unchanged()
    rep = checkpoint.verify(url)
    assert not rep.ok and any(shard in x and "header bytes changed" in x for x in rep.problems), rep.problems


def test_row_blocks_hash_the_chunks_they_hold_and_combine_to_the_digest(tmp_path, monkeypatch):
    """What the ranks of a ``Shard(0)`` load exchange, in one process: ``check_first`` over row
    blocks of uneven sizes (blocks not aligned to chunks, read through small buffers on 3
    threads) gives, together, every chunk digest exactly as format 3 defines them, each from the
    block it starts in, and ``check_chunks`` accepts them; a flipped byte in any chunk is refused
    naming the tensor; a missing chunk checks nothing. No target is involved: the rows are hashed
    before any copy."""
    import xxhash

    from checkpoint.storage import digest, pread, read_check

    monkeypatch.setattr(digest, "TENSOR_CHUNK", 2048)  # recorded in the index by the save
    monkeypatch.setattr(read_check, "_BUFFER", 4096)
    monkeypatch.setattr(pread, "PIECE", 4096)
    monkeypatch.setattr(pread, "_THREADS", 3)
    t = torch.randn(97, 61, generator=torch.Generator().manual_seed(3))  # 23,668 bytes: 12 chunks
    checkpoint.save({"t": t}, tmp_path / "ck")
    raw = t.numpy().tobytes()
    row = len(raw) // 97
    oracle = {k: xxhash.xxh3_128_digest(raw[a : a + 2048]) for k, a in enumerate(range(0, len(raw), 2048))}
    cuts = [0, 13, 40, 41, 97]  # rows per block: 13, 27, 1, 56
    shutil.copytree(tmp_path / "ck", tmp_path / "bad")
    p = tmp_path / "bad" / SHARD
    b = bytearray(p.read_bytes())
    b[len(b) - len(raw) + 5 * 2048 + 7] ^= 0x01  # inside chunk 5, which the second block cuts
    p.write_bytes(bytes(b))
    for path in (tmp_path / "ck", tmp_path / "bad"):
        got: dict[int, bytes] = {}
        with open_checkpoint(path) as r:
            for a, b in zip(cuts, cuts[1:]):
                mine = r.check_first([], {"t": [(a * row, b * row)]})["t"]
                assert not set(mine) & set(got)  # each chunk from the block it starts in
                got.update(mine)
            if path.name == "ck":
                assert got == oracle
                assert r.check_chunks("t", {k: v for k, v in got.items() if k != 5}) is False
                assert r.check_chunks("t", got) is True
                continue
            with pytest.raises(CorruptCheckpointError) as err:
                r.check_chunks("t", got)
            assert err.value.key == "t" and SHARD in str(err.value)


# -- peft's adapter file -----------------------------------------------------------------------------


def _peft_model(seed: int):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(seed)
    pm = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    for n, prm in pm.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(prm)
    return pm


@pytest.mark.parametrize("kind", ["data", "header dtype"])
def test_adapter_file_is_digested_and_checked(tmp_path, capsys, kind):
    """``adapter_model.safetensors`` (the trained LoRA weights) has a record in the model index:
    a flipped byte in its last tensor, or a dtype edited in its header, fails ``verify`` (naming
    the file) and is refused by ``load`` naming file (and tensor); the targets' LoRA tensors are
    unchanged by the refused header; the clean save loads exactly and verifies."""
    from checkpoint.storage.format import index_name
    from checkpoint.storage.reader import read_index

    pm = _peft_model(0)
    p = tmp_path / "lora"
    checkpoint.save(pm, p)
    meta = read_index(str(p / index_name())).metadata.fqnckpt
    assert list(meta.extra_shards) == ["adapter_model.safetensors"]
    assert meta.extra_shards["adapter_model.safetensors"].size == (p / "adapter_model.safetensors").stat().st_size
    assert checkpoint.verify(p).ok
    back = _peft_model(1)
    checkpoint.load(back, p)
    want = dict(pm.named_parameters())
    assert all(torch.equal(prm, want[n]) for n, prm in back.named_parameters())
    f = p / "adapter_model.safetensors"
    raw = bytearray(f.read_bytes())
    n, head = _header(f)
    last = max((k for k in head if k != "__metadata__"), key=lambda k: head[k]["data_offsets"][1])
    if kind == "data":
        raw[-3] ^= 0x20  # inside the last tensor's data
    else:
        at = raw.index(last.encode(), 8, 8 + n)
        i = raw.index(b'"F32"', at)
        raw[i : i + 5] = b'"I32"'
    f.write_bytes(bytes(raw))
    rep = checkpoint.verify(p)
    assert not rep.ok and any("adapter_model.safetensors" in x for x in rep.problems), rep.problems
    assert cli_main(["verify", str(p)]) == 1
    capsys.readouterr()
    target = _peft_model(1)
    snap = Snapshot(dict(target.named_parameters()))
    with pytest.raises(CorruptCheckpointError) as err:
        checkpoint.load(target, p)
    assert "adapter_model.safetensors" in str(err.value)
    if kind == "data":
        assert err.value.key == last
    else:
        snap.assert_unchanged()


# -- names from the model's own state_dict, hooks included --------------------------------------------


class _Impl(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("scale", torch.tensor([2.0, 3.0]))


class _Hidden(torch.nn.Module):
    """A module hiding its runtime-only level ``impl.lin`` (as quantization and fused wrappers
    do): its state_dict hook names ``impl.lin.weight`` ``weight``, and its load_state_dict
    pre-hook renames it back, so torch's own ``load_state_dict`` takes what ``state_dict`` gave."""

    def __init__(self):
        super().__init__()
        self.impl = _Impl()
        self._register_state_dict_hook(_hide)
        self._register_load_state_dict_pre_hook(_unhide)


def _hide(module, sd, prefix, local_metadata):
    for k in [k for k in sd if k.startswith(prefix + "impl.lin.")]:
        sd[prefix + k[len(prefix + "impl.lin.") :]] = sd.pop(k)
    return sd


def _unhide(sd, prefix, *args):
    for k in [k for k in sd if k.startswith(prefix) and k[len(prefix) :] in ("weight", "bias")]:
        sd[prefix + "impl.lin." + k[len(prefix) :]] = sd.pop(k)


class _Model(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.q = _Hidden()
        self.head = torch.nn.Linear(2, 2)


def test_save_and_load_follow_state_dict_hooks(tmp_path):
    """``save(model)`` stores exactly the keys ``model.state_dict()`` gives (the hook's names, not
    the parameter paths); ``load`` fills a fresh model from them strictly; torch's
    ``load_state_dict`` of the stored tensors (through the module's pre-hook) gives the same
    values; the optimizer part is keyed by the same names."""
    from safetensors.torch import load_file

    m = _Model(0)
    want = m.state_dict()
    assert "q.weight" in want and "q.impl.lin.weight" not in want
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for prm in m.parameters():
        prm.grad = torch.ones_like(prm)
    opt.step()
    want = {k: v.clone() for k, v in m.state_dict().items()}
    checkpoint.save(m, tmp_path / "ck", optimizer=opt)
    r = open_checkpoint(tmp_path / "ck")
    assert r.keys() == sorted(want)
    assert all(torch.equal(r.get(k), v) for k, v in want.items())
    back = _Model(1)
    opt2 = torch.optim.SGD(back.parameters(), lr=0.5, momentum=0.9)
    rep = checkpoint.load(back, tmp_path / "ck", optimizer=opt2)
    assert rep.ok and rep.loaded_keys == sorted(want) and rep.optimizer_loaded
    assert all(torch.equal(back.state_dict()[k], v) for k, v in want.items())
    assert opt2.param_groups[0]["lr"] == 0.1
    assert all(torch.equal(opt2.state[b]["momentum_buffer"], opt.state[a]["momentum_buffer"])
               for a, b in zip(m.parameters(), back.parameters()))  # fmt: skip
    torch_side = _Model(2)
    torch_side.load_state_dict(load_file(str(tmp_path / "ck" / SHARD)))  # strict, through the pre-hook
    assert all(torch.equal(torch_side.state_dict()[k], v) for k, v in want.items())
    # and the other way: what torch's state_dict gives (safetensors' save_file) loads strictly
    from safetensors.torch import save_file

    os.makedirs(tmp_path / "st")
    save_file({k: v.contiguous() for k, v in want.items()}, str(tmp_path / "st" / "model.safetensors"))
    again = _Model(3)
    assert checkpoint.load(again, tmp_path / "st").ok
    assert all(torch.equal(again.state_dict()[k], v) for k, v in want.items())


# -- ranks: every placement, checkpoint.load and dcp.load, one shared 2-rank spawn --------------------

PLACEMENTS = ["Shard(0)", "Shard(1)", "_StridedShard(0, 2)", "_StridedShard(1, 2)", "Replicate()"]


def _placement(code):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {"Shard(0)": Shard(0), "Shard(1)": Shard(1), "_StridedShard(0, 2)": _StridedShard(0, split_factor=2),
            "_StridedShard(1, 2)": _StridedShard(1, split_factor=2), "Replicate()": Replicate()}[code]  # fmt: skip


def _rank_matrix(rank: int, world: int, cases: dict[str, str]) -> dict:
    """Per (checkpoint case, placement, loader): ``("loaded", equal to the reference)`` or
    ``("refused", error type name, its text)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    ref = reference()
    out = {}
    for case, path in cases.items():
        for code in PLACEMENTS:
            for how in ("checkpoint.load", "dcp.load"):
                target = {k: distribute_tensor(torch.zeros_like(v), mesh, [_placement(code)], src_data_rank=None)
                          if v.dim() == 2 else torch.zeros_like(v) for k, v in ref.items()}  # fmt: skip
                try:
                    if how == "checkpoint.load":
                        checkpoint.load(target, path)
                    else:
                        dcp.load(target, storage_reader=StorageReader(path))
                    got = ("loaded", all(torch.equal(target[k].full_tensor() if v.dim() == 2 else target[k], v)
                                         for k, v in ref.items()))  # fmt: skip
                except BaseException as e:  # noqa: BLE001 - reported (DCP raises a BaseException)
                    untouched = all(not (target[k].to_local() if v.dim() == 2 else target[k]).any() for k, v in ref.items())
                    got = ("refused", type(e).__name__, str(e)[-2000:], untouched)
                out[(case, code, how)] = got
    return out


def test_every_placement_refuses_a_changed_shard_on_two_ranks(tmp_path):
    """On 2 ranks, ``checkpoint.load`` and ``dcp.load`` (our StorageReader) into ``Shard(1)``,
    ``_StridedShard(1)`` and ``Replicate`` DTensors refuse a flipped byte in a small tensor and in
    a chunked one, naming file and tensor on every rank (``checkpoint.load`` into ``Shard(1)``:
    each rank reads whole rows, so one of them, in turn, hashes the
    tensor on the way; the others raise the same error through the load's agreement).
    ``checkpoint.load`` into ``Shard(0)`` / ``_StridedShard(0)`` rows refuses it too: each rank
    hashes the digest chunks starting in its rows (a flip in a chunk inside one rank's rows, and
    in the chunk cut by the ranks' boundary, which its first rank reads to its end), and the
    ranks combine them in the load's closing exchange. Every placement refuses an edited header
    naming the file; the clean checkpoint loads exactly everywhere."""
    from checkpoint.ranks.launch import run_ranks

    cases = {"clean": str(saved(tmp_path, None))}
    for kind in ("header dtype", "header shape"):
        cases[kind] = str(saved(tmp_path, kind))
    for key, at in (("w", "middle"), ("big", "middle"), ("big", "start")):
        cases[f"data {key} {at}"] = str(saved(tmp_path, "data", key, at))
    results = run_ranks(_rank_matrix, 2, cases, timeout=240)
    for rank, res in enumerate(results):
        for (case, code, how), got in res.items():
            where = (rank, case, code, how, got[:2])
            if case == "clean":
                assert got == ("loaded", True), where
                continue
            assert got[0] == "refused", where
            assert got[3], ("a target changed before the refusal", *where)
            # every rank raises ours (one rank's check, agreed); DCP's CheckpointException keeps its text
            assert got[1] == ("CorruptCheckpointError" if how == "checkpoint.load" else "CheckpointException"), where
            assert SHARD in got[2], where
            assert "xxh3-128 digest" in got[2], where
            if case.startswith("data"):
                assert f"'{case.split()[1]}'" in got[2], where


# -- the last tensor read is the corrupt one: nothing written before the refusal -------------------


def _flip_last(ck) -> str:
    """Flip one bit of the tensor stored last in the checkpoint's last shard file (the one a
    load reads last); returns its key."""
    files = sorted(f for f in os.listdir(ck) if f.startswith("model") and f.endswith(".safetensors"))
    p = ck / files[-1]
    raw = bytearray(p.read_bytes())
    n, head = _header(p)
    key = max((k for k in head if k != "__metadata__"), key=lambda k: head[k]["data_offsets"][0])
    b, e = head[key]["data_offsets"]
    raw[8 + n + (b + e) // 2] ^= 0x04
    p.write_bytes(bytes(raw))
    return key


def test_transformers_layout_load_refuses_before_any_parameter_changes(tmp_path):
    """A transformers MoE model saved in its on-disk layout (per-expert tensors converted to the
    fused ones while loading) with a flipped byte in the tensor read last: the load is refused
    naming it, and not one parameter of the model changed (the stored sources are checked before
    the first conversion is copied)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
        head_dim=8, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    src = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    checkpoint.save(src, tmp_path / "ck")
    key = _flip_last(tmp_path / "ck")
    torch.manual_seed(1)
    dst = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    snap = Snapshot(dict(dst.named_parameters()))
    with pytest.raises(CorruptCheckpointError) as err:
        checkpoint.load(dst, tmp_path / "ck")
    assert err.value.key == key and "xxh3-128 digest" in str(err.value)
    snap.assert_unchanged()


def test_object_storage_load_refuses_before_any_target_changes(tmp_path):
    """The same promise on object storage (moto's S3 server): the checked tensors are fetched,
    hashed and only then copied, so a flipped byte in the last tensor leaves every target as it was;
    the clean checkpoint loads exactly, each tensor fetched once."""
    pytest.importorskip("s3fs")
    import fsspec

    from checkpoint.storage.writer import stats
    from tests.s3_server import make_bucket, start_moto, storage_options

    server, port = start_moto()
    try:
        make_bucket(port, "bkt")
        opts = storage_options(port)
        ref = reference()
        checkpoint.save(ref, tmp_path / "ck")
        fs = fsspec.filesystem("s3", **opts)
        fs.put(str(tmp_path / "ck"), "bkt/clean", recursive=True)
        key = _flip_last(tmp_path / "ck")
        fs.put(str(tmp_path / "ck"), "bkt/bad", recursive=True)
        target = {k: torch.zeros_like(v) for k, v in ref.items()}
        stats.reset()
        checkpoint.load(target, "s3://bkt/clean", storage_options=opts)
        assert all(torch.equal(target[k], v) for k, v in ref.items())
        assert stats.bytes_read == sum(v.nbytes for v in ref.values())  # fetched once: checked, then copied
        target = {k: torch.zeros_like(v) for k, v in ref.items()}
        with unchanged_on_refusal(target), pytest.raises(CorruptCheckpointError) as err:
            checkpoint.load(target, "s3://bkt/bad", storage_options=opts)
        assert err.value.key == key
        # What the ranks of a Shard(0) load exchange, over ranged GETs: the chunks starting in
        # each rank's rows (two uneven row blocks of "big", 3 chunks), combined and checked.
        fs.put(str(saved(tmp_path, "data", "big", "start")), "bkt/bad-big", recursive=True)
        row = ref["big"].nbytes // ref["big"].shape[0]
        for url, ok in (("s3://bkt/clean", True), ("s3://bkt/bad-big", False)):
            got: dict[int, bytes] = {}
            with checkpoint.open_checkpoint(url, storage_options=opts) as r:
                for lo, hi in ((0, 300), (300, 1024)):
                    mine = r.check_first([], {"big": [(lo * row, hi * row)]})["big"]
                    assert not set(mine) & set(got)
                    got.update(mine)
                if ok:
                    assert sorted(got) == [0, 1, 2] and r.check_chunks("big", got) is True
                else:
                    with pytest.raises(CorruptCheckpointError):
                        r.check_chunks("big", got)
    finally:
        server.stop()


@pytest.mark.parametrize("mapped", [True, False], ids=["leased-mapping", "preadv"])
def test_many_small_tensors_refuse_the_first_changed_one_in_file_order(tmp_path, mapped, monkeypatch):
    """Loads of many small tensors hash them in groups of adjacent tensors on the read threads:
    two flipped bytes (tensors 'layers.123.w' and 'layers.200.w', 4 KiB each, 1.2 MiB in all) are
    refused naming the first in file order, with every target unchanged; the clean copy loads
    exactly."""
    from checkpoint.storage import leased

    if not mapped:
        monkeypatch.setattr(leased, "enabled", False)
    g = torch.Generator().manual_seed(5)
    sd = {f"layers.{i}.w": torch.randn(32, 32, generator=g) for i in range(300)}
    ck = tmp_path / "ck"
    checkpoint.save(sd, ck)
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    checkpoint.load(dst, ck)
    assert all(torch.equal(dst[k], sd[k]) for k in sd)
    with open_checkpoint(ck) as r:
        spans = {k: r._spans[k] for k in ("layers.123.w", "layers.200.w")}
    with open(ck / SHARD, "r+b") as f:
        for b, _ in spans.values():
            f.seek(b + 100)
            x = f.read(1)
            f.seek(b + 100)
            f.write(bytes([x[0] ^ 0x10]))
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    snap = Snapshot(dst)
    with pytest.raises(CorruptCheckpointError) as err:
        checkpoint.load(dst, ck)
    assert err.value.key == "layers.123.w" and SHARD in str(err.value)
    snap.assert_unchanged()
