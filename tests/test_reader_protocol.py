"""Every reader kind satisfies the one reading interface (checkpoint.sources.protocol.TensorReader)
and reads the same bytes for the same tensor: one tiny checkpoint per format (fqnckpt, plain
Hugging Face safetensors as a file and as indexed shards, peft's adapter file, DCP, zip and legacy
pickles, Meta's model-parallel shards through a conversion, FP8 weights dequantized while read,
object storage), opened by every
opener that gives a reader of it (load's and migrate's)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import save_file

import checkpoint
from checkpoint.loading import open_load_reader
from checkpoint.sources import open_source
from checkpoint.sources.protocol import TensorReader

W = (torch.arange(24, dtype=torch.float32).reshape(4, 6) - 5) / 7  # the tensor every format holds
B = (torch.arange(10) - 3).to(torch.bfloat16)
MEMBERS = ("keys", "spec", "file_of", "check_first", "get", "get_slice", "read_into", "close")


def _fqnckpt(tmp_path):
    checkpoint.save({"w": W, "b": B}, tmp_path / "c")
    return [("CheckpointReader", lambda: checkpoint.open_checkpoint(tmp_path / "c"), "w", True),
            ("load", lambda: open_load_reader(str(tmp_path / "c")), "w", True),
            ("Source over CheckpointReader", lambda: open_source(tmp_path / "c"), "w", True)]  # fmt: skip


def _hf_file(tmp_path):
    save_file({"w": W, "b": B}, str(tmp_path / "model.safetensors"))
    return [("Source", lambda: open_source(tmp_path / "model.safetensors"), "w", True),
            ("load", lambda: open_load_reader(str(tmp_path / "model.safetensors")), "w", True)]  # fmt: skip


def _hf_shards(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    save_file({"b": B}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"w": W}, str(d / "model-00002-of-00002.safetensors"))
    wm = {"b": "model-00001-of-00002.safetensors", "w": "model-00002-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 116}, "weight_map": wm}))
    return [("Source", lambda: open_source(d), "w", True), ("load", lambda: open_load_reader(str(d)), "w", True)]


def _peft_adapter(tmp_path):
    from checkpoint.peft_state import open_adapter_reader

    key = "base_model.model.proj.lora_A.weight"
    save_file({key: W}, str(tmp_path / "adapter_model.safetensors"))
    return [("adapter", lambda: open_adapter_reader(str(tmp_path)), key, True),
            ("Source", lambda: open_source(tmp_path / "adapter_model.safetensors"), key, True)]  # fmt: skip


def _dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": W, "b": B}}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    return [("DCPSource", lambda: open_source(tmp_path / "dcp"), "w", False),
            ("load", lambda: open_load_reader(str(tmp_path / "dcp")), "w", False)]  # fmt: skip


def _pickles(tmp_path):
    torch.save({"w": W, "b": B}, tmp_path / "m.pt")
    torch.save({"w": W, "b": B}, tmp_path / "m.bin", _use_new_zipfile_serialization=False)
    return [("zip", lambda: open_source(tmp_path / "m.pt"), "w", False),
            ("legacy", lambda: open_source(tmp_path / "m.bin"), "w", False),
            ("load", lambda: open_load_reader(str(tmp_path / "m.pt")), "w", False)]  # fmt: skip


def _meta_shards(tmp_path):
    from checkpoint.convert import open_conversion
    from checkpoint.convert.reader import ConvertedReader

    h, heads, ff, vocab = 4, 2, 6, 4  # down_proj (h x ff) is W, split on dim 1 as Meta's w2 is
    g = torch.Generator().manual_seed(0)
    sd = {"tok_embeddings.weight": torch.randn(vocab, h, generator=g), "norm.weight": torch.randn(h, generator=g),
          "output.weight": torch.randn(vocab, h, generator=g), "layers.0.feed_forward.w2.weight": W}
    for n, shape in (("attention.wq", (h, h)), ("attention.wk", (h, h)), ("attention.wv", (h, h)), ("attention.wo", (h, h)),
                     ("feed_forward.w1", (ff, h)), ("feed_forward.w3", (ff, h))):
        sd[f"layers.0.{n}.weight"] = torch.randn(*shape, generator=g)
    sd |= {"layers.0.attention_norm.weight": torch.randn(h, generator=g), "layers.0.ffn_norm.weight": torch.randn(h, generator=g)}
    d = tmp_path / "meta"
    d.mkdir()
    dim1 = ("attention.wo.weight", "feed_forward.w2.weight", "tok_embeddings.weight")
    for i in range(2):
        part = {k: v.clone() if v.dim() == 1 else v.chunk(2, 1 if k.endswith(dim1) else 0)[i].clone() for k, v in sd.items()}
        torch.save(part, d / f"consolidated.{i:02d}.pth")
    (d / "params.json").write_text(json.dumps({"dim": h, "n_layers": 1, "n_heads": heads, "n_kv_heads": heads,
                                               "vocab_size": vocab, "norm_eps": 1e-5, "rope_theta": 10000.0}))  # fmt: skip
    key = "model.layers.0.mlp.down_proj.weight"
    return [("ConvertedReader", lambda: ConvertedReader(open_conversion(d, "meta-llama-to-hf")), key, False)]


def _fp8_dequantized(tmp_path):
    from checkpoint.convert.dequant import dequantized_view

    q = (torch.arange(16.0).reshape(4, 4) / 4).to(torch.float8_e4m3fn)
    save_file({"w": W, "q.weight": q, "q.weight_scale_inv": torch.full((1, 1), 2.0)}, str(tmp_path / "model.safetensors"))
    return [("DequantizingReader", lambda: dequantized_view(checkpoint.open_checkpoint(tmp_path)), "w", True)]


def _object_storage(tmp_path):
    pytest.importorskip("fsspec")
    url = f"memory://reader-protocol/{tmp_path.name}"
    checkpoint.save({"w": W, "b": B}, url)
    return [("RemoteCheckpointReader", lambda: checkpoint.open_checkpoint(url), "w", None),
            ("Source", lambda: open_source(url), "w", None)]  # fmt: skip


FORMATS = {"fqnckpt": _fqnckpt, "hf-file": _hf_file, "hf-shards": _hf_shards, "peft-adapter": _peft_adapter,
           "dcp": _dcp, "pickle": _pickles, "meta-shards-converted": _meta_shards, "fp8-dequantized": _fp8_dequantized,
           "object-storage": _object_storage}  # fmt: skip


def _same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(
        got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_reader_satisfies_the_protocol_and_reads_the_same_bytes(tmp_path, fmt):
    want = W
    for kind, opener, key, reads_into in FORMATS[fmt](tmp_path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's single-process notice
            r = opener()
        try:
            assert isinstance(r, TensorReader), (fmt, kind, type(r))
            assert all(callable(getattr(type(r), m, None)) for m in MEMBERS), (fmt, kind)
            assert key in r.keys() and len(set(r.keys())) == len(r.keys())
            spec = r.spec(key)
            assert (tuple(spec.shape), spec.dtype) == (tuple(want.shape), want.dtype), (fmt, kind)
            assert isinstance(r.file_of(key), str) and r.file_of(key)
            assert r.check_first([key], {}) == {}, (fmt, kind)  # the check before any target is written
            assert _same_bytes(r.get(key), want), (fmt, kind)
            assert _same_bytes(r.get_slice(key, (slice(1, 3),)), want[1:3]), (fmt, kind)
            assert _same_bytes(r.get_slice(key, (slice(0, 4), slice(2, 5))), want[:, 2:5]), (fmt, kind)
            out = torch.full_like(want, -1.0)
            done = r.read_into(key, out)
            assert done is True or done is False
            assert _same_bytes(out, want if done else torch.full_like(want, -1.0)), (fmt, kind)
            if reads_into is not None:
                assert done is reads_into, (fmt, kind)  # safetensors: straight into the target
            with pytest.raises(KeyError):
                r.spec("no.such.tensor")
        finally:
            r.close()


def test_headers_only_source_is_a_reader_that_refuses_data(tmp_path):
    from checkpoint.sources.st_headers import open_safetensors_headers

    save_file({"w": W}, str(tmp_path / "m.safetensors"))
    src = open_safetensors_headers(tmp_path / "m.safetensors")
    assert isinstance(src, TensorReader)
    assert (src.keys(), tuple(src.spec("w").shape), str(src.spec("w").dtype)) == (["w"], (4, 6), "torch.float32")
    with pytest.raises(TypeError, match="headers only"):
        src.get("w")
    with pytest.raises(TypeError, match="headers only"):
        src.read_into("w", torch.empty(4, 6))
    src.close()


def test_an_object_without_read_into_is_no_reader():
    class Partial:
        def keys(self):
            return []

        def spec(self, key):
            raise KeyError(key)

    assert not isinstance(Partial(), TensorReader)


def test_safetensors_sources_keep_every_check(tmp_path):
    """Plain safetensors sources read through the one safetensors reader keep every check: each
    tensor in exactly one file without an index; with an fqnckpt index, the tensor digests on
    reads and before any target is written, the header digests and ``total_size`` on open."""
    import struct

    from checkpoint.errors import CorruptCheckpointError, DuplicateTensorError

    d = tmp_path / "noindex"
    d.mkdir()
    save_file({"a": W}, str(d / "x.safetensors"))
    save_file({"b": B, "a": W}, str(d / "y.safetensors"))
    with pytest.raises(DuplicateTensorError) as e:
        open_source(d)
    assert (e.value.key, e.value.files) == ("a", ["x.safetensors", "y.safetensors"])
    (d / "x.safetensors").unlink()
    raw = (d / "y.safetensors").read_bytes()
    order = [k for k in json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]]) if k != "__metadata__"]
    with open_source(d) as src:  # every tensor of the headers, in header order
        assert sorted(order) == ["a", "b"]
        assert (src.keys(), src.file_of("a"), src.format) == (order, "y.safetensors", "safetensors-sharded")
        assert _same_bytes(src.get("a"), W)

    c = tmp_path / "c"
    checkpoint.save({"w": W, "b": B}, c)
    shard = next(c.glob("*.safetensors"))
    whole = shard.read_bytes()
    (n,) = struct.unpack("<Q", whole[:8])
    begin = 8 + n + json.loads(whole[8 : 8 + n])["w"]["data_offsets"][0]
    flipped = bytearray(whole)
    flipped[begin + 5] ^= 0x10
    shard.write_bytes(bytes(flipped))
    for read in (lambda s: s.get("w"), lambda s: s.check_first(["w"]), lambda s: s.read_into("w", torch.empty(4, 6))):
        with open_source(c) as src, pytest.raises(CorruptCheckpointError, match="'w'"):
            read(src)
    head = whole[8 : 8 + n].replace(b'"F32"', b'"I32"', 1)  # same byte sizes: only the digest tells
    shard.write_bytes(whole[:8] + head + whole[8 + n :])
    with pytest.raises(CorruptCheckpointError, match="header bytes differ"):
        open_source(c)
    shard.write_bytes(whole)
    index = c / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["metadata"]["total_size"] += 4
    index.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="total_size"):
        open_source(c)
