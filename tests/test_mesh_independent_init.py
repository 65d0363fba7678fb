"""Mesh-independent init (autoparallel.mesh_init, autoparallel.rng).

Single-process: Philox4x32-10 known answers, shard boxes equal to slices of the full tensor, the
moments and bounds of every distribution on 10^6 samples, independence of FQN streams, fallbacks.
Multi-rank (one 4-rank spawn; meshes of 1, 2 and 4 ranks and 2x2 inside it): the parallel
module's ``init_weights()`` gives bit-identical full tensors to ``mesh_independent_init`` on the
eager model, for Shard(0), Shard(1) and Replicate plans.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from autoparallel import FullTensorWarning, mesh_independent_init
from autoparallel.rng import fill_box, philox4x32_10, stream_id

N = 1_000_000


# --- the generator --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "counter,key,expected",
    [  # Random123 v1.14.0 tests/kat_vectors, "philox4x32 10" lines
        ((0, 0, 0, 0), (0, 0), "6627e8d5 e169c58d bc57ac4c 9b00dbd8"),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), "408f276d 41c83b0e a20bc7c6 6d5451fd"),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            "d16cfe09 94fdcceb 5001e420 24126ea1",
        ),
    ],
)
def test_philox_known_answers(counter, key, expected):
    words = philox4x32_10([torch.tensor([c]) for c in counter], key)
    assert " ".join(f"{int(w):08x}" for w in words) == expected


@pytest.mark.parametrize(
    "kind", ["normal", "normal32", "uniform", "uniform32", "uniform53", "open", "int63", "int64"]
)
def test_any_box_equals_the_slice_of_the_full_tensor(kind, monkeypatch):
    monkeypatch.setattr("autoparallel.rng.CHUNK", 64)  # several pieces and row batches
    sid = stream_id(7, "w", "op", 0)
    shape = (9, 13, 6)
    dtype = torch.int64 if kind.startswith("int") else torch.float32 if kind.endswith("32") else torch.float64
    full = torch.empty(shape, dtype=dtype)
    fill_box(full, shape, (0, 0, 0), sid, kind, lambda v, p: v)
    for offset, local in [
        ((0, 0, 0), (9, 13, 6)),
        ((2, 0, 0), (3, 13, 6)),
        ((0, 5, 0), (9, 7, 6)),
        ((1, 3, 2), (5, 9, 3)),
        ((8, 12, 5), (1, 1, 1)),
        ((4, 0, 1), (2, 13, 4)),
    ]:
        box = torch.empty(local, dtype=dtype)
        fill_box(box, shape, offset, sid, kind, lambda v, p: v)
        want = full[tuple(slice(o, o + n) for o, n in zip(offset, local))]
        assert torch.equal(box, want), (kind, offset, local)
    # A non-contiguous destination gets the same values.
    t = torch.empty(6, 13, 9, dtype=dtype).permute(2, 1, 0)
    fill_box(t, shape, (0, 0, 0), sid, kind, lambda v, p: v)
    assert torch.equal(t, full)


@pytest.fixture
def one_thread():
    # As mesh_independent_context runs fills: intra-op threads only add waits on a shared 2-core box.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_float32_box_muller_matches_float64_and_ignores_layout(one_thread):
    # normal32's angle is normal's shifted by pi (its words count from -2^31): z32 ~ -z64. The
    # float32 series (+ - * / sqrt only) stay within 2e-6 of the float64 libm values where
    # |z| > 0.1; below, float32 u1 = (w + 1) 2^-32 (24 bits) coarsens the radius near u1 = 1.
    n = 1 << 20
    sid = stream_id(5, "w", "normal_", 0)
    z32, z64 = torch.empty(n), torch.empty(n, dtype=torch.float64)
    fill_box(z32, (n,), (0,), sid, "normal32", lambda v, p: v)
    fill_box(z64, (n,), (0,), sid, "normal", lambda v, p: v)
    err = (z32.double() + z64).abs()
    assert err.max().item() < 5e-5 and err[z64.abs() > 0.1].max().item() < 3e-6
    # Shifted by 37 elements, every element sits elsewhere in the SIMD vectors and scalar tails.
    box = torch.empty((1 << 17) - 37)
    fill_box(box, (n,), (37,), sid, "normal32", lambda v, p: v)
    assert torch.equal(box, z32[37 : 1 << 17])


_DIGEST = """
import hashlib, importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("rng", sys.argv[1])  # rng alone: a quick start
rng = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rng)
print(torch.backends.cpu.get_cpu_capability())
n = (1 << 16) + 13  # odd length: scalar tails in every kernel
for kind in ("normal32", "uniform32"):
    t = torch.empty(n)
    rng.fill_box(t, (n + 5,), (5,), rng.stream_id(3, "w", kind, 0), kind, lambda v, p: v.mul_(0.02).add_(0.01))
    print(kind, hashlib.sha256(t.numpy().tobytes()).hexdigest())
"""


def test_float32_kinds_do_not_depend_on_the_cpu_kernels():
    # ATEN_CPU_CAPABILITY=default runs torch's scalar (non-SIMD) kernels: same bits as the SIMD ones.
    import os
    import subprocess
    import sys

    import autoparallel.rng

    best = torch.backends.cpu.get_cpu_capability().lower()
    if best == "default":
        pytest.skip("this CPU has no SIMD kernels to compare against")
    cmd = [sys.executable, "-c", _DIGEST, autoparallel.rng.__file__]
    procs = {  # both processes run at once: one torch import's wait, not two
        cap: subprocess.Popen(cmd, env=dict(os.environ, ATEN_CPU_CAPABILITY=cap), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
        for cap in ("default", best)
    }
    digests = {}
    for cap, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        ran, *digests[cap] = out.split("\n")
        assert ran.lower() == cap, ran
    assert digests["default"] == digests[best] and len(digests[best]) == 3  # two kinds and the last newline


def test_box_of_a_huge_tensor_needs_no_full_tensor():
    # 2^41 elements (8 TiB as float32): only the boxes are computed; block numbers pass 2^32.
    shape = (2**20, 2**21)
    sid = stream_id(11, "huge", "normal_", 0)
    a = torch.empty(3, 5)
    fill_box(a, shape, (2**20 - 3, 2**21 - 5), sid, "normal", lambda v, p: v)
    b = torch.empty(2, 7)
    fill_box(b, shape, (2**20 - 2, 2**21 - 7), sid, "normal", lambda v, p: v)
    assert torch.equal(a[1:], b[:, 2:]) and a.std() > 0.3


# --- distributions on 10^6 samples ----------------------------------------------------------------


class _One(nn.Module):
    def __init__(self, n=N, dtype=torch.float32):
        super().__init__()
        self.w = nn.Parameter(torch.empty(n, dtype=dtype))


def _sample(fn, n=N, dtype=torch.float32, seed=0) -> torch.Tensor:
    torch.manual_seed(seed)
    m = _One(n, dtype)
    with torch.no_grad():
        mesh_independent_init(m, lambda mod: fn(mod.w))
    return m.w.detach().double()


def _check(x, mean, std, lo=-math.inf, hi=math.inf, sigmas=5.0):
    n = x.numel()
    assert abs(x.mean().item() - mean) < sigmas * std / math.sqrt(n), (x.mean().item(), mean)
    # sd of the sample variance ~ std^2 sqrt(2 / n) (up to kurtosis); 10 of them is generous and tight
    assert abs(x.var().item() - std**2) < 10 * std**2 * math.sqrt(2 / n) * 3, (x.std().item(), std)
    assert x.min().item() >= lo and x.max().item() <= hi


def test_normal_moments_and_tails():
    x = _sample(lambda w: nn.init.normal_(w, mean=1.5, std=0.02))
    _check(x, 1.5, 0.02)
    z = (x - 1.5) / 0.02
    assert abs((z.abs() > 1.959964).double().mean().item() - 0.05) < 0.002  # two-sided 5% quantile
    assert abs((z**4).mean().item() - 3.0) < 0.05  # kurtosis of a normal
    assert z.abs().max().item() < 7.0  # Box-Muller with 32-bit u1 cannot pass ~6.7 sigma


def test_uniform_and_kaiming_uniform_bounds():
    x = _sample(lambda w: nn.init.uniform_(w, -0.3, 0.7))
    _check(x, 0.2, 1.0 / math.sqrt(12), -0.3, 0.7)
    torch.manual_seed(0)
    m = nn.Linear(1000, 1000)
    mesh_independent_init(m, lambda mod: nn.init.kaiming_uniform_(mod.weight, a=math.sqrt(5)))
    bound = 1 / math.sqrt(1000)
    _check(m.weight.detach().double().flatten(), 0.0, bound / math.sqrt(3), -bound, bound)
    x64 = _sample(lambda w: w.uniform_(), dtype=torch.float64)
    _check(x64, 0.5, 1 / math.sqrt(12), 0.0, 1.0)
    assert (x64 * 2**32 != (x64 * 2**32).floor()).any()  # float64 gets 53 bits, not 32


@pytest.mark.parametrize("a,b", [(-2.0, 2.0), (-0.5, 1.0), (1.0, 3.0), (-3.0, -2.5)])
def test_trunc_normal_moments_and_bounds(a, b):
    mean, std = 0.0, 1.0
    x = _sample(lambda w: nn.init.trunc_normal_(w, mean=mean, std=std, a=a, b=b))
    # Moments of the truncated normal (Johnson, Kotz, Balakrishnan, vol. 1, 13.10).
    phi = lambda t: math.exp(-t * t / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda t: 0.5 * math.erfc(-t / math.sqrt(2))  # noqa: E731
    z = cdf(b) - cdf(a)
    m = (phi(a) - phi(b)) / z
    var = 1 + (a * phi(a) - b * phi(b)) / z - m * m
    _check(x, m, math.sqrt(var), a, b)


def test_exponential_bernoulli_random_cauchy_geometric_log_normal():
    x = _sample(lambda w: w.exponential_(2.0))
    _check(x, 0.5, 0.5, 0.0)
    assert abs((x > 1.0).double().mean().item() - math.exp(-2.0)) < 0.002  # inverse CDF tail
    x = _sample(lambda w: w.bernoulli_(0.3))
    _check(x, 0.3, math.sqrt(0.21), 0.0, 1.0)
    assert set(x.unique().tolist()) == {0.0, 1.0}
    p = torch.linspace(0, 1, N)
    x = _sample(lambda w: w.bernoulli_(p))
    assert abs(x[: N // 10].mean().item() - 0.05) < 0.003 and abs(x[-N // 10 :].mean().item() - 0.95) < 0.003
    x = _sample(lambda w: w.random_(3, 13))
    _check(x, 7.5, math.sqrt((10**2 - 1) / 12), 3, 12)
    assert set(x.unique().tolist()) == set(range(3, 13))
    x = _sample(lambda w: w.cauchy_(1.0, 2.0))
    assert abs(x.median().item() - 1.0) < 0.02 and abs((x - 1).abs().median().item() - 2.0) < 0.02
    x = _sample(lambda w: w.geometric_(0.25))
    _check(x, 4.0, math.sqrt(0.75) / 0.25, 1.0)
    x = _sample(lambda w: w.log_normal_(0.0, 0.5))
    assert abs(x.log().mean().item()) < 0.003 and abs(x.log().std().item() - 0.5) < 0.003


def test_random_factories_and_int_dtypes():
    torch.manual_seed(3)
    m = _One(N)
    out = {}

    def fn(mod):
        out["randn"] = torch.randn(N, dtype=torch.float64)
        out["rand"] = torch.rand(N, dtype=torch.float64)
        out["randint"] = torch.randint(-5, 5, (N,))
        out["randn_like"] = torch.randn_like(mod.w)

    mesh_independent_init(m, fn)
    _check(out["randn"], 0.0, 1.0)
    _check(out["rand"], 0.5, 1 / math.sqrt(12), 0.0, 1.0)
    assert out["randint"].dtype == torch.int64 and set(out["randint"].unique().tolist()) == set(range(-5, 5))
    _check(out["randn_like"].double(), 0.0, 1.0)
    assert out["randn_like"].dtype == torch.float32
    assert not torch.equal(out["randn"].float(), out["randn_like"])  # successive temporaries differ


# --- streams: FQN, call number, key ---------------------------------------------------------------


class _Pair(nn.Module):
    def __init__(self, n=N // 2):
        super().__init__()
        self.a = nn.Parameter(torch.empty(n))
        self.b = nn.Parameter(torch.empty(n))

    def init_weights(self):
        nn.init.normal_(self.a)
        nn.init.normal_(self.b)


def test_fqn_streams_are_independent_and_order_free():
    torch.manual_seed(0)
    m = mesh_independent_init(_Pair())
    a, b = m.a.detach().double(), m.b.detach().double()
    r = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(r) < 5 / math.sqrt(a.numel())
    assert abs(torch.corrcoef(torch.stack([a[:-1], b[1:]]))[0, 1].item()) < 5 / math.sqrt(a.numel())
    # Values depend on the FQN, not on the order of the fills.
    torch.manual_seed(0)
    m2 = mesh_independent_init(_Pair(), lambda mod: (nn.init.normal_(mod.b), nn.init.normal_(mod.a)))
    assert torch.equal(m2.a, m.a) and torch.equal(m2.b, m.b)
    # A second fill of one tensor is a fresh stream; a new key (next init) gives new values.
    torch.manual_seed(0)
    with torch.no_grad():
        m3 = mesh_independent_init(_Pair(), lambda mod: (mod.a.normal_(), mod.a.normal_(), mod.b.normal_()))
    assert not torch.equal(m3.a, m.a) and torch.equal(m3.b, m.b)
    first = m.a.detach().clone()
    mesh_independent_init(m)
    assert not torch.equal(m.a, first)
    # Same seed, same values; .data and .detach() aliases use the parameter's stream.
    torch.manual_seed(0)
    with torch.no_grad():
        m4 = mesh_independent_init(_Pair(), lambda mod: (mod.a.data.normal_(), mod.b.detach().normal_()))
    assert torch.equal(m4.a, a.float()) and torch.equal(m4.b, b.float())


def test_reassigned_parameter_keeps_its_fqn_stream():
    def reassign(mod):
        mod.a = nn.Parameter(torch.empty(mod.a.shape))
        nn.init.normal_(mod.a)

    torch.manual_seed(0)
    m = mesh_independent_init(_Pair(1000), lambda mod: nn.init.normal_(mod.a))
    torch.manual_seed(0)
    m2 = mesh_independent_init(_Pair(1000), reassign)
    assert torch.equal(m2.a, m.a)
    assert nn.Module.__setattr__.__name__ == "__setattr__"  # the patch was undone


def test_user_generator_sets_the_key():
    def fn(seed):
        def run(mod):
            nn.init.normal_(mod.w, generator=torch.Generator().manual_seed(seed))

        return run

    torch.manual_seed(0)
    x = mesh_independent_init(_One(1000), fn(5)).w.detach().clone()
    torch.manual_seed(1)  # the default generator no longer matters for this fill
    y = mesh_independent_init(_One(1000), fn(5)).w.detach().clone()
    z = mesh_independent_init(_One(1000), fn(6)).w.detach().clone()
    assert torch.equal(x, y) and not torch.equal(x, z)


def test_whole_tensor_inits_on_plain_tensors_and_errors():
    torch.manual_seed(0)
    m = nn.Bilinear(8, 8, 12)  # weight [12, 8, 8]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FullTensorWarning)  # nothing is "made full" on one device
        mesh_independent_init(m, lambda mod: nn.init.orthogonal_(mod.weight))
    w = m.weight.detach().flatten(1)  # 12 orthonormal rows of length 64
    torch.testing.assert_close(w @ w.t(), torch.eye(12), atol=1e-5, rtol=0)
    s = nn.Linear(20, 10)
    torch.manual_seed(0)
    mesh_independent_init(s, lambda mod: nn.init.sparse_(mod.weight, 0.5, std=0.01))
    assert ((s.weight == 0).sum(0) == 5).all() and 0.005 < s.weight[s.weight != 0].std() < 0.02
    assert nn.init.orthogonal_.__module__ == "torch.nn.init"  # patches undone
    with pytest.raises(TypeError, match="has no init_weights"):
        mesh_independent_init(nn.Linear(2, 2))


def test_transformers_init_functions_are_covered():
    # transformers >= 5 calls its own saved references to torch.nn.init functions.
    hf_init = pytest.importorskip("transformers.initialization")
    torch.manual_seed(0)
    a = mesh_independent_init(_One(1000), lambda m: hf_init.trunc_normal_(m.w, std=0.02, a=-0.04, b=0.04)).w
    torch.manual_seed(0)
    b = mesh_independent_init(_One(1000), lambda m: nn.init.trunc_normal_(m.w, std=0.02, a=-0.04, b=0.04)).w
    assert torch.equal(a, b) and a.abs().max() <= 0.04 + 1e-7
    assert hf_init.TORCH_INIT_FUNCTIONS["trunc_normal_"] is torch.nn.init.trunc_normal_  # restored


# --- multi-rank: bit-identical on every mesh ------------------------------------------------------


class _AllInits(nn.Module):
    """Every kind of init, on tensors whose dims split unevenly over 2 and 4 ranks."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.empty(10, 7))
        self.b = nn.Parameter(torch.empty(6, 9, 5))
        self.c = nn.Parameter(torch.empty(11))
        self.lin = nn.Linear(7, 10)
        self.d = nn.Parameter(torch.empty(9, 6))
        self.e = nn.Parameter(torch.empty(7, 10))
        self.f = nn.Parameter(torch.empty(8, 5))
        self.g = nn.Parameter(torch.empty(6, 4))
        self.register_buffer("mask", torch.empty(5, 9))
        self.register_buffer("ids", torch.empty(9, 4, dtype=torch.int64))

    def init_weights(self):
        nn.init.trunc_normal_(self.a, std=0.02)
        nn.init.xavier_normal_(self.b)
        nn.init.kaiming_uniform_(self.lin.weight, a=math.sqrt(5))
        nn.init.uniform_(self.lin.bias, -0.1, 0.1)
        with torch.no_grad():
            self.a.mul_(3.0)
            self.b.add_(torch.rand_like(self.b))  # a temporary, sharded like b
            self.c.bernoulli_(0.3)
            self.mask.exponential_(2.0)
            self.mask.log_normal_(0.0, 0.5)  # a second fill of the same tensor
            self.ids.random_(0, 100)
        nn.init.orthogonal_(self.d)  # needs the whole tensor
        nn.init.sparse_(self.e, 0.3)  # needs the whole tensor
        self.f = nn.Parameter(torch.randn(8, 5) * 0.02)  # user code assigning a full tensor
        self.g = nn.Parameter(torch.empty(6, 4))  # reassigned, then filled: still the stream of "g"
        nn.init.normal_(self.g)


WHOLE = {"d", "e", "f", "g"}  # the FQNs whose init makes a full tensor


def _distribute(model: nn.Module, mesh, placements_of) -> nn.Module:
    """Swap every parameter / buffer for a DTensor (local chunk only, no comms), as the parallel
    module holds them, and wrap init_weights as build_parallel_module does."""
    from torch.distributed.tensor import distribute_tensor

    from autoparallel import wrap_init_weights

    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for key, t in store.items():
                dt = distribute_tensor(t.detach(), mesh, placements_of(t.dim()), src_data_rank=None)
                store[key] = nn.Parameter(dt, t.requires_grad) if isinstance(t, nn.Parameter) else dt
    wrap_init_weights(model)
    return model


def _plans(mesh_shape):
    from torch.distributed.tensor import Replicate, Shard

    def last(ndim):
        return Shard(ndim - 1 if ndim > 1 else 0)

    if len(mesh_shape) == 1:
        return {
            "Shard(0)": lambda nd: (Shard(0),),
            "Shard(1)": lambda nd: (Shard(min(1, nd - 1)),),
            "Shard(last)": lambda nd: (last(nd),),
            "Replicate": lambda nd: (Replicate(),),
        }
    return {
        "(Shard(0), Shard(1))": lambda nd: (Shard(0), Shard(min(1, nd - 1))),
        "(Shard(1), Shard(0))": lambda nd: (Shard(min(1, nd - 1)), Shard(0)),
        "(Shard(0), Shard(0))": lambda nd: (Shard(0), Shard(0)),
        "(Replicate, Shard(1))": lambda nd: (Replicate(), Shard(min(1, nd - 1))),
    }


def _state_full(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}


def _max_diff(got: dict, want: dict) -> float:
    assert list(got) == list(want)
    worst = 0.0
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        d = (got[k].double() - want[k].double()).abs().max().item() if want[k].numel() else 0.0
        if not torch.equal(got[k], want[k]):
            worst = max(worst, d, 1e-300)  # unequal bits count even where the difference rounds to 0
    return worst


def _meshes(world: int):
    """Meshes of 1, 2 and 4 ranks and a 2x2 mesh, all from one 4-rank spawn (a DTensor sees only its
    mesh: a size-2 submesh is a 2-rank run)."""
    from torch.distributed.device_mesh import init_device_mesh

    assert world == 4
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    return {
        "1": init_device_mesh("cpu", (4, 1), mesh_dim_names=("a", "b"))["b"],
        "2": grid["b"],
        "4": init_device_mesh("cpu", (4,)),
        "2x2": grid,
    }


def _mesh_rank_main(rank, world):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    from autoparallel import AutoParallel
    from tests.models import TinyConfig, TinyTransformer

    eager_model = _AllInits()  # built first: its constructor draws from the default generator
    torch.manual_seed(1234)
    want = _state_full(mesh_independent_init(eager_model))
    table = {}
    meshes = _meshes(world)
    for key, mesh in meshes.items():
        for plan, placements_of in _plans(tuple(mesh.shape)).items():
            model = _distribute(_AllInits(), mesh, placements_of)
            torch.manual_seed(1234)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with CommDebugMode() as comm:
                    model.init_weights()
            full_made = sorted(
                str(w.message).split("'")[1] for w in caught if issubclass(w.category, FullTensorWarning)
            )
            sharded = any(p.is_shard() for p in placements_of(2)) and mesh.size() > 1
            assert full_made == (sorted(WHOLE) if sharded else []), (key, plan, full_made)
            assert comm.get_total_counts() == 0, (key, plan)  # every fill stayed local
            table[(key, plan)] = _max_diff(_state_full(model), want)

    # The parallel module itself (capture + build) of TinyTransformer on the 2x2 mesh, built on meta
    # and materialized, with a plan mixing Shard(0), Shard(1) and Replicate tensors.
    cfg = TinyConfig()
    eager_tt = TinyTransformer(cfg)
    torch.manual_seed(99)
    eager = _state_full(mesh_independent_init(eager_tt))
    mesh = meshes["2x2"]
    with torch.device("meta"):
        meta_model = TinyTransformer(cfg)
    with AutoParallel(meta_model, lambda: torch.randint(0, 32, (2 * world, cfg.seq)), mesh) as autop:
        autop.add_input_constraints([(Shard(0), Shard(0))])
        autop.add_output_constraints([(Shard(0), Shard(0))])
        autop.set_placements(
            {
                "layers.*.attention.w*.weight": (Shard(1), Shard(0)),
                "layers.0.feed_forward.*": (Replicate(), Replicate()),
            }
        )
        pmod = autop.apply_placement(autop.optimize_placement())
    pmod.to_empty(device="cpu")
    torch.manual_seed(99)
    with CommDebugMode() as comm:
        pmod.init_weights()
    assert comm.get_total_counts() == 0
    table[("2x2", "parallel module of TinyTransformer")] = _max_diff(_state_full(pmod), eager)

    # Writes through views, ties and transformers' own init on the same meshes (one spawn).
    from tests.init_view_checks import parallel_module_checks, refusal_checks, view_checks

    views = {**view_checks(meshes, _plans), **parallel_module_checks(meshes)}
    return table, views, refusal_checks(meshes["2"])


@pytest.mark.slow
def test_init_is_bit_identical_on_every_mesh():
    from checkpoint.ranks.launch import run_ranks

    results = run_ranks(_mesh_rank_main, 4, backend="gloo", timeout=400)
    assert all(r == results[0] for r in results)
    table, views, refused = results[0]
    assert {mesh for mesh, _ in table} == {"1", "2", "4", "2x2"}
    print(
        "\nmax |parallel init_weights() - mesh_independent_init(eager)| over all tensors (0: bit-identical)"
    )
    for (mesh, plan), d in table.items():
        print(f"  mesh {mesh:4s} {plan:38s} {d:g}")
    assert all(d == 0.0 for d in table.values()), table
    # Writes through views, ties, transformers models, the parallel module of a tied embedding.
    assert {mesh for mesh, _ in views} == {"1", "2", "4", "2x2"}
    assert {case for _, case in views} >= {
        "views Shard(0)",
        "tied (Shard(0), Shard(1))",
        "transformers t5",
        "parallel module",
        "parallel module qwen2",
    }
    # Padding rows and ties on 1, 2 and 4 ranks, 1-D and 2-D: every model on every mesh.
    for case in ("views Shard(0)", "tied Shard(0)", "parallel module", "parallel module qwen2",
                 *(f"transformers {f}" for f in ("llama", "qwen2", "gemma2", "gpt2", "t5"))):  # fmt: skip
        mesh_case = case if case.startswith(("parallel", "transformers")) else case.replace("Shard(0)", "(Shard(0), Shard(1))")
        assert {m for m, c in views if c in (case, mesh_case)} == {"1", "2", "4", "2x2"}, case
    assert {k: v for k, v in views.items() if v} == {}
    assert refused == 3
