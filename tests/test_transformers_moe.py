"""transformers 5 checkpoints in and out: MoE models keep their experts fused in memory
(``mlp.experts.gate_up_proj``) and per expert on disk (``mlp.experts.0.gate_proj.weight``,
Mixtral's ``block_sparse_moe.experts.0.w1.weight``), through transformers' own conversion mapping.
``checkpoint.load`` of a ``save_pretrained`` directory must give what ``from_pretrained`` gives, and
``checkpoint.save`` (and ``async_save``) must write the names and tensors ``save_pretrained`` writes,
bit for bit; the family matrix checks the same for the other families in one process, and for the
dense ones on 2 ranks through the parallel module (capture, FQN map, init, load, outputs, save)."""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch

import checkpoint
from checkpoint.errors import CheckpointError
from checkpoint.storage.format import IndexFile

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from tests.helpers import assert_same_state, same_state

_DENSE = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=32)  # fmt: skip
# model_type -> config fields (tiny: 4 experts, 2 per token); "-tied": the output tied to the embeddings.
MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, head_dim=8, tie_word_embeddings=False),
    "qwen3_moe-tied": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, head_dim=8, tie_word_embeddings=True),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, first_k_dense_replace=1, num_key_value_heads=2,
                        n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                        v_head_dim=8, n_shared_experts=1, tie_word_embeddings=False),
}  # fmt: skip
# The fused in-memory names and what save_pretrained writes for them (layer 1 is a MoE layer in each).
FUSED = "model.layers.1.mlp.experts.gate_up_proj"
PER_EXPERT = {
    "mixtral": "model.layers.1.block_sparse_moe.experts.3.w1.weight",
    "qwen3_moe": "model.layers.1.mlp.experts.3.gate_proj.weight",
    "qwen3_moe-tied": "model.layers.1.mlp.experts.3.gate_proj.weight",
    "deepseek_v3": "model.layers.1.mlp.experts.3.gate_proj.weight",
}


# The auto class of the model types that are not causal LMs (the others: AutoModelForCausalLM).
AUTO = {"bert": "AutoModelForMaskedLM", "t5": "AutoModelForSeq2SeqLM"}


def auto_class(model_type: str):
    """transformers' auto class building ``model_type``'s model with its head."""
    return getattr(transformers, AUTO.get(model_type, "AutoModelForCausalLM"))


def tiny_config(kind: str, table=None, **over):
    """The config of ``tiny(kind)`` (``over``: fields replaced, e.g. ``num_hidden_layers``)."""
    return transformers.AutoConfig.for_model(kind.removesuffix("-tied"), **{**_DENSE, **(table or MOE)[kind], **over})


def tiny(kind: str, seed: int, table=None):
    """The tiny model ``kind`` (``MOE`` / ``FAMILIES``), every parameter drawn from ``seed``
    (normal, std 0.5: no two models of different seeds share a value)."""
    cfg = tiny_config(kind, table)
    model = auto_class(cfg.model_type).from_config(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def stored(d) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint directory, by its stored key."""
    idx = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.exists(idx) else ["model.safetensors"]
    out = {}
    for f in files:
        with safe_open(os.path.join(d, f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def from_pretrained(d):
    """``from_pretrained`` of the auto class of the directory's model type (its config.json)."""
    return auto_class(transformers.AutoConfig.from_pretrained(d).model_type).from_pretrained(d).eval()


@pytest.mark.parametrize("kind", list(MOE))
def test_save_pretrained_directory_loads_as_from_pretrained(tmp_path, kind):
    """The per-expert keys of a save_pretrained directory fill the fused experts (Mixtral's
    block_sparse_moe renamed mlp): into the eager model and a torch.compile wrapper, values equal
    to from_pretrained's, the report clean."""
    tiny(kind, 0).save_pretrained(tmp_path / "hub")
    assert PER_EXPERT[kind] in stored(tmp_path / "hub")  # transformers' on-disk layout
    want = state(from_pretrained(tmp_path / "hub"))
    assert FUSED in want
    model = tiny(kind, 1)
    rep = checkpoint.load(model, tmp_path / "hub")
    assert rep.ok and rep.missing_keys == [] and rep.unexpected_keys == []
    assert_same_state(state(model), want)
    wrapped = torch.compile(tiny(kind, 2))
    assert checkpoint.load(wrapped, tmp_path / "hub").ok
    assert_same_state(state(wrapped._orig_mod), want)
    half = tiny(kind, 3).to(torch.bfloat16)  # another dtype: converted by the copy, not read straight in
    assert checkpoint.load(half, tmp_path / "hub").ok
    assert_same_state(state(half), {k: v.to(torch.bfloat16) for k, v in want.items()})


def test_hub_snapshot_loads(tmp_path):
    """A Hub cache snapshot (files symlinked to blobs) of a save_pretrained directory loads as the
    directory does."""
    model = tiny("mixtral", 0)
    model.save_pretrained(tmp_path / "hub")
    repo = tmp_path / "cache" / "models--org--tiny-mixtral"
    snap = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in os.listdir(tmp_path / "hub"):
        (repo / "blobs" / f"{f}.blob").write_bytes((tmp_path / "hub" / f).read_bytes())
        (snap / f).symlink_to(f"../../blobs/{f}.blob")
    target = tiny("mixtral", 1)
    assert checkpoint.load(target, snap).ok
    assert_same_state(state(target), state(model))


def test_base_model_and_head(tmp_path):
    """As for any checkpoint, the converted keys resolve by container prefix: a MixtralForCausalLM
    directory into MixtralModel (lm_head unexpected) and a MixtralModel directory into
    MixtralForCausalLM (lm_head missing), strict=False loading the rest exactly."""
    model = tiny("mixtral", 0)
    model.save_pretrained(tmp_path / "full")
    model.model.save_pretrained(tmp_path / "base")
    base = transformers.MixtralModel(model.config)
    rep = checkpoint.load(base, tmp_path / "full", strict=False)
    assert (rep.missing_keys, rep.unexpected_keys) == ([], ["lm_head.weight"])
    assert_same_state(state(base), state(model.model))
    full = tiny("mixtral", 1)
    rep = checkpoint.load(full, tmp_path / "base", strict=False)
    assert (rep.missing_keys, rep.unexpected_keys) == (["lm_head.weight"], [])
    assert_same_state(state(full.model), state(model.model))


def test_urls(tmp_path):
    """One process, through fsspec: save to memory:// writes save_pretrained's layout and loads
    back; a file:// URL of a save_pretrained directory loads as the directory does."""
    import uuid

    model = tiny("mixtral", 0)
    model.save_pretrained(tmp_path / "hub")
    url = f"memory://moe-{uuid.uuid4().hex[:8]}/ck"
    index = checkpoint.save(model, url)
    assert sorted(index.weight_map) == sorted(stored(tmp_path / "hub"))
    for src in (url, f"file://{tmp_path / 'hub'}"):
        target = tiny("mixtral", 1)
        assert checkpoint.load(target, src).ok
        assert_same_state(state(target), state(model))


@pytest.mark.parametrize("kind", list(MOE))
def test_save_writes_what_save_pretrained_writes(tmp_path, kind):
    """save's default is transformers' on-disk layout: the same keys and bytes as save_pretrained,
    from_pretrained gives the model back exactly, and load reads it (with verify=True: the index
    carries fqnckpt's checksums). layout='memory' writes the module's own fused names, which
    load takes as they are."""
    model = tiny(kind, 0)
    model.save_pretrained(tmp_path / "hub")
    index = checkpoint.save(model, tmp_path / "ours")
    assert isinstance(index, IndexFile)
    assert_same_state(stored(tmp_path / "ours"), stored(tmp_path / "hub"))
    assert sorted(os.listdir(tmp_path / "ours")) == [
        "config.json", "generation_config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert_same_state(state(from_pretrained(tmp_path / "ours")), state(model))
    back = tiny(kind, 1)
    assert checkpoint.load(back, tmp_path / "ours", verify=True).ok
    assert_same_state(state(back), state(model))

    checkpoint.save(model, tmp_path / "mem", layout="memory")
    mem = stored(tmp_path / "mem")
    assert FUSED in mem and PER_EXPERT[kind] not in mem
    assert torch.equal(mem[FUSED], model.state_dict()[FUSED])
    back = tiny(kind, 1)
    assert checkpoint.load(back, tmp_path / "mem").ok
    assert_same_state(state(back), state(model))


def test_async_save_writes_what_save_pretrained_writes(tmp_path):
    """async_save's default is save's: a MoE model's tensors alone go to disk as save_pretrained
    writes them (same keys and bytes, the values at the call though the model changes right
    after), converted in the background from the staged copies; layout='memory' writes the fused
    names; a bad layout is refused in the call, nothing written."""
    from checkpoint.training.async_save import async_save

    for kind in ("mixtral", "qwen3_moe-tied"):
        model = tiny(kind, 0)
        model.save_pretrained(tmp_path / kind / "hub")
        want = state(model)
        fut = async_save(model, tmp_path / kind / "async")
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        index = fut.result()
        assert sorted(index.weight_map) == sorted(stored(tmp_path / kind / "hub"))
        assert_same_state(stored(tmp_path / kind / "async"), stored(tmp_path / kind / "hub"))
        assert_same_state(state(from_pretrained(tmp_path / kind / "async")), want)
    async_save(model, tmp_path / "mem", layout="memory").result()
    mem = stored(tmp_path / "mem")
    assert FUSED in mem and PER_EXPERT["qwen3_moe"] not in mem
    with pytest.raises(ValueError, match=r"async_save\(layout='fused'\)"):
        async_save(model, tmp_path / "no", layout="fused")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"async_save\(layout='pretrained'\).*optimizer"):
        async_save(model, tmp_path / "no", optimizer=opt, layout="pretrained")
    assert not (tmp_path / "no").exists()


def test_training_checkpoint_keeps_the_memory_layout(tmp_path):
    """With an optimizer the default is the in-memory layout (the optimizer state is keyed by the
    fused parameters) and resumes exactly; the on-disk layout asked for with an optimizer, an
    unknown layout, or a save_pretrained directory loaded with optimizer= are refused by name
    before anything is written or changed."""
    model = tiny("qwen3_moe", 0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.arange(8)[None]).logits.sum().backward()
    opt.step()
    checkpoint.save(model, tmp_path / "train", optimizer=opt)
    assert FUSED in stored(tmp_path / "train")
    fresh = tiny("qwen3_moe", 1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert checkpoint.load(fresh, tmp_path / "train", optimizer=fresh_opt).ok
    assert_same_state(state(fresh), state(model))
    assert torch.equal(fresh_opt.state[fresh.get_parameter(FUSED)]["exp_avg"], opt.state[model.get_parameter(FUSED)]["exp_avg"])

    with pytest.raises(TypeError, match="layout='pretrained'.*optimizer"):
        checkpoint.save(model, tmp_path / "no", optimizer=opt, layout="pretrained")
    with pytest.raises(ValueError, match="layout='fused'"):
        checkpoint.save(model, tmp_path / "no", layout="fused")
    with pytest.raises(TypeError, match="recipe.*layout"):
        checkpoint.save(model, tmp_path / "no", layout="memory", recipe="fused-to-experts")
    assert not (tmp_path / "no").exists()

    model.save_pretrained(tmp_path / "hub")
    before, opt_before = state(fresh), {k: dict(v) for k, v in fresh_opt.state_dict()["state"].items()}
    with pytest.raises(TypeError, match="transformers' on-disk layout.*optimizer="):
        checkpoint.load(fresh, tmp_path / "hub", optimizer=fresh_opt)
    assert_same_state(state(fresh), before)
    after = fresh_opt.state_dict()["state"]
    assert all(torch.equal(after[i][k], v) for i, s in opt_before.items() for k, v in s.items())


def test_mismatches_are_reported_as_for_any_checkpoint(tmp_path):
    """The converted keys go through load's own checks: 4 experts into a model of 8 are
    shape-mismatched fused keys (CheckpointMismatchError, nothing changed); a directory missing
    lm_head.weight and holding a stray key is refused with both named, and strict=False loads
    the rest, equal to from_pretrained's values."""
    from safetensors.torch import load_file, save_file

    from checkpoint.errors import CheckpointMismatchError

    model = tiny("mixtral", 0)
    model.save_pretrained(tmp_path / "hub")
    fields = {**_DENSE, **MOE["mixtral"], "num_local_experts": 8}
    eight = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("mixtral", **fields))
    before = state(eight)
    with pytest.raises(CheckpointMismatchError) as err:
        checkpoint.load(eight, tmp_path / "hub")
    shapes = {m.key: (m.checkpoint_shape, m.target_shape) for m in err.value.report.shape_mismatched}
    assert shapes == {f"model.layers.{i}.mlp.{k}": ([4, *rest], [8, *rest]) for i in range(2)
                      for k, rest in (("experts.gate_up_proj", [64, 16]), ("experts.down_proj", [16, 32]), ("gate.weight", [16]))}  # fmt: skip
    assert_same_state(state(eight), before)

    tensors = load_file(tmp_path / "hub" / "model.safetensors")
    del tensors["lm_head.weight"]
    tensors["extra.thing"] = torch.zeros(2)
    (tmp_path / "partial").mkdir()
    save_file(tensors, tmp_path / "partial" / "model.safetensors", metadata={"format": "pt"})
    target = tiny("mixtral", 1)
    before = state(target)
    with pytest.raises(CheckpointMismatchError) as err:
        checkpoint.load(target, tmp_path / "partial")
    assert (err.value.report.missing_keys, err.value.report.unexpected_keys) == (["lm_head.weight"], ["extra.thing"])
    assert_same_state(state(target), before)
    rep = checkpoint.load(target, tmp_path / "partial", strict=False)
    assert (rep.missing_keys, rep.unexpected_keys) == (["lm_head.weight"], ["extra.thing"])
    want = {**state(model), "lm_head.weight": before["lm_head.weight"]}
    assert_same_state(state(target), want)


def mixtral_model():
    """``fqnckpt diff --model tests.test_transformers_moe:mixtral_model``: the tiny Mixtral."""
    return tiny("mixtral", 5)


def test_diff_reads_the_on_disk_layout_as_the_model_holds_it(tmp_path, capsys):
    """fqnckpt diff of a save_pretrained directory (per-expert keys) and the in-memory layout
    (fused): different by raw names; with the transformers --model, the per-expert side is read
    through the model's conversion mapping, every tensor compared by value, and the report says so.
    A changed expert is a value difference of its fused tensor."""
    from checkpoint.cli.main import main

    model = tiny("mixtral", 0)
    model.save_pretrained(tmp_path / "hub")
    checkpoint.save(model, tmp_path / "mem", layout="memory")
    hub, mem = str(tmp_path / "hub"), str(tmp_path / "mem")
    assert main(["diff", hub, mem, "--part", "model"]) == 1
    capsys.readouterr()
    assert main(["diff", hub, mem, "--part", "model", "--model", "tests.test_transformers_moe:mixtral_model", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    n = len(model.state_dict())
    assert (out["same"], out["common"], out["values_compared"]) == (True, n, n)
    assert out["converted"] == {"a": "experts-to-fused (transformers' conversion mapping of the model)"}
    assert main(["diff", hub, mem, "--part", "model", "--model", "tests.test_transformers_moe:mixtral_model"]) == 0
    assert "a read as the model holds it: experts-to-fused" in capsys.readouterr().out

    with torch.no_grad():
        model.get_parameter("model.layers.1.mlp.experts.down_proj")[2, 0, 0] += 1
    checkpoint.save(model, tmp_path / "changed")
    assert main(["diff", hub, str(tmp_path / "changed"), "--part", "model", "--model", "tests.test_transformers_moe:mixtral_model", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["value_differs"] == ["model.layers.1.mlp.experts.down_proj"] and out["converted"].keys() == {"a", "b"}


def test_inspect_shows_the_other_layouts_names(tmp_path, capsys):
    """fqnckpt inspect of a Mixtral checkpoint with its config.json: per-expert keys (save_pretrained)
    show the fused names the model holds in memory and the keys each is built from; fused keys
    (layout='memory') show the per-expert names save_pretrained writes. A dense model's shows none."""
    from checkpoint.cli.main import main

    model = tiny("mixtral", 0)
    model.save_pretrained(tmp_path / "hub")
    checkpoint.save(model, tmp_path / "mem", layout="memory")
    assert main(["inspect", str(tmp_path / "hub"), "--json"]) == 0
    other = json.loads(capsys.readouterr().out)["transformers_names"]
    assert (other["as"], other["model"], other["recipe"], other["tensors"]) == ("in memory", "MixtralForCausalLM", "experts-to-fused", 21)
    layer = "model.layers.1.block_sparse_moe"
    assert other["from"] == {
        **{f"model.layers.{i}.mlp.experts.gate_up_proj": [f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"
                                                           for w in ("w1", "w3") for e in range(4)] for i in range(2)},
        **{f"model.layers.{i}.mlp.experts.down_proj": [f"model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight" for e in range(4)]
           for i in range(2)},
        **{f"model.layers.{i}.mlp.gate.weight": [f"model.layers.{i}.block_sparse_moe.gate.weight"] for i in range(2)},
    }  # fmt: skip
    assert main(["inspect", str(tmp_path / "mem"), "--json"]) == 0
    other = json.loads(capsys.readouterr().out)["transformers_names"]
    assert (other["as"], other["recipe"], other["tensors"]) == ("as save_pretrained writes it", "fused-to-experts", 41)
    assert other["from"][f"{layer}.experts.3.w3.weight"] == ["model.layers.1.mlp.experts.gate_up_proj"]
    assert sorted(other["from"]) == sorted(set(stored(tmp_path / "hub")) - set(stored(tmp_path / "mem")))
    assert main(["inspect", str(tmp_path / "hub")]) == 0
    assert "in memory (MixtralForCausalLM of config.json, by experts-to-fused): 21 tensors, 6 of them" in capsys.readouterr().out

    tiny("llama", 0, FAMILIES).save_pretrained(tmp_path / "dense")
    assert main(["inspect", str(tmp_path / "dense"), "--json"]) == 0
    assert "transformers_names" not in json.loads(capsys.readouterr().out)


def _pmod_ranks(rank: int, world: int, root: str, s3: dict) -> dict:
    """Each rank: the parallel module of each MoE model (built on meta, default plan: the fused
    experts Shard(0), 2 of 4 experts a rank) loaded from the save_pretrained directory with every
    read of the conversion's source counted, then saved (default layout) beside it; the same load
    and save of a fully_shard-ed Qwen3-MoE."""
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from autoparallel import AutoParallel
    from checkpoint.convert.catalog import Catalog

    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    reads: list[str] = []
    get, get_slice = Catalog.get, Catalog.get_slice

    def counted_get(self, key, shard=0):
        reads.append(key)
        return get(self, key, shard)

    def counted_slice(self, key, slices, shard=0):
        reads.append(key)
        return get_slice(self, key, slices, shard)

    for kind in PMOD_KINDS:
        with torch.device("meta"):
            meta = tiny_meta(kind)
        ids = torch.randint(0, 64, (2 * world, 8), generator=torch.Generator().manual_seed(4))
        with AutoParallel(meta, lambda: {"args": (), "kwargs": {"input_ids": ids}}, mesh) as autop:
            pmod = autop.apply_placement()
        pmod.to_empty(device="cpu")
        pmod.init_weights()
        fused = pmod.get_parameter(FUSED)
        out[f"{kind} placement"] = isinstance(fused, DTensor) and tuple(fused.placements) == (Shard(0),)
        reads.clear()
        with mock.patch.object(Catalog, "get", counted_get), mock.patch.object(Catalog, "get_slice", counted_slice):
            out[f"{kind} load ok"] = checkpoint.load(pmod, os.path.join(root, kind, "hub")).ok
        out[f"{kind} experts read"] = sorted({k for k in reads if ".experts." in k})
        out[f"{kind} state"] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                                for k, v in pmod.state_dict().items()}  # fmt: skip
        if kind == "mixtral":  # no temporary save: rank 0 converts the tensors as they are gathered
            import checkpoint.saving as saving

            real = saving.write_checkpoint

            def no_temporary(path, *a, distributed=False, **kw):  # every rank writing the module's layout somewhere
                assert not distributed, f"temporary save to {path}"
                return real(path, *a, distributed=distributed, **kw)

            with mock.patch.object(saving, "write_checkpoint", side_effect=no_temporary):
                checkpoint.save(pmod, os.path.join(root, kind, "ours"))
            try:  # rank 0's refusal (the destination exists), agreed by every rank
                checkpoint.save(pmod, os.path.join(root, kind, "ours"))
            except CheckpointError as e:
                out["again"] = (type(e).__name__, os.path.join(root, kind, "ours") in str(e))
        else:
            checkpoint.save(pmod, os.path.join(root, kind, "ours"))
        if kind == "mixtral":  # each rank its own copy of the saved checkpoint (node-local disks): one checkpoint by digest
            import shutil

            mine = shutil.copytree(os.path.join(root, kind, "ours"), os.path.join(root, f"copy-{rank}"))
            with torch.no_grad():
                for p in pmod.parameters():
                    p.zero_()
            out["own copy load ok"] = checkpoint.load(pmod, mine).ok
            out["own copy state"] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                                     for k, v in pmod.state_dict().items()}  # fmt: skip
        if kind == "qwen3_moe":  # to URLs: file:// and S3 in the on-disk layout (rank 0 writes what it converts)
            from checkpoint.training.async_save import async_save

            async_save(pmod, os.path.join(root, kind, "async")).result()  # as save: the on-disk layout
            checkpoint.save(pmod, f"file://{root}/qwen3_moe/file-url")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                checkpoint.save(pmod, "s3://moe/pmod", storage_options=s3)
                # async_save converts from a temporary save every rank writes: local paths only
                async_save(pmod, "s3://moe/async", storage_options=s3).result()
            out["s3 warned"] = [str(w.message)[:64] for w in caught if "layout" in str(w.message)]
            try:
                async_save(pmod, "s3://moe/refused", storage_options=s3, layout="pretrained")
            except NotImplementedError as e:
                out["s3 refused"] = str(e)
    # FSDP2: fully_shard's FSDPQwen3MoeForCausalLM class, rules from the eager class under it.
    from torch.distributed.fsdp import fully_shard

    model = tiny("qwen3_moe", 1)
    fully_shard(model, mesh=mesh)
    out["fsdp load ok"] = checkpoint.load(model, os.path.join(root, "qwen3_moe", "hub")).ok
    out["fsdp state"] = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    checkpoint.save(model, os.path.join(root, "new", "parents", "fsdp"))  # parents created, as without conversion
    return out


PMOD_KINDS = ("qwen3_moe", "mixtral", "deepseek_v3")


def tiny_meta(kind: str):
    """``tiny(kind)``'s architecture without values (built under the meta device)."""
    cfg = transformers.AutoConfig.for_model(kind, **{**_DENSE, **MOE[kind], "use_cache": False})
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.slow
def test_parallel_module_on_two_ranks(tmp_path):
    """2 gloo ranks, autoparallel's parallel module with the fused experts sharded by expert: the
    save_pretrained directory loads to from_pretrained's values, each rank reading only the
    per-expert keys of its own 2 experts; the collective save writes save_pretrained's keys and
    bytes. The same for FSDP2 (fully_shard) of Qwen3-MoE."""
    from checkpoint.ranks.launch import run_ranks

    from checkpoint.storage.location import resolve
    from tests.s3_server import make_bucket, start_moto, storage_options

    for kind in PMOD_KINDS:
        tiny(kind, 0).save_pretrained(tmp_path / kind / "hub")
    server, port = start_moto()
    try:
        make_bucket(port, "moe")
        results = run_ranks(_pmod_ranks, 2, str(tmp_path), storage_options(port), backend="gloo", timeout=600)
        s3 = resolve("s3://moe", storage_options(port))
        s3_keys = {k for k in json.loads(s3.get("pmod/model.safetensors.index.json"))["weight_map"]}
        s3_async = {k for k in json.loads(s3.get("async/model.safetensors.index.json"))["weight_map"]}
        s3_names = set(s3.listing())
    finally:
        server.stop()
    for kind in PMOD_KINDS:
        want = state(from_pretrained(tmp_path / kind / "hub"))
        for rank, res in enumerate(results):
            assert res[f"{kind} placement"] and res[f"{kind} load ok"]
            assert_same_state(res[f"{kind} state"], want, where=f"{kind} rank {rank}")
            mine = sorted(k for k in stored(tmp_path / kind / "hub") if re.search(rf"\.experts\.({2 * rank}|{2 * rank + 1})\.", k))
            assert len(mine) == 6 * (1 if kind == "deepseek_v3" else 2)  # 2 experts x 3 matrices a MoE layer (DeepSeek: layer 1 only)
            assert res[f"{kind} experts read"] == mine, (kind, rank)
        assert_same_state(stored(tmp_path / kind / "ours"), stored(tmp_path / kind / "hub"))
        extra = ["async", "file-url"] if kind == "qwen3_moe" else []
        assert sorted(p.name for p in (tmp_path / kind).iterdir()) == extra + ["hub", "ours"]  # temporary saves removed
    assert all(res["own copy load ok"] and same_state(res["own copy state"], res["mixtral state"]) for res in results)
    assert [res["again"] for res in results] == [("CheckpointExistsError", True)] * 2
    want = state(from_pretrained(tmp_path / "qwen3_moe" / "hub"))
    assert_same_state(stored(tmp_path / "qwen3_moe" / "file-url"), stored(tmp_path / "qwen3_moe" / "hub"))
    assert_same_state(stored(tmp_path / "qwen3_moe" / "async"), stored(tmp_path / "qwen3_moe" / "hub"))
    assert s3_keys == set(stored(tmp_path / "qwen3_moe" / "hub"))  # save: save_pretrained's names
    assert s3_async == set(want) and s3_names == {"pmod", "async"}  # async_save: the module's own; nothing refused
    assert [res["s3 warned"] for res in results] == [["async_save(s3://moe/async): DTensors are written to a URL in the"]] * 2
    assert [res["s3 refused"][:66] for res in results] == ["async_save(layout='pretrained') of DTensors to s3://moe/refused: s"] * 2
    assert all(res["fsdp load ok"] and same_state(res["fsdp state"], want) for res in results)
    assert_same_state(stored(tmp_path / "new" / "parents" / "fsdp"), stored(tmp_path / "qwen3_moe" / "hub"))
    assert os.listdir(tmp_path / "new" / "parents") == ["fsdp"]


# The other families (tiny configs; fields a family does not know are kept unused by its config):
# dense ones, and the other MoE ones (GPT-OSS keeps its experts fused on disk too). Padding row 0;
# the output tied to the input embedding where the family ties it by default or in the runs
# (Qwen2, Gemma2, Gemma3, GPT-2, BERT's decoder, T5's four names).
_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
TIED = ("qwen2", "gemma2", "gemma3_text", "gpt2", "bert", "t5")
DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2", "bert", "t5", "olmo", "olmo2",
         "granite", "stablelm")  # fmt: skip
FAMILIES = {
    **{name: {**_IDS, "tie_word_embeddings": name in TIED, **({"head_dim": 8} if name in ("gemma2", "gemma3_text", "qwen3") else {})}
       for name in DENSE if name != "t5"},
    "t5": {**_IDS, "tie_word_embeddings": True, "eos_token_id": 1, "decoder_start_token_id": 0, "d_kv": 8, "d_ff": 32, "num_decoder_layers": 2,
           "relative_attention_num_buckets": 8},
    "qwen2_moe": {**_IDS, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8},
    "olmoe": {**_IDS, "num_experts": 4, "num_experts_per_tok": 2},
    "glm4_moe": {**_IDS, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "first_k_dense_replace": 1,
                 "n_group": 1, "topk_group": 1, "head_dim": 8},
    "gpt_oss": {**_IDS, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8, "layer_types": ["sliding_attention", "full_attention"]},
}  # fmt: skip


def test_family_matrix(tmp_path):
    """Every other family: the save_pretrained directory loads to from_pretrained's values; save
    writes save_pretrained's keys (the tied output not stored twice) and bytes, and from_pretrained
    reads it back exactly."""
    bad = {}
    for kind in FAMILIES:
        model = tiny(kind, 0, FAMILIES)
        hub, ours = tmp_path / kind / "hub", tmp_path / kind / "ours"
        model.save_pretrained(hub)
        target = tiny(kind, 1, FAMILIES)
        ok = checkpoint.load(target, hub).ok and same_state(state(target), state(from_pretrained(hub)))
        checkpoint.save(model, ours)
        got, want = stored(ours), stored(hub)
        checks = {"load": ok, "keys": sorted(got) == sorted(want), "bytes": all(torch.equal(got[k], want[k]) for k in want if k in got),
                  "from_pretrained": same_state(state(from_pretrained(ours)), state(model))}  # fmt: skip
        if not all(checks.values()):
            bad[kind] = [k for k, v in checks.items() if not v] + sorted(set(got) ^ set(want))
    assert bad == {}


# --- the dense families on 2 ranks: one shared spawn, asserted here per family --------------------

RANK_BATCH, SEQ_LEN = 2, 8  # each rank's batch: rows [2 r, 2 r + 2) of the global (4, 8) batch


def matrix_config(kind: str):
    """The 2-rank matrix's config of ``kind``: ``FAMILIES``' with one layer (T5: one a stack)."""
    return tiny_config(kind, FAMILIES, num_hidden_layers=1, num_decoder_layers=1, use_cache=False)


def matrix_inputs(kind: str, world: int) -> dict[str, torch.Tensor]:
    """The global batch ``(RANK_BATCH * world, SEQ_LEN)`` of token ids (T5: its decoder's too)."""
    g = torch.Generator().manual_seed(4)
    ids = {"input_ids": torch.randint(3, 64, (RANK_BATCH * world, SEQ_LEN), generator=g)}
    if kind == "t5":
        ids["decoder_input_ids"] = torch.randint(3, 64, (RANK_BATCH * world, SEQ_LEN), generator=g)
    return ids


def _full(model) -> dict[str, torch.Tensor]:
    """The full values of ``model``'s state dict and non-persistent buffers (a collective for DTensors)."""
    from tests.init_view_checks import full_state

    return {k: v.detach().clone() for k, v in full_state(model).items()}


def _family_rank(rank: int, world: int, root: str, kind: str) -> dict:
    """One family on this rank (see ``_family_ranks``)."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoparallel import build_parallel_module, capture, default_plan

    meshes = {"1": init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "one"))["one"],
              "2": init_device_mesh("cpu", (world,))}  # fmt: skip
    with torch.device("meta"):
        meta = auto_class(kind).from_config(matrix_config(kind)).eval()
    mine = {k: v[RANK_BATCH * rank : RANK_BATCH * (rank + 1)] for k, v in matrix_inputs(kind, world).items()}
    cap = capture(meta, (), mine)  # one capture: both meshes run the same local batch
    out: dict = {"fqns": sorted(cap.fqn_map.eager_fqns(include_aliases=True)), "aliases": cap.fqn_map.alias_groups()}
    for key, mesh in meshes.items():
        pmod = build_parallel_module(meta, cap, default_plan(cap.fqn_map, mesh), mesh)
        pmod.to_empty(device="cpu")
        torch.manual_seed(5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FullTensorWarning of inits needing a whole tensor: values checked
            pmod.init_weights()
        out[f"init {key}"] = _full(pmod)
        emb, head = pmod.get_input_embeddings().weight, pmod.get_output_embeddings().weight
        out[f"tied {key}"] = head is emb
    # The 2-rank module: the save_pretrained directory in, the outputs of this rank's rows, save.
    out["load ok"] = checkpoint.load(pmod, os.path.join(root, kind, "hub")).ok
    out["loaded"] = _full(pmod)
    with torch.no_grad():
        y = pmod(**mine)
    out["logits"] = y.logits.detach().clone()
    checkpoint.save(pmod, os.path.join(root, kind, "ours"))
    return out


def _family_ranks(rank: int, world: int, root: str) -> dict:
    """Each rank, every family of ``DENSE`` in turn (tiny, one layer, built on meta): capture for
    the local batch and the FQN map; the parallel module (default plan) on a 1-rank and a 2-rank
    mesh, ``init_weights()`` from seed 5 on each; the 2-rank one loaded from the family's
    save_pretrained directory, run on this rank's rows, and saved (default: on-disk layout).
    ``{kind: results}``; a family that raised gives its traceback instead (both ranks run the same
    code, so both raise where one does)."""
    import traceback

    results = {}
    for kind in DENSE:
        try:
            results[kind] = _family_rank(rank, world, root, kind)
        except Exception:  # noqa: BLE001 - reported by that family's test in the parent
            results[kind] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def family_spawn(tmp_path_factory):
    """The one 2-rank spawn behind ``test_family_on_two_ranks``: ``(root, [rank results])``, the
    save_pretrained directories written first (seed 0). An error of the spawn fails every family."""
    from checkpoint.ranks.launch import run_ranks

    root = tmp_path_factory.mktemp("families")
    for kind in DENSE:
        model = auto_class(kind).from_config(matrix_config(kind)).eval()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        model.save_pretrained(root / kind / "hub")
    try:
        return root, run_ranks(_family_ranks, 2, str(root), backend="gloo", timeout=300)
    except Exception as e:  # noqa: BLE001 - every family's test reports it
        return root, e


@pytest.mark.slow
@pytest.mark.parametrize("kind", DENSE)
def test_family_on_two_ranks(family_spawn, kind):
    """A dense family on 2 gloo ranks, as the README's quick start runs it: the FQN map names every
    eager tensor (tied names as aliases of one); ``init_weights()`` of the parallel module on 1 and
    2 ranks equals ``mesh_independent_init`` of the eager model bit for bit (padding row zero, the
    tie kept); the save_pretrained directory loads to from_pretrained's values, the outputs of each
    rank's rows equal the eager model's bit for bit; ``save`` writes save_pretrained's keys and
    bytes and from_pretrained reads the model back."""
    from autoparallel import mesh_independent_init
    from tests.init_view_checks import unequal

    root, results = family_spawn
    if isinstance(results, Exception):
        raise results
    ranks = [res[kind] for res in results]
    for res in ranks:
        assert not isinstance(res, str), res
    eager = auto_class(kind).from_config(matrix_config(kind)).eval()
    names = {n for n, _ in [*eager.named_parameters(remove_duplicate=False), *eager.named_buffers(remove_duplicate=False)]}
    ties = [sorted(g) for g in ranks[0]["aliases"]]
    assert ranks[0]["fqns"] == sorted(names) and all(r["fqns"] == ranks[0]["fqns"] for r in ranks)
    tied = kind in TIED
    emb = next(k for k, v in eager.named_parameters() if v is eager.get_input_embeddings().weight)
    assert (emb in {n for g in ties for n in g}) == tied, ties

    torch.manual_seed(5)
    want = _full(mesh_independent_init(eager))
    pad = eager.get_input_embeddings().padding_idx
    zero_rows = (~want[emb].any(dim=1)).nonzero().flatten().tolist()
    assert zero_rows == ([pad] if pad is not None else [])
    for rank, res in enumerate(ranks):
        for mesh in ("1", "2"):
            assert unequal(res[f"init {mesh}"], want) == [], (rank, mesh)
            assert res[f"tied {mesh}"] == tied

    hub, ours = root / kind / "hub", root / kind / "ours"
    ref = from_pretrained(hub)
    loaded = state(ref)
    batch = matrix_inputs(kind, len(ranks))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank computes (tests/rank_threads.py): the same kernels' splits
    try:
        with torch.no_grad():
            for rank, res in enumerate(ranks):
                assert res["load ok"]
                assert same_state({k: res["loaded"][k] for k in loaded}, loaded), rank
                rows = {k: v[RANK_BATCH * rank : RANK_BATCH * (rank + 1)] for k, v in batch.items()}
                assert torch.equal(res["logits"], ref(**rows).logits), rank
    finally:
        torch.set_num_threads(threads)
    assert_same_state(stored(ours), stored(hub))
    assert_same_state(state(from_pretrained(ours)), loaded)
