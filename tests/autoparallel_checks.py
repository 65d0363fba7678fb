"""Per-rank checks of the parallel module run inside the spawns of tests/test_autoparallel_ranks.py
(one spawn per world size, shared): transformers models with default attention, the refusal of
never-initialized state, and the bytes mixed-precision collectives move."""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import checkpoint
from autoparallel import (
    AutoParallel,
    MixedPrecisionPolicy,
    StateError,
    UninitializedStateError,
    build_parallel_module,
    capture,
    default_plan,
    gather,
)
from autoparallel.data import InputSignature, local_inputs
from tests.models import TinyConfig, TinyTransformer, hf_bert, hf_gpt2, hf_llama

# Llama's vocab 66 gives uneven Shard(0) embedding / head shards on 4 ranks.
HF_MODELS = {"llama": lambda: hf_llama(vocab=66), "bert": hf_bert, "gpt2": hf_gpt2}
SEQ = 12


def _tensors(tree) -> list[torch.Tensor]:
    return [y for y in pytree.tree_leaves(tree) if isinstance(y, torch.Tensor)]


def _hf_inputs(name: str, batch: int) -> dict:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 64, (batch, SEQ), generator=g)
    if name != "bert":
        return {"input_ids": ids}
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    mask[1::2, SEQ - 4 :] = 0  # padded rows: the mask is built from an input inside the graph
    return {"input_ids": ids, "attention_mask": mask}


def _mixed_plan(fmap, mesh: DeviceMesh) -> dict:
    """The default plan with every 3rd matrix Shard(1) and every 3rd replicated (per mesh dim)."""
    plan = default_plan(fmap, mesh)
    matrices = [r.fqn for r in fmap if len(r.shape) == 2]
    for i, fqn in enumerate(matrices):
        if i % 3 == 1:
            plan[fqn] = (Shard(1),) + (Shard(0),) * (mesh.ndim - 1)
        elif i % 3 == 2:
            plan[fqn] = (Replicate(),) + (Shard(1),) * (mesh.ndim - 1)
    return plan


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """max |a - b| over the reference's scale (max |b|, at least ``floor``)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item()


def hf_checks(rank: int, names: list[str], setups: list[tuple], tag: str) -> dict:
    """transformers models with their default attention (sdpa), float32: forward outputs and every
    gradient of the parallel module against eager on the global batch, for each setup
    ``(mesh, input placements, output placements or None, plan kind)``; setups whose local
    shapes agree share one capture. Returns ``{"<model> <tag>.<setup #>": (out rel diff, grad rel diff)}``."""
    out: dict = {}
    for name in names:
        torch.manual_seed(0)
        model = HF_MODELS[name]()
        assert model.config._attn_implementation == "sdpa"  # the library default
        ref = copy.deepcopy(model)
        batch = 2 * max(s[0].size() for s in setups)
        kwargs = _hf_inputs(name, batch)
        ref_out = _tensors(ref(**kwargs))
        weights = [
            torch.randn(y.shape, generator=torch.Generator().manual_seed(7 + i))
            for i, y in enumerate(ref_out)
        ]
        sum((y * w).sum() for y, w in zip(ref_out, weights)).backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        # A gradient that is zero in exact arithmetic (BERT's key bias: softmax ignores a per-row
        # shift) is pure rounding noise; its scale is floored at 1e-3 of the model's largest.
        floor = 1e-3 * max(g.abs().max().item() for g in ref_grads.values())
        cap = None
        for k, (mesh, in_pl, out_pl, plan_kind) in enumerate(setups):
            table = [in_pl] * len(kwargs)
            local = local_inputs((), kwargs, table, tuple(mesh.shape))
            if cap is None or cap.inputs != InputSignature.of(*local):
                cap = capture(model, *local)
            plan = _mixed_plan(cap.fqn_map, mesh) if plan_kind == "mixed" else default_plan(cap.fqn_map, mesh)
            outs = [out_pl] * len(ref_out) if out_pl else None
            pmod = build_parallel_module(model, cap, plan, mesh, table, outs)
            my_in = {key: distribute_tensor(v, mesh, in_pl).to_local() for key, v in kwargs.items()}
            got = _tensors(pmod(**my_in))
            want_pl = out_pl or in_pl
            mine = [distribute_tensor(t.detach(), mesh, want_pl).to_local() for t in (*ref_out, *weights)]
            want, my_w = mine[: len(ref_out)], mine[len(ref_out) :]
            sum((y * w).sum() for y, w in zip(got, my_w)).backward()
            out_d = max(_rel(y, r.detach()) for y, r in zip(got, want))
            # reduce="mean": the per-rank sums' gradients averaged over the data-parallel ranks.
            dp = 1
            for i, p in enumerate(in_pl):
                dp *= mesh.size(i) if p.is_shard() else 1
            grad_d = 0.0
            for n, p in pmod.named_parameters():
                if n in ref_grads:
                    assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, n
                    grad_d = max(grad_d, _rel(p.grad.full_tensor() * dp, ref_grads[n], floor))
                else:
                    assert p.grad is None, n  # unused in the graph (BERT's pooler when not returned)
            assert out_d <= 1e-5 and grad_d <= 1e-5, (name, k, out_d, grad_d)
            out[f"{name} {tag}.{k}"] = (out_d, grad_d)
    return out


def _named(err: UninitializedStateError) -> set[str]:
    """The FQNs an UninitializedStateError names: the message's first 8 (then a count), all in ``fqns``."""
    assert set(err.fqns[:8]) <= set(str(err).split("allocated: ")[1].split(". Call")[0].split(", "))
    return set(err.fqns)


def uninit_checks(rank: int, mesh: DeviceMesh) -> bool:
    """to_empty'd tensors are refused until written; load alone leaves Llama's inv_freq unwritten."""
    world = mesh.size()
    with torch.device("meta"):
        tiny = TinyTransformer(TinyConfig(n_layers=1))
    tokens = torch.randint(0, 32, (2 * world, 8))
    with AutoParallel(tiny, lambda: tokens, mesh) as autop:
        pmod = autop.apply_placement()
    pmod.to_empty(device="cpu")
    mine = tokens.chunk(world)[rank]
    with pytest.raises(
        UninitializedStateError, match=r"12 tensor\(s\).*init_weights\(\).*checkpoint.load"
    ) as err:
        pmod(mine)
    every = {n for n, _ in pmod.named_parameters()} | {"freqs_cis"}
    assert _named(err.value) == every
    # Writes of any kind count, a tensor at a time.
    with torch.no_grad():
        pmod.norm.weight.fill_(1.0)
    zeros = distribute_tensor(torch.zeros(16, 16), mesh, [Shard(0)])
    pmod.load_state_dict({"layers.0.attention.wq.weight": zeros}, strict=False)
    with pytest.raises(UninitializedStateError, match=r"10 tensor\(s\)") as err:
        pmod(mine)
    assert _named(err.value) == every - {"norm.weight", "layers.0.attention.wq.weight"}
    pmod.init_weights()
    pmod(mine)  # everything written

    # transformers' Llama: checkpoint.load writes every persistent tensor, not rotary_emb.inv_freq.
    torch.manual_seed(0)
    eager = hf_llama()
    ckpt = os.path.join(tempfile.gettempdir(), f"fqnckpt-uninit-{os.getppid()}")
    if rank == 0:  # transformers' own save_pretrained: checkpoint.load reads it into the parallel module
        shutil.rmtree(ckpt, ignore_errors=True)
        eager.save_pretrained(ckpt)
    dist.barrier()
    with torch.device("meta"):
        meta = hf_llama()
    ids = torch.randint(0, 64, (2 * world, SEQ), generator=torch.Generator().manual_seed(3))
    with AutoParallel(meta, lambda: {"args": (), "kwargs": {"input_ids": ids}}, mesh) as autop:
        pllama = autop.apply_placement()
    pllama.to_empty(device="cpu")
    checkpoint.load(pllama, ckpt)
    mine = ids.chunk(world)[rank]
    with pytest.raises(UninitializedStateError, match=r"1 tensor\(s\).*: model.rotary_emb.inv_freq\. Call"):
        pllama(input_ids=mine)
    pllama.init_weights()  # computes the rotary buffers (and re-initializes the weights)
    checkpoint.load(pllama, ckpt)
    torch.testing.assert_close(
        pllama(input_ids=mine).logits, eager(input_ids=ids).logits.chunk(world)[rank], atol=1e-5, rtol=1e-5
    )
    # save_pretrained on the parallel module (every rank): the eager class's from_pretrained reads it.
    pretrained = ckpt + "-pretrained"
    pllama.save_pretrained(pretrained, max_shard_size="100KB")
    dist.barrier()  # gloo's barrier also waits for every collective still in flight on this group
    with pytest.raises(TypeError, match="safe_serialization=False"):
        pllama.save_pretrained(pretrained, safe_serialization=False)
    if rank == 0:
        back = type(eager).from_pretrained(pretrained)
        assert json.load(open(os.path.join(pretrained, "config.json")))["architectures"] == [type(eager).__name__]
        torch.testing.assert_close(back(input_ids=ids).logits, eager(input_ids=ids).logits, atol=0, rtol=0)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(pretrained)
    # A graph captured in training mode refuses eval mode (its dropout is fixed at capture).
    pllama.eval()
    with pytest.raises(
        StateError, match=r"'AutoParallelLlamaForCausalLM' is in eval mode.*captured in training"
    ):
        pllama(input_ids=mine)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(ckpt)
    return True


class _CountCollectives(TorchDispatchMode):
    """Records ``(collective, input dtype, input bytes)`` of every functional collective."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name not in ("wait_tensor", "_wrap_tensor_autograd"):
            t = args[0]
            self.calls.append((name, t.dtype, t.numel() * t.element_size()))
        return func(*args, **(kwargs or {}))


def mp_bytes_checks(rank: int, mesh: DeviceMesh) -> dict:
    """All-gathers move param_dtype (bf16) bytes; gradients are reduce-scattered in reduce_dtype
    (float32 by default, bf16 when asked); exact byte counts from the plan's shard shapes; one
    collective each way per step (the parameters form one bucket)."""
    world = mesh.size()
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(n_layers=1))
    model.init_weights()
    tokens = torch.randint(0, 32, (2 * world, 8))
    found = {}
    for reduce_dtype in (None, torch.bfloat16):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        with AutoParallel(model, lambda: tokens, mesh, mp_policy=policy) as autop:
            pmod = autop.apply_placement()
        # Every parameter is Shard(0) with even shards here (dims 16 / 32 over 2 ranks).
        params = dict(pmod.named_parameters())  # the tied embedding once
        assert all(p.placements == (Shard(0),) and p.shape[0] % world == 0 for p in params.values())
        with _CountCollectives() as fwd:
            logits = pmod(tokens.chunk(world)[rank])
        with _CountCollectives() as bwd:
            logits.float().sum().backward()
        # All Shard(0) parameters on a 1-D mesh: one bucket, one all-gather and one reduce-scatter.
        gathers = [c for c in fwd.calls if c[0] == "all_gather_into_tensor"]
        assert len(gathers) == len(fwd.calls) == 1, fwd.calls
        assert all(dtype == torch.bfloat16 for _, dtype, _ in gathers)
        assert sum(b for *_, b in gathers) == sum(p.numel() // world * 2 for p in params.values())
        scatters = [c for c in bwd.calls if c[0] == "reduce_scatter_tensor"]
        assert len(scatters) == len(bwd.calls) == 1, bwd.calls
        want = reduce_dtype or torch.float32
        assert all(dtype == want for _, dtype, _ in scatters)
        assert sum(b for *_, b in scatters) == sum(p.numel() * want.itemsize for p in params.values())
        assert all(p.grad.dtype == torch.float32 for p in params.values())
        found[str(want)] = (sum(b for *_, b in gathers), sum(b for *_, b in scatters))
    return found


class _Uneven(torch.nn.Module):
    """Dim 0 of 9 and 5 rows: uneven shards on 2 and 4 ranks (3, 3, 3, 0 and 2, 2, 1, 0 on 4)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(9, 6)
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 6, bias=False)  # Shard(1) override: per-tensor path
        self.c = torch.nn.Parameter(torch.randn(4, 6))  # Replicate override: per-tensor path
        self.unused = torch.nn.Parameter(torch.randn(7))  # in the graph, not in the loss

    def forward(self, ids):
        h = torch.tanh(self.a(self.emb(ids)))
        return self.b(h) @ self.c.t(), self.unused * 2


def _bucket_pmods(model, mesh, ids, policy=None, caps=(None,), reduce="sum") -> list:
    """One parallel module per bucket cap (``None``: the default), sharing one capture. The bucket
    checks' losses sum over the global batch (each rank its part): ``reduce="sum"`` by default."""
    pmods = []
    with AutoParallel(model, lambda: ids, mesh, mp_policy=policy, reduce=reduce) as autop:
        autop.set_placements({"b.weight": (Shard(1),), "c": (Replicate(),)})
        for cap in caps:
            default, gather.BUCKET_BYTES = gather.BUCKET_BYTES, cap or gather.BUCKET_BYTES
            try:
                pmods.append(autop.apply_placement())
            finally:
                gather.BUCKET_BYTES = default
    return pmods


class _OpOrder(TorchDispatchMode):
    """Names of the ops dispatched, in order."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


class InFlight(TorchDispatchMode):
    """``max``: the most functional collectives issued and not yet waited at any moment (c10d's
    registry of pending functional works, read after each one is issued). On gloo,
    several of torch 2.13's functional all-gathers in flight corrupt the heap
    (tests/repro/gloo_functional_inflight.py); the parallel module keeps at most one on CPU."""

    def __init__(self):
        super().__init__()
        self.max = 0
        self.log: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        r = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional":
            pending = torch._C._distributed_c10d._get_work_registry_size()
            self.max = max(self.max, pending)
            self.log.append((func.__name__.split(".")[0], pending))
        return r


def bucket_checks(rank: int, mesh: DeviceMesh) -> dict:
    """The bucketed path (Shard(0) parameters on a 1-D mesh) next to the per-tensor one: forward and
    gradients equal eager (float32, uneven dim 0, a rank with an empty shard on 4 ranks, an output
    the loss ignores, accumulation over two backwards, a frozen member), with one bucket and with
    a bucket per tensor (a reduce-scatter issued before backward is over); under bf16 one all-gather
    of the padded bucket in bf16 and one reduce-scatter in float32 per step."""
    world = mesh.size()
    torch.manual_seed(0)
    model = _Uneven()
    ids = torch.randint(0, 9, (2 * world, 3), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)
    ref_out, ref_unused = ref(ids)
    w = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(2))
    (ref_out * w).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    assert set(ref_grads) == {"emb.weight", "a.weight", "a.bias", "b.weight", "c"}
    scale = max(g.abs().max().item() for g in ref_grads.values())
    diffs = []
    # The default cap (one bucket) and a 1-byte cap (a bucket per tensor, reduce-scatters issued
    # while backward runs, a bucket the loss never reaches).
    # Each rank's loss sums its part of the global batch: reduce="sum" gives eager's gradients,
    # reduce="mean" (uneven and empty shards, per-tensor members) eager's / world.
    one, each = _bucket_pmods(model, mesh, ids, caps=(None, 1))
    (mean,) = _bucket_pmods(model, mesh, ids, reduce="mean")
    if world > 1:  # on CPU (gloo) one collective in flight at a time
        for pmod in (one, each):
            with InFlight() as flight:
                out, _ = pmod(ids.chunk(world)[rank])
                out.sum().backward()
            assert flight.max == 1, (flight.max, flight.log)
            pmod.zero_grad()
    for pmod in (one, each, mean):
        factor = 1 / world if pmod is mean else 1.0
        buckets = pmod._autoparallel.buckets
        fqns = sorted(fqn for b in buckets for fqn in b.fqns)
        assert fqns == ["a.bias", "a.weight", "emb.weight", "unused"], fqns
        assert len(buckets) == (4 if pmod is each else 1)
        assert sorted(fqn for fqn, _ in pmod._autoparallel.single) == ["b.weight", "c"]
        for accumulated in (1, 2):  # the second backward adds to the first's gradients
            out, unused = pmod(ids.chunk(world)[rank])
            diffs.append(_rel(out, ref_out.chunk(world)[rank].detach()))
            assert torch.equal(unused, ref_unused.detach())
            with _OpOrder() as order:
                (out * w.chunk(world)[rank]).sum().backward()
            if world > 1 and pmod is each:  # a.weight's reduce-scatter starts before emb's gradient
                first = order.ops.index("reduce_scatter_tensor")
                assert first < order.ops.index("embedding_dense_backward"), order.ops
            for n, p in pmod.named_parameters():
                if n == "unused":
                    assert p.grad is None  # as in eager: the loss does not reach it
                    continue
                assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, n
                assert p.grad.to_local().shape == p.to_local().shape, n
                diffs.append(_rel(p.grad.full_tensor(), accumulated * factor * ref_grads[n], scale * factor))
        pmod.zero_grad()
        pmod.a.bias.requires_grad_(False)
        out, _ = pmod(ids.chunk(world)[rank])
        (out * w.chunk(world)[rank]).sum().backward()
        assert pmod.a.bias.grad is None and pmod.emb.weight.grad is not None
        diffs.append(_rel(pmod.emb.weight.grad.full_tensor(), factor * ref_grads["emb.weight"], scale * factor))
        with torch.no_grad():
            diffs.append(_rel(pmod(ids.chunk(world)[rank])[0], ref_out.chunk(world)[rank].detach()))
        # A member replaced by a plain parameter: its bucket goes down the per-tensor path (a plain
        # tensor is not reduced across ranks).
        pmod.zero_grad()
        pmod.a.bias = torch.nn.Parameter(ref.a.bias.detach().clone())
        out, _ = pmod(ids.chunk(world)[rank])
        (out * w.chunk(world)[rank]).sum().backward()
        bias_grad = pmod.a.bias.grad.clone()  # a plain tensor's gradient is this rank's batch's
        dist.all_reduce(bias_grad)  # (in either mode: a plain tensor is no DTensor to reduce)
        diffs.append(_rel(bias_grad, ref_grads["a.bias"], scale))
        diffs.append(_rel(pmod.a.weight.grad.full_tensor(), factor * ref_grads["a.weight"], scale * factor))
    assert max(diffs) <= 1e-5, diffs

    # Bytes and number of collectives under bf16 (gloo: only with more than one rank).
    (pmod,) = _bucket_pmods(model, mesh, ids, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with _CountCollectives() as fwd:
        out, _ = pmod(ids.chunk(world)[rank])
    with _CountCollectives() as bwd:
        out.float().sum().backward()
    padded = sum(-(-p.shape[0] // world) * p[0].numel() for p in model.parameters() if p is not model.c)
    padded -= -(-6 // world) * 5  # b.weight is not in the bucket
    if world > 1:
        assert fwd.calls[0] == ("all_gather_into_tensor", torch.bfloat16, 2 * padded), fwd.calls
        assert [c[0] for c in fwd.calls] == ["all_gather_into_tensor"] * 2  # + b.weight's (Shard(1))
        assert ("reduce_scatter_tensor", torch.float32, 4 * world * padded) in bwd.calls, bwd.calls
        assert sorted(c[0] for c in bwd.calls) == [
            "all_reduce",
            "reduce_scatter_tensor",
            "reduce_scatter_tensor",
        ]
    return {"diff": max(diffs), "fwd": len(fwd.calls), "bwd": len(bwd.calls)}


GRAD_BATCH = 4  # global batch of the gradient-agreement check: split over 1, 2 or 4 ranks


def grad_agreement_batch(cfg: TinyConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The global ``(tokens, targets)`` of :func:`grad_agreement_checks` (the same in every world)."""
    g = torch.Generator().manual_seed(21)
    return (
        torch.randint(0, cfg.vocab, (GRAD_BATCH, cfg.seq), generator=g),
        torch.randint(0, cfg.vocab, (GRAD_BATCH, cfg.seq), generator=g),
    )


def grad_agreement_model() -> TinyTransformer:
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(n_layers=1))
    model.init_weights()
    return model


def mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over the given (this rank's) tokens, as transformers' ``out.loss``."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def grad_agreement_checks(rank: int, mesh: DeviceMesh) -> dict:
    """One step's full gradients on the same global batch, float32, from: the parallel module
    (``reduce="mean"``, per-rank mean loss) with the default plan (bucketed path) and a mixed plan
    (per-tensor path), the parallel module with ``reduce="sum"`` and a loss normalised over the
    global batch, FSDP2 (``fully_shard`` per block and at the root, per-rank mean loss), and under
    ``reduce_dtype=float16`` (FSDP2's pre / post division) the parallel module and FSDP2.
    Returns ``{kind: {FQN: full gradient}}`` (the test compares them across world sizes)."""
    world = mesh.size()
    model = grad_agreement_model()
    tokens, targets = grad_agreement_batch(model.cfg)
    mine, my_targets = tokens.chunk(world)[rank], targets.chunk(world)[rank]
    out: dict = {}

    def run(kind, module, loss_of):
        loss_of(module(mine), my_targets).backward()
        out[kind] = {n: _full_grad(p.grad) for n, p in module.named_parameters()}

    def global_sum(logits, t):  # this rank's share of the global mean: summed, not averaged
        return F.cross_entropy(logits.float().flatten(0, 1), t.flatten(), reduction="sum") / targets.numel()

    fp16_reduce = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float16)
    for kinds, reduce, policy, loss_of in [
        (("mean", "mean mixed plan"), "mean", None, mean_loss),  # one capture, two plans
        (("sum",), "sum", None, global_sum),
        (("mean fp16 reduce",), "mean", fp16_reduce, mean_loss),
    ]:
        with AutoParallel(model, lambda: tokens, mesh, mp_policy=policy, reduce=reduce) as autop:
            for kind in kinds:
                plan = _mixed_plan(autop.fqn_map, mesh) if "mixed" in kind else autop.optimize_placement()
                run(kind, autop.apply_placement(plan), loss_of)
    for kind, policy in [("fsdp2", None), ("fsdp2 fp16 reduce", fp16_reduce)]:
        fsdp = copy.deepcopy(model)
        for block in fsdp.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
        fully_shard(fsdp, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
        run(kind, fsdp, mean_loss)
    return out


def _full_grad(g: torch.Tensor) -> torch.Tensor:
    return g.full_tensor() if isinstance(g, DTensor) else g


def replaced_param_checks(rank: int, mesh: DeviceMesh) -> dict:
    """A parameter replaced by a DTensor with other placements than the plan's is
    gathered by its own placements: forward and gradients equal eager with the new value, the
    gradient in the new placements (both paths: a bucket member and a per-tensor one, under
    ``reduce="sum"`` and ``"mean"``). A replacement the graph cannot take (global shape, dtype,
    a Partial placement, not a tensor) is refused with a StateError naming its FQN before any
    collective, the module unchanged."""
    world = mesh.size()
    torch.manual_seed(0)
    model = _Uneven()
    ids = torch.randint(0, 9, (2 * world, 3), generator=torch.Generator().manual_seed(1))
    w = torch.randn(2 * world, 3, 4, generator=torch.Generator().manual_seed(2))
    new = {
        "a.weight": torch.randn(5, 6, generator=torch.Generator().manual_seed(11)),  # plan: Shard(0), bucketed
        "c": torch.randn(4, 6, generator=torch.Generator().manual_seed(12)),  # plan: Replicate, per tensor
    }
    ref = copy.deepcopy(model)
    ref.a.weight = torch.nn.Parameter(new["a.weight"].clone())
    ref.c = torch.nn.Parameter(new["c"].clone())
    ref_out = ref(ids)[0]
    (ref_out * w).sum().backward()
    diffs = []
    # reduce="sum": two modules of one capture, the second kept untouched for the refusals below.
    summed, untouched = _bucket_pmods(model, mesh, ids, caps=(None, None))
    for reduce in ("sum", "mean"):
        factor = 1 / world if reduce == "mean" else 1.0
        (pmod,) = (summed,) if reduce == "sum" else _bucket_pmods(model, mesh, ids, reduce="mean")
        for fqn, placements in (("a.weight", (Replicate(),)), ("c", (Shard(1),))):
            mod, leaf = (pmod.a, "weight") if fqn == "a.weight" else (pmod, "c")
            setattr(mod, leaf, torch.nn.Parameter(distribute_tensor(new[fqn].clone(), mesh, placements)))
        out = pmod(ids.chunk(world)[rank])[0]
        diffs.append(_rel(out, ref_out.chunk(world)[rank].detach()))
        (out * w.chunk(world)[rank]).sum().backward()
        for fqn, want in (("a.weight", (Replicate(),)), ("c", (Shard(1),)), ("emb.weight", (Shard(0),))):
            p = pmod.get_parameter(fqn)
            assert isinstance(p.grad, DTensor) and p.grad.placements == want, (fqn, p.grad)
            ref_g = ref.get_parameter(fqn).grad
            diffs.append(_rel(p.grad.full_tensor(), factor * ref_g, factor * ref_g.abs().max().item()))
    assert max(diffs) <= 1e-5, diffs

    # Refusals: named, before any collective, nothing changed.
    from tests.snapshot import Snapshot

    pmod = untouched
    partial = DTensor.from_local(torch.zeros(4, 6), mesh, [Partial()], run_check=False)
    bad = [
        ("a.weight", torch.nn.Parameter(distribute_tensor(torch.zeros(5, 7), mesh, [Shard(0)])), r"shape \(5, 7\)"),
        ("a.weight", torch.nn.Parameter(distribute_tensor(torch.zeros(5, 6).double(), mesh, [Replicate()])), "float64"),
        ("c", torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16)), "bfloat16"),
        ("c", torch.nn.Parameter(partial), "Partial"),
    ]
    for fqn, value, message in bad:
        mod, leaf = (pmod.a, "weight") if fqn == "a.weight" else (pmod, "c")
        kept = getattr(mod, leaf)
        setattr(mod, leaf, value)
        snap = Snapshot(pmod)
        with _CountCollectives() as comm:
            with pytest.raises(StateError, match=rf"'{fqn}'.*{message}"):
                pmod(ids.chunk(world)[rank])
        assert comm.calls == [], comm.calls
        snap.assert_unchanged()
        setattr(mod, leaf, kept)
    pmod.c = None  # an unset parameter slot: refused by name too
    with pytest.raises(StateError, match=r"'c' is NoneType, not a tensor"):
        pmod(ids.chunk(world)[rank])
    return {"diff": max(diffs), "refused": len(bad) + 1}


def meta_moe_checks(rank: int, mesh: DeviceMesh) -> dict:
    """transformers' Qwen3MoeForCausalLM built on meta, parallelized on ``mesh`` (captured on fake
    tensors of the mesh's device type: the MoE block's device branch is the CPU one), loaded with
    the eager model's values: logits and every gradient equal eager on the global batch (float32).
    Returns ``{"out": rel diff, "grad": rel diff}``."""
    from tests.models import hf_qwen3_moe

    world = mesh.size()
    torch.manual_seed(0)
    eager = hf_qwen3_moe()
    with torch.device("meta"):
        meta = hf_qwen3_moe()
    ids = torch.randint(0, 64, (2 * world, SEQ), generator=torch.Generator().manual_seed(4))
    with AutoParallel(meta, lambda: {"args": (), "kwargs": {"input_ids": ids}}, mesh) as autop:
        assert autop.captured.device == torch.device(mesh.device_type)
        pmod = autop.apply_placement()
    pmod.to_empty(device=mesh.device_type)
    pmod.init_weights()  # the non-persistent rotary buffers
    state = {**dict(pmod.named_parameters()), **dict(pmod.named_buffers())}
    with torch.no_grad():
        for name, t in [*eager.named_parameters(), *eager.named_buffers()]:
            state[name].copy_(distribute_tensor(t.detach(), mesh, state[name].placements))
    ref_logits = eager(input_ids=ids).logits
    w = torch.randn(ref_logits.shape, generator=torch.Generator().manual_seed(5))
    (ref_logits * w).sum().backward()
    logits = pmod(input_ids=ids.chunk(world)[rank]).logits
    out_d = _rel(logits, ref_logits.chunk(world)[rank].detach())
    (logits * w.chunk(world)[rank]).sum().backward()
    ref_grads = {n: p.grad for n, p in eager.named_parameters()}
    grad_d = 0.0
    for n, p in pmod.named_parameters():
        assert p.grad is not None and isinstance(p.grad, DTensor), n
        # reduce="mean": each rank's summed loss -> eager's gradient / world
        grad_d = max(grad_d, _rel(p.grad.full_tensor() * world, ref_grads[n], 1e-30))
    assert out_d <= 1e-5 and grad_d <= 1e-5, (out_d, grad_d)
    return {"out": out_d, "grad": grad_d}




def one_rank_checks(rank: int, mesh: DeviceMesh, workdir: str) -> dict:
    """A 1-rank world: build (meta model), init (``init_weights`` equals ``mesh_independent_init``
    of the eager model bit for bit), forward and backward (equal eager), then save, load into a
    fresh parallel module, async save and load again (all state bit-identical, forward equal
    eager). Returns ``{"save": "ok", "grad": rel diff}``."""
    from autoparallel import mesh_independent_init

    cfg = TinyConfig(n_layers=1)

    def build():
        with torch.device("meta"):
            meta = TinyTransformer(cfg)
        tokens = torch.zeros(2, cfg.seq, dtype=torch.long)
        with AutoParallel(meta, lambda: tokens, mesh) as autop:
            pmod = autop.apply_placement()
        pmod.to_empty(device=mesh.device_type)
        return pmod

    def full_state(m):
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in m.state_dict().items()}

    pmod = build()
    torch.manual_seed(3)
    pmod.init_weights()
    eager = TinyTransformer(cfg)
    torch.manual_seed(3)  # the same key for both inits
    mesh_independent_init(eager)
    want = eager.state_dict()
    got = full_state(pmod)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq), generator=torch.Generator().manual_seed(8))
    targets = torch.randint(0, cfg.vocab, (2, cfg.seq), generator=torch.Generator().manual_seed(9))
    out = pmod(tokens)
    ref = eager(tokens)
    assert torch.equal(out, ref)
    mean_loss(out, targets).backward()
    mean_loss(ref, targets).backward()
    ref_named = dict(eager.named_parameters())
    grad = max(_rel(p.grad.full_tensor(), ref_named[n].grad) for n, p in pmod.named_parameters())
    assert grad <= 1e-6, grad

    saved = os.path.join(workdir, "sync")
    checkpoint.save(pmod, saved)  # DTensors on a 1-rank process group
    second = build()
    checkpoint.load(second, saved)
    assert all(torch.equal(v, want[k]) for k, v in full_state(second).items())
    later = os.path.join(workdir, "async")
    checkpoint.async_save(second, later).result()
    third = build()
    third.init_weights()  # computes the non-persistent buffers (freqs_cis), which checkpoints do not hold
    checkpoint.load(third, later)
    assert all(torch.equal(v, want[k]) for k, v in full_state(third).items())
    assert torch.equal(third(tokens), ref)
    return {"save": "ok", "grad": grad}
