"""A world of one rank is a world: under a process group of world size 1
(``torchrun --nproc-per-node 1``, a 1-GPU FSDP2 or parallel-module run) ``save``, ``load``,
``async_save`` (background staging included) and ``CheckpointManager`` work on DTensors, for
hand-made DTensor parameters, FSDP2 (``fully_shard``) and the autoparallel parallel module.

One spawned rank (gloo) runs every check: a spawn is the cost.
"""

from __future__ import annotations

import importlib
import os
import threading

import torch
from torch import nn

from checkpoint.ranks.launch import run_ranks
from tests.helpers import same_state


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: _full(v) for k, v in module.state_dict().items()}


def _dtensor_linear(mesh, seed: int) -> nn.Module:
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(seed)
    m = nn.Linear(4, 6)
    for n, p in list(m.named_parameters()):
        setattr(m, n, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    return m


def _dtensor_checks(mesh, root: str) -> dict:
    import checkpoint
    from torch.distributed.tensor import DTensor

    out = {}
    m = _dtensor_linear(mesh, 0)
    want = _values(m)
    checkpoint.save(m, os.path.join(root, "sync"))
    with checkpoint.open_checkpoint(os.path.join(root, "sync")) as r:
        out["save"] = same_state({k: r.get(k) for k in r.keys()}, want)
    fresh = _dtensor_linear(mesh, 1)
    rep = checkpoint.load(fresh, os.path.join(root, "sync"))
    out["load"] = rep.ok and same_state(_values(fresh), want) and isinstance(fresh.weight, DTensor)
    eager = nn.Linear(4, 6)
    checkpoint.load(eager, os.path.join(root, "sync"))
    out["load_eager"] = same_state(_values(eager), want)

    # async_save with background staging: the values at the call, then a write to the local
    # tensor before staging is refused (the wrapper's counter does not see it).
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ((m.weight * m.weight).sum() + m.bias.sum()).backward()
    opt.step()
    at_call = _values(m)
    fut = checkpoint.async_save(m, os.path.join(root, "async"), optimizer=opt, background_staging=True)
    opt.step()  # held by the step pre-hook until staged
    fut.result(timeout=120)
    got = _dtensor_linear(mesh, 2)
    checkpoint.load(got, os.path.join(root, "async"))
    out["async"] = same_state(_values(got), at_call) and not same_state(_values(m), at_call)

    mod = importlib.import_module("checkpoint.training.async_save")
    gate, original = threading.Event(), mod._stage_deferred

    def held(path, deferred):
        assert gate.wait(60)
        original(path, deferred)

    mod._stage_deferred = held
    try:
        for how in ("to_local", "_local_tensor", "dtensor"):
            saver = mod.AsyncSaver()
            gate.clear()
            fut = saver.save(m, os.path.join(root, f"torn-{how}"), optimizer=opt, background_staging=True)
            with torch.no_grad():  # breaks the contract: written before wait_staged()
                if how == "to_local":
                    m.bias.to_local().fill_(7.0)
                elif how == "_local_tensor":
                    m.weight._local_tensor[0].zero_()
                else:
                    m.bias.mul_(2)
            gate.set()
            try:
                fut.result(timeout=120)
                out[f"torn {how}"] = "committed"
            except checkpoint.SnapshotChangedError as e:
                out[f"torn {how}"] = e.key
            out[f"torn {how} nothing written"] = not os.path.exists(os.path.join(root, f"torn-{how}"))
    finally:
        mod._stage_deferred = original

    # CheckpointManager, async, with retention and load_latest.
    mgr = checkpoint.CheckpointManager(os.path.join(root, "mgr"), keep_latest=1)
    mgr.save(1, m, opt, {"step": 1})
    with torch.no_grad():
        m.weight.add_(1)
    step2 = _values(m)
    mgr.save(2, m, opt, {"step": 2})
    mgr.wait()
    fresh = _dtensor_linear(mesh, 3)
    extra: dict = {"step": 0}
    out["manager"] = (
        mgr.steps() == [2]
        and mgr.load_latest(fresh, extra_state=extra) == 2
        and extra == {"step": 2}
        and same_state(_values(fresh), step2)
    )
    return out


def _fsdp2_checks(mesh, root: str) -> dict:
    import checkpoint
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, opt = build(0)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    want = _values(model)
    want_opt = {(k, s): _full(v) for k, st in enumerate(opt.state.values()) for s, v in st.items()}
    path = os.path.join(root, "fsdp2")
    checkpoint.save(model, path, optimizer=opt)
    model2, opt2 = build(5)
    checkpoint.load(model2, path, optimizer=opt2)
    got_opt = {(k, s): _full(v) for k, st in enumerate(opt2.state.values()) for s, v in st.items()}
    eager = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    checkpoint.load(eager, path)
    return {
        "fsdp2 dtensor": isinstance(model[0].weight, DTensor),
        "fsdp2 model": same_state(_values(model2), want),
        "fsdp2 optimizer": want_opt.keys() == got_opt.keys() and all(torch.equal(want_opt[k], got_opt[k]) for k in want_opt),
        "fsdp2 eager": same_state(_values(eager), want) and torch.equal(eager(x), model2(x).detach()),
    }


class _Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _parallel_module_checks(mesh, root: str) -> dict:
    import checkpoint
    from autoparallel import AutoParallel
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    eager = _Small()
    with AutoParallel(eager, lambda: torch.randn(2, 4), mesh) as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        pmod = autop.apply_placement(autop.optimize_placement())
    with torch.no_grad():
        for p in pmod.parameters():
            p.add_(0.5)  # the saved values are the parallel module's, not the eager init
    want = _values(pmod)
    path = os.path.join(root, "parallel")
    checkpoint.save(pmod, path)
    other = _Small()
    checkpoint.load(other, path)
    with torch.no_grad():
        for p in pmod.parameters():
            p.zero_()
    rep = checkpoint.load(pmod, path)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(2))
    return {
        "parallel save->eager": same_state(_values(other), want),
        "parallel load": rep.ok and same_state(_values(pmod), want),
        "parallel output": torch.allclose(pmod(x), other(x), atol=1e-6, rtol=1e-6),
    }


def _wrapped_hf_checks(mesh, root: str) -> dict:
    """A trained tiny Llama saved under FSDP2, FSDP1 and DDP: config.json's ``architectures`` and
    the reference logits, for the parent's ``from_pretrained``."""
    import json

    import checkpoint
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from tests.models import hf_llama

    tokens = torch.tensor([[1, 5, 9, 33, 2, 60, 7, 7]])
    out = {}
    for how in ("fsdp2", "fsdp1", "ddp"):
        torch.manual_seed(0)
        model = hf_llama(layers=2)
        if how == "fsdp2":
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            wrapped = model
        elif how == "fsdp1":
            wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
        else:
            wrapped = DistributedDataParallel(model)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
        wrapped(tokens, labels=tokens).loss.backward()
        opt.step()
        path = os.path.join(root, f"hf-{how}")
        checkpoint.save(wrapped, path)
        with torch.no_grad():
            logits = wrapped(tokens).logits.detach().clone()
        with open(os.path.join(path, "config.json")) as f:
            out[f"{how} architectures"] = json.load(f)["architectures"]
        out[f"{how} logits"] = logits
    return out


def _one_rank(rank, world, root):
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    assert dist.is_initialized() and dist.get_world_size() == 1
    mesh = init_device_mesh("cpu", (1,))
    out = _dtensor_checks(mesh, root)
    out.update(_fsdp2_checks(mesh, root))
    out.update(_parallel_module_checks(mesh, root))
    out.update(_wrapped_hf_checks(mesh, root))
    return out


def test_save_load_async_manager_fsdp2_parallel_module_on_one_rank(tmp_path):
    (res,) = run_ranks(_one_rank, 1, str(tmp_path), backend="gloo", timeout=300)
    # from_pretrained (transformers, in this process) of what FSDP2 / FSDP1 / DDP saved: the
    # trained model's logits exactly, under its eager class.
    from transformers import AutoModelForCausalLM

    for how in ("fsdp2", "fsdp1", "ddp"):
        assert res.pop(f"{how} architectures") == ["LlamaForCausalLM"], how
        back, info = AutoModelForCausalLM.from_pretrained(tmp_path / f"hf-{how}", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (how, info)
        with torch.no_grad():
            got = back.eval()(torch.tensor([[1, 5, 9, 33, 2, 60, 7, 7]])).logits
        assert torch.equal(got, res.pop(f"{how} logits")), how
    assert res == {
        "save": True,
        "load": True,
        "load_eager": True,
        "async": True,
        "torn to_local": "bias",
        "torn to_local nothing written": True,
        "torn _local_tensor": "weight",
        "torn _local_tensor nothing written": True,
        "torn dtensor": "bias",
        "torn dtensor nothing written": True,
        "manager": True,
        "fsdp2 dtensor": True,
        "fsdp2 model": True,
        "fsdp2 optimizer": True,
        "fsdp2 eager": True,
        "parallel save->eager": True,
        "parallel load": True,
        "parallel output": True,
    }
