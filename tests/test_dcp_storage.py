"""checkpoint.dcp: DCP's StorageWriter / StorageReader interfaces over fqnckpt.

The cases of torch's own ``test/distributed/checkpoint/test_hf_storage.py`` (write_data with
``fqn_to_index_mapping``, read_data / read_metadata of a hand-written safetensors file, the index
``finish`` writes) and ``test_hf_safetensor_e2e.py`` (single-rank save / load / load into an
empty dict; 1-D and 2-D placement changes; 1-D <-> 2-D mesh changes; empty shards), rewritten
with our classes, plus: every placement (``_StridedShard`` included) and int / bool / fp8 /
complex values, non-tensor values as extra state, torchtitan's HF export sequence read by
``from_pretrained``, ``async_save`` (thread and process), torch's ``HuggingFaceStorageWriter``
output read by our reader, object storage. One spawn per world size (1, 2, 4 ranks) runs every
multi-rank case.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import checkpoint
from torch.distributed.checkpoint.planner import WriteItemType

from checkpoint.dcp import SavePlanner, StorageReader, StorageWriter
from checkpoint.ranks.launch import run_ranks
from checkpoint.storage.layout import DTYPE_TO_ST

def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (compared bit for bit: float8 has no ==, nan != nan)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


# -- torch's test_hf_storage.py, with our classes ----------------------------------------------------


def test_write_data_honours_fqn_to_index_mapping(tmp_path):
    t0, t1 = torch.rand(4), torch.rand(10)
    path = str(tmp_path / "ck")
    dcp.save({"tensor_0": t0, "tensor_1": t1},
             storage_writer=StorageWriter(path, fqn_to_index_mapping={"tensor_0": 1, "tensor_1": 2}))  # fmt: skip
    assert sorted(load_file(f"{path}/model-00001-of-00002.safetensors")) == ["tensor_0"]
    assert torch.equal(load_file(f"{path}/model-00002-of-00002.safetensors")["tensor_1"], t1)
    idx = json.loads(open(f"{path}/model.safetensors.index.json").read())
    assert idx["weight_map"] == {"tensor_0": "model-00001-of-00002.safetensors", "tensor_1": "model-00002-of-00002.safetensors"}
    assert idx["metadata"]["total_size"] == 14 * 4
    assert checkpoint.verify(path).ok
    # A key the mapping does not name is refused, nothing written (torch's writer: KeyError).
    with pytest.raises(BaseException, match="no file index for \\['tensor_1'\\]"):
        dcp.save({"tensor_0": t0, "tensor_1": t1},
                 storage_writer=StorageWriter(str(tmp_path / "bad"), fqn_to_index_mapping={"tensor_0": 1}))  # fmt: skip
    assert not (tmp_path / "bad").exists()


def _hand_written(path, name: str, t: torch.Tensor, shape) -> int:
    """A safetensors file written byte by byte as torch's test writes it (no __metadata__)."""
    head = json.dumps({"tensor_0": {"dtype": "F32", "shape": list(shape), "data_offsets": [0, t.nbytes]}}).encode()
    with open(os.path.join(path, name), "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + t.numpy().tobytes())
    return len(head) + 8


def test_read_data_and_metadata_of_a_hand_written_file(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    t = torch.rand(5, 10)
    _hand_written(tmp_path, "test.safetensors", t, (5, 10))
    md = StorageReader(str(tmp_path)).read_metadata()
    assert md.state_dict_metadata == {
        "tensor_0": TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.float32), size=torch.Size([5, 10]),
            chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([5, 10]))],
        )
    }  # fmt: skip
    (chunk,) = md.storage_data.values()
    assert (chunk.key, chunk.offsets, chunk.shape) == ("tensor_0", (0, 0), (5, 10))
    target = {"tensor_0": torch.zeros(5, 10)}
    dcp.load(target, storage_reader=StorageReader(str(tmp_path)))
    assert torch.equal(target["tensor_0"], t)


@pytest.mark.parametrize("kind", ["tensor", "bytes"])
def test_read_data_refuses_an_item_its_metadata_lacks_before_reading(tmp_path, kind):
    # Our error naming the item, never a bare KeyError from the metadata lookup (the tensor item)
    # or from the extra state.
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from checkpoint.errors import UnknownReadItemError

    t = torch.rand(5, 10)
    _hand_written(tmp_path, "test.safetensors", t, (5, 10))
    reader = StorageReader(str(tmp_path))
    md = reader.read_metadata()
    target = {"tensor_0": torch.zeros(5, 10)}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(target, md, True)
    reader.set_up_storage_reader(md, True)
    plan = planner.create_local_plan()
    if kind == "tensor":
        idx = MetadataIndex("nope", torch.Size([0]))
        extra = ReadItem(LoadItemType.TENSOR, idx, torch.Size([0]), idx, torch.Size([0]), torch.Size([3]))
        want = f"the load plan reads 'nope' at storage offsets [0], which its metadata does not hold"
    else:
        idx = MetadataIndex("gone")
        extra = ReadItem(LoadItemType.BYTE_IO, idx, torch.Size([0]), idx, torch.Size([0]), torch.Size([0]))
        want = "the load plan reads 'gone' (a non-tensor value), which its metadata does not hold"
    plan.items.append(extra)
    with pytest.raises(UnknownReadItemError) as e:
        reader.read_data(plan, planner)
    assert str(e.value) == f"DCP checkpoint {tmp_path}: {want}; nothing was read"
    assert isinstance(e.value, KeyError) and e.value.key == extra.storage_index.fqn
    assert torch.equal(target["tensor_0"], torch.zeros(5, 10))  # nothing read before the refusal


def test_finish_writes_an_fqnckpt_index(tmp_path):
    sd = {"tensor_0": torch.rand(25), "tensor_1": torch.rand(25)}
    path = str(tmp_path / "ck")
    dcp.save(sd, storage_writer=StorageWriter(path, max_shard_size=100))
    idx = json.loads(open(f"{path}/model.safetensors.index.json").read())
    assert idx["metadata"]["total_size"] == 200
    assert idx["weight_map"] == {"tensor_0": "model-00001-of-00002.safetensors", "tensor_1": "model-00002-of-00002.safetensors"}
    files = idx["metadata"]["fqnckpt"]["files"]
    assert sorted(files) == sorted(set(idx["weight_map"].values()))
    assert checkpoint.verify(path).ok


# -- torch's test_hf_safetensor_e2e.py, single rank ----------------------------------------------------


class MyTestModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = torch.nn.Linear(5, 5)
        self.linear_2 = torch.nn.Linear(5, 1)
        self.emb = torch.nn.EmbeddingBag(5, 10)


def test_single_rank_save_reads_with_safetensors_and_fqnckpt(tmp_path):
    sd = MyTestModule().state_dict()
    path = str(tmp_path / "ck")
    dcp.save(sd, storage_writer=StorageWriter(path))
    loaded = load_file(f"{path}/model-00001-of-00001.safetensors")
    assert sorted(loaded) == sorted(sd) and all(torch.equal(loaded[k], v) for k, v in sd.items())
    target = MyTestModule()
    assert checkpoint.load(target, path).loaded_keys == sorted(sd)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in sd.items())


def test_single_rank_load_and_load_into_empty_dict(tmp_path):
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    sd = MyTestModule().state_dict()
    save_file(sd, str(tmp_path / "model-00001-of-00001.safetensors"))
    target = MyTestModule().state_dict()
    dcp.load(target, storage_reader=StorageReader(str(tmp_path)))
    assert all(torch.equal(target[k], v) for k, v in sd.items())
    empty = _load_state_dict_from_keys(storage_reader=StorageReader(str(tmp_path)))
    assert sorted(empty) == sorted(sd) and all(torch.equal(empty[k], v) for k, v in sd.items())


def test_values_of_every_kind_and_non_tensor_state(tmp_path):
    """int / bool / fp8 / complex tensors (torch's consolidation crashes on int and bool), a 0-d
    and an empty tensor, nested non-tensor values: kept as fqnckpt extra state, back from DCP,
    from ``checkpoint.load(extra_state=)`` and into an empty dict, nested as saved."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    g = torch.Generator().manual_seed(0)
    sd = {
        "i64": torch.randint(-(2**40), 2**40, (3, 4), generator=g), "i8": torch.randint(-100, 100, (7,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (5,), dtype=torch.uint8, generator=g), "flag": torch.rand(6, generator=g) > 0.5,
        "fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn), "fp8b": torch.randn(3, generator=g).to(torch.float8_e5m2),
        "c64": torch.randn(3, 2, dtype=torch.complex64, generator=g), "bf16": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "zero_d": torch.tensor(7.5), "empty": torch.zeros(0, 3),
        "step": 12, "train": {"tokens": 2**40, "lr": 3e-4, "name": "run-1", "hist": [1.5, float("inf")], "none": None},
    }  # fmt: skip
    path = str(tmp_path / "ck")
    dcp.save(sd, storage_writer=StorageWriter(path))
    assert checkpoint.verify(path).ok
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    with checkpoint.open_checkpoint(path) as rd:
        assert rd.keys() == sorted(tensors)
        for k, v in tensors.items():
            got = rd.get(k)
            assert got.dtype == v.dtype and torch.equal(_bits(got), _bits(v)), k
    extra = {"step": 0, "train": {}}
    checkpoint.load({k: torch.empty_like(v) for k, v in tensors.items()}, path, extra_state=extra)
    assert extra == {"step": 12, "train": sd["train"]}
    target = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()}
    target["train"] = {k: None for k in sd["train"]}
    dcp.load(target, storage_reader=StorageReader(path))
    assert target["step"] == 12 and target["train"] == sd["train"]
    assert all(torch.equal(_bits(target[k]), _bits(v)) for k, v in tensors.items())
    empty = _load_state_dict_from_keys(storage_reader=StorageReader(path))
    assert empty["train"] == sd["train"] and empty["step"] == 12 and torch.equal(empty["i64"], sd["i64"])


class Opaque:
    """A value extra state cannot hold (weights_only unpickling refuses it)."""


def test_refusals_name_the_key_and_write_nothing(tmp_path):
    for bad, key in (({"w": torch.zeros(2), "obj": Opaque()}, "obj"), ({"w": torch.zeros(2, dtype=torch.complex128)}, "w")):
        path = tmp_path / f"ck-{key}"
        with pytest.raises(BaseException, match=repr(key)):
            dcp.save(bad, storage_writer=StorageWriter(str(path)))
        assert not path.exists() and os.listdir(tmp_path) == sorted(os.listdir(tmp_path))
    assert [p.name for p in tmp_path.iterdir() if "staging" in p.name] == []  # nothing half-written left


def test_overwrite_keeps_foreign_files_and_refusal_keeps_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    dcp.save({"a": torch.ones(3)}, storage_writer=StorageWriter(path))
    (tmp_path / "ck" / "config.json").write_text("{}")
    dcp.save({"a": torch.full((3,), 2.0)}, storage_writer=StorageWriter(path))  # DCP's default: overwrite
    assert (tmp_path / "ck" / "config.json").read_text() == "{}"
    with pytest.raises(BaseException, match="CheckpointExistsError|exists"):
        dcp.save({"a": torch.zeros(3)}, storage_writer=StorageWriter(path, overwrite=False))
    assert torch.equal(load_file(f"{path}/model-00001-of-00001.safetensors")["a"], torch.full((3,), 2.0))


def test_reader_index_is_authoritative_and_hub_cache_and_duplicates(tmp_path):
    from tests.test_symlink_rule import _to_hub_cache

    path = tmp_path / "ck"
    dcp.save({"a": torch.ones(3), "b": torch.zeros(2)}, storage_writer=StorageWriter(str(path)))
    save_file({"a": torch.full((3,), 9.0)}, str(path / "model-old.safetensors"))  # a stray older file
    target = {"a": torch.zeros(3), "b": torch.ones(2)}
    with pytest.warns(checkpoint.StrayFileWarning):
        dcp.load(target, storage_reader=StorageReader(str(path)))
    assert torch.equal(target["a"], torch.ones(3)) and torch.equal(target["b"], torch.zeros(2))
    os.remove(path / "model-old.safetensors")
    snap = _to_hub_cache(path, tmp_path / "hub")
    target = {"a": torch.zeros(3), "b": torch.ones(2)}
    dcp.load(target, storage_reader=StorageReader(str(snap)))
    assert torch.equal(target["a"], torch.ones(3))
    # Without an index, a tensor in two files is refused (torch's reader merges them silently).
    loose = tmp_path / "loose"
    loose.mkdir()
    save_file({"a": torch.ones(3)}, str(loose / "x.safetensors"))
    save_file({"a": torch.zeros(3)}, str(loose / "y.safetensors"))
    with pytest.raises(BaseException, match="DuplicateTensorError|'a'"):
        dcp.load({"a": torch.zeros(3)}, storage_reader=StorageReader(str(loose)))


def test_reader_gives_tied_weights_under_every_name(tmp_path):
    """checkpoint.save stores a tied lm_head.weight once (alias group); a DCP load of the model's
    full state_dict (both names) finds both."""
    from tests.test_checkpoint_interop import TOKENS, tiny_llama

    model = tiny_llama(4, tie=True)
    checkpoint.save(model, str(tmp_path / "ck"))
    back = tiny_llama(5, tie=True)
    sd = back.state_dict()
    assert "lm_head.weight" in sd
    dcp.load(sd, storage_reader=StorageReader(str(tmp_path / "ck")))
    back.load_state_dict(sd)
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, model(TOKENS).logits)


def test_transformers_from_pretrained_and_cli_read_it(tmp_path, capsys):
    from transformers import LlamaForCausalLM

    from checkpoint.cli.main import main as cli
    from tests.test_checkpoint_interop import TOKENS, tiny_llama

    model = tiny_llama(3, tie=False)
    path = str(tmp_path / "hf")
    dcp.save(model.state_dict(), storage_writer=StorageWriter(path, max_shard_size=20_000))
    model.config.save_pretrained(path)
    back = LlamaForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, model(TOKENS).logits)
    for argv in (["verify", path], ["inspect", path]):
        assert cli(argv) == 0, capsys.readouterr()


# -- multi-rank: one spawn per world size ------------------------------------------------------------

ONE_D = [("S0", "R"), ("R", "S0"), ("S0", "S1"), ("SS0/2", "S0"), ("S1", "SS0/2")]
TWO_D_PLACEMENTS = [("R", "R"), ("R", "S0"), ("S0", "R"), ("S0", "S0")]
TWO_D = [(a, b) for a in TWO_D_PLACEMENTS for b in TWO_D_PLACEMENTS if a != b]


def _pl(code):
    from tests.test_checkpoint_dist import _pl as pl

    return pl(code)


def _dist(t, mesh, code):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t, mesh, _pl(code), src_data_rank=None)  # every rank holds t


def _full(v):
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def _meshes(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,)), init_device_mesh("cpu", (2, world // 2) if world > 1 else (1, 1))


def _placement_and_mesh_changes(root, world, mesh1, mesh2) -> dict[str, bool]:
    """torch's TestDTensorReshardPlacementChange / TestDTensorReshardMeshChange / empty shard."""
    from torch.distributed.tensor import zeros

    out = {}
    g = torch.arange(16, dtype=torch.float).view(4, 4)
    p1, p2 = f"{root}/one_d", f"{root}/two_d"
    sd1 = {f"t{i}": _dist(g + i, mesh1, a) for i, (a, _) in enumerate(ONE_D)}
    dcp.save(sd1, storage_writer=StorageWriter(p1), planner=SavePlanner())
    sd2 = {f"t{i}": _dist(g + i, mesh2, a) for i, (a, _) in enumerate(TWO_D)}
    dcp.save(sd2, storage_writer=StorageWriter(p2), planner=SavePlanner())
    for name, path, pairs, mesh in (("1d", p1, ONE_D, mesh1), ("2d", p2, TWO_D, mesh2)):
        tgt = {f"t{i}": zeros([4, 4], device_mesh=mesh, placements=_pl(b)) for i, (_, b) in enumerate(pairs)}
        dcp.load(tgt, storage_reader=StorageReader(path))
        for i, (a, b) in enumerate(pairs):
            want = _dist(g + i, mesh, b)
            out[f"{name}:{a}->{b}"] = torch.equal(tgt[f"t{i}"].full_tensor(), g + i) and torch.equal(
                tgt[f"t{i}"].to_local(), want.to_local()
            )
    # Mesh changes: the 1-D save into 2-D placements and the 2-D save into 1-D placements.
    for name, path, pairs, mesh, codes in (
        ("1d->2d", p1, ONE_D, mesh2, TWO_D_PLACEMENTS), ("2d->1d", p2, TWO_D, mesh1, ["S0", "R", "S1", "SS0/2"])
    ):  # fmt: skip
        for code in codes:
            tgt = {f"t{i}": zeros([4, 4], device_mesh=mesh, placements=_pl(code)) for i in range(len(pairs))}
            dcp.load(tgt, storage_reader=StorageReader(path))
            out[f"{name}:{code}"] = all(torch.equal(v.full_tensor(), g + i) for i, v in enumerate(tgt.values()))
    # Empty shards: one element over every rank, loaded into a 2-D Shard(0), Shard(0).
    torch.manual_seed(0)
    one = torch.rand(1)
    dcp.save({"dtensor": _dist(one, mesh1, "S0")}, storage_writer=StorageWriter(f"{root}/empty"))
    tgt = {"dtensor": _dist(torch.zeros(1), mesh2, ("S0", "S0"))}
    dcp.load(tgt, storage_reader=StorageReader(f"{root}/empty"))
    out["empty-shards"] = torch.equal(tgt["dtensor"].full_tensor(), one)
    return out


def _every_placement(root, world, mesh1, mesh2) -> tuple[dict[str, bool], int]:
    """fqnckpt's placement set (uneven, _StridedShard, 3-D, int / bool / bf16) plus fp8 and
    complex DTensors and non-tensor values; bytes this rank wrote."""
    from checkpoint.storage.writer import stats
    from tests.test_checkpoint_dist import LOAD_1D, LOAD_2D, PLACEMENTS_1D, PLACEMENTS_2D, _dtensors

    mesh, save_pl, load_pl = (mesh2, PLACEMENTS_2D, LOAD_2D) if world == 4 else (mesh1, PLACEMENTS_1D, LOAD_1D)
    sd = _dtensors(mesh, save_pl)
    extra_ref = _extra_tensors()
    sd.update({k: _dist(v, mesh1, "S0") for k, v in extra_ref.items()})
    sd["train_state"] = {"step": 7, "tokens": [1, 2, 3]}
    stats.reset()
    dcp.save(sd, storage_writer=StorageWriter(f"{root}/every", max_shard_size=200), planner=SavePlanner())
    written = stats.bytes_written
    tgt = _dtensors(mesh, load_pl, zero=True)  # default load planner, _StridedShard targets included
    tgt.update({k: _dist(torch.zeros_like(v), mesh1, "R") for k, v in extra_ref.items()})
    tgt["train_state"] = {"step": 0, "tokens": []}
    dcp.load(tgt, storage_reader=StorageReader(f"{root}/every"))
    from tests.test_checkpoint_dist import reference_tensors

    ref = reference_tensors() | extra_ref
    out = {f"every:{k}": torch.equal(_bits(_full(tgt[k])), _bits(v)) for k, v in ref.items()}
    out["every:train_state"] = tgt["train_state"] == {"step": 7, "tokens": [1, 2, 3]}
    return out, written


def _extra_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "fp8": torch.randn(8, 4, generator=g).to(torch.float8_e4m3fn),
        "c64": torch.randn(8, 3, dtype=torch.complex64, generator=g),
        "i32": torch.randint(-5, 5, (8,), dtype=torch.int32, generator=g),
    }


def _async(root, world, mesh1) -> dict[str, bool]:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    g = torch.arange(24.0).view(6, 4)
    out = {}
    kinds = [AsyncCheckpointerType.THREAD] + ([AsyncCheckpointerType.PROCESS] if world == 2 else [])
    for kind in kinds:
        path = f"{root}/async-{kind.value}"
        sd = {"w": _dist(g, mesh1, "S0"), "b": torch.ones(3), "step": 5}
        fut = dcp.async_save(sd, storage_writer=StorageWriter(path), async_checkpointer_type=kind)
        sd["w"].to_local().add_(100.0)  # after the call: the save holds its own copy
        fut.result()
        tgt = {"w": _dist(torch.zeros(6, 4), mesh1, "R"), "b": torch.zeros(3), "step": 0}
        dcp.load(tgt, storage_reader=StorageReader(path))
        out[f"async:{kind.value}"] = torch.equal(tgt["w"].full_tensor(), g) and tgt["step"] == 5
    return out


def titan_names(hf_sd: dict) -> dict:
    """HF Llama names -> torchtitan's (``torchtitan/models/llama3/model/state_dict_adapter.py``
    ``from_hf_map``; the RoPE permutation of wq / wk is left out, it is a value change only)."""
    import re

    rules = [
        (r"^model\.embed_tokens\.weight$", "tok_embeddings.weight"), (r"^model\.norm\.weight$", "norm.weight"),
        (r"^lm_head\.weight$", "output.weight"),
        (r"^model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight$", r"layers.\1.attention.w\2.weight"),
        (r"^model\.layers\.(\d+)\.mlp\.gate_proj\.weight$", r"layers.\1.feed_forward.w1.weight"),
        (r"^model\.layers\.(\d+)\.mlp\.down_proj\.weight$", r"layers.\1.feed_forward.w2.weight"),
        (r"^model\.layers\.(\d+)\.mlp\.up_proj\.weight$", r"layers.\1.feed_forward.w3.weight"),
        (r"^model\.layers\.(\d+)\.input_layernorm\.weight$", r"layers.\1.attention_norm.weight"),
        (r"^model\.layers\.(\d+)\.post_attention_layernorm\.weight$", r"layers.\1.ffn_norm.weight"),
    ]  # fmt: skip
    out = {}
    for k, v in hf_sd.items():
        for pat, rep in rules:
            if re.match(pat, k):
                out[re.sub(pat, rep, k)] = v
                break
        else:
            raise KeyError(k)
    return out


class _Adapter:
    """torchtitan's ``BaseStateDictAdapter`` shape: ``to_hf`` / ``from_hf`` renames and the
    ``fqn_to_index_mapping`` read from an HF index (here: layers over two files)."""

    def __init__(self, hf_keys):
        self.hf_keys = list(hf_keys)
        self.to_titan = dict(zip(self.hf_keys, titan_names(dict.fromkeys(self.hf_keys))))
        self.fqn_to_index_mapping = {k: 2 if ".layers.1." in k else 1 for k in self.hf_keys}

    def to_hf(self, sd):
        back = {v: k for k, v in self.to_titan.items()}
        return {back[k]: v for k, v in sd.items()}


def _titan_export(root, mesh1) -> dict[str, bool]:
    """torchtitan's HF export (``CheckpointManager._save_last_step`` with ``last_save_in_hf``):
    ``sd_adapter.to_hf(state_dict)``, then ``dcp.save`` through an HF storage writer given the
    adapter's ``fqn_to_index_mapping``; ours in place of ``HuggingFaceStorageWriter``."""
    from torch.distributed.fsdp import fully_shard

    from tests.test_checkpoint_interop import tiny_llama

    model = tiny_llama(11, tie=False)
    fully_shard(model, mesh=mesh1)
    hf_sd = model.state_dict()
    adapter = _Adapter(hf_sd)
    native = titan_names(hf_sd)  # what a torchtitan model's state_dict holds
    path = f"{root}/titan-hf"
    dcp.save(adapter.to_hf(native), storage_writer=StorageWriter(path, fqn_to_index_mapping=adapter.fqn_to_index_mapping))
    if mesh1.get_rank() == 0:
        model.config.save_pretrained(path)
    return {"titan:sharded": all(v.placements[0].is_shard() for v in hf_sd.values())}


def _torch_hf_output(root, world, mesh1, mesh2) -> dict[str, bool]:
    """torch's HuggingFaceStorageWriter(save_distributed=True): the per-rank shard files, and
    (floats only: it crashes on ints) the consolidated files, read by our StorageReader."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.tensor import zeros

    g = torch.arange(48.0).view(8, 6)
    out = {}
    sd = {"a": _dist(g, mesh1, "S0"), "b": _dist(g + 1, mesh1, "S1"), "c": _dist(g + 2, mesh1, "R")}
    for consolidate in (False, True) if world == 2 else (False,):
        path = f"{root}/torch-hf-{consolidate}"
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True, enable_consolidation=consolidate))
        tgt = {k: zeros([8, 6], device_mesh=mesh2, placements=_pl(("S1", "S0"))) for k in sd}
        dcp.load(tgt, storage_reader=StorageReader(path))
        out[f"torch-hf:{consolidate}"] = all(torch.equal(tgt[k].full_tensor(), g + i) for i, k in enumerate(sd))
    return out


def _remote(url, opts, mesh1) -> dict[str, bool]:
    """An object-storage save on the caller's process group (a gloo group of every rank, as for
    async_save): the save's own collectives run on it, not on the default group."""
    import torch.distributed as dist

    from checkpoint.ranks import dist as fdist

    g = torch.arange(40.0).view(10, 4)
    sd = {"w": _dist(g, mesh1, "S0"), "s": _dist(g[:, :1].contiguous(), mesh1, "SS0/2"), "step": 4}
    group, used = dist.new_group(backend="gloo"), []
    real = fdist.broadcast_object
    fdist.broadcast_object = lambda obj, src=0: (used.append(fdist._group()), real(obj, src))[1]
    try:
        dcp.save(sd, storage_writer=StorageWriter(url, storage_options=opts, process_group=group),
                 planner=SavePlanner(), process_group=group)  # fmt: skip
    finally:
        fdist.broadcast_object = real
    tgt = {"w": _dist(torch.zeros(10, 4), mesh1, "S1"), "s": _dist(torch.zeros(10, 1), mesh1, "R"), "step": 0}
    dcp.load(tgt, storage_reader=StorageReader(url, storage_options=opts))
    return {"s3": torch.equal(tgt["w"].full_tensor(), g) and torch.equal(tgt["s"].full_tensor(), g[:, :1])
            and tgt["step"] == 4, "s3:group": bool(used) and all(u is group for u in used)}  # fmt: skip


def _train_state(root, mesh1) -> dict[str, bool]:
    """A training checkpoint as DCP users write it: FSDP2 model and AdamW state from
    ``get_state_dict``, plus train state; resumed into another model, the next step is identical."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    def make(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
        fully_shard(m, mesh=mesh1)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    runs = []
    for seed in (0, 1):
        m, opt = make(seed)
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
        runs.append((m, opt))
    (m, opt), (m2, opt2) = runs
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd, "train_state": {"step": 1}}, checkpoint_id=f"{root}/train",
             storage_writer=StorageWriter())  # fmt: skip
    msd2, osd2 = get_state_dict(m2, opt2)
    state = {"model": msd2, "optim": osd2, "train_state": {"step": 0}}
    dcp.load(state, checkpoint_id=f"{root}/train", storage_reader=StorageReader())
    set_state_dict(m2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for model, o in runs:
        model(x).sum().backward()
        o.step()
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(m.parameters(), m2.parameters()))
    return {"train:resume": same and state["train_state"] == {"step": 1}}


def _digests(root, world, mesh1) -> dict[str, bool]:
    """Split-tensor digests (each rank wrote part of a Shard(0) tensor; its digest was hashed
    back): a load reading tensors whole (Replicate) or through all their rows (Shard(1)) checks
    each tensor on exactly one rank; a flipped byte is then refused on every rank, by name."""
    import torch.distributed as dist

    g = torch.arange(64.0).view(8, 8)
    path, out = f"{root}/digests", {}
    sd = {"w": _dist(g, mesh1, "S0"), "v": _dist(g + 1, mesh1, "S0")}
    dcp.save(sd, storage_writer=StorageWriter(path))
    from checkpoint.storage.writer import stats  # tensors and bytes the checks before the copies compared

    for code in ("R", "S1"):
        tgt = {k: _dist(torch.zeros(8, 8), mesh1, code) for k in sd}
        before = (stats.tensors_checked, stats.bytes_checked)
        dcp.load(tgt, storage_reader=StorageReader(path))
        mine = (stats.tensors_checked - before[0], stats.bytes_checked - before[1])
        every: list = [None] * world
        dist.all_gather_object(every, mine)
        once = sum(t for t, _ in every) == len(sd) and sum(b for _, b in every) == len(sd) * g.nbytes
        out[f"digest:{code}:once"] = once and torch.equal(tgt["v"].full_tensor(), g + 1)
    dist.barrier()
    if dist.get_rank() == 0:
        _flip_byte(path, "v", 3)
    dist.barrier()
    for code in ("R", "S1"):
        tgt = {k: _dist(torch.zeros(8, 8), mesh1, code) for k in sd}
        try:
            dcp.load(tgt, storage_reader=StorageReader(path))
            out[f"digest:{code}:refused"] = False
        except BaseException as e:  # DCP's CheckpointException, on every rank
            out[f"digest:{code}:refused"] = "CorruptCheckpointError" in str(e) and "tensor 'v'" in str(e)
    # Ranks whose plan is empty (Shard(0) of one row; of three 1 MiB rows, three 1 MiB digest
    # chunks, on 4 ranks) take part in the check all the same: the intact tensors load on every
    # rank, and a flipped byte is refused by name on every rank with every target unchanged.
    dist.barrier()
    rows = {"row": torch.arange(8.0).view(1, 8), "big": torch.arange(3.0 * 2**18).view(3, 2**18)}
    for key, g in rows.items():
        p = f"{root}/empty-rank-{key}"
        dcp.save({key: _dist(g, mesh1, "S0")}, storage_writer=StorageWriter(p))
        tgt = {key: _dist(torch.zeros_like(g), mesh1, "S0")}
        dcp.load(tgt, storage_reader=StorageReader(p))
        out[f"digest:empty-rank:{key}:loaded"] = torch.equal(tgt[key].full_tensor(), g)
        dist.barrier()
        if dist.get_rank() == 0:
            _flip_byte(p, key, g.nbytes - 5)  # in the last row (of the last digest chunk)
        dist.barrier()
        tgt = {key: _dist(torch.full_like(g, -1.0), mesh1, "S0")}
        try:
            dcp.load(tgt, storage_reader=StorageReader(p))
            out[f"digest:empty-rank:{key}:refused"] = False
        except BaseException as e:  # DCP's CheckpointException, on every rank
            out[f"digest:empty-rank:{key}:refused"] = (
                "CorruptCheckpointError" in str(e) and f"tensor '{key}'" in str(e)
                and bool((tgt[key].to_local() == -1.0).all())
            )
    return out


class _FailingPlanner(SavePlanner):
    """Raises on the last rank while it writes its first tensor (a rank failing mid-write)."""

    def resolve_data(self, write_item):
        import torch.distributed as dist

        if dist.get_rank() == dist.get_world_size() - 1 and write_item.type != WriteItemType.BYTE_IO:
            raise OSError(28, "No space left on device (injected on the last rank)")
        return super().resolve_data(write_item)


class _OverwrittenReader(StorageReader):
    """Rank 0 opens the checkpoint, then overwrites it (a save of another process), then the
    other ranks open it: the ranks hold different checkpoints."""

    def read_metadata(self, *args, **kwargs):
        import torch.distributed as dist

        if dist.get_rank() == 0:
            md = super().read_metadata()
            checkpoint.save({"w": torch.full((8, 8), 7.0), "v": torch.full((8, 8), 7.0)}, self.path, overwrite=True)
        dist.barrier()
        if dist.get_rank() != 0:
            md = super().read_metadata()
        return md


def _hostile(root, world, mesh1) -> dict[str, bool]:
    """A rank failing mid-write: every rank gets the same named error, nothing is committed
    (the previous checkpoint stays whole, no staging left once the writer is gone) and a retry
    commits. An overwrite landing while the ranks open a checkpoint for dcp.load: every rank
    gets a named error instead of a mix of two checkpoints."""
    import gc

    import torch.distributed as dist

    g = torch.arange(64.0).view(8, 8)
    path, out = f"{root}/hostile", {}
    sd = {"w": _dist(g, mesh1, "S0"), "v": _dist(g + 1, mesh1, "S0")}
    dcp.save(sd, storage_writer=StorageWriter(path))
    new = {"w": _dist(g * 2, mesh1, "S0"), "v": _dist(g * 3, mesh1, "S0")}
    try:
        dcp.save(new, storage_writer=StorageWriter(path), planner=_FailingPlanner())
        out["fail:raised"] = False
    except BaseException as e:  # DCP's CheckpointException, the failing rank's error inside
        out["fail:raised"] = "No space left on device (injected on the last rank)" in str(e)
    gc.collect()  # the failed save's writer is gone: its staging directory and lock with it
    dist.barrier()
    with checkpoint.open_checkpoint(path) as rd:
        out["fail:old-kept"] = torch.equal(rd.get("w"), g) and torch.equal(rd.get("v"), g + 1)
    out["fail:no-staging"] = [n for n in os.listdir(root) if n.startswith(".hostile")] == [] and all(
        not n.startswith(".") for n in os.listdir(path)
    )
    dist.barrier()
    dcp.save(new, storage_writer=StorageWriter(path))
    tgt = {k: _dist(torch.zeros(8, 8), mesh1, "R") for k in sd}
    dcp.load(tgt, storage_reader=StorageReader(path))
    out["fail:retry"] = torch.equal(tgt["w"].full_tensor(), g * 2) and torch.equal(tgt["v"].full_tensor(), g * 3)
    try:
        dcp.load(tgt, storage_reader=_OverwrittenReader(path))
        out["overwrite:refused"] = False
    except BaseException as e:
        out["overwrite:refused"] = "opened another checkpoint than rank 0" in str(e)
    dist.barrier()
    dcp.load(tgt, storage_reader=StorageReader(path))  # one checkpoint again: loads whole
    out["overwrite:after"] = torch.equal(tgt["w"].full_tensor(), torch.full((8, 8), 7.0))
    # use_collectives=False: refused on every rank, saying why, nothing written.
    try:
        dcp.save(sd, storage_writer=StorageWriter(f"{root}/nocoll"), use_collectives=False)
        out["nocoll:refused"] = False
    except ValueError as e:
        out["nocoll:refused"] = "use_collectives=False" in str(e) and "shared Hugging Face shard files" in str(e)
    dist.barrier()
    out["nocoll:nothing"] = not os.path.exists(f"{root}/nocoll")
    # Per-rank extra state written by checkpoint.save (PerRank): each rank reads back its own.
    checkpoint.save({"w": sd["w"]}, f"{root}/perrank", extra_state={"pos": checkpoint.PerRank(100 + dist.get_rank()), "step": 9})
    tgt = {"w": _dist(torch.zeros(8, 8), mesh1, "R"), "pos": -1, "step": 0}
    dcp.load(tgt, storage_reader=StorageReader(f"{root}/perrank"))
    out["perrank:read"] = tgt["pos"] == 100 + dist.get_rank() and tgt["step"] == 9 and torch.equal(tgt["w"].full_tensor(), g)
    return out


def _ranks_worker(rank, world, root, s3_port):
    mesh1, mesh2 = _meshes(world)
    out = _placement_and_mesh_changes(root, world, mesh1, mesh2)
    every, written = _every_placement(root, world, mesh1, mesh2)
    out.update(every)
    out.update(_async(root, world, mesh1))
    out.update(_titan_export(root, mesh1))
    out.update(_train_state(root, mesh1))
    out.update(_torch_hf_output(root, world, mesh1, mesh2))
    if world > 1:
        out.update(_digests(root, world, mesh1))
        out.update(_hostile(root, world, mesh1))
    if s3_port is not None:
        from tests.s3_server import storage_options

        out.update(_remote("s3://bkt/dcp", storage_options(s3_port), mesh1))
    return {"ok": out, "written": written}


@pytest.fixture(scope="module")
def s3_port():
    from tests.s3_server import make_bucket, start_moto

    server, port = start_moto()
    make_bucket(port, "bkt")
    yield port
    server.stop()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks(tmp_path, world, request):
    port = request.getfixturevalue("s3_port") if world == 2 else None
    root = str(tmp_path)
    res = run_ranks(_ranks_worker, world, root, port, backend="gloo", timeout=300)
    for r in res:
        bad = sorted(k for k, v in r["ok"].items() if not v)
        assert not bad, bad
    names = set(res[0]["ok"])
    assert {f"1d:{a}->{b}" for a, b in ONE_D} <= names and {f"2d:{a}->{b}" for a, b in TWO_D} <= names
    assert {"empty-shards", "async:thread", "train:resume"} <= names and (world != 2 or {"async:process", "s3"} <= names)
    assert world == 1 or {"digest:R:once", "digest:S1:once", "digest:R:refused", "digest:S1:refused",
                          "digest:empty-rank:row:refused", "digest:empty-rank:big:refused"} <= names  # fmt: skip
    assert world == 1 or {"fail:raised", "fail:old-kept", "fail:no-staging", "fail:retry", "overwrite:refused",
                          "nocoll:refused", "perrank:read"} <= names  # fmt: skip
    assert world != 2 or "s3:group" in names
    # What StorageWriter wrote is an fqnckpt checkpoint: verifies, each byte written once (the
    # ranks' pwrites, headers included, add up to the files' sizes), safetensors reads it.
    every = f"{root}/every"
    assert checkpoint.verify(every).ok
    with checkpoint.open_checkpoint(every) as rd:
        files = rd.files
    assert len(files) > 1
    assert sum(r["written"] for r in res) == sum(os.path.getsize(os.path.join(every, f)) for f in files)
    for f in files:
        for k, v in load_file(os.path.join(every, f)).items():
            assert v.dtype in DTYPE_TO_ST, k
    # torchtitan's HF export loads with from_pretrained, file by file as the adapter mapped it.
    from transformers import LlamaForCausalLM

    from tests.test_checkpoint_interop import TOKENS, tiny_llama

    idx = json.loads(open(f"{root}/titan-hf/model.safetensors.index.json").read())
    assert {v for k, v in idx["weight_map"].items() if ".layers.1." in k} == {"model-00002-of-00002.safetensors"}
    back = LlamaForCausalLM.from_pretrained(f"{root}/titan-hf").eval()
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, tiny_llama(11, tie=False)(TOKENS).logits)
    shutil.rmtree(root, ignore_errors=True)


def test_dcp_per_rank_files_must_cover_each_tensor(tmp_path):
    """torch's save_distributed=True files: chunks placed by DCP_SHARDING_INFO; a rank's file
    missing leaves a hole, refused by name (DCP would load the target's old values there)."""
    g = torch.arange(24.0).view(6, 4)

    def shard(r):
        info = json.dumps({"a": {"saved_offsets": [2 * r, 0]}})
        save_file({"a": g[2 * r : 2 * r + 2].clone()}, str(tmp_path / f"shard-0000{r + 1}-model-00001-of-00001.safetensors"),
                  metadata={"DCP_SHARDING_INFO": info})  # fmt: skip

    for r in range(3):
        shard(r)
    target = {"a": torch.zeros(6, 4)}
    dcp.load(target, storage_reader=StorageReader(str(tmp_path)))
    assert torch.equal(target["a"], g)
    os.remove(tmp_path / "shard-00002-model-00001-of-00001.safetensors")
    with pytest.raises(BaseException, match="do not cover"):
        dcp.load({"a": torch.zeros(6, 4)}, storage_reader=StorageReader(str(tmp_path)))


def test_non_tensor_inside_a_list_beside_a_tensor_loads_back(tmp_path):
    # A list holding a tensor and a number: the tensor goes to the shard file, the number to
    # extra_state.json as [None, 3]; torch's flatten of that stops at the list, the caller's does not.
    path = str(tmp_path / "ck")
    dcp.save({"m": {"a": torch.ones(2), "l": [torch.arange(3.0), 3, {"k": "v"}]}, "step": 5},
             storage_writer=StorageWriter(path))  # fmt: skip
    target = {"m": {"a": torch.zeros(2), "l": [torch.zeros(3), 0, {"k": ""}]}, "step": 0}
    dcp.load(target, storage_reader=StorageReader(path))
    assert target["step"] == 5 and target["m"]["l"][1] == 3 and target["m"]["l"][2] == {"k": "v"}
    assert torch.equal(target["m"]["l"][0], torch.arange(3.0)) and torch.equal(target["m"]["a"], torch.ones(2))


def _flip_byte(path: str, key: str, at: int = 5) -> None:
    """Flip one bit of tensor ``key``'s stored bytes (its byte ``at``) in checkpoint ``path``."""
    with checkpoint.open_checkpoint(path) as rd:
        name, (begin, _) = rd.file_of(key), rd._spans[key]
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(begin + at)
        b = f.read(1)
        f.seek(begin + at)
        f.write(bytes([b[0] ^ 1]))


def test_flipped_byte_is_refused_by_both_load_paths(tmp_path):
    """A byte flipped in a shard file: dcp.load through StorageReader and checkpoint.load raise
    CorruptCheckpointError naming file and tensor (safetensors has no checksum; before, both
    loaded it silently). checkpoint.load then applies no extra state; with verify=True (files
    checked whole first, then not hashed again on read) nothing changes at all."""
    from checkpoint.errors import CorruptCheckpointError

    path = str(tmp_path / "ck")
    sd = {"a": torch.arange(64.0).view(8, 8), "b": torch.ones(5), "step": 3}
    dcp.save(sd, storage_writer=StorageWriter(path))
    _flip_byte(path, "a", 17)
    with pytest.raises(BaseException, match="CorruptCheckpointError.*model-00001-of-00001.safetensors: tensor 'a'") as e:
        dcp.load({"a": torch.zeros(8, 8), "b": torch.zeros(5), "step": 0}, storage_reader=StorageReader(path))
    assert "xxh3-128 digest" in str(e.value)
    target, extra = {"a": torch.zeros(8, 8), "b": torch.zeros(5)}, {"step": 0}
    with pytest.raises(CorruptCheckpointError, match="tensor 'a'") as e:
        checkpoint.load(target, path, extra_state=extra)
    assert e.value.key == "a" and e.value.file.endswith("model-00001-of-00001.safetensors")
    import pickle  # DCP hands a rank's error to every rank pickled: it must come back whole

    back = pickle.loads(pickle.dumps(e.value))
    assert type(back) is CorruptCheckpointError and (back.file, back.key, str(back)) == (e.value.file, "a", str(e.value))
    assert extra == {"step": 0}  # not applied
    # verify=True promises all or nothing: refused before any target changes.
    target = {"a": torch.full((8, 8), -1.0), "b": torch.full((5,), -1.0)}
    with pytest.raises(checkpoint.ChecksumMismatchError):
        checkpoint.load(target, path, verify=True, extra_state=extra)
    assert torch.equal(target["a"], torch.full((8, 8), -1.0)) and torch.equal(target["b"], torch.full((5,), -1.0))
    # A tensor read through a window (a column block of it spanning every row, same dtype or
    # converting) is checked too.
    with checkpoint.open_checkpoint(path) as rd:
        out = torch.zeros(8, 3)
        assert rd.copy_into("a", out, (slice(0, 8), slice(2, 5)))  # not asked to check
        assert torch.equal(out[1:], torch.arange(64.0).view(8, 8)[1:, 2:5])  # (the flipped byte is in row 0)
        for target in (torch.zeros(8, 3), torch.zeros(8, 3, dtype=torch.float64), torch.zeros(3, 8).t()):
            with pytest.raises(CorruptCheckpointError, match="tensor 'a'"):
                rd.copy_into("a", target, (slice(0, 8), slice(2, 5)), check=True)
        assert rd.copy_into("a", torch.zeros(7, 3), (slice(1, 8), slice(2, 5)), check=True)  # not every row
    # The untouched tensor still loads; `fqnckpt verify` names the damaged one.
    target = {"b": torch.zeros(5)}
    dcp.load(target, storage_reader=StorageReader(path), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(target["b"], torch.ones(5))
    assert not checkpoint.verify(path).ok


def test_save_inside_another_checkpoint_is_refused(tmp_path):
    from checkpoint.errors import NestedCheckpointError

    outer = tmp_path / "ck"
    dcp.save({"a": torch.ones(2)}, storage_writer=StorageWriter(str(outer)))
    before = sorted(os.listdir(outer))
    for inner in (outer / "sub", outer / "deeper" / "sub"):
        with pytest.raises(BaseException, match="NestedCheckpointError.*inside the checkpoint") as e:
            dcp.save({"b": torch.zeros(3)}, storage_writer=StorageWriter(str(inner)))
        assert str(outer) in str(e.value)
    assert sorted(os.listdir(outer)) == before  # nothing written inside it
    err = NestedCheckpointError(str(outer / "sub"), str(outer))
    assert str(err).startswith(f"refusing to save a checkpoint at {outer / 'sub'}: it is inside the checkpoint {outer}")
    dcp.save({"b": torch.zeros(3)}, storage_writer=StorageWriter(str(tmp_path / "beside")))  # beside it: fine


def test_reader_gives_checkpoint_save_optimizer_state(tmp_path):
    """checkpoint.save(model, optimizer=...) writes the optimizer part by FQN; a DCP user's
    get_optimizer_state_dict loads it through StorageReader (state tensors, step, param groups)
    and the next step matches the saved optimizer's."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))

    def make(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        o = torch.optim.AdamW(m.parameters(), lr=1e-2 * (seed + 1), betas=(0.8, 0.95 + seed / 100))
        m(x).sum().backward()
        o.step()
        o.zero_grad()
        return m, o

    (m, o), (m2, o2) = make(0), make(1)
    checkpoint.save(m, str(tmp_path / "ck"), optimizer=o)
    m2.load_state_dict(m.state_dict())
    osd = get_optimizer_state_dict(m2, o2)
    dcp.load(osd, storage_reader=StorageReader(str(tmp_path / "ck")))
    set_optimizer_state_dict(m2, o2, osd)
    ref = get_optimizer_state_dict(m, o)
    assert osd["param_groups"] == ref["param_groups"] and sorted(osd["state"]) == sorted(ref["state"])
    for fqn, d in ref["state"].items():
        assert sorted(osd["state"][fqn]) == sorted(d)
        assert all(torch.equal(torch.as_tensor(osd["state"][fqn][n]), torch.as_tensor(v)) for n, v in d.items())
    for model, opt in ((m, o), (m2, o2)):
        model(x).sum().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


def test_tied_tensors_written_once_with_save_planner(tmp_path):
    """One tensor under two keys (tied embeddings): DCP's planners write it under each key, as
    torch's writers do; SavePlanner writes it once and records the alias group, as
    checkpoint.save does. Both load back into every key, and from_pretrained reads the result."""
    from transformers import LlamaForCausalLM

    from tests.test_checkpoint_interop import TOKENS, tiny_llama

    model = tiny_llama(6, tie=True)
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
    once, twice = str(tmp_path / "once"), str(tmp_path / "twice")
    dcp.save(sd, storage_writer=StorageWriter(once), planner=SavePlanner())
    dcp.save(sd, storage_writer=StorageWriter(twice))
    idx = json.loads(open(f"{once}/model.safetensors.index.json").read())
    assert "lm_head.weight" not in idx["weight_map"] and "model.embed_tokens.weight" in idx["weight_map"]
    assert idx["metadata"]["fqnckpt"]["alias_groups"] == [["model.embed_tokens.weight", "lm_head.weight"]]
    size = sd["lm_head.weight"].nbytes
    twice_idx = json.loads(open(f"{twice}/model.safetensors.index.json").read())
    assert twice_idx["metadata"]["total_size"] - idx["metadata"]["total_size"] == size
    assert checkpoint.verify(once).ok
    for path in (once, twice):
        back = tiny_llama(7, tie=True)
        target = back.state_dict()
        dcp.load(target, storage_reader=StorageReader(path))
        back.load_state_dict(target)
        with torch.no_grad():
            assert torch.equal(back(TOKENS).logits, model(TOKENS).logits)
    model.config.save_pretrained(once)
    with torch.no_grad():
        assert torch.equal(LlamaForCausalLM.from_pretrained(once).eval()(TOKENS).logits, model(TOKENS).logits)