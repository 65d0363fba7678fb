import pytest
import torch
import torch.distributed as dist

from checkpoint.ranks.launch import RankFailedError, run_ranks


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _boom(rank, world_size):
    if rank == 1:
        raise ValueError("rank one fails")
    return rank


def test_run_ranks_returns_per_rank_results():
    assert run_ranks(_allreduce, 2, backend="gloo", timeout=60) == [3.0, 3.0]


def test_run_ranks_reports_failing_rank():
    with pytest.raises(RankFailedError, match="(?s)rank 1:.*rank one fails"):
        run_ranks(_boom, 2, backend="gloo", timeout=60)


def _in_flight_at_return(rank, world_size):
    """Collectives in flight on the default group and a subgroup: the launcher's teardown waits
    them (checked here by calling it), and waits those still in flight when ``fn`` returns before
    it destroys the groups."""
    from checkpoint.ranks.launch import _wait_collectives

    sub = dist.new_group([0, 1])
    works = []
    for _ in range(3):
        works.append(dist.all_reduce(torch.ones(256), async_op=True))
        works.append(dist.all_reduce(torch.ones(256), group=sub, async_op=True))
    _wait_collectives()
    done = [w.is_completed() for w in works]
    for _ in range(3):  # never waited here
        dist.all_reduce(torch.ones(4096), group=sub, async_op=True)
        dist.all_reduce(torch.ones(4096), async_op=True)
    return done


def test_teardown_waits_collectives_in_flight_then_destroys_the_groups():
    for _ in range(3):  # each rank's exit with collectives issued and not waited by fn
        assert run_ranks(_in_flight_at_return, 2, backend="gloo", timeout=60) == [[True] * 6] * 2


def _parallel_steps_then_exit(rank, world_size, steps):
    """``steps`` iterations of the parallel module (forward: its state gathered by bucketed
    all-gathers; backward: gradients reduce-scattered; then the full state gathered as a
    checkpoint does), counting after each the collectives issued and never waited (c10d's registry
    of functional collectives); then a collective left in flight for the launcher's teardown."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from autoparallel import AutoParallel

    unwaited = torch._C._distributed_c10d._get_work_registry_size
    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with AutoParallel(model, lambda: torch.zeros(2 * world_size, 8), mesh) as autop:
        pmod = autop.apply_placement()
    pmod.to_empty(device="cpu")
    with torch.no_grad():
        for p in pmod.parameters():
            p.fill_(0.5)
    left, sums = [], []
    for i in range(steps):
        x = torch.full((2, 8), float(i))
        pmod(x).sum().backward()
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in pmod.state_dict().items()}
        grads = [p.grad.full_tensor() for p in pmod.parameters()]
        left.append(unwaited())
        sums.append((sum(float(t.sum()) for t in full.values()), sum(float(g.sum()) for g in grads)))
    dist.all_reduce(torch.ones(1024), async_op=True)  # never waited by fn: the teardown waits it
    return left, sums


def test_parallel_module_collectives_waited_and_ranks_exit_0_in_a_loop():
    """30 steps of the parallel module's collectives on 2 gloo ranks: none is left unwaited after
    a step, every rank gets the same state and gradients, and both ranks exit with code 0 (run_ranks
    fails a rank killed by a signal, or exiting with another code, after its result)."""
    steps = 30
    (left0, sums0), (left1, sums1) = run_ranks(_parallel_steps_then_exit, 2, steps, backend="gloo", timeout=300)
    assert left0 == left1 == [0] * steps
    assert sums0 == sums1 and len(set(sums0)) == steps  # the gradients change with the batch


def _exit_3_after_result(rank, world_size):
    from multiprocessing import util

    if rank == 1:  # run by multiprocessing after the rank has sent its result
        util.Finalize(None, __import__("os")._exit, args=(3,), exitpriority=0)
    return rank


def test_rank_exiting_nonzero_after_its_result_fails_the_run():
    with pytest.raises(RankFailedError, match=r"exited with a nonzero code after sending their results: \{1: 3\}") as e:
        run_ranks(_exit_3_after_result, 2, backend="gloo", timeout=60)
    assert e.value.signals == {}


def _abort(rank, world_size):
    if rank == 0:
        import os

        os.abort()
    return rank


def test_rank_killed_by_a_signal_is_named_with_its_signal_and_its_stack_kept(tmp_path, monkeypatch):
    """Crash evidence: the failure's message holds the killed rank's faulthandler
    stack (every thread), and the file holding it is kept; files of clean ranks are removed."""
    import os

    monkeypatch.setenv("FQNCKPT_CRASH_DIR", str(tmp_path))
    with pytest.raises(RankFailedError, match=r"died without a result: \[\(0, -6\)\]") as e:
        run_ranks(_abort, 1, backend="gloo", timeout=60)
    assert e.value.signals == {0: 6} and not RankFailedError("x").signals
    msg = str(e.value)
    assert "Fatal Python error: Aborted" in msg and "in _abort" in msg  # the rank's own stack
    (kept,) = e.value.stacks.values()
    assert os.path.dirname(kept) == str(tmp_path) and "in _abort" in open(kept).read()
    run_ranks(_allreduce, 2, backend="gloo", timeout=60)
    assert os.listdir(tmp_path) == [os.path.basename(kept)]  # clean ranks leave no file


def _killed(rank, world_size):
    import os
    import signal

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def test_rank_killed_by_sigkill_leaves_no_empty_stack_file(tmp_path, monkeypatch):
    """A signal faulthandler cannot see (SIGKILL) leaves nothing to keep: the rank is named with
    its signal, no stack is listed, and the crash directory is left empty (no litter per spawn)."""
    import os

    monkeypatch.setenv("FQNCKPT_CRASH_DIR", str(tmp_path))
    with pytest.raises(RankFailedError) as e:
        run_ranks(_killed, 2, backend="gloo", timeout=60)
    assert e.value.signals == {1: 9} and e.value.stacks == {}
    assert os.listdir(tmp_path) == []


def _tensor_result(rank, world_size):
    return {"rank": rank, "t": torch.full((3,), float(rank))}


def test_run_ranks_returns_tensors_after_ranks_exit():
    out = run_ranks(_tensor_result, 2, backend="gloo", timeout=60)
    assert [o["rank"] for o in out] == [0, 1]
    assert torch.equal(out[1]["t"], torch.ones(3))


def _env_and_print(rank, world_size):
    import os
    import sys

    print(f"rank {rank} says hello", flush=True)
    return os.environ.get("FQNCKPT_TEST_ENV"), sys.modules.get("torch.distributed.checkpoint") is not None


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_get_the_callers_environment_and_stdout(method, monkeypatch, capfd):
    if method == "forkserver":  # the server already up (spawn has none: each rank starts afresh)
        run_ranks(_allreduce, 1, backend="gloo", timeout=60, start_method=method)
    monkeypatch.setenv("FQNCKPT_TEST_ENV", f"set after the server started ({method})")
    out = run_ranks(_env_and_print, 2, backend="gloo", timeout=60, start_method=method)
    assert [o[0] for o in out] == [f"set after the server started ({method})"] * 2
    if method == "forkserver":  # preloaded by the server, so every rank has it already
        assert all(o[1] for o in out)
    text = capfd.readouterr().out
    assert "rank 0 says hello" in text and "rank 1 says hello" in text  # this test's stdout


def test_unknown_start_method_is_refused():
    with pytest.raises(ValueError, match="start_method 'thread'"):
        run_ranks(_allreduce, 1, start_method="thread")


def _exit_without_result(rank, world_size):
    import os

    os._exit(0)  # skips the launcher's reporting, as a library calling os._exit would


def test_rank_that_exits_0_without_a_result_is_reported_not_waited_for():
    # Waiting for the timeout would raise "ranks did not finish within 600 s" instead.
    with pytest.raises(RankFailedError, match=r"died without a result: \[\(0, 0\)\]") as e:
        run_ranks(_exit_without_result, 1, backend="gloo", timeout=600)
    assert e.value.signals == {}


class _FailsToUnpickle:
    def __reduce__(self):
        return (int, ("not a number",))


def _unloadable_result(rank, world_size):
    return _FailsToUnpickle()


def test_result_that_cannot_be_unpickled_names_its_rank():
    with pytest.raises(RankFailedError, match=r"(?s)rank 0: its result could not be unpickled.*ValueError"):
        run_ranks(_unloadable_result, 1, backend="gloo", timeout=60)


def _segfault_beside_gloo(rank, world_size):
    import ctypes
    import sys

    t = torch.ones(2)
    dist.all_reduce(t)  # gloo's worker threads are up
    if rank == 1:
        print("rank 1 stderr before the crash", file=sys.stderr, flush=True)
        ctypes.string_at(0)  # SIGSEGV
    return rank


def test_rank_killed_by_sigsegv_keeps_every_threads_native_stack(tmp_path, monkeypatch, capfd):
    """Faulthandler shows Python frames only, and gloo's worker threads run CPython code
    with no Python frame; a killed rank's C++ stacks of every thread (c10's fatal-signal report,
    gloo's pt_gloo_runloop workers included) are in the failure's message and its kept file, and
    the rank's stderr still reaches the caller's."""
    import os

    monkeypatch.setenv("FQNCKPT_CRASH_DIR", str(tmp_path))
    with pytest.raises(RankFailedError, match=r"died without a result: \[\(1, -11\)\]") as e:
        run_ranks(_segfault_beside_gloo, 2, backend="gloo", timeout=60)
    assert e.value.signals == {1: 11}
    msg = str(e.value)
    assert "Fatal Python error: Segmentation fault" in msg and "in _segfault_beside_gloo" in msg
    assert "native stacks of every thread" in msg and "SIGSEGV(11), PID:" in msg
    assert "c10d::ProcessGroupGloo::runLoop" in msg  # a gloo worker thread's own frames
    (kept,) = e.value.stacks.values()
    text = open(kept).read()
    assert os.path.dirname(kept) == str(tmp_path) and "c10d::ProcessGroupGloo::runLoop" in text
    assert "in _segfault_beside_gloo" in text
    err = capfd.readouterr().err
    assert "rank 1 stderr before the crash" in err and "SIGSEGV(11), PID:" in err


def _corrupt_heap(rank, world_size):
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    p, q = libc.malloc(40), libc.malloc(40)
    libc.free(p)
    libc.free(q)
    ctypes.memset(q, 0x41, 8)  # a write into a freed chunk: its free-list link
    libc.malloc(40)
    libc.malloc(40)  # glibc aborts here ("malloc(): unaligned tcache chunk detected")
    return rank


def test_rank_aborted_by_a_corrupted_heap_keeps_its_python_stack(tmp_path, monkeypatch):
    """A corrupted heap: glibc aborts on a corrupted heap. faulthandler's stack is
    written before c10's native report runs (that one allocates, and on this heap dies itself)."""
    monkeypatch.setenv("FQNCKPT_CRASH_DIR", str(tmp_path))
    with pytest.raises(RankFailedError) as e:
        run_ranks(_corrupt_heap, 1, backend="gloo", timeout=60)
    assert set(e.value.signals.values()) <= {6, 11}, e.value.signals  # abort (or a crash on the garbage)
    (kept,) = e.value.stacks.values()
    assert "in _corrupt_heap" in open(kept).read() and "in _corrupt_heap" in str(e.value)
