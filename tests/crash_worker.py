"""Crash trials shared by ``tests/test_crash_safety.py`` and ``tests/bench/reliability_report.py``.

A *zygote* subprocess (this file run by path with ``serve``) imports torch once and forks one
child per trial, in its own process group: the child saves deterministic "new" values over a path
holding "old" values (or over nothing), in one process or on 2 gloo ranks spawned with
:func:`checkpoint.ranks.launch.run_ranks`. The driver (:class:`Zygote`, in the test process) kills the
whole group with SIGKILL after a random delay, or the save kills itself at a fault point
(``FQNCKPT_FAULT_POINT``). Forking a warm zygote keeps a trial at ~0.1 s (1 process) instead of
~2 s of imports; a 2-rank trial still pays the spawned ranks' imports.

After each trial :func:`judge` loads the path and classifies the outcome: exactly old, exactly
new, "no checkpoint" (:class:`~checkpoint.CheckpointNotFoundError`, right only for a new path), a
silent wrong load (values match neither) or a partial checkpoint visible (any other error, or
``verify`` not ok). Then a fresh save must succeed and leave nothing but the checkpoint and its
lock file beside the path. Every trial is driven by one integer seed, printed on failure.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("single", "ranks")
SINGLE_SHARD_BYTES = 600_000  # 4 data files of ~524 KB for the single-process values
RANKS_SHARD_BYTES = 70_000


# -- deterministic values ---------------------------------------------------------------------------


def values(tag: str, seed: int, mode: str):
    """Full (unsharded) tensors saved by a trial: ``tag`` "old" or "new", same names and shapes."""
    import torch

    g = torch.Generator().manual_seed(seed * 2 + (tag == "new"))
    if mode == "single":
        sd = {f"layers.{i}.weight": torch.randn(256, 256, generator=g) for i in range(8)}
        sd["embed.weight"] = torch.randn(64, 32, generator=g).to(torch.bfloat16)
        sd["step_counts"] = torch.randint(0, 1 << 40, (16,), generator=g)
    else:
        sd = {f"layers.{i}.weight": torch.randn(64, 128, generator=g) for i in range(4)}
        sd["norm.weight"] = torch.randn(128, generator=g)  # Replicate
        sd["head.weight"] = torch.randn(32, 64, generator=g)  # Shard(1)
    return sd


def _dtensors(sd, world: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    r = dist.get_rank()
    out = {}
    for k, t in sd.items():
        if k == "norm.weight":
            out[k] = DTensor.from_local(t.clone(), mesh, [Replicate()], run_check=False)
        elif k == "head.weight":
            out[k] = DTensor.from_local(t.chunk(world, 1)[r].clone(), mesh, [Shard(1)], run_check=False)
        else:
            out[k] = DTensor.from_local(t.chunk(world, 0)[r].clone(), mesh, [Shard(0)], run_check=False)
    return out


_REAL_WRITES = (os.pwrite, os.write)


def _disk_ok() -> None:
    """Undo :func:`_enospc_after` (the result must still reach the driver through pipes)."""
    os.pwrite, os.write = _REAL_WRITES


def _enospc_after(budget: int):
    """Make ``os.pwrite`` / ``os.write`` fail with ENOSPC once ``budget`` bytes were written."""
    state = {"left": budget}
    real_pwrite, real_write = _REAL_WRITES

    def take(n):
        if state["left"] < n:
            raise OSError(errno.ENOSPC, "No space left on device")
        state["left"] -= n

    def pwrite(fd, data, off):
        take(len(data))
        return real_pwrite(fd, data, off)

    def write(fd, data):
        take(len(data))
        return real_write(fd, data)

    os.pwrite, os.write = pwrite, write


def _rank_save(rank: int, world: int, job: dict) -> dict:
    """One rank of a 2-rank trial: build DTensors of the "new" values, signal ready, save."""
    import torch.distributed as dist

    import checkpoint

    sd = _dtensors(values("new", job["seed"], "ranks"), world)
    took = 0.0
    if job.get("warm"):  # a warm-up save measures how long one takes under the current load
        t0 = time.perf_counter()
        checkpoint.save(sd, job["warm"], overwrite=True, max_shard_size=RANKS_SHARD_BYTES)
        took = time.perf_counter() - t0
    if job.get("enospc_rank") == rank:
        _enospc_after(job["enospc_bytes"])
    _arm_fault(job)
    dist.barrier()
    if rank == 0:
        _signal_ready(job["ready"], took)
    t0 = time.perf_counter()
    try:
        checkpoint.save(sd, job["path"], overwrite=True, max_shard_size=RANKS_SHARD_BYTES)
    except Exception as e:  # noqa: BLE001 - reported to the driver
        return {"error": type(e).__name__, "message": str(e), "oserror": isinstance(e, OSError)}
    finally:
        _disk_ok()
    return {"seconds": time.perf_counter() - t0}


def _arm_fault(job: dict) -> None:
    """Arm the fault point (after the warm-up save, which must not die)."""
    if job.get("fault"):
        os.environ["FQNCKPT_FAULT_POINT"] = job["fault"]
        if job.get("fault_rank") is not None:
            os.environ["FQNCKPT_FAULT_RANK"] = str(job["fault_rank"])


def _write_marker(p: str, data: dict) -> None:
    """Write a marker file for the driver whole or not at all (a kill may come at any time)."""
    Path(p + ".tmp").write_text(json.dumps(data))
    os.rename(p + ".tmp", p)


def _signal_ready(p: str, seconds: float) -> None:
    """Tell the driver the real save starts now; ``seconds`` is the warm-up save's duration."""
    _write_marker(p, {"seconds": seconds})


def _child(job: dict) -> int:
    """Body of a forked trial child (own process group). Returns the exit code."""
    import checkpoint

    if job["mode"] == "ranks":
        from checkpoint.ranks.launch import run_ranks

        # A fork of the warm zygote child: no per-rank imports (the driver kills this whole group).
        res = run_ranks(_rank_save, 2, job, backend="gloo", timeout=job.get("timeout", 60), start_method="fork")
        result = {"ranks": res}
    else:
        sd = values(job.get("tag", "new"), job["seed"], "single")
        took = 0.0
        if job.get("warm"):
            t0 = time.perf_counter()
            checkpoint.save(sd, job["warm"], overwrite=True, max_shard_size=SINGLE_SHARD_BYTES)
            took = time.perf_counter() - t0
        if job.get("enospc_bytes") is not None:
            _enospc_after(job["enospc_bytes"])
        _arm_fault(job)
        _signal_ready(job["ready"], took)
        t0 = time.perf_counter()
        try:
            checkpoint.save(sd, job["path"], overwrite=True, max_shard_size=SINGLE_SHARD_BYTES)
            result = {"seconds": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - reported to the driver
            result = {"error": type(e).__name__, "message": str(e), "oserror": isinstance(e, OSError)}
        finally:
            _disk_ok()
    _write_marker(job["done"], result)
    return 0


def serve() -> None:
    """Zygote loop: ``{"op": "fork", "job": {...}}`` -> ``{"pid": N}``; ``{"op": "wait", "pid": N}``
    -> ``{"status": wait status}``. Children never write to the protocol's stdout. The zygote is a
    child subreaper, so ranks orphaned by a killed trial are reaped here, not left as zombies."""
    import ctypes

    import torch  # noqa: F401 - warm imports shared by every forked child

    import checkpoint  # noqa: F401
    import checkpoint.loading  # noqa: F401 - `import checkpoint` alone imports them on first use
    import checkpoint.ranks.launch  # noqa: F401
    import checkpoint.saving  # noqa: F401

    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER (Linux)
    reaped: dict[int, int] = {}
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "fork":
            pid = os.fork()
            if pid == 0:
                code = 3
                try:
                    os.setpgid(0, 0)
                    os.dup2(2, 1)  # stdout belongs to the protocol
                    code = _child(req["job"])
                except BaseException:  # noqa: BLE001
                    import traceback

                    traceback.print_exc()
                finally:
                    os._exit(code)
            try:
                os.setpgid(pid, pid)
            except OSError:
                pass  # the child already did it (or exited)
            out = {"pid": pid}
        else:
            pid = req["pid"]
            status = reaped.pop(pid) if pid in reaped else os.waitpid(pid, 0)[1]
            out = {"status": status}
        while True:  # reap orphans (and remember statuses of trial children reaped early)
            try:
                p, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if p == 0:
                break
            reaped[p] = st
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


# -- driver -----------------------------------------------------------------------------------------


class Zygote:
    """A warm worker process (``python tests/crash_worker.py serve``); use as a context manager."""

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        for k in ("FQNCKPT_FAULT_POINT", "FQNCKPT_FAULT_RANK"):
            env.pop(k, None)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=str(ROOT),
            env=env,
            text=True,
        )

    def _ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("crash worker zygote died")
        return json.loads(line)

    def fork(self, job: dict) -> int:
        return self._ask({"op": "fork", "job": job})["pid"]

    def wait(self, pid: int) -> int:
        return self._ask({"op": "wait", "pid": pid})["status"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def group_members(pgid: int) -> set[int]:
    """Live (not zombie) processes of process group ``pgid``, from /proc (Linux)."""
    out = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.add(int(d))
    return out


def _wait_ready(p: Path, pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        if p.exists():
            return True
        n += 1
        if n % 20 == 0 and not group_members(pid):
            return p.exists()
        time.sleep(0.001)
    return False


def run_job(z: Zygote, job: dict, *, kill_frac: float | None, wait_s: float) -> dict:
    """Fork ``job``; SIGKILL its process group ``kill_frac`` x (its warm-up save's duration) after it
    signals ready. With None, let it finish or die at its fault point (when a rank dies, its peers get a short grace,
    then the group is killed). Returns the child's result dict plus ``killed`` (the save never
    reported success)."""
    for k in ("ready", "done"):
        Path(job[k]).unlink(missing_ok=True)
    done = Path(job["done"])
    pid = z.fork(job)
    ready = _wait_ready(Path(job["ready"]), pid, wait_s)
    if ready and kill_frac is not None:
        time.sleep(kill_frac * json.loads(Path(job["ready"]).read_text())["seconds"])
    elif ready:
        members = group_members(pid)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not done.exists():
            live = group_members(pid)
            if not live:
                break
            if members - live:  # a rank ended (finished, or killed at its fault point)
                grace = time.monotonic() + 1.5
                while time.monotonic() < grace and not done.exists() and group_members(pid):
                    time.sleep(0.005)
                break
            members |= live
            time.sleep(0.005)
    _killpg(pid)
    status = z.wait(pid)
    deadline = time.monotonic() + 10
    while group_members(pid) and time.monotonic() < deadline:  # spawned ranks end with the group
        time.sleep(0.01)
    out = json.loads(done.read_text()) if done.exists() else {}
    saved = done.exists() and "error" not in out and all("error" not in r for r in out.get("ranks", [{}]))
    out["killed"] = not saved
    out["signaled"] = os.WIFSIGNALED(status)
    return out


# -- judging ----------------------------------------------------------------------------------------


@dataclass
class Tally:
    """Counts of one row of the report table."""

    tried: int = 0
    killed: int = 0
    loaded_old: int = 0
    loaded_new: int = 0
    rejected_right: int = 0  # "no checkpoint" for a new path / the right error type
    wrong_silently: int = 0
    partial_visible: int = 0
    code_executed: int = 0
    leftovers: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)

    @property
    def ok(self) -> bool:
        return not self.failures


# Files the user keeps beside a previous checkpoint (Hugging Face layout): every save must leave them.
USER_FILES = {"config.json": b'{"model_type": "trial"}', "tokenizer/vocab.txt": b"a\nb\n"}


def _user_files_intact(path: Path) -> bool:
    try:
        return all((path / rel).read_bytes() == data for rel, data in USER_FILES.items())
    except OSError:
        return False


def _tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def judge(
    path: Path, seed: int, mode: str, had_old: bool, t: Tally, what: str, user_files: bool = False
) -> str:
    """Load ``path`` after a trial and classify it (see module docstring); records failures in ``t``.
    ``user_files``: :data:`USER_FILES` were put beside the old checkpoint and must be intact.
    Returns "old", "new", "absent", "wrong" or "partial"."""
    import torch

    import checkpoint
    from tests.helpers import same_state

    if user_files and not _user_files_intact(path):
        t.partial_visible += 1
        t.failures.append(f"{what}: user files beside the checkpoint were changed or removed")
        return "partial"

    old, new = values("old", seed, mode), values("new", seed, mode)
    target = {k: torch.zeros_like(v) for k, v in new.items()}
    try:
        checkpoint.load(target, path)
    except checkpoint.InterruptedCommitError:
        # Killed after its commit point, while moving files in: readers refuse and change nothing;
        # the next writer (here recover) completes it, and then the new checkpoint is there, whole.
        before = _tree(path)
        try:
            checkpoint.verify(path)
        except checkpoint.InterruptedCommitError:
            pass
        if _tree(path) != before:
            t.partial_visible += 1
            t.failures.append(f"{what}: a reader changed an interrupted commit")
            return "partial"
        checkpoint.recover(path)
        return judge(path, seed, mode, had_old, t, what, user_files)
    except checkpoint.CheckpointNotFoundError as e:
        if had_old:
            t.partial_visible += 1
            t.failures.append(f"{what}: previous checkpoint lost: {e}")
            return "partial"
        t.rejected_right += 1
        return "absent"
    except Exception as e:  # noqa: BLE001
        t.partial_visible += 1
        t.failures.append(f"{what}: partial checkpoint visible: {type(e).__name__}: {e}")
        return "partial"
    if had_old and same_state(target, old):
        kind = "old"
        t.loaded_old += 1
    elif same_state(target, new):
        kind = "new"
        t.loaded_new += 1
    else:
        t.wrong_silently += 1
        t.failures.append(f"{what}: loaded values that are neither old nor new")
        return "wrong"
    rep = checkpoint.verify(path)
    if not rep.ok:
        t.partial_visible += 1
        t.failures.append(f"{what}: loaded {kind} but verify failed: {rep.problems}")
        return "partial"
    return kind


def check_clean_after_next_save(path: Path, seed: int, mode: str, t: Tally, what: str) -> None:
    """A fresh save over ``path`` succeeds and leaves only the checkpoint and its lock file beside
    it, and inside it only the new checkpoint's files (no stale shard, no work entry) and the
    user's files."""
    import checkpoint
    from checkpoint.storage.format import index_name

    shard = SINGLE_SHARD_BYTES if mode == "single" else RANKS_SHARD_BYTES
    try:
        checkpoint.save(values("new", seed, mode), path, overwrite=True, max_shard_size=shard)
    except Exception as e:  # noqa: BLE001
        t.failures.append(f"{what}: the next save failed: {type(e).__name__}: {e}")
        t.leftovers += 1
        return
    names = sorted(os.listdir(path.parent))
    want = [path.name]  # the lock file exists only while a save holds it
    if names != want:
        t.leftovers += 1
        t.failures.append(f"{what}: leftovers after the next save: {sorted(set(names) - set(want))}")
    with checkpoint.open_checkpoint(path) as r:
        inside_want = set(r.files) | {index_name()}
    inside_want |= {rel.split("/")[0] for rel in USER_FILES} if (path / "config.json").exists() else set()
    inside = set(os.listdir(path))
    if inside != inside_want:
        t.leftovers += 1
        t.failures.append(f"{what}: inside the checkpoint after the next save: extra "
                          f"{sorted(inside - inside_want)}, missing {sorted(inside_want - inside)}")  # fmt: skip


def _seed_old(path: Path, seed: int, mode: str) -> None:
    """The previous checkpoint, in twice as many shards as a trial's save writes (so the new
    save's shard names differ and the old shards become stale), plus the user's files."""
    import checkpoint

    shard = SINGLE_SHARD_BYTES if mode == "single" else RANKS_SHARD_BYTES
    checkpoint.save(values("old", seed, mode), path, max_shard_size=shard // 2)
    for rel, data in USER_FILES.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)


RANK1_POINTS = ("after_tensor_write", "before_file_fsync", "after_file_fsync")
# From the commit point on, the new checkpoint is visible (completed by the next load if killed).
NEW_FROM = ("after_commit_rename", "after_first_move", "before_cleanup")
IN_PLACE_ONLY = ("after_first_move", "before_cleanup")  # reached only over an existing directory


def plan_trial(seed: int, mode: str, kill: str, max_frac: float = 1.2, point: str | None = None) -> dict:
    """The random choices of one trial, all drawn from ``seed``: a previous checkpoint (with user
    files beside it) for even seeds, and a fault point the save reaches (any rank for points every
    rank passes, else rank 0) or a kill delay as a fraction of a save's duration (above 1 some
    saves finish first)."""
    from checkpoint.testing.faults import POINTS

    rng = random.Random(seed)
    plan = {"had_old": seed % 2 == 0}
    if kill == "fault":
        points = [p for p in POINTS if p not in IN_PLACE_ONLY or plan["had_old"]]
        if point is not None:  # forced: make the point reachable
            plan["had_old"] |= point in IN_PLACE_ONLY
        point = point or rng.choice(points)
        plan["fault"] = point
        plan["fault_rank"] = (rng.randrange(2) if point in RANK1_POINTS else 0) if mode == "ranks" else None
    else:
        plan["delay_frac"] = rng.random() * max_frac
    return plan


def crash_trial(
    z: Zygote,
    root: Path,
    seed: int,
    mode: str,
    kill: str,
    t: Tally,
    max_frac: float = 1.2,
    point: str | None = None,
) -> str:
    """One crash trial (see module docstring; ``point`` forces the fault point); updates ``t``;
    returns the judged outcome."""
    plan = plan_trial(seed, mode, kill, max_frac, point)
    d = root / f"{mode}-{kill}-{seed}"
    path = d / "in" / "ck"  # markers stay in d, outside the checkpoint's parent
    path.parent.mkdir(parents=True)
    if plan["had_old"]:
        _seed_old(path, seed, mode)
    job = {"mode": mode, "seed": seed, "path": str(path), "ready": str(d / "ready"), "done": str(d / "done"),
           "warm": str(d / "warm"), "fault": plan.get("fault"), "fault_rank": plan.get("fault_rank"),
           "timeout": 60}  # fmt: skip
    out = run_job(z, job, kill_frac=plan.get("delay_frac"), wait_s=90 if mode == "ranks" else 30)
    what = f"seed={seed} mode={mode} kill={kill} plan={plan}"
    t.tried += 1
    t.killed += out["killed"]
    outcome = judge(path, seed, mode, plan["had_old"], t, what, user_files=plan["had_old"])
    if not out["killed"] and outcome != "new":
        t.failures.append(f"{what}: the save completed but {outcome} is visible")
    if kill == "fault" and outcome in ("old", "new", "absent"):
        after = plan["fault"] in NEW_FROM
        want = "new" if after else ("old" if plan["had_old"] else "absent")
        if outcome != want:
            t.failures.append(f"{what}: killed at {plan['fault']} but {outcome} is visible, expected {want}")
    check_clean_after_next_save(path, seed, mode, t, what)
    return outcome


def disk_full_trial(z: Zygote, root: Path, seed: int, mode: str, budget: int, t: Tally) -> None:
    """Writes fail with ENOSPC after ``budget`` bytes (on rank ``seed % 2`` in 2-rank mode): the
    save must raise an OSError subclass from :mod:`checkpoint.errors` naming the path (2 ranks:
    that rank; the other gets a RankAgreementError), and the previous checkpoint stays intact."""
    d = root / f"{mode}-enospc-{seed}-{budget}"
    path = d / "in" / "ck"  # markers stay in d, outside the checkpoint's parent
    path.parent.mkdir(parents=True)
    _seed_old(path, seed, mode)
    job = {"mode": mode, "seed": seed, "path": str(path), "ready": str(d / "ready"), "done": str(d / "done"),
           "enospc_bytes": budget, "enospc_rank": seed % 2 if mode == "ranks" else None}  # fmt: skip
    out = run_job(z, job, kill_frac=None, wait_s=90)
    what = f"seed={seed} mode={mode} enospc after {budget} bytes"
    t.tried += 1
    results = out.get("ranks", [out]) if out.get("ranks") or "error" in out else []
    failing = results[seed % 2] if mode == "ranks" and results else (results[0] if results else {})
    if (
        failing.get("error") == "CheckpointWriteError"
        and failing.get("oserror")
        and str(path) in failing.get("message", "")
        and "No space left" in failing.get("message", "")
        and (mode == "single" or results[1 - seed % 2].get("error") == "RankAgreementError")
    ):
        t.rejected_right += 1
    else:
        t.failures.append(f"{what}: expected CheckpointWriteError naming {path}, got {out}")
    if judge(path, seed, mode, True, t, what, user_files=True) != "old":
        t.failures.append(f"{what}: the previous checkpoint did not survive")
    check_clean_after_next_save(path, seed, mode, t, what)


def concurrent_trial(z: Zygote, root: Path, seed: int, t: Tally, kill_one: bool = False) -> str:
    """Two processes save different values ("old" / "new" of ``seed``) to one path at once (one of
    them SIGKILLed mid-way with ``kill_one``): the path must load as exactly one of them."""
    d = root / f"concurrent-{seed}"
    path = d / "in" / "ck"  # markers stay in d, outside the checkpoint's parent
    path.parent.mkdir(parents=True)
    jobs = []
    for tag in ("old", "new"):
        jobs.append({"mode": "single", "tag": tag, "seed": seed, "path": str(path),
                     "ready": str(d / f"ready-{tag}"), "done": str(d / f"done-{tag}")})  # fmt: skip
    pids = [z.fork(j) for j in jobs]
    rng = random.Random(seed)
    victim = rng.randrange(2) if kill_one else None
    if victim is not None:
        _wait_ready(Path(jobs[victim]["ready"]), pids[victim], 30)
        time.sleep(rng.random() * 0.08)
        _killpg(pids[victim])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(group_members(p) for p in pids):
        time.sleep(0.005)
    for p in pids:
        _killpg(p)  # only if still running past the deadline
        z.wait(p)
    what = f"seed={seed} concurrent kill_one={kill_one}"
    t.tried += 1
    t.killed += victim is not None and not Path(jobs[victim]["done"]).exists()
    outcome = judge(path, seed, "single", True, t, what)
    if outcome not in ("old", "new"):
        t.failures.append(f"{what}: result is {outcome}")
    check_clean_after_next_save(path, seed, "single", t, what)
    return outcome


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        sys.exit("usage: crash_worker.py serve (started by tests/test_crash_safety.py)")
