"""Ranks agree on every failure: an error on one rank alone during a collective
save (extra_state / state snapshot failing there, planning failing there), an async save (with
and without background staging), a save with a recipe (rank 0's temporary directory), a load
(opening on one rank) and the manager's ``load_latest`` (listing on one rank) becomes that
rank's own error there and a ``RankAgreementError`` naming it on every other rank, and the ranks
then meet in their next collective (no hang, no bare backend error). One 2-rank spawn runs every
stage in turn."""

from __future__ import annotations

import contextlib
import os

import pytest

from checkpoint.ranks.launch import run_ranks


def _outcome(fn):
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {str(e)[:300]}"
    except BaseException as e:  # DCP's CheckpointException: the failing rank's own error inside
        failures = getattr(e, "failures", None)
        if not failures:
            raise
        inner = next(iter(failures.values()))
        inner = getattr(inner, "exc", inner)  # torch wraps it (_WrappedException)
        inner = inner[0] if isinstance(inner, tuple) else inner  # or pairs it with its traceback
        return f"{type(e).__name__} of {type(inner).__name__}: {str(inner)[:300]}"


@contextlib.contextmanager
def _failing(rank, on, owner, name, error):
    """``owner.name`` raises ``error`` on rank ``on`` only (the real one on the others), restored
    after the block."""
    real = getattr(owner, name)

    def fails(*a, **k):
        if rank == on:
            raise error
        return real(*a, **k)

    setattr(owner, name, fails)
    try:
        yield
    finally:
        setattr(owner, name, real)


def _stages(rank, world, root):
    import numpy as np
    import torch
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import checkpoint
    import checkpoint.loading as loading
    import checkpoint.saving as saving
    import checkpoint.write.pipeline as pipeline
    from checkpoint.training.manager import CheckpointManager

    mesh = init_device_mesh("cpu", (world,))

    def model():
        m = torch.nn.Linear(4, 8)
        m.weight = torch.nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Shard(0)]))
        m.bias = torch.nn.Parameter(distribute_tensor(m.bias.detach(), mesh, [Shard(0)]))
        return m

    out = {}

    def stage(name, fn):
        out[name] = _outcome(fn)
        tdist.barrier()  # the loop goes on to its next collective: must not hang

    m = model()
    p = os.path.join(root, "c")
    # extra_state invalid on rank 1 only (a numpy int64 PerRank value)
    extra = {"pos": checkpoint.PerRank(np.int64(3) if rank == 1 else 3)}
    stage("save_extra", lambda: checkpoint.save(m, p, overwrite=True, extra_state=extra))

    # planning fails on rank 1 only (inside the distributed save)
    with _failing(rank, 1, pipeline, "plan_parts", ValueError("planning failed here")):
        stage("save_plan", lambda: checkpoint.save(m, p, overwrite=True))

    for bg in (False, True):
        def async_bad(bg=bg):
            fut = checkpoint.async_save(m, p + f"-a{bg}", overwrite=True, extra_state=extra, background_staging=bg)
            fut.result()

        stage(f"async_extra_bg{bg}", async_bad)

    # save(recipe=): rank 0 cannot make its temporary directory
    with _failing(rank, 0, saving.tempfile, "mkdtemp", PermissionError("no temporary directory here")):
        stage("save_recipe", lambda: checkpoint.save(m, os.path.join(root, "r"), recipe="hf-to-torchtitan-llama3"))

    # load: rank 1 cannot open the checkpoint
    checkpoint.save(m, p, overwrite=True)
    with _failing(rank, 1, loading, "open_load_reader", OSError("cannot open here")):
        stage("load_open", lambda: checkpoint.load(model(), p))

    # manager: rank 1 cannot list the steps
    mgr = CheckpointManager(os.path.join(root, "mgr"), async_save=False)
    mgr.save(0, m)
    with _failing(rank, 1, CheckpointManager, "steps", OSError("listing failed here")):
        stage("manager_latest", lambda: mgr.load_latest(model()))
    out.update(_argument_stages(rank, root, model, stage))
    out.update(_disagreeing_state_stages(rank, root, mesh, stage))
    return out


def _disagreeing_state_stages(rank, root, mesh, stage):
    """Ranks whose state disagrees where one collective decides: DCP's StorageWriter given plain
    tensors of another shape or dtype per rank (DCP's planner keeps each from one rank), and the
    manager's ``load_latest`` over node-local roots where rank 1's copy lacks rank 0's newest
    step. Returns the outcomes, what each DCP path holds afterwards, and a load once the step
    is copied there."""
    import shutil

    import torch
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor

    import checkpoint
    from checkpoint.dcp import StorageWriter
    from checkpoint.training.manager import CheckpointManager

    out: dict = {}
    third = torch.tensor([1 / 3] * 3)
    w = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    shapes = {"w": w, "a": torch.zeros(4, 4 + rank), "b": third.clone()}
    dtypes = {"w": w, "a": torch.zeros(4, 4), "b": third.clone() if rank == 0 else third.half()}
    for name, sd in (("shape", shapes), ("dtype", dtypes)):
        p = os.path.join(root, f"dcp-{name}")
        stage(f"dcp_plain_{name}", lambda sd=sd, p=p: dcp.save(sd, storage_writer=StorageWriter(p)))
        out[f"dcp_plain_{name}_exists"] = os.path.exists(p)
        q = os.path.join(root, f"save-{name}")
        stage(f"save_plain_{name}", lambda sd=sd, q=q: checkpoint.save(sd, q))
        out[f"save_plain_{name}_exists"] = os.path.exists(q)

    def weights(v):
        return {"w": distribute_tensor(torch.full((4, 2), v), mesh, [Shard(0)])}

    shared = os.path.join(root, "mgr-shared")
    mgr = CheckpointManager(shared, async_save=False)
    for step in (1, 2):
        mgr.save(step, weights(float(step)))
    tdist.barrier()
    if rank == 0:  # node-local copies; node 1 lacks the newest step
        for r in (0, 1):
            shutil.copytree(shared, os.path.join(root, f"node{r}"))
        shutil.rmtree(os.path.join(root, "node1", "step-00000002"))
    tdist.barrier()
    local = CheckpointManager(os.path.join(root, f"node{rank}"), async_save=False)
    target = weights(0.0)
    stage("manager_node_local_missing", lambda: local.load_latest(target))
    out["manager_node_local_unchanged"] = bool(torch.equal(target["w"].full_tensor(), torch.zeros(4, 2)))
    if rank == 0:
        shutil.copytree(os.path.join(shared, "step-00000002"), os.path.join(root, "node1", "step-00000002"))
    tdist.barrier()
    out["manager_node_local_copied"] = local.load_latest(target)
    out["manager_node_local_values"] = bool(torch.equal(target["w"].full_tensor(), torch.full((4, 2), 2.0)))
    # The same step on both roots, the RNG states saved in rank 0's copy only: rank 0 would
    # check its RNG entry (a collective) while rank 1 went on into load's.
    for name, rng in (("rng-yes", True), ("rng-no", False)):
        CheckpointManager(os.path.join(root, name), async_save=False, rng_state=rng).save(3, weights(3.0))
    mixed = CheckpointManager(os.path.join(root, "rng-yes" if rank == 0 else "rng-no"), async_save=False)
    stage("manager_rng_entries_differ", lambda: mixed.load_latest(target))
    out["manager_rng_entries_unchanged"] = bool(torch.equal(target["w"].full_tensor(), torch.full((4, 2), 2.0)))
    return out


def _argument_stages(rank, root, model, stage):
    """Ranks given different arguments for one collective call (a path or step per rank, other
    ``overwrite`` flags, a checkpoint per rank on load): refused on every rank, nothing written,
    no target changed. Returns the outcomes plus what each path holds afterwards."""
    import torch
    import torch.distributed.checkpoint as dcp

    import checkpoint
    from checkpoint.dcp import StorageReader, StorageWriter
    from checkpoint.training.manager import CheckpointManager

    out: dict = {}
    base = os.path.join(root, "args")
    stage("args_save_paths", lambda: checkpoint.save(model(), f"{base}-save-r{rank}"))
    checkpoint.save(model(), f"{base}-ow")
    stage("args_save_overwrite", lambda: checkpoint.save(model(), f"{base}-ow", overwrite=rank == 0))
    stage("args_async_paths", lambda: checkpoint.async_save(model(), f"{base}-async-r{rank}").result())
    mgr = CheckpointManager(f"{base}-mgr", async_save=False)
    stage("args_manager_steps", lambda: mgr.save(5 + rank, model()))
    stage("args_dcp_save_paths", lambda: dcp.save(model().state_dict(), storage_writer=StorageWriter(f"{base}-dcp-r{rank}")))
    torch.manual_seed(10)
    checkpoint.save(model(), f"{base}-A")
    torch.manual_seed(11)
    checkpoint.save(model(), f"{base}-B")
    target = model()
    before = {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone() for k, v in target.state_dict().items()}
    stage("args_load_paths", lambda: checkpoint.load(target, f"{base}-{'AB'[rank]}"))
    after = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in target.state_dict().items()}
    out["args_load_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    # A Hugging Face checkpoint (no digests) in each rank's own hub cache: the same repository
    # and revision passes wherever the cache is; another revision is refused.
    from safetensors.torch import save_file

    full = {"weight": torch.arange(32.0).reshape(8, 4), "bias": torch.arange(8.0)}
    for r in (0, 1):
        for rev in ("aaa", "bbb"):
            snap = os.path.join(root, f"hub{r}", "models--org--tiny", "snapshots", rev)
            os.makedirs(snap, exist_ok=True)
            os.makedirs(os.path.join(root, f"hub{r}", "models--org--tiny", "blobs"), exist_ok=True)
            if rank == 0 and not os.path.exists(os.path.join(snap, "model.safetensors")):
                save_file(full, os.path.join(snap, "model.safetensors"))
    torch.distributed.barrier()
    mine = os.path.join(root, f"hub{rank}", "models--org--tiny", "snapshots")
    hub_target = model()
    stage("args_load_hub_same_revision", lambda: checkpoint.load(hub_target, os.path.join(mine, "aaa")))
    out["args_load_hub_values"] = bool(torch.equal(hub_target.weight.full_tensor(), full["weight"]))
    stage("args_load_hub_revisions", lambda: checkpoint.load(model(), os.path.join(mine, "aaa" if rank == 0 else "bbb")))
    # One DTensor held with different placements on the two ranks (Shard(0) here, Replicate
    # there): before, rank 1 (coordinate 1 of a replica group) wrote nothing, rank 0 its half,
    # and a checkpoint with zero rows committed and verified OK.
    from torch.distributed.tensor import DTensor, Replicate, Shard

    w = torch.arange(32, dtype=torch.float32).reshape(8, 4) + 1
    mesh = target.weight.device_mesh
    diverged = DTensor.from_local(
        w.chunk(2)[0].contiguous() if rank == 0 else w, mesh, [Shard(0) if rank == 0 else Replicate()],
        run_check=False, shape=w.shape, stride=w.stride(),
    )  # fmt: skip
    stage("args_save_placements", lambda: checkpoint.save({"w": diverged}, f"{base}-placements"))
    out["args_listing"] = sorted(n for n in os.listdir(root) if n.startswith("args"))
    out["args_mgr_listing"] = sorted(os.listdir(f"{base}-mgr"))
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("agree")
    return run_ranks(_stages, 2, str(root), backend="gloo", timeout=120)


@pytest.mark.parametrize(
    "stage, failing, own",
    [
        ("save_extra", 1, "TypeError"),
        ("save_plan", 1, "ValueError: planning failed here"),
        ("async_extra_bgFalse", 1, "TypeError"),
        ("async_extra_bgTrue", 1, "TypeError"),
        ("save_recipe", 0, "PermissionError: no temporary directory here"),
        ("load_open", 1, "OSError: cannot open here"),
        ("manager_latest", 1, "OSError: listing failed here"),
    ],
)
def test_one_rank_failure_is_agreed_by_every_rank(outcomes, stage, failing, own):
    other = 1 - failing
    assert outcomes[failing][stage].startswith(own), outcomes[failing][stage]
    agreed = outcomes[other][stage]
    assert agreed.startswith("RankAgreementError"), agreed
    assert f"rank {failing}" in agreed and own.split(":")[0] in agreed, agreed


@pytest.mark.parametrize(
    "stage, argument",
    [
        ("args_save_paths", "destination"),
        ("args_save_overwrite", "overwrite"),
        ("args_async_paths", "destination"),
        ("args_manager_steps", "destination"),
        ("args_dcp_save_paths", "destination"),
        ("args_load_paths", "checkpoints"),
        ("args_save_placements", "the shards of DTensor 'w'"),
        ("args_load_hub_revisions", "checkpoints"),
    ],
)
def test_ranks_given_different_arguments_are_refused_on_every_rank(outcomes, stage, argument):
    # Refused on both ranks: otherwise rank 0's path (or step, or flag) would take effect and
    # rank 1's be ignored silently (a load would fill each rank's shards from another checkpoint).
    for per_rank in outcomes:
        got = per_rank[stage]
        assert "RankMismatchError" in got and f"differ in {argument}" in got, got
        assert "rank 0:" in got and "rank 1:" in got, got


@pytest.mark.parametrize("what, key, values", [
    ("shape", "a", ("rank 0: [4, 4] torch.float32", "rank 1: [4, 5] torch.float32")),
    ("dtype", "b", ("rank 0: [3] torch.float32", "rank 1: [3] torch.float16")),
])
def test_dcp_writer_refuses_plain_tensors_that_differ_between_ranks(outcomes, what, key, values):
    # Nothing committed: otherwise each tensor would come from whichever rank DCP's dedup kept.
    for per_rank in outcomes:
        got = per_rank[f"dcp_plain_{what}"]
        assert got.startswith("CheckpointException of RankMismatchError"), got
        assert f"the shape and dtype of tensor {key!r}" in got and all(v in got for v in values), got
        assert per_rank[f"dcp_plain_{what}_exists"] is False


@pytest.mark.parametrize("what, key, values", [
    ("shape", "a", ("rank 0: [4, 4] F32", "rank 1: [4, 5] F32")),
    ("dtype", "b", ("rank 0: [3] F32", "rank 1: [3] F16")),
])
def test_save_names_the_plain_tensor_that_differs_between_ranks(outcomes, what, key, values):
    # The error names the tensor and each rank's shape and dtype, not only "different layouts".
    for per_rank in outcomes:
        got = per_rank[f"save_plain_{what}"]
        assert got.startswith("RankMismatchError"), got
        assert f"the shape and dtype of tensor {key!r}" in got and all(v in got for v in values), got
        assert per_rank[f"save_plain_{what}_exists"] is False


def test_load_latest_refuses_a_step_missing_on_one_rank_alike_on_every_rank(outcomes):
    # The same error on both ranks: neither enters a collective the other skips (the RNG check's
    # on one rank and load's on the other would hang both until the process group's timeout).
    got = [per_rank["manager_node_local_missing"] for per_rank in outcomes]
    assert got[0] == got[1], got
    assert got[0].startswith("CheckpointNotFoundError: no checkpoint at "), got[0]
    assert "node1/step-00000002" in got[0] and "rank(s) [1] have no complete step 2" in got[0], got[0]
    assert "rank 1: step 1" in got[0], got[0]
    for per_rank in outcomes:  # nothing loaded; once the step is there, it loads on both ranks
        assert per_rank["manager_node_local_unchanged"] is True
        assert per_rank["manager_node_local_copied"] == 2 and per_rank["manager_node_local_values"] is True


def test_load_latest_refuses_copies_of_a_step_holding_other_rng_entries(outcomes):
    got = [per_rank["manager_rng_entries_differ"] for per_rank in outcomes]
    assert got[0] == got[1], got
    assert got[0].startswith("RankMismatchError: loading step 3: the ranks differ in the RNG entries their "
                             "copies of the step hold (rank 0: fqnckpt.rng in "), got[0]
    assert "rng-yes/step-00000003; rank 1: none in " in got[0] and "rng-no/step-00000003)" in got[0], got[0]
    assert all(per_rank["manager_rng_entries_unchanged"] is True for per_rank in outcomes)


def test_refused_collective_calls_wrote_nothing_and_changed_no_target(outcomes):
    for per_rank in outcomes:
        # only the checkpoints the stages saved themselves exist: none at a per-rank path
        assert per_rank["args_listing"] == ["args-A", "args-B", "args-mgr", "args-ow"], per_rank["args_listing"]
        assert per_rank["args_mgr_listing"] == [], per_rank["args_mgr_listing"]
        assert per_rank["args_load_unchanged"] is True
        # the same hub revision in each rank's own cache directory loads
        assert per_rank["args_load_hub_same_revision"] == "ok" and per_rank["args_load_hub_values"] is True
