"""Multi-rank checks of autoparallel (gloo, 127.0.0.1, via checkpoint.ranks.launch.run_ranks).

One spawn per world size (1, 2, 4), shared by the tests that read it (a module fixture runs each
world once); the 4-rank spawn also runs a 2x2 mesh, the 1-rank one test_one_rank_is_a_world's checks. Each rank compares the
parallel module with the eager model: outputs and every gradient within 1e-5 in float32, within
bf16 tolerance under the mixed-precision policy, over three optimizer steps.
"""

from __future__ import annotations

import copy


import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from autoparallel import (
    AutoParallel,
    DataAssignmentError,
    InputError,
    MixedPrecisionPolicy,
    apply_mixed_precision,
    dtensor_init_context,
)
from checkpoint.ranks.launch import run_ranks
from tests.autoparallel_checks import (
    InFlight,
    HF_MODELS,
    _rel,
    bucket_checks,
    grad_agreement_batch,
    grad_agreement_checks,
    grad_agreement_model,
    hf_checks,
    mean_loss,
    meta_moe_checks,
    mp_bytes_checks,
    one_rank_checks,
    replaced_param_checks,
    uninit_checks,
)
from tests.models import TinyConfig, TinyTransformer, rope_tables

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
OVERRIDES_2D = {
    "layers.*.attention.wq.weight": (Shard(0), Shard(0)),
    "layers.*.feed_forward.w2.weight": (Shard(1), Replicate()),
    "output.weight": (Replicate(), Shard(1)),  # the tied embedding, reached by its alias
}
OVERRIDES_1D = {"layers.0.*": (Replicate(),), "norm.weight": (Shard(0),)}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters(remove_duplicate=False)] + [
        n for n, _ in model.named_buffers(remove_duplicate=False)
    ]


def _parallelize(model, mesh, batch, seq, mp_policy=None, overrides=None):
    shard_all = tuple(Shard(0) for _ in range(mesh.ndim))
    with AutoParallel(model, lambda: torch.randint(0, 32, (batch, seq)), mesh, mp_policy=mp_policy) as autop:
        autop.add_input_constraints([shard_all])
        autop.add_output_constraints([shard_all])
        if overrides:
            autop.set_placements(overrides)
        plan = autop.optimize_placement()
        return autop.apply_placement(plan), plan


def _train_and_compare(rank, mesh, mp_policy, overrides, tol):
    """Three optimizer steps on the parallel module and on the eager reference; returns max diffs."""
    cfg = TinyConfig(n_layers=1)  # one block keeps the DTensor warm-up (per op signature) short
    world = mesh.size()
    torch.manual_seed(0)
    user = TinyTransformer(cfg)
    user.init_weights()
    before = {k: v.clone() for k, v in user.state_dict().items()}
    before_names = _names(user)
    ref = copy.deepcopy(user)
    apply_mixed_precision(ref, mp_policy)  # same casts in eager (a no-op without a policy)
    batch = 2 * world
    pmod, plan = _parallelize(user, mesh, batch, cfg.seq, mp_policy, overrides)

    # Structure: the user's class, eager state_dict keys, tied weight, non-persistent buffer.
    assert isinstance(pmod, TinyTransformer) and type(pmod) is not TinyTransformer
    assert list(pmod.state_dict()) == list(user.state_dict())
    assert _names(pmod) == before_names
    assert pmod.output.weight is pmod.tok_embeddings.weight
    assert "freqs_cis" in pmod._non_persistent_buffers_set and isinstance(pmod.freqs_cis, DTensor)
    for name, p in pmod.named_parameters():
        assert isinstance(p, DTensor) and p.placements == plan[pmod.fqn_map.to_eager(name)], name
        assert p.dtype == torch.float32
    assert sorted(pmod.fqn_map.eager_fqns(include_aliases=True)) == sorted(before_names)
    assert pmod.fqn_map.alias_groups() == [["tok_embeddings.weight", "output.weight"]]

    # SGD: AdamW normalizes each update (m / sqrt(v)), so a near-zero gradient's summation-order
    # noise (1e-9) becomes a 1e-5 parameter difference; SGD keeps parameters as close as gradients.
    opt, ref_opt = torch.optim.SGD(pmod.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_named = dict(ref.named_parameters())
    out_d = grad_d = param_d = 0.0
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g)
        targets = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g)
        with InFlight() as flight:
            out = pmod(tokens.chunk(world)[rank])
            mean_loss(out, targets.chunk(world)[rank]).backward()
        assert flight.max <= 1, f"{flight.max} functional collectives in flight on gloo (one at a time on CPU)"
        ref_out = ref(tokens)
        torch.testing.assert_close(out.float(), ref_out.chunk(world)[rank].float(), **tol)
        out_d = max(out_d, (out.float() - ref_out.chunk(world)[rank].float()).abs().max().item())
        # Each rank's mean loss; reduce="mean" averages the gradients: the eager global mean's.
        mean_loss(ref_out, targets).backward()
        for name, p in pmod.named_parameters():
            ref_name = (
                name if name in ref_named else name.replace(".weight", ".parametrizations.weight.original")
            )
            assert p.grad is not None and p.grad.dtype == torch.float32, name
            g_full, g_ref = _full(p.grad), ref_named[ref_name].grad
            torch.testing.assert_close(g_full, g_ref, **tol, msg=lambda m, n=name: f"grad {n}: {m}")
            grad_d = max(grad_d, (g_full - g_ref).abs().max().item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, p in pmod.named_parameters():
        ref_name = name if name in ref_named else name.replace(".weight", ".parametrizations.weight.original")
        torch.testing.assert_close(_full(p.detach()), ref_named[ref_name].detach(), **tol)
        param_d = max(param_d, (_full(p.detach()) - ref_named[ref_name].detach()).abs().max().item())
    # The user's model was never touched.
    assert _names(user) == before_names and type(user) is TinyTransformer
    for k, v in user.state_dict().items():
        assert torch.equal(v, before[k]), k
    return {"out": out_d, "grad": grad_d, "param": param_d}


class _Child(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(6, 4))
        self.register_buffer("scale", torch.empty(6), persistent=False)

    def forward(self, x):
        return (x @ self.w.t()) * self.scale

    def init_weights(self):
        with torch.no_grad():
            self.w.copy_(torch.arange(24.0).view(6, 4) / 10)
        self.scale = torch.linspace(0, 1, 6)  # buffer recomputed and reassigned


class _DetModel(nn.Module):
    """Deterministic single-device init in every style the parallel module must support."""

    def __init__(self):
        super().__init__()
        self.child = _Child()
        self.b = nn.Parameter(torch.empty(6))
        self.g = nn.Parameter(torch.empty(5, 6))
        self.z = nn.Parameter(torch.empty(3))

    def forward(self, x):
        return (self.child(x) + self.b) @ self.g.t() + self.z.sum()

    def init_weights(self, lose_write: bool = False):
        self.child.init_weights()
        self.b = nn.Parameter(torch.arange(6.0))  # reassignment
        self.g.data[:] = torch.arange(30.0).view(5, 6).cos()
        nn.init.constant_(self.z, 0.5)
        if lose_write:
            self.z.data = torch.zeros(3)


def _init_checks(rank, mesh):
    """Meta model -> to_empty -> user's init_weights: exact values, no comms, right distributions."""
    world = mesh.size()
    with torch.device("meta"):
        det = _DetModel()
    pdet, _ = _parallelize_det(det, mesh)
    pdet.to_empty(device="cpu")
    with CommDebugMode() as comm:
        pdet.init_weights()
    assert comm.get_total_counts() == 0
    eager = _DetModel()
    eager.init_weights()
    for name, t in [*eager.named_parameters(), *eager.named_buffers()]:
        got = pdet.get_parameter(name) if "scale" not in name else pdet.child.scale
        assert isinstance(got, DTensor), name
        assert torch.equal(got.full_tensor(), t.detach()), name
    assert "scale" in pdet.child._non_persistent_buffers_set
    # A submodule's init_weights called directly.
    with torch.no_grad():
        pdet.child.w.zero_()
    pdet.child.init_weights()
    assert torch.equal(pdet.child.w.full_tensor(), eager.child.w.detach())
    x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(pdet(x.chunk(world)[rank]), eager(x).chunk(world)[rank], atol=1e-5, rtol=1e-5)
    with pytest.raises(DataAssignmentError, match=r"shape \(3,\)"):
        pdet.init_weights(lose_write=True)
    with pytest.raises(DataAssignmentError):
        with dtensor_init_context(pdet):
            pdet.g.data = torch.zeros(5, 6)
    assert nn.Module.__setattr__.__name__ == "__setattr__"  # the init patch was undone

    # The transformer: built on meta, materialized, user init (random + RoPE table recomputed).
    cfg = TinyConfig()
    with torch.device("meta"):
        model = TinyTransformer(cfg)
    pmod, plan = _parallelize(model, mesh, 2 * world, cfg.seq, BF16)
    assert all(t.is_meta for t in model.state_dict().values())  # user's model untouched
    pmod.to_empty(device="cpu")
    assert pmod.output.weight is pmod.tok_embeddings.weight  # still tied after materialization
    torch.manual_seed(1234)
    with CommDebugMode() as comm:
        pmod.init_weights()
    assert comm.get_total_counts() == 0  # in-place inits stayed local: no full tensor gathered
    assert pmod.output.weight is pmod.tok_embeddings.weight and list(pmod.state_dict()) == list(
        model.state_dict()
    )
    local = pmod.layers[0].attention.wq.weight.to_local()
    assert local.shape[0] < cfg.dim  # still a shard
    assert torch.equal(pmod.freqs_cis.full_tensor(), rope_tables(cfg.dim // cfg.n_heads, cfg.seq))
    assert torch.equal(pmod.norm.weight.full_tensor(), torch.ones(cfg.dim))
    emb = pmod.tok_embeddings.weight.full_tensor()
    assert 0.014 < emb.std().item() < 0.026 and abs(emb.mean().item()) < 0.005
    chunks = emb.chunk(world)
    assert all(not torch.equal(chunks[0], c) for c in chunks[1:])  # each shard has its own stream
    # A replicated tensor initialized randomly holds the same values on every rank.
    rep = nn.Module()
    rep.register_buffer("r", distribute_tensor(torch.empty(64), mesh, [Replicate()] * mesh.ndim))
    torch.manual_seed(7)
    with dtensor_init_context(rep):
        nn.init.normal_(rep.r)
    gathered = [None] * world
    dist.all_gather_object(gathered, rep.r.to_local().tolist())
    assert all(g == gathered[0] for g in gathered) and 0.6 < torch.tensor(gathered[0]).std().item() < 1.4
    tokens = torch.randint(0, cfg.vocab, (2 * world, cfg.seq), generator=torch.Generator().manual_seed(5))
    eager_tt = TinyTransformer(cfg)
    eager_tt.load_state_dict({k: v.full_tensor() for k, v in pmod.state_dict().items()})
    apply_mixed_precision(eager_tt, BF16)
    out = pmod(tokens.chunk(world)[rank])
    torch.testing.assert_close(
        out.float(), eager_tt(tokens).chunk(world)[rank].float(), atol=1e-2, rtol=1.6e-2
    )
    return True


def _parallelize_det(model, mesh):
    shard_all = tuple(Shard(0) for _ in range(mesh.ndim))
    with AutoParallel(model, lambda: torch.randn(2 * mesh.size(), 4), mesh) as autop:
        autop.add_input_constraints([shard_all])
        autop.add_output_constraints([shard_all])
        plan = autop.optimize_placement()
        return autop.apply_placement(plan), plan


F32 = {"atol": 1e-5, "rtol": 1e-5}
BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2}


def _api_checks(rank, mesh):
    """apply_placement twice gives independent modules; inputs unlike the capture's are refused."""
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(n_layers=1))
    model.init_weights()
    tokens = torch.randint(0, 32, (2, 8))
    with AutoParallel(model, lambda: tokens, mesh) as autop:
        autop.add_input_constraints([(Shard(0),)])
        first = autop.apply_placement()
        second = autop.apply_placement()
    assert first.tok_embeddings.weight is not second.tok_embeddings.weight
    with torch.no_grad():
        first.norm.weight.zero_()
    assert torch.equal(second.norm.weight.full_tensor(), torch.ones(16))
    torch.testing.assert_close(second(tokens), model(tokens), atol=1e-6, rtol=1e-6)
    with pytest.raises(
        InputError, match=r"forward got 2 positional argument\(s\).*captured for 1 positional"
    ):
        first(tokens, tokens)
    with pytest.raises(
        InputError, match=r"input tensor #0 has shape \(1, 8\).*local \(per-rank\) shape \(2, 8\)"
    ):
        first(tokens[:1])  # the graph is static: another batch size would silently mis-shape masks
    # Exact dtype (same kind too) and the mesh's device type: never a bare error from the graph.
    with pytest.raises(InputError, match=r"input tensor #0 has dtype torch.int32; the graph was captured for torch.int64"):
        first(tokens.int())
    with pytest.raises(InputError, match=r"input tensor #0 is on device meta; the module runs on cpu"):
        first(tokens.to("meta"))
    return True


def _ranks_main(rank, world, runs, hf, workdir=None):
    results = {}
    for shape, kinds in runs:
        names = ("dp",) if len(shape) == 1 else ("dp", "tp")
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        overrides = OVERRIDES_2D if len(shape) == 2 else (OVERRIDES_1D if world > 1 else None)
        key = "x".join(map(str, shape))
        checks = {
            "fp32": lambda: _train_and_compare(rank, mesh, None, overrides, F32),
            "bf16": lambda: _train_and_compare(rank, mesh, BF16, overrides, BF16_TOL),
            "init": lambda: _init_checks(rank, mesh),
            "api": lambda: _api_checks(rank, mesh),
            "uninit": lambda: uninit_checks(rank, mesh),
            "mp": lambda: mp_bytes_checks(rank, mesh),
            "bucket": lambda: bucket_checks(rank, mesh),
            "grads": lambda: grad_agreement_checks(rank, mesh),
            "replaced": lambda: replaced_param_checks(rank, mesh),
            "moe": lambda: meta_moe_checks(rank, mesh),
            "one": lambda: one_rank_checks(rank, mesh, workdir),
        }
        for kind in kinds:  # in the order listed
            results[f"{key} {kind}"] = checks[kind]()
    for g, (names, setups) in enumerate(hf):
        results.update(hf_checks(rank, names, [_setup(*s) for s in setups], f"hf{g}"))
    return results


def _setup(shape, in_pl, out_pl, plan_kind):
    names = ("dp",) if len(shape) == 1 else ("dp", "tp")
    return init_device_mesh("cpu", shape, mesh_dim_names=names), in_pl, out_pl, plan_kind


ALL = ("fp32", "bf16", "init")
S, R = Shard(0), Replicate()
# transformers models: (names, [(mesh shape, input placements, output placements, plan)]); setups
# with equal local shapes share one capture per model.
HF_1 = [(["llama", "bert", "gpt2"], [((1,), (S,), None, "default")])]
HF_2 = [
    (["llama", "bert", "gpt2"], [((2,), (S,), None, "default"), ((2,), (S,), (R,), "mixed")]),
]
HF_4 = [
    (["llama", "bert", "gpt2"], [((4,), (S,), None, "mixed"), ((2, 2), (S, S), None, "mixed")]),
    (["llama"], [((2, 2), (S, R), None, "mixed")]),  # data split on the first mesh dim only
]


# Spawns are the cost (imports, dynamo, DTensor dispatch warm-up): one per world size, shared by
# the tests that read it (the 1-rank world also runs test_one_rank_is_a_world's checks, "one").
WORLDS = {
    1: ([((1,), ("fp32", "bf16", "api", "bucket", "grads", "replaced", "moe", "one"))], HF_1),
    2: ([((2,), (*ALL, "uninit", "mp", "bucket", "grads", "replaced", "moe"))], HF_2),
    4: ([((4,), ("fp32", "bucket", "grads", "replaced")), ((2, 2), ALL)], HF_4),
}


def _spawn(world: int, workdir: str) -> list[dict]:
    # No rerun: several of torch 2.13's functional collectives in flight on gloo corrupt the heap
    # (tests/repro/gloo_functional_inflight.py); the parallel module keeps one at a time on CPU
    # (InFlight checks it above). A rank killed by a signal fails the tests with its faulthandler
    # and native stacks (RankFailedError).
    runs, hf = WORLDS[world]
    return run_ranks(_ranks_main, world, runs, hf, workdir, backend="gloo", timeout=600)


@pytest.fixture(scope="module")
def world_results(tmp_path_factory):
    """``world_results(world size)``: that world's per-rank results, its one spawn run on first use."""
    done: dict[int, object] = {}

    def get(world: int) -> list[dict]:
        if world not in done:
            try:
                done[world] = _spawn(world, str(tmp_path_factory.mktemp(f"world{world}")))
            except BaseException as e:  # every test of this world fails with the spawn's error
                done[world] = e
        if isinstance(done[world], BaseException):
            raise done[world]
        return copy.deepcopy(done[world])

    return get


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4], ids=["1rank", "2ranks", "4ranks+2x2"])
def test_parallel_module_matches_eager(world, world_results):
    runs, hf = WORLDS[world]
    results = world_results(world)
    assert len(results) == world
    expected = {f"{'x'.join(map(str, shape))} {k}" for shape, kinds in runs for k in kinds}
    expected |= {
        f"{name} hf{g}.{k}"
        for g, (names, setups) in enumerate(hf)
        for name in names
        for k in range(len(setups))
    }
    for per_rank in results:
        assert set(per_rank) == expected
        for key, diffs in per_rank.items():
            if key.endswith("fp32"):
                assert max(diffs.values()) <= 1e-5, (key, diffs)
            if key.split()[0] in HF_MODELS:  # (output, gradient) max |diff| / reference scale
                assert max(diffs) <= 1e-5, (key, diffs)
    grads = results[0].pop(f"{world} grads")
    _check_grad_agreement(world, grads)
    print(world, results[0])


_GRADS: dict[int, dict] = {}  # world size -> its spawn's gradients (grad_agreement_checks)


def _check_grad_agreement(world: int, grads: dict) -> None:
    """The same global batch's gradients: the parallel module (mean and sum) equal the eager global
    mean's and FSDP2's within 1e-6 (relative to each tensor's max), in this world and across the
    worlds run so far; under a float16 reduce_dtype the parallel module equals FSDP2's."""
    ref = grad_agreement_model()
    tokens, targets = grad_agreement_batch(ref.cfg)
    mean_loss(ref(tokens), targets).backward()
    eager = {n: p.grad for n, p in ref.named_parameters()}
    assert set(grads) == {"mean", "mean mixed plan", "sum", "mean fp16 reduce", "fsdp2", "fsdp2 fp16 reduce"}
    table = {}
    for kind, against in [
        ("mean", "eager"),
        ("mean mixed plan", "eager"),
        ("sum", "eager"),
        ("fsdp2", "eager"),
        ("mean", "fsdp2"),
        ("mean mixed plan", "fsdp2"),
        ("mean fp16 reduce", "fsdp2 fp16 reduce"),
    ]:
        ref_grads = eager if against == "eager" else grads[against]
        assert set(grads[kind]) == set(ref_grads), kind
        table[f"{kind} vs {against}"] = max(_rel(g, ref_grads[n]) for n, g in grads[kind].items())
    for other, theirs in _GRADS.items():  # earlier spawns (other world sizes)
        for kind in ("mean", "mean mixed plan", "sum", "fsdp2"):
            table[f"{kind} vs {other} rank(s)"] = max(_rel(g, theirs[kind][n]) for n, g in grads[kind].items())
    _GRADS[world] = grads
    print(f"gradient agreement, {world} rank(s):", table)
    assert max(table.values()) <= 1e-6, table


@pytest.mark.slow
def test_one_rank_is_a_world(world_results):
    """Build, init, forward, backward, save, load and async save on a 1-rank mesh in a 1-rank world
    (run inside the 1-rank world's spawn, after its other checks)."""
    (ranks,) = world_results(1)
    result = ranks["1 one"]
    assert result["grad"] <= 1e-6
    assert result["save"] == "ok"
