"""Quantized checkpoints as users have them: DeepSeek-V3-style FP8 weights with a
``weight_scale_inv`` per 128x128 block, and gpt-oss-style MXFP4 ``*_blocks`` / ``*_scales``.

``checkpoint.load`` into floating-point targets of another dtype dequantizes them, strictly (the
scales are part of their weight), on every placement, checked against outside oracles: torch's
``QuantizedHuggingFaceStorageReader`` on the same files (bit-identical), DeepSeek's
dequantization formula (``weight_dequant``: each block times its scale), and transformers'
MXFP4 ``convert_moe_packed_tensors``. An FP8 target keeps the stored bytes and scales.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

import checkpoint
from checkpoint.convert.quant import fp8_quantize
from checkpoint.errors import CheckpointMismatchError, QuantizationError
from checkpoint.ranks.launch import run_ranks
from snapshot import Snapshot

# Uneven shapes: edge blocks short in rows, columns or both; one weight under one block.
FP8_SHAPES = {"layers.0.q.weight": (300, 200), "layers.0.o.weight": (129, 257), "layers.1.q.weight": (128, 256), "head.weight": (5, 7)}
MX_SHAPE = (3, 10, 4, 16)  # [experts, rows, groups, bytes]: 4 groups of 32 FP4 values


def _fp8_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """FP8 weights with float32 scales (DeepSeek's amax / 448 quantizer), plus plain tensors."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for k, shape in FP8_SHAPES.items():
        w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 4
        q, s = fp8_quantize(w)
        sd[k], sd[k + "_scale_inv"] = q, s
    sd["layers.0.norm.weight"] = torch.randn(200, generator=g)
    sd["embed.weight"] = torch.randn(11, 200, generator=g).to(torch.bfloat16)
    return sd


def _write_hf(path, sd: dict[str, torch.Tensor], config: dict | None, files: int = 2) -> None:
    """A Hugging Face sharded checkpoint: ``files`` shards by key order, index, config.json."""
    path.mkdir(parents=True, exist_ok=True)
    keys = sorted(sd)
    names = [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    weight_map = {}
    for i, name in enumerate(names):
        part = {k: sd[k].contiguous() for k in keys[i::files]}
        save_file(part, str(path / name))
        weight_map.update(dict.fromkeys(part, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))


FP8_CONFIG = {"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}


def _torch_reader(path, keys_shapes: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What torch's QuantizedHuggingFaceStorageReader loads into fresh ``dtype`` tensors."""
    out = {k: torch.zeros(s, dtype=dtype) for k, s in keys_shapes.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.load(out, storage_reader=QuantizedHuggingFaceStorageReader(str(path), target_dtype=dtype), no_dist=True)
    return out


def _deepseek(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """DeepSeek-V3's ``weight_dequant`` (inference/kernel.py) written out: every ``block``
    square of ``q`` (edges short) times its scale, in float32."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = q[rows, cols].to(torch.float32) * s[i, j]
    return out


def _targets(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    sd = _fp8_state()
    return {k: torch.zeros(v.shape, dtype=dtype) for k, v in sd.items() if not k.endswith("_scale_inv")}


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / "deepseek"
    _write_hf(path, _fp8_state(), FP8_CONFIG)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_loads_strictly_bit_identical_to_torch_quantized_reader(fp8_dir, dtype):
    sd = _fp8_state()
    targets = _targets(dtype)
    rep = checkpoint.load(targets, fp8_dir)  # strict: the scales are no unexpected keys
    assert rep.unexpected_keys == [] and rep.missing_keys == []
    assert rep.loaded_keys == sorted(targets)
    assert rep.dequantized == {k: f"fp8 128x128 blocks, scales {k}_scale_inv" for k in FP8_SHAPES}
    ref = _torch_reader(fp8_dir, FP8_SHAPES, dtype)
    for k in FP8_SHAPES:
        assert torch.equal(targets[k], ref[k]), k
        assert torch.equal(targets[k], _deepseek(sd[k], sd[k + "_scale_inv"]).to(dtype)), k
    assert torch.equal(targets["layers.0.norm.weight"], sd["layers.0.norm.weight"].to(dtype))
    assert torch.equal(targets["embed.weight"], sd["embed.weight"].to(dtype))


def test_fp8_into_module_and_load_dtype(fp8_dir):
    """An nn.Module (its names resolved as always) and ``load(dtype=)``: dequantized into the
    dtype the module's parameters take."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(200, 300, bias=False)
            self.o = torch.nn.Linear(257, 129, bias=False)
            self.norm = torch.nn.LayerNorm(200, bias=False)

    class Last(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(256, 128, bias=False)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(11, 200)
            self.layers = torch.nn.ModuleList([Block(), Last()])
            self.head = torch.nn.Linear(7, 5, bias=False)

    m = Model()
    rep = checkpoint.load(m, fp8_dir, dtype=torch.bfloat16)
    assert sorted(rep.dequantized) == sorted(FP8_SHAPES) and rep.ok
    ref = _torch_reader(fp8_dir, FP8_SHAPES, torch.bfloat16)
    got = m.state_dict()
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], ref[k]) for k in FP8_SHAPES)


def test_fp8_target_receives_stored_bytes_and_scales(fp8_dir):
    sd = _fp8_state()
    targets = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
    rep = checkpoint.load(targets, fp8_dir)
    assert rep.dequantized == {} and rep.dtype_converted == [] and rep.loaded_keys == sorted(sd)
    for k, v in sd.items():
        assert torch.equal(targets[k].view(torch.uint8) if v.element_size() == 1 else targets[k], v.view(torch.uint8) if v.element_size() == 1 else v), k


def test_fp8_float16_target_overflow_is_checked_on_dequantized_values(tmp_path):
    """A scale pushing values past float16's range is refused as any float32 -> float16 overflow."""
    q, s = fp8_quantize(torch.full((4, 4), 448.0))
    s = s * 1024  # 448 * 1024 > 65504
    _write_hf(tmp_path / "ck", {"w": q, "w_scale_inv": s}, None, files=1)
    t = {"w": torch.zeros(4, 4, dtype=torch.float16)}
    snap = Snapshot(t)
    with pytest.raises(checkpoint.LossyConversionError, match="'w'"):
        checkpoint.load(t, tmp_path / "ck")
    snap.assert_unchanged()


def test_scale_grid_not_covering_weight_refused_by_name(tmp_path):
    sd = _fp8_state()
    sd["layers.0.o.weight_scale_inv"] = sd["layers.0.o.weight_scale_inv"][:, :2]  # (2, 2) for (129, 257)
    _write_hf(tmp_path / "ck", sd, FP8_CONFIG)
    t = _targets(torch.bfloat16)
    snap = Snapshot(t)
    with pytest.raises(QuantizationError, match=r"layers\.0\.o\.weight_scale_inv.*scale grid \(2, 2\) does not cover.*expected \(2, 3\)") as e:
        checkpoint.load(t, tmp_path / "ck")
    assert e.value.key == "layers.0.o.weight_scale_inv" and e.value.file.endswith(".safetensors")
    snap.assert_unchanged()


def test_config_disagreeing_with_tensors_refused_by_name(tmp_path):
    sd = _fp8_state()
    t = _targets(torch.bfloat16)
    snap = Snapshot(t)
    # Blocks of 64: every grid of 128-blocks is too small for it.
    _write_hf(tmp_path / "b64", sd, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}})
    with pytest.raises(QuantizationError, match=r"does not cover .* in 64x64 blocks"):
        checkpoint.load(t, tmp_path / "b64")
    # fp8 said, but no scaled float8 weight stored.
    plain = {k: v for k, v in sd.items() if not k.endswith("_scale_inv")}
    _write_hf(tmp_path / "none", {k: v.float() for k, v in plain.items()}, FP8_CONFIG)
    with pytest.raises(QuantizationError, match="quant_method fp8, but no float8 weight"):
        checkpoint.load(t, tmp_path / "none")
    # A float8 weight without its scales under an fp8 config.
    _write_hf(tmp_path / "lost", {k: v for k, v in sd.items() if k != "head.weight_scale_inv"}, FP8_CONFIG)
    with pytest.raises(QuantizationError, match=r"'head\.weight'.*no 'head\.weight_scale_inv'"):
        checkpoint.load(t, tmp_path / "lost")
    # A block size that is no block size.
    _write_hf(tmp_path / "bad", sd, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [0, 128]}})
    with pytest.raises(QuantizationError, match=r"config\.json.*quantization_config\.weight_block_size"):
        checkpoint.load(t, tmp_path / "bad")
    snap.assert_unchanged()


def test_fp8_without_config_uses_torch_default_block(tmp_path):
    """No config.json (a bare safetensors directory): 128x128 blocks, as torch's reader assumes."""
    sd = _fp8_state()
    _write_hf(tmp_path / "ck", sd, None, files=1)
    t = _targets(torch.float32)
    assert sorted(checkpoint.load(t, tmp_path / "ck").dequantized) == sorted(FP8_SHAPES)
    ref = _torch_reader(tmp_path / "ck", FP8_SHAPES, torch.float32)
    assert all(torch.equal(t[k], ref[k]) for k in FP8_SHAPES)


def test_non_strict_fp8_never_fills_raw_values(fp8_dir):
    """A target without some of the weights: the others still dequantize; the absent ones and
    their scales are reported unexpected, none filled with raw FP8 values."""
    t = _targets(torch.bfloat16)
    del t["head.weight"]
    rep = checkpoint.load(t, fp8_dir, strict=False)
    assert rep.unexpected_keys == ["head.weight", "head.weight_scale_inv"]
    ref = _torch_reader(fp8_dir, FP8_SHAPES, torch.bfloat16)
    assert all(torch.equal(t[k], ref[k]) for k in FP8_SHAPES if k != "head.weight")


# -- MXFP4 -----------------------------------------------------------------------------------

def _mx_state(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, MX_SHAPE, dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, MX_SHAPE[:-1], dtype=torch.uint8, generator=g)
    return {
        "model.layers.0.mlp.experts.gate_up_proj_blocks": blocks,
        "model.layers.0.mlp.experts.gate_up_proj_scales": scales,
        "model.layers.0.mlp.experts.gate_up_proj_bias": torch.randn(3, 10, generator=g).to(torch.bfloat16),
    }


MX = "model.layers.0.mlp.experts.gate_up_proj"
MX_CONFIG = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}}


@pytest.fixture(scope="module")
def mx_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mx") / "gpt-oss"
    _write_hf(path, _mx_state(), MX_CONFIG)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_torch_layout_bit_identical_to_references(mx_dir, dtype):
    """Under the name ``X_blocks``, ``[*prefix, G * 2 B]`` (torch's reader's layout): the values
    of transformers' ``convert_moe_packed_tensors`` (untransposed). torch's reader itself fills
    only the first G values of each row in torch 2.13 (its metadata corrects the tensor's size
    but not its chunk's, so the read request is G long): it agrees with us there."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    sd = _mx_state()
    g, n = MX_SHAPE[2], MX_SHAPE[2] * MX_SHAPE[3] * 2
    t = {MX + "_blocks": torch.zeros(3, 10, n, dtype=dtype), MX + "_bias": torch.zeros(3, 10, dtype=dtype)}
    rep = checkpoint.load(t, mx_dir)
    assert rep.ok and rep.dequantized == {MX + "_blocks": f"mxfp4 {MX}_blocks with scales {MX}_scales, torch's layout"}
    want = convert_moe_packed_tensors(sd[MX + "_blocks"], sd[MX + "_scales"], dtype=dtype).transpose(1, 2)
    assert torch.equal(t[MX + "_blocks"], want)
    ref = _torch_reader(mx_dir, {MX + "_blocks": (3, 10, n)}, dtype)[MX + "_blocks"]
    assert torch.equal(ref[..., :g], want[..., :g]) and (torch.equal(ref, want) or not ref[..., g:].any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_transformers_layout_bit_identical_to_transformers(mx_dir, dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    sd = _mx_state()
    n = MX_SHAPE[2] * MX_SHAPE[3] * 2
    t = {MX: torch.zeros(3, n, 10, dtype=dtype), MX + "_bias": torch.zeros(3, 10, dtype=dtype)}
    rep = checkpoint.load(t, mx_dir)
    assert rep.ok and list(rep.dequantized) == [MX]
    want = convert_moe_packed_tensors(sd[MX + "_blocks"], sd[MX + "_scales"], dtype=dtype)
    assert want.shape == (3, n, 10) and torch.equal(t[MX], want)


def test_mxfp4_uint8_targets_receive_stored_bytes(mx_dir):
    sd = _mx_state()
    t = {k: torch.zeros_like(v) for k, v in sd.items()}
    rep = checkpoint.load(t, mx_dir)
    assert rep.dequantized == {} and all(torch.equal(t[k], v) for k, v in sd.items())


def test_mxfp4_scales_not_matching_blocks_refused(tmp_path):
    sd = _mx_state()
    sd[MX + "_scales"] = sd[MX + "_scales"][:, :, :3]
    _write_hf(tmp_path / "ck", sd, MX_CONFIG, files=1)
    t = {MX: torch.zeros(3, 128, 10), MX + "_bias": torch.zeros(3, 10)}
    snap = Snapshot(t)
    with pytest.raises(QuantizationError, match=r"gate_up_proj_scales.*\(3, 10, 3\) do not cover blocks"):
        checkpoint.load(t, tmp_path / "ck")
    snap.assert_unchanged()


def test_strict_load_still_names_a_weight_the_target_lacks(fp8_dir):
    """A target lacking a weight still fails strictly, naming it and its scales."""
    t = _targets(torch.bfloat16)
    del t["layers.1.q.weight"]
    with pytest.raises(CheckpointMismatchError, match=r"layers\.1\.q\.weight"):
        checkpoint.load(t, fp8_dir)


# -- ranks -----------------------------------------------------------------------------------

def _rank_load(rank, world, fp8_path, mx_path):
    """Every rank loads DTensor targets (rows, then columns sharded) in float32 and bfloat16, by
    ``checkpoint.load`` and by ``dcp.load`` through our StorageReader, and returns the full
    tensors, the report and the bytes ``checkpoint.load`` read."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from checkpoint.dcp import StorageReader
    from checkpoint.storage.writer import stats

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for dim in (0, 1):
            t = {k: distribute_tensor(torch.zeros(s, dtype=dtype), mesh, [Shard(dim)]) for k, s in FP8_SHAPES.items()}
            t[MX] = distribute_tensor(torch.zeros(3, 128, 10, dtype=dtype), mesh, [Shard(dim + 1)])
            before = stats.bytes_read
            rep = checkpoint.load({k: v for k, v in t.items() if k != MX}, fp8_path, strict=False)
            read = stats.bytes_read - before
            rep_mx = checkpoint.load({MX: t[MX]}, mx_path, strict=False)
            via_dcp = {k: distribute_tensor(torch.zeros(s, dtype=dtype), mesh, [Shard(dim)]) for k, s in FP8_SHAPES.items()}
            dcp.load(via_dcp, storage_reader=StorageReader(fp8_path))
            out[(str(dtype), dim)] = (
                {k: v.full_tensor() for k, v in t.items()}, sorted(rep.dequantized), list(rep_mx.dequantized), read,
                {k: v.full_tensor() for k, v in via_dcp.items()},
            )  # fmt: skip
    return out


def _fp8_bytes_for(rank: int, world: int, dim: int, bf16: bool = False) -> int:
    """Bytes a rank reads for its Shard(dim) blocks of the FP8 weights: its FP8 rows / columns
    and the scale rows / columns covering them (float32), nothing else; ``bf16``: and each whole
    scale grid once more, the bound of the float32 -> bfloat16 range check (1/4096 of the FP8
    bytes)."""
    total = 0
    for shape in FP8_SHAPES.values():
        if bf16:
            total += -(-shape[0] // 128) * -(-shape[1] // 128) * 4
        n = shape[dim]
        size = -(-n // world)
        a, b = min(rank * size, n), min((rank + 1) * size, n)
        if a == b:
            continue
        other = shape[1 - dim]
        scales_here = -(-b // 128) - a // 128
        scales_other = -(-other // 128)
        total += (b - a) * other + scales_here * scales_other * 4
    return total


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_dequantize_only_their_blocks(fp8_dir, mx_dir, world):
    res = run_ranks(_rank_load, world, str(fp8_dir), str(mx_dir), backend="gloo", timeout=240)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    mx = _mx_state()
    for dtype in (torch.float32, torch.bfloat16):
        ref = _torch_reader(fp8_dir, FP8_SHAPES, dtype)
        ref_mx = convert_moe_packed_tensors(mx[MX + "_blocks"], mx[MX + "_scales"], dtype=dtype)
        for rank, r in enumerate(res):
            for dim in (0, 1):
                full, deq, deq_mx, read, via_dcp = r[(str(dtype), dim)]
                assert all(torch.equal(via_dcp[k], ref[k]) for k in FP8_SHAPES), (world, rank, dtype, dim)
                assert deq == sorted(FP8_SHAPES) and deq_mx == [MX]
                assert all(torch.equal(full[k], ref[k]) for k in FP8_SHAPES), (world, rank, dtype, dim)
                assert torch.equal(full[MX], ref_mx), (world, rank, dtype, dim)
                assert read == _fp8_bytes_for(rank, world, dim, dtype == torch.bfloat16), (world, rank, dim, read)


# -- DCP -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dcp_storage_reader_matches_torch_quantized_reader(fp8_dir, mx_dir, dtype):
    """checkpoint.dcp.StorageReader describes and reads the quantized weights as torch's
    QuantizedHuggingFaceStorageReader does: the same values bit for bit (MXFP4: transformers')."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from checkpoint.dcp import StorageReader

    sd = _fp8_state()
    got = {k: torch.zeros(s, dtype=dtype) for k, s in FP8_SHAPES.items()}
    got["layers.0.norm.weight"] = torch.zeros(200, dtype=dtype)
    got["head.weight_scale_inv"] = torch.zeros(1, 1)  # the scales are still keys: loaded as stored
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, storage_reader=StorageReader(fp8_dir), no_dist=True)
    ref = _torch_reader(fp8_dir, FP8_SHAPES, dtype)
    assert all(torch.equal(got[k], ref[k]) for k in FP8_SHAPES)
    assert torch.equal(got["head.weight_scale_inv"], sd["head.weight_scale_inv"])
    assert torch.equal(got["layers.0.norm.weight"], sd["layers.0.norm.weight"].to(dtype))
    raw = {k: torch.zeros(s, dtype=torch.float8_e4m3fn) for k, s in FP8_SHAPES.items()}  # FP8 targets: stored bytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(raw, storage_reader=StorageReader(fp8_dir), no_dist=True)
    assert all(torch.equal(raw[k].view(torch.uint8), sd[k].view(torch.uint8)) for k in FP8_SHAPES)
    mx = _mx_state()
    n = MX_SHAPE[2] * MX_SHAPE[3] * 2
    t = {MX + "_blocks": torch.zeros(3, 10, n, dtype=dtype)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(t, storage_reader=StorageReader(mx_dir), no_dist=True)
    want = convert_moe_packed_tensors(mx[MX + "_blocks"], mx[MX + "_scales"], dtype=dtype).transpose(1, 2)
    assert torch.equal(t[MX + "_blocks"], want)


# -- migrate ---------------------------------------------------------------------------------

def test_migrate_dequantize_matches_torch_reader_and_drops_quantization_config(fp8_dir, mx_dir, tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from checkpoint.convert.quant_recipes import REPORT_NAME

    sd = _fp8_state()
    for recipe, dtype in (("dequantize-bf16", torch.bfloat16), ("dequantize-fp32", torch.float32)):
        out = tmp_path / recipe
        rep = checkpoint.migrate(fp8_dir, out, recipe=recipe)
        assert rep.written and rep.dequantized == sorted(FP8_SHAPES)
        assert rep.kept == ["embed.weight", "layers.0.norm.weight"]
        cfg = json.loads((out / "config.json").read_text())
        assert cfg == {"model_type": "deepseek_v3"}  # no quantization_config
        assert json.loads((out / REPORT_NAME).read_text())["dequantized"] == sorted(FP8_SHAPES)
        ref = _torch_reader(fp8_dir, FP8_SHAPES, dtype)
        with checkpoint.open_checkpoint(out) as rd:
            assert rd.keys() == sorted(rep.dequantized + rep.kept)
            assert all(rd.spec(k).dtype == dtype and torch.equal(rd.get(k), ref[k]) for k in FP8_SHAPES)
            assert all(torch.equal(rd.get(k), sd[k]) for k in rep.kept)  # as stored
        assert checkpoint.verify(out).ok
    mx = _mx_state()
    rep = checkpoint.migrate(mx_dir, tmp_path / "mx", recipe="dequantize-bf16")
    assert rep.dequantized == [MX] and rep.kept == [MX + "_bias"]
    with checkpoint.open_checkpoint(tmp_path / "mx") as rd:  # transformers' gpt-oss name and layout
        want = convert_moe_packed_tensors(mx[MX + "_blocks"], mx[MX + "_scales"], dtype=torch.bfloat16)
        assert torch.equal(rd.get(MX), want)


def test_migrate_quantize_fp8_loads_in_transformers_and_round_trips(tmp_path):
    """bf16 -> FP8 128x128 blocks (DeepSeek's amax / 448 scales): transformers loads it
    (dequantizing on CPU) to the values checkpoint.load gives, and the round trip is within FP8's
    rounding (e4m3: 3 mantissa bits, a relative error of at most 2**-4 of each block's values
    in the normal range); dequantize-bf16 gives those values back as a plain checkpoint."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from checkpoint.convert.quant import fp8_dequantize

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=384, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    m.save_pretrained(tmp_path / "bf16")
    rep = checkpoint.migrate(tmp_path / "bf16", tmp_path / "fp8", recipe="quantize-fp8")
    layer = "model.layers.0."
    assert rep.quantized == sorted(layer + n + ".weight" for n in ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj",
        "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"))  # fmt: skip
    assert rep.kept == sorted(["lm_head.weight", layer + "input_layernorm.weight", layer + "post_attention_layernorm.weight",
                               "model.embed_tokens.weight", "model.norm.weight"])  # fmt: skip
    q_cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert q_cfg["quant_method"] == "fp8" and q_cfg["weight_block_size"] == [128, 128]
    orig = m.state_dict()
    with checkpoint.open_checkpoint(tmp_path / "fp8") as rd:
        for k in rep.quantized:
            q, s = rd.get(k), rd.get(k + "_scale_inv")
            assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
            w = orig[k].float()
            amax = w.abs().max()
            back = fp8_dequantize(q, s, (128, 128))
            normal = w.abs() >= s.max() * 2.0**-6  # e4m3's normal range in every block
            assert ((back - w).abs() <= w.abs() * 2.0**-4)[normal].all() and ((back - w).abs() <= amax * 2.0**-10 + 1e-30)[~normal].all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, info = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours = LlamaForCausalLM(cfg).to(torch.bfloat16)
    report = checkpoint.load(ours, tmp_path / "fp8")
    assert sorted(report.dequantized) == rep.quantized
    a, b = theirs.state_dict(), ours.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(b[k], orig[k]) for k in rep.kept)
    checkpoint.migrate(tmp_path / "fp8", tmp_path / "back", recipe="dequantize-bf16")
    again = LlamaForCausalLM(cfg).to(torch.bfloat16)
    assert checkpoint.load(again, tmp_path / "back").dequantized == {}
    assert all(torch.equal(again.state_dict()[k], b[k]) for k in b)
    with pytest.raises(ValueError, match="holds quantized weights already"):
        checkpoint.migrate(tmp_path / "fp8", tmp_path / "twice", recipe="quantize-fp8")
    assert not (tmp_path / "twice").exists()


def test_cli_migrate_quantization_recipes(fp8_dir, tmp_path, capsys):
    from checkpoint.cli.main import main

    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in ("dequantize-bf16", "dequantize-fp32", "quantize-fp8"))
    assert main(["migrate", str(fp8_dir), str(tmp_path / "bf16"), "--recipe", "dequantize-bf16"]) == 0
    out = capsys.readouterr().out
    assert f"{len(FP8_SHAPES)} weights dequantized to bfloat16" in out and "2 keys copied unchanged" in out
    ref = _torch_reader(fp8_dir, FP8_SHAPES, torch.bfloat16)
    with checkpoint.open_checkpoint(tmp_path / "bf16") as rd:
        assert all(torch.equal(rd.get(k), ref[k]) for k in FP8_SHAPES)
    assert main(["migrate", str(fp8_dir), str(tmp_path / "again"), "--recipe", "quantize-fp8"]) != 0
    assert "holds quantized weights already" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_other_configs_change_nothing(tmp_path):
    """config.json is read for fp8 / mxfp4 quantization only: another method, or a file that is
    not JSON, beside a plain checkpoint loads it as before."""
    sd = {"w": torch.randn(3, 4), "w_scales": torch.randn(3)}
    for name, text in (("bnb", json.dumps({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}})),
                       ("broken", "{not json")):  # fmt: skip
        _write_hf(tmp_path / name, sd, None, files=1)
        (tmp_path / name / "config.json").write_text(text)
        t = {k: torch.zeros_like(v) for k, v in sd.items()}
        rep = checkpoint.load(t, tmp_path / name)
        assert rep.dequantized == {} and all(torch.equal(t[k], v) for k, v in sd.items())


def test_fp8_dequantize_any_block_offset_dtype_and_nan():
    """The lookup equals float32(w) * scale, then the dtype, for every block of a weight (any
    offsets, edge blocks short), strided and complex outputs, NaN codes, e5m2 weights; scales
    that do not cover the block are refused."""
    from checkpoint.convert.quant import fp8_dequantize, fp8_scale_slices, scale_grid

    g = torch.Generator().manual_seed(5)
    for dt8, (rows, cols, br, bc) in ((torch.float8_e4m3fn, (300, 200, 128, 128)), (torch.float8_e5m2, (10, 7, 4, 3))):
        w = (torch.randn(rows, cols, generator=g) * 50).to(dt8)
        w.view(torch.uint8)[0, :3] = torch.tensor([0x7F, 0xFF, 0x80], dtype=torch.uint8)  # NaN, NaN, -0
        s = torch.rand(*scale_grid((rows, cols), (br, bc)), generator=g) * 3
        whole = w.float() * s.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
        for a, b, c, d in ((0, rows, 0, cols), (5, rows - 3, 1, cols - 2), (rows // 2, rows, cols // 3, cols), (1, 2, 3, 4)):
            sl = (slice(a, b), slice(c, d))
            part = w[sl], s[fp8_scale_slices((br, bc), sl)]
            for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64):
                for out in (torch.empty(b - a, d - c, dtype=dtype), torch.empty(d - c, b - a, dtype=dtype).t()):
                    fp8_dequantize(*part, (br, bc), (a, c), out)
                    want = whole[sl].to(dtype)
                    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num()), (dt8, dtype, sl)
    with pytest.raises(ValueError, match=r"scales \(3, 1\) do not cover"):
        fp8_dequantize(torch.zeros(300, 200, dtype=torch.float8_e4m3fn), torch.ones(3, 1), (128, 128))
