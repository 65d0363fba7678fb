"""Single-process checks of autoparallel: capture (AC tags, casts, inputs), FQN map, placement rules."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import Replicate, Shard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autoparallel import (
    AutoParallel,
    CaptureError,
    MixedPrecisionPolicy,
    PlacementError,
    StateError,
    apply_overrides,
    capture,
    count_param_casts,
    default_plan,
    fsdp_placements,
)
from autoparallel.data import local_inputs
from tests.models import TinyConfig, TinyTransformer, hf_llama

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
TAG = torch.ops.higher_order.tag_activation_checkpoint


def _hop_count(gm: torch.fx.GraphModule, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def _eager_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters(remove_duplicate=False)] + [
        n for n, _ in model.named_buffers(remove_duplicate=False)
    ]


def _snapshot(model: nn.Module):
    return (
        type(model),
        [
            (n, id(t), t.dtype, t.device, t.clone() if not t.is_meta else None)
            for n, t in model.state_dict(keep_vars=True).items()
        ],
        _eager_names(model),
        [type(m) for m in model.modules()],
    )


def _assert_unchanged(before, model):
    cls, items, names, classes = before
    assert type(model) is cls
    assert _eager_names(model) == names
    assert [type(m) for m in model.modules()] == classes
    now = list(model.state_dict(keep_vars=True).items())
    assert [n for n, _ in now] == [i[0] for i in items]
    for (n, t), (_, tid, dtype, device, val) in zip(now, items):
        assert id(t) == tid and t.dtype == dtype and t.device == device, n
        if val is not None:
            assert torch.equal(t, val), n


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    m = TinyTransformer(TinyConfig())
    m.init_weights()
    return m


def test_capture_keeps_ac_and_casts_every_parameter_use(tiny):
    before = _snapshot(tiny)
    tokens = torch.randint(0, 32, (2, 8))
    cap = capture(tiny, (tokens,), mp_policy=BF16)
    _assert_unchanged(before, tiny)
    assert _hop_count(cap.gm, TAG) == 2  # one AC region per layer
    # 20 parameter tensors, the tied embedding used twice (embedding + output head): 21 uses.
    assert count_param_casts(cap.gm, torch.bfloat16) == (21, 21)
    assert cap.n_casts == 21  # one per owning module: the tied weight has two owners
    # Eager side of the map: exact eager names, tied alias recorded, no parametrization names.
    fmap = cap.fqn_map
    assert sorted(fmap.eager_fqns(include_aliases=True)) == sorted(_eager_names(tiny))
    assert fmap.alias_groups() == [["tok_embeddings.weight", "output.weight"]]
    assert not any("parametrizations" in n for n in fmap.eager_fqns(include_aliases=True))
    assert "layers.0.attention.wq.parametrizations.weight.original" in fmap.to_captured(
        "layers.0.attention.wq.weight"
    )
    assert (
        fmap.to_eager("layers.1.feed_forward.w2.parametrizations.weight.original")
        == "layers.1.feed_forward.w2.weight"
    )
    assert fmap.record("norm.weight").dtype == "float32"
    # The graph computes the eager model's numbers in bf16.
    ref = copy.deepcopy(tiny)
    ref_out = ref(tokens)
    out = cap.gm(tokens)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)


def test_capture_without_policy_is_exact_and_casts_nothing(tiny):
    tokens = torch.randint(0, 32, (3, 8))
    cap = capture(tiny, (tokens,))
    assert count_param_casts(cap.gm, torch.bfloat16) == (0, 21)
    assert torch.equal(cap.gm(tokens), tiny(tokens))
    assert cap.attr_of["tok_embeddings.weight"] == "tok_embeddings.weight"  # one graph attr for the tied pair
    assert set(cap.attr_of) == {r.fqn for r in cap.fqn_map}


def test_capture_on_meta_uses_no_memory_and_keeps_model():
    with torch.device("meta"):
        model = TinyTransformer(TinyConfig())
    before = _snapshot(model)
    cap = capture(model, (torch.randint(0, 32, (4, 8)),), mp_policy=BF16)
    _assert_unchanged(before, model)
    # Traced on fake tensors of the default device (cpu), not on meta: device-faithful branches.
    assert cap.device == torch.device("cpu")
    assert all(t.is_meta for t in cap.gm.state_dict().values())  # the graph holds the meta tensors
    assert _hop_count(cap.gm, TAG) == 2


def _save_mm(ctx, op, *args, **kwargs):
    return (
        CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE
    )


class _Selective(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = checkpoint_wrapper(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))

    def forward(self, x):
        # Selective AC as torchtitan writes it: a partial of create_selective_checkpoint_contexts.
        ctx = functools.partial(create_selective_checkpoint_contexts, _save_mm)
        h = checkpoint(self.a, x, use_reentrant=False, context_fn=ctx)
        return self.b(h)


def test_ac_tags_with_selective_context_fn_and_checkpoint_wrapper():
    torch.manual_seed(0)
    m = _Selective()
    x = torch.randn(3, 4)
    cap = capture(m, (x,), mp_policy=BF16)
    assert _hop_count(cap.gm, TAG) == 2
    assert count_param_casts(cap.gm, torch.bfloat16) == (4, 4)
    # checkpoint_wrapper's segment is stripped from the eager side, kept on the captured side.
    assert sorted(cap.fqn_map.eager_fqns()) == ["a.bias", "a.weight", "b.0.bias", "b.0.weight"]
    assert sorted(_eager_names(m)) == sorted(
        ["a.weight", "a.bias", "b._checkpoint_wrapped_module.0.weight", "b._checkpoint_wrapped_module.0.bias"]
    )
    # Floating inputs are cast by the parallel module (cast_forward_inputs); here by hand.
    torch.testing.assert_close(cap.gm(x.bfloat16()).float(), m(x), atol=2e-2, rtol=2e-2)


def test_transformers_llama_with_gradient_checkpointing_keeps_a_tag_per_layer():
    # transformers 5.25's attention runs under the `kernels` package's layer wrapper, which sets and
    # resets a global while dynamo traces: under AC dynamo refused it ("HOP: Unsafe side effect")
    # unless the capture lets the replay go (an exported graph never replays Python side effects).
    torch.manual_seed(0)
    model = hf_llama(layers=2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 64, (2, 8))
    cap = capture(model, (ids,))
    assert _hop_count(cap.gm, TAG) == 2
    torch.testing.assert_close(cap.gm(ids).logits, model(ids).logits)
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint is False  # not leaked


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, pair, cfg=None, *, scale):
        y = self.lin(x) + pair[0] * cfg["k"][1] * scale
        return {"y": y, "rest": [pair[1] * 2]}


def test_nested_positional_keyword_inputs():
    torch.manual_seed(0)
    m = _Nested()
    args = (torch.randn(2, 4), (torch.randn(2, 4), torch.randn(2, 4)))
    kwargs = {"cfg": {"k": [1.0, torch.randn(2, 4)]}, "scale": torch.tensor(3.0)}
    cap = capture(m, args, kwargs)
    out, ref = cap.gm(*args, **kwargs), m(*args, **kwargs)
    assert torch.equal(out["y"], ref["y"]) and torch.equal(out["rest"][0], ref["rest"][0])


class _Scale(nn.Module):
    def forward(self, w):
        return w * 2.0


def test_user_parametrized_model_deepcopies_and_keeps_its_names():
    m = nn.Sequential(nn.Linear(4, 4))
    torch.nn.utils.parametrize.register_parametrization(m[0], "weight", _Scale())
    dup = copy.deepcopy(m)  # deep copies of parametrized modules work
    assert torch.equal(dup[0].weight, m[0].weight)
    x = torch.randn(2, 4)
    cap = capture(m, (x,), mp_policy=BF16)
    # A user parametrization is not fqnckpt's: its real name stays, and it is not cast-wrapped.
    assert "0.parametrizations.weight.original" in cap.fqn_map.eager_fqns()
    torch.testing.assert_close(cap.gm(x), m(x))
    assert list(m[0].parametrizations.weight) and isinstance(m[0].parametrizations.weight[0], _Scale)
    assert len(m[0].parametrizations.weight) == 1


class _Breaks(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        if x.sum().item() > 0:  # data-dependent Python control flow: no single graph
            return self.lin(x)
        return x


def test_capture_failure_is_a_capture_error():
    with pytest.raises(CaptureError, match="_Breaks"):
        capture(_Breaks(), (torch.randn(2, 2),))


class _FakeMesh:
    """Only what the placement rules and the capture read: ``shape``, ``ndim``, ``device_type``."""

    def __init__(self, *shape):
        self.shape = shape
        self.ndim = len(shape)
        self.device_type = "cpu"


def test_fsdp_rule_shards_dim0_when_it_covers_the_mesh():
    assert fsdp_placements([32, 16], (2,)) == (Shard(0),)
    assert fsdp_placements([3, 16], (2,)) == (Shard(0),)  # uneven shards allowed
    assert fsdp_placements([1, 16], (2,)) == (Replicate(),)
    assert fsdp_placements([4], (2, 2)) == (Shard(0), Shard(0))
    assert fsdp_placements([3], (2, 2)) == (Shard(0), Replicate())
    assert fsdp_placements([], (2,)) == (Replicate(),)


def test_default_plan_and_glob_overrides(tiny):
    fmap = capture(tiny, (torch.randint(0, 32, (2, 8)),)).fqn_map
    mesh = _FakeMesh(2, 2)
    plan = default_plan(fmap, mesh)
    assert set(plan) == {r.fqn for r in fmap}
    assert plan["layers.0.attention.wq.weight"] == (Shard(0), Shard(0))
    assert plan["freqs_cis"] == (Replicate(), Replicate())  # buffers replicated, FSDP-style
    new = apply_overrides(
        plan,
        {"layers.*.wq.weight": (Shard(1), Replicate()), "output.weight": (Replicate(), Shard(1))},
        fmap,
        mesh,
    )
    assert (
        new["layers.0.attention.wq.weight"] == new["layers.1.attention.wq.weight"] == (Shard(1), Replicate())
    )
    assert new["tok_embeddings.weight"] == (Replicate(), Shard(1))  # reached through its tied alias
    assert new["layers.0.attention.wk.weight"] == (Shard(0), Shard(0))
    with pytest.raises(PlacementError, match="nothing.*matches no FQN"):
        apply_overrides(plan, {"nothing.*": (Shard(0), Shard(0))}, fmap, mesh)
    with pytest.raises(PlacementError, match="'norm.weight': 1 placements for a 2-D mesh"):
        apply_overrides(plan, {"norm.weight": (Shard(0),)}, fmap, mesh)
    with pytest.raises(PlacementError, match="'norm.weight': S\\(1\\) on a 1-D tensor"):
        apply_overrides(plan, {"norm.weight": (Shard(1), Replicate())}, fmap, mesh)


def test_autoparallel_api_plan_overrides_and_state_errors(tiny):
    mesh = _FakeMesh(2)
    autop = AutoParallel(tiny, lambda: torch.randint(0, 32, (4, 8)), mesh)
    with pytest.raises(StateError, match="outside its `with` block"):
        autop.optimize_placement()
    with autop:
        autop.set_placements({"layers.1.*": (Replicate(),)})
        plan = autop.optimize_placement()
        with pytest.raises(PlacementError, match="'input #0': 2 placements for a 1-D mesh"):
            autop.add_input_constraints([(Shard(0), Shard(0))])
    assert plan["layers.1.attention.wq.weight"] == (Replicate(),)
    assert plan["layers.0.attention.wq.weight"] == (Shard(0),)
    assert list(plan) == [r.fqn for r in autop_fqn_map(tiny)]
    with pytest.raises(StateError):
        autop.fqn_map  # noqa: B018 - the capture is dropped on exit


def autop_fqn_map(model):
    return capture(model, (torch.randint(0, 32, (2, 8)),)).fqn_map


def test_transformers_cache_output_is_a_capture_error_naming_the_fix():
    torch.manual_seed(0)
    model = hf_llama(use_cache=True)  # transformers' default: forward returns a DynamicCache
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(CaptureError, match=r"returns a DynamicCache \(output #1\).*use_cache=False"):
        capture(model, (ids,))
    model.config.use_cache = False
    cap = capture(model, (ids,))
    torch.testing.assert_close(cap.gm(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_cast_fqns_are_the_parameters_read_through_a_cast(tiny):
    cap = capture(tiny, (torch.randint(0, 32, (2, 8)),), mp_policy=BF16)
    assert cap.cast_fqns == {n for n, _ in tiny.named_parameters()}  # the tied pair once
    assert capture(tiny, (torch.randint(0, 32, (2, 8)),)).cast_fqns == frozenset()
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    torch.nn.utils.parametrize.register_parametrization(m[0], "weight", _Scale())
    cap = capture(m, (torch.randn(2, 4),), mp_policy=BF16)
    # A user-parametrized module is left alone (weight and bias uncast): gathered in float32.
    assert cap.cast_fqns == {"1.weight", "1.bias"}


def test_local_inputs_split_the_batch_and_refuse_what_cannot_be_split():
    ids, mask = torch.zeros(8, 5, dtype=torch.long), torch.ones(1, 5)
    args, kwargs = local_inputs(
        (ids,), {"mask": mask}, [(Shard(0), Replicate()), (Replicate(), Replicate())], (2, 2)
    )
    assert args[0].shape == (4, 5) and kwargs["mask"].shape == (1, 5) and kwargs["mask"] is mask
    args, _ = local_inputs((ids,), {}, None, (2, 2))  # default: Shard(0) on every mesh dim
    assert args[0].shape == (2, 5)
    with pytest.raises(PlacementError, match=r"input #0 of shape \(6, 5\): dim 0 must be divisible by the 4"):
        local_inputs((torch.zeros(6, 5),), {}, None, (2, 2))
    with pytest.raises(PlacementError, match=r"input #1: S\(1\) is not supported.*dim 0 \(the batch\) only"):
        local_inputs((ids,), {"mask": mask}, [(Shard(0),), (Shard(1),)], (2,))
    with pytest.raises(PlacementError, match="1 input constraints for 2 input tensors"):
        local_inputs((ids,), {"mask": mask}, [(Shard(0),)], (2,))


def test_input_signature_checks_exact_dtype_and_device():
    """A float64 or meta batch into a graph captured for a float32 CPU batch is an InputError
    naming the input; with forward's input cast on, any floating dtype is accepted."""
    import torch.utils._pytree as pytree

    from autoparallel.data import InputSignature
    from autoparallel.errors import InputError

    x = torch.randn(4, 16)
    sig = InputSignature.of((x,), {})

    def check(y, **kw):
        flat, spec = pytree.tree_flatten(((y,), {}))
        sig.check(flat, spec, "cpu", **kw)

    check(x)
    with pytest.raises(InputError, match=r"input tensor #0 has dtype torch.float64; the graph was captured for torch.float32"):
        check(x.double())
    with pytest.raises(InputError, match=r"input tensor #0 has dtype torch.bfloat16"):
        check(x.bfloat16())
    with pytest.raises(InputError, match=r"input tensor #0 has dtype torch.int64"):
        check(x.long(), cast_floats=True)
    check(x.double(), cast_floats=True)  # forward casts it
    with pytest.raises(InputError, match=r"input tensor #0 is on device meta; the module runs on cpu"):
        check(x.to("meta"))


def test_bucket_all_gathers_are_waited_when_forward_fails_after_issuing_them(tmp_path, monkeypatch):
    """_gather_state: a failure after the buckets' all-gathers were issued waits for every one of
    them before it propagates (none left in flight to meet a later collective); the next forward
    runs. A world of one rank, in this process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import autoparallel.gather as gather_mod
    import autoparallel.parallel_module as pm
    from autoparallel import AutoParallel

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(16, 8)

            def forward(self, x):
                return self.a(x)

        mesh = init_device_mesh("cpu", (1,))
        x = torch.randn(4, 16)
        with AutoParallel(M(), lambda: x, mesh) as ap:
            ap.add_input_constraints([(Shard(0),)])
            ap.add_output_constraints([(Shard(0),)])
            pmod = ap.apply_placement(ap.optimize_placement())
        pmod.to_empty(device="cpu")
        with torch.no_grad():
            for p in pmod.parameters():
                p.fill_(0.5)
        assert pmod._autoparallel.buckets, "the test needs bucketed parameters"
        waited, real_end = [], gather_mod.BucketTape.end_forward

        def end_forward(self):
            waited.append(sum(g is not None for g in self.gathers))
            real_end(self)
            assert all(g is None for g in self.gathers)

        real_gather = pm.gather_buckets

        def gathers_then_fails(tape, tensors):
            real_gather(tape, tensors)  # every bucket's all-gather is in flight now
            raise RuntimeError("a gather after the buckets failed")

        monkeypatch.setattr(gather_mod.BucketTape, "end_forward", end_forward)
        monkeypatch.setattr(pm, "gather_buckets", gathers_then_fails)
        with pytest.raises(RuntimeError, match="after the buckets"):
            pmod(x)
        assert waited and waited[0] >= 1  # the issued all-gathers were waited before the raise
        monkeypatch.setattr(pm, "gather_buckets", real_gather)
        torch.testing.assert_close(pmod(x), (0.5 * x.sum(1, keepdim=True) + 0.5).expand(4, 8))
    finally:
        dist.destroy_process_group()
