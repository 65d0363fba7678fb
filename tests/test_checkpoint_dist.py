"""Distributed save / load of DTensors (gloo, 127.0.0.1): each byte written once, by its owner;
a single process reads the result; loading reshards to other meshes and placements.

Two spawns in all (2 ranks, 4 ranks) to keep the suite fast; each also runs a phase of the
resume test: an autoparallel parallel module trains 3 AdamW steps on 2 ranks and saves model and
optimizer; an eager model (this process) and a parallel module on 4 ranks with another plan load
it and train 3 more steps; the losses equal the uninterrupted 6-step eager run within 1e-6.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

import checkpoint
from checkpoint import open_checkpoint
from checkpoint.ranks.launch import run_ranks

CFG_BATCH, LR = 8, 1e-2  # resume test: global batch, AdamW learning rate


def batch(step: int, vocab: int, seq: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, vocab, (CFG_BATCH, seq), generator=g)
    targets = torch.randint(0, vocab, (CFG_BATCH, seq), generator=g)
    return tokens, targets


def loss_fn(logits, targets, n_tokens):
    # Sum over the local batch / global token count: per-rank losses add up to the eager loss.
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / n_tokens


def train(model, opt, steps, rank=0, world=1):
    """Run ``steps`` AdamW steps on the global batch (this rank's chunk); returns local losses."""
    losses = []
    for step in steps:
        tokens, targets = batch(step, model.cfg.vocab, model.cfg.seq)
        out = model(tokens.chunk(world)[rank])
        loss = loss_fn(out, targets.chunk(world)[rank], tokens.numel())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def parallelize(model, mesh, overrides=None):
    from torch.distributed.tensor import Shard

    from autoparallel import AutoParallel

    shard_all = tuple(Shard(0) for _ in range(mesh.ndim))
    # loss_fn is normalised over the global batch already: gradients are summed, not averaged.
    inputs = lambda: torch.randint(0, 32, (CFG_BATCH, model.cfg.seq))  # noqa: E731
    with AutoParallel(model, inputs, mesh, reduce="sum") as autop:
        autop.add_input_constraints([shard_all])
        autop.add_output_constraints([shard_all])
        if overrides:
            autop.set_placements(overrides)
        return autop.apply_placement(autop.optimize_placement())


def reference_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "even": torch.randn(8, 6, generator=g),
        "uneven": torch.randn(7, 5, generator=g),
        "rep": torch.randn(3, 4, generator=g),
        "ints": torch.randint(-1000, 1000, (9, 2), generator=g),
        "flags": torch.rand(5, generator=g) > 0.5,
        "bf16": torch.randn(6, 10, generator=g).to(torch.bfloat16),
        "plain": torch.randn(4, generator=g),
        "scalar": torch.tensor(2.5),
        # Every storage placement: _StridedShard (FSDP2 + TP, AutoParallel),
        # uneven, Shard on the last dim of a 3-D tensor.
        "strided": torch.randn(8, 6, generator=g),
        "strided_odd": torch.randn(9, 5, generator=g),
        "cube": torch.randn(3, 5, 4, generator=g),
    }


# Codes: "R" Replicate, "S<d>" Shard(d), "SS<d>/<k>" _StridedShard(d, split_factor=k).
PLACEMENTS_1D = {
    "even": "S0", "uneven": "S0", "rep": "R", "ints": "S1", "flags": "S0", "bf16": "S1",
    "strided": "SS0/2", "strided_odd": "SS0/3", "cube": "S2",
}  # fmt: skip
PLACEMENTS_2D = {
    "even": ("S0", "S1"), "uneven": ("S1", "S0"), "rep": ("R", "R"), "ints": ("R", "S0"),
    "flags": ("S0", "R"), "bf16": ("S0", "S0"),
    "strided": ("SS0/2", "S0"), "strided_odd": ("S1", "SS1/2"), "cube": ("S2", "S1"),
}  # fmt: skip
# Loading side: other placements than the ones saved (resharding).
LOAD_1D = {
    "even": "S1", "uneven": "R", "rep": "S0", "ints": "S0", "flags": "R", "bf16": "S0",
    "strided": "S1", "strided_odd": "S0", "cube": "SS1/2",
}  # fmt: skip
LOAD_2D = {
    "even": ("S1", "R"), "uneven": ("S0", "S1"), "rep": ("S0", "S1"), "ints": ("S1", "R"),
    "flags": ("R", "S0"), "bf16": ("R", "S1"),
    "strided": ("S1", "SS0/2"), "strided_odd": ("SS0/2", "S0"), "cube": ("S0", "S2"),
}  # fmt: skip


def _pl(code):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    def one(c):
        if c == "R":
            return Replicate()
        if c.startswith("SS"):
            d, k = c[2:].split("/")
            return _StridedShard(int(d), split_factor=int(k))
        return Shard(int(c[1]))

    return [one(c) for c in (code if isinstance(code, tuple) else (code,))]


def _strided(code) -> bool:
    return any(c.startswith("SS") for c in (code if isinstance(code, tuple) else (code,)))


def _dtensors(mesh, placements, zero=False):
    from torch.distributed.tensor import distribute_tensor

    ref = reference_tensors()
    out = {}
    for k, v in ref.items():
        src = torch.zeros_like(v) if zero else v
        # Every rank holds the same reference values: split locally (distribute_tensor's scatter
        # refuses uneven _StridedShard).
        out[k] = (
            distribute_tensor(src, mesh, _pl(placements[k]), src_data_rank=None)
            if k in placements
            else src.clone()
        )
    return out


def _resume_phase(rank, world, path, mesh_shape, first):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from tests.models import TinyTransformer

    mesh = init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(0)
    user = TinyTransformer()
    user.init_weights()
    if first:
        pmod = parallelize(user, mesh)
        opt = torch.optim.AdamW(pmod.parameters(), lr=LR)
        losses = train(pmod, opt, range(3), rank, world)
        checkpoint.save(pmod, path, optimizer=opt, max_shard_size=4000)
        return losses
    other_plan = {
        "layers.*.attention.wq.weight": (Shard(1), Shard(0)),
        "layers.*.feed_forward.w2.weight": (Replicate(), Shard(1)),
        "output.weight": (Shard(1), Replicate()),
    }
    torch.manual_seed(1)
    fresh = TinyTransformer()
    fresh.init_weights()  # other values: everything must come from the checkpoint
    pmod = parallelize(fresh, mesh, other_plan)
    opt = torch.optim.AdamW(pmod.parameters(), lr=0.5)  # hyper-parameters come back too
    rep = checkpoint.load(pmod, path, optimizer=opt)
    assert rep.ok and rep.optimizer_loaded and opt.param_groups[0]["lr"] == LR
    return train(pmod, opt, range(3, 6), rank, world)


def _interop(mesh, path, hf_path):
    """DCP's HuggingFaceStorageReader reads our output into DTensors; a transformers
    ``save_pretrained`` checkpoint loads into a ``fully_shard``-ed (DTensor) Llama."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.fsdp import fully_shard

    from tests.test_checkpoint_interop import TOKENS, tiny_llama

    # DCP's reader is checked on the placements it supports (not _StridedShard).
    sd = {k: v for k, v in _dtensors(mesh, LOAD_1D, zero=True).items() if not _strided(LOAD_1D.get(k, "R"))}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(path))
    ref = reference_tensors()
    out = {
        f"dcp:{k}": bool(torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, ref[k]))
        for k, v in sd.items()
    }
    # A torch.save pickle into DTensors of every placement: the same pipeline, this rank's blocks.
    pt = f"{path}.rank{mesh.get_rank()}.pt"
    torch.save(ref, pt)
    target = _dtensors(mesh, LOAD_1D, zero=True)
    assert checkpoint.load(target, pt).ok
    out.update({f"pickle:{k}": bool(torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, ref[k]))
                for k, v in target.items()})  # fmt: skip
    model = tiny_llama(1)
    fully_shard(model, mesh=mesh)
    rep = checkpoint.load(model, hf_path)
    assert rep.ok and model.model.embed_tokens.weight.placements[0].is_shard()
    # save(recipe=) of the DTensor model: every rank saves its bytes, rank 0 converts; all get the report.
    conv = checkpoint.save(model, hf_path + "-torchtitan", recipe="hf-to-torchtitan-llama3")
    assert conv.written and conv.recipe == "hf-to-torchtitan-llama3"
    # ... and load(recipe=) converts it back while loading into another sharded model.
    back = tiny_llama(5)
    fully_shard(back, mesh=mesh)
    rep = checkpoint.load(back, hf_path + "-torchtitan", recipe="torchtitan-llama3-to-hf")
    assert rep.ok and rep.loaded_keys
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, model(TOKENS).logits)
    with torch.no_grad():
        out["logits"] = model(TOKENS).logits.tolist()  # tensors do not survive the rank's exit
    out.update(_converted_blocks(mesh, hf_path))
    return out


def _convert_models():
    """A Qwen3-MoE (4 experts) and a Llama with 2 KV groups: on 2 ranks, fully_shard gives each
    rank 2 experts of the fused gate_up_proj / down_proj and 1 KV group of q / k / v (Shard(0))."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    moe = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
    gqa = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(7)
    return Qwen3MoeForCausalLM(moe).eval(), LlamaForCausalLM(gqa).eval()


def _converted_blocks(mesh, hf_path) -> dict[str, bool]:
    """load(recipe=) into fully_shard-ed models reads a rank's blocks only: its experts' per-expert
    keys (experts-to-fused) and the fused linear_qkv rows of its KV group (megatron-gpt-to-hf)."""
    from unittest import mock

    from torch.distributed.fsdp import fully_shard

    from checkpoint.convert.catalog import Catalog

    rank, out = mesh.get_rank(), {}
    reads: list[tuple[str, tuple]] = []
    get, get_slice = Catalog.get, Catalog.get_slice

    def counted_get(self, key, shard=0):
        reads.append((key, ()))
        return get(self, key, shard)

    def counted_slice(self, key, slices, shard=0):
        reads.append((key, tuple(sl.indices(self.specs(key)[shard].shape[d])[:2] for d, sl in enumerate(slices))))
        return get_slice(self, key, slices, shard)

    for name, recipe, src in (("moe", "experts-to-fused", hf_path + "-moe"), ("mg", "megatron-gpt-to-hf", hf_path + "-mg")):
        ref = _convert_models()[name == "mg"]
        checkpoint.load(ref, src, recipe=recipe)  # the one-process conversion: the values wanted
        model = _convert_models()[name == "mg"]
        fully_shard(model, mesh=mesh)
        reads.clear()
        with mock.patch.object(Catalog, "get", counted_get), mock.patch.object(Catalog, "get_slice", counted_slice):
            assert checkpoint.load(model, src, recipe=recipe).ok
        want = ref.state_dict()
        out[f"convert:{name}-values"] = all(torch.equal(v.full_tensor(), want[k]) for k, v in model.state_dict().items())
        if name == "moe":  # experts 2r, 2r+1 only, each key read as a whole expert block
            experts = {k for k, _ in reads if ".experts." in k}
            mine = {f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight" for i in range(2) for e in (2 * rank, 2 * rank + 1)
                    for p in ("gate", "up", "down")}  # fmt: skip
            out["convert:moe-experts-read"] = experts == mine
        else:  # rows of this rank's KV group: (2 q heads + k + v) * head_dim 4 = 16 of the 32 rows
            qkv = {sl for k, sl in reads if k.endswith("linear_qkv.weight")}
            out["convert:mg-rows-read"] = qkv == {((16 * rank, 16 * rank + 16), (0, 16))}
    return out


CONVERT_CHECKS = ("convert:moe-values", "convert:moe-experts-read", "convert:mg-values", "convert:mg-rows-read")


def _worker(rank, world, path, save_pl, load_pl, mesh_shape, resume_path, resume_first, hf_path=None):
    from torch.distributed.device_mesh import init_device_mesh

    from checkpoint.storage.writer import stats

    losses = _resume_phase(rank, world, resume_path, mesh_shape, resume_first)

    mesh = init_device_mesh("cpu", mesh_shape)
    sd = _dtensors(mesh, save_pl)
    stats.reset()
    checkpoint.save(sd, path, max_shard_size=200)
    written = stats.bytes_written
    # Existing path without overwrite fails on every rank (no hang).
    try:
        checkpoint.save(sd, path)
        again = "no error"
    except checkpoint.CheckpointError as e:
        again = type(e).__name__
    target = _dtensors(mesh, load_pl, zero=True)
    stats.reset()
    from checkpoint.storage.reader import CheckpointReader

    sliced, get_slice, copy_into = [], CheckpointReader.get_slice, CheckpointReader.copy_into

    def counted(self, key, slices):
        sliced.append(key)
        return get_slice(self, key, slices)

    def counted_copy(self, key, out, slices=None, check=False):  # a block read through the window
        if slices is not None:
            sliced.append(key)
        return copy_into(self, key, out, slices, check)

    CheckpointReader.get_slice, CheckpointReader.copy_into = counted, counted_copy
    try:
        rep = checkpoint.load(target, path)
    finally:
        CheckpointReader.get_slice, CheckpointReader.copy_into = get_slice, copy_into
    read = stats.bytes_read
    # Each rank's local shard holds exactly its bytes of the reference (no gather needed to tell).
    want = _dtensors(mesh, load_pl)
    local_ok = {k: bool(torch.equal(_held(v), _held(want[k]))) for k, v in target.items()}
    # What this rank holds after the load: its local shards (a plain tensor is held whole).
    held = sum((v.to_local() if hasattr(v, "to_local") else v).nbytes for v in target.values())
    ref = reference_tensors()
    ok = {
        k: bool(torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, ref[k]))
        for k, v in target.items()
    }
    if resume_first:  # the 2-rank spawn also runs the interop checks
        extra = _interop(mesh, path, hf_path)
        ok.update({k: v for k, v in extra.items() if k.startswith(("dcp:", "pickle:", "convert:"))})
        losses = (losses, extra["logits"])
    return {
        "written": written,
        "read": read,
        "held": held,
        "again": again,
        "ok": ok,
        "loaded": rep.loaded_keys,
        "losses": losses,
        "local_ok": local_ok,
        "sliced": sorted(set(sliced)),
    }


def _held(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _row_blocks(code) -> bool:
    """Placements sharding only dim 0 (Shard(0), _StridedShard(0)): each local block is one
    contiguous byte range of the file, read straight into the local shard (no get_slice)."""
    return all(c == "R" or c[1:].lstrip("S").startswith("0") for c in (code if isinstance(code, tuple) else (code,)))


def _check(path, world, save_pl, load_pl, mesh_shape, resume_path, resume_first, hf_path=None):
    res = run_ranks(
        _worker, world, path, save_pl, load_pl, mesh_shape, resume_path, resume_first, hf_path,
        backend="gloo", timeout=180,
    )  # fmt: skip
    ref = reference_tensors()
    for r in res:
        dcp_keys = [k for k in ref if not _strided(LOAD_1D.get(k, "R"))]
        want = {k: True for k in ref} | (
            {f"dcp:{k}": True for k in dcp_keys} | {f"pickle:{k}": True for k in ref} | dict.fromkeys(CONVERT_CHECKS, True)
            if resume_first else {}
        )  # fmt: skip
        assert r["ok"] == want, r["ok"]
        assert r["local_ok"] == {k: True for k in ref}, r["local_ok"]
        assert r["loaded"] == sorted(ref)
        # Row blocks are read straight into the local shard, never through get_slice;
        # on 4 ranks a rank holding one row of a column-sharded tensor reads it directly too.
        other = sorted(k for k, c in load_pl.items() if not _row_blocks(c))
        assert set(r["sliced"]) <= set(other) and (world > 2 or r["sliced"] == other), r["sliced"]
    # rank 0's refusal is every rank's, under its own name (the rank agreement carries it)
    assert all(r["again"] == "CheckpointExistsError" for r in res), [r["again"] for r in res]
    # A single process reads the plain HF layout with exact values.
    with open_checkpoint(path) as rd:
        assert rd.keys() == sorted(ref)
        assert all(torch.equal(rd.get(k), v) for k, v in ref.items())
        files = rd.files
    assert checkpoint.verify(path).ok and len(files) > 1
    # Per-tensor digests (each rank hashing the chunks in its own bytes, format version 3) equal
    # those of the tensors' bytes: the same in any layout or sharding.
    with open_checkpoint(path) as rd:
        digests = rd.meta.tensor_digests()
    from checkpoint.storage import digest

    assert digests == {
        k: digest.tensor_hexdigest(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        for k, v in ref.items()
    }
    # Each byte written exactly once: bytes written over all ranks == bytes of all shard files.
    on_disk = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    assert sum(r["written"] for r in res) == on_disk
    # Each rank reads exactly the slices it holds, never whole tensors it does not keep.
    assert [r["read"] for r in res] == [r["held"] for r in res]
    return res


def _eager_reference():
    from tests.models import TinyTransformer

    torch.manual_seed(0)
    ref = TinyTransformer()
    ref.init_weights()
    return train(ref, torch.optim.AdamW(ref.parameters(), lr=LR), range(6))


def test_dtensor_2_and_4_ranks_and_resume(tmp_path):
    from tests.models import TinyTransformer
    from tests.test_checkpoint_interop import TOKENS, tiny_llama

    resume = str(tmp_path / "resume")
    hf = tiny_llama(0)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="8KB")
    moe, gqa = _convert_models()  # the sources of the ranks' load(recipe=) block checks
    moe.save_pretrained(tmp_path / "hf-moe")  # per-expert keys, as on the hub
    checkpoint.save(gqa, tmp_path / "gqa")
    checkpoint.migrate(tmp_path / "gqa", tmp_path / "hf-mg", recipe="hf-to-megatron-gpt", model=gqa)
    with torch.no_grad():
        hf_logits = hf(TOKENS).logits
    # 2 ranks, 1-D mesh: DTensor checks, interop, resume phase 1 (train 3 steps, save model + optimizer).
    res2 = _check(str(tmp_path / "ck2"), 2, PLACEMENTS_1D, LOAD_1D, (2,), resume, True, str(tmp_path / "hf"))
    assert all(r["written"] > 0 for r in res2)
    for r in res2:
        r["losses"], logits = r["losses"]
        assert torch.equal(
            torch.tensor(logits), hf_logits
        )  # HF checkpoint -> 2-rank parallel module: identical output
    # The 2-rank save(recipe=) equals the one-process conversion of the same weights, bit for bit.
    checkpoint.save(hf, tmp_path / "tt-one", recipe="hf-to-torchtitan-llama3")
    with open_checkpoint(tmp_path / "hf-torchtitan") as a, open_checkpoint(tmp_path / "tt-one") as b:
        assert a.keys() == b.keys() and "layers.0.attention.qkv_linear.wq.weight" in a.keys()  # torchtitan today
        assert all(torch.equal(a.get(k), b.get(k)) for k in a.keys())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".fqnckpt")] == []  # temp removed
    first = [sum(x) for x in zip(*(r["losses"] for r in res2))]
    ref = _eager_reference()
    assert max(abs(a - b) for a, b in zip(first, ref[:3])) < 1e-6
    names = sorted(open_checkpoint(resume, prefix="optimizer").keys())
    assert (
        "state.tok_embeddings.weight.exp_avg" in names
        and "state.layers.1.feed_forward.w2.weight.step" in names
    )
    assert checkpoint.verify(resume).ok
    # (a) eager model in this process resumes.
    torch.manual_seed(2)
    eager = TinyTransformer()
    eager.init_weights()
    opt = torch.optim.AdamW(eager.parameters(), lr=0.5)
    rep = checkpoint.load(eager, resume, optimizer=opt)
    assert rep.ok and rep.optimizer_loaded and eager.output.weight is eager.tok_embeddings.weight
    resumed = train(eager, opt, range(3, 6))
    assert max(abs(a - b) for a, b in zip(resumed, ref[3:])) < 1e-6, (resumed, ref[3:])
    # (b) 4 ranks, 2x2 mesh: DTensor checks + a parallel module with another plan resumes.
    res4 = _check(str(tmp_path / "ck4"), 4, PLACEMENTS_2D, LOAD_2D, (2, 2), resume, False)
    assert all(r["written"] > 0 for r in res4)
    second = [sum(x) for x in zip(*(r["losses"] for r in res4))]
    assert max(abs(a - b) for a, b in zip(second, ref[3:])) < 1e-6, (second, ref[3:])
