"""Per-rank device checks run by tests/gpu/run.sh: one rank per visible GPU (NCCL), or
CPU ranks (gloo) with ``--device cpu`` (what CI runs, small). Prints one line per check (OK /
FAIL with the numbers) and GB/s; exits 1 if a check failed.

    python tests/gpu/checks.py --device cuda --world 8 [--mib 1024] [--rounds 3] [--dir DIR]

Checks, every rank, state on the mesh's device:
1. parallel module: a TinyTransformer through AutoParallel on a 1-D mesh; each rank's output of
   its batch rows equals the eager model's (CPU, float32, TF32 off) within 1e-4.
2. checkpoint: ``--mib`` MiB of float32 DTensors (``Shard(0)``, plus a ``Shard(1)``, a
   ``Replicate`` and a bfloat16 tensor) saved with ``checkpoint.save``; ``verify`` passes; loaded
   straight into zeroed DTensors on the device with the same placements and with ``Shard(1)``
   everywhere (resharded): equal to the source bit for bit.
3. load speed: ``checkpoint.load`` into the device DTensors against the reference, each rank's
   ``safe_open(...).get_slice(key)[its block].to(device)`` copied into its local shard; GB/s of
   the bytes each rank holds, ratio reference time / our time per round (median [range]).
4. async save from the device: ``checkpoint.async_save`` (pinned staging on CUDA): GB/s of the
   call (device -> host staging) and of the whole save, against a plain ``.cpu()`` of every local
   shard (pageable copies); the saved values read back equal the source.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from checkpoint.ranks.launch import run_ranks  # noqa: E402
from tests.helpers import same_state  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _parallel_module(rank: int, world: int, device: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from autoparallel import AutoParallel
    from tests.models import TinyConfig, TinyTransformer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    mesh = init_device_mesh(device, (world,))
    cfg = TinyConfig(n_layers=1)
    torch.manual_seed(0)
    user = TinyTransformer(cfg)
    user.init_weights()
    batch = 2 * world
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = user(tokens)
    with AutoParallel(user, lambda: torch.randint(0, cfg.vocab, (batch, cfg.seq)), mesh) as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        pmod = autop.apply_placement(autop.optimize_placement())
    with torch.no_grad():
        out = pmod(tokens.chunk(world)[rank].to(device))
    diff = (out.float().cpu() - ref.chunk(world)[rank].float()).abs().max().item()
    ok = diff <= 1e-4
    return f"{'OK' if ok else 'FAIL'} parallel module vs eager on {device}: max |diff| {diff:.2e}"


def _state(mesh, mib: int, device: str) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    rows = max(mesh.size(), (mib << 20) // (8 * 4096 * 4))
    full = {f"layers.{i}.weight": torch.randn(rows, 4096, generator=g) for i in range(8)}
    full["cols"] = torch.randn(64, 96, generator=g)
    full["rep"] = torch.randn(7, 5, generator=g)
    full["bf16"] = torch.randn(33, 16, generator=g).to(torch.bfloat16)
    pl = {k: [Shard(0)] for k in full} | {"cols": [Shard(1)], "rep": [Replicate()]}
    return {k: distribute_tensor(v.to(device), mesh, pl[k], src_data_rank=None) for k, v in full.items()}


def _zeros_like(sd: dict, placements=None) -> dict:
    from torch.distributed.tensor import zeros

    return {
        k: zeros(v.shape, dtype=v.dtype, device_mesh=v.device_mesh, placements=placements or v.placements)
        for k, v in sd.items()
    }


def _equal(a: dict, b: dict) -> bool:
    """Same keys, and every DTensor's full tensor the same bits, dtype and shape (on CPU)."""
    return same_state({k: v.full_tensor().cpu() for k, v in a.items()}, {k: v.full_tensor().cpu() for k, v in b.items()})


def _ratio(ref: list[float], ours: list[float]) -> str:
    r = [x / y for x, y in zip(ref, ours)]
    return f"{statistics.median(r):.2f}x [{min(r):.2f}-{max(r):.2f}]"


def _gbs(nbytes: int, ts: list[float]) -> str:
    return f"{nbytes / statistics.median(ts) / 1e9:.2f} GB/s"


def _checkpoint_checks(rank: int, world: int, device: str, mib: int, rounds: int, root: str) -> list[str]:
    import torch.distributed as tdist
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import checkpoint
    from checkpoint.ranks import shards

    lines = []
    mesh = init_device_mesh(device, (world,))
    sd = _state(mesh, mib, device)
    held = sum(v.to_local().numel() * v.element_size() for v in sd.values())
    path = os.path.join(root, "ck")
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    tdist.barrier()
    checkpoint.save(sd, path)
    ok = checkpoint.verify(path).ok if rank == 0 else True
    lines.append(f"{'OK' if ok else 'FAIL'} save from {device} DTensors + verify")
    same, resharded = _zeros_like(sd), _zeros_like(sd, [Shard(1)])
    checkpoint.load(same, path)
    checkpoint.load(resharded, path)
    eq = _equal(sd, same) and _equal(sd, resharded)
    lines.append(f"{'OK' if eq else 'FAIL'} load into {device} DTensors (same placements, and Shard(1)): bit-exact")

    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))

    def ours():
        checkpoint.load(same, path)

    def reference():  # plain safe_open + .to(device) of each block this rank holds
        for f in files:
            with safe_open(f, framework="pt") as h:
                for k in h.keys():
                    local = same[k].to_local()
                    for lsl, gsl in shards.local_blocks(same[k]):
                        local[lsl].copy_(h.get_slice(k)[gsl].to(device))

    times: dict[str, list[float]] = {"ours": [], "ref": []}
    for i in range(rounds + 1):
        for side in (("ours", "ref") if i % 2 == 0 else ("ref", "ours")):
            tdist.barrier()
            t = time.perf_counter()
            ours() if side == "ours" else reference()
            _sync(device)
            if i:
                times[side].append(time.perf_counter() - t)
    lines.append(
        f"INFO load into {device} DTensors: ours {_gbs(held, times['ours'])}, safe_open + .to({device!r}) "
        f"{_gbs(held, times['ref'])}; ours vs reference {_ratio(times['ref'], times['ours'])} (rank {rank}, "
        f"{held / 2**20:.0f} MiB held)"
    )

    # async save from the device (pinned staging on CUDA)
    stage: dict[str, list[float]] = {"call": [], "total": [], "cpu_copy": []}
    for i in range(rounds + 1):
        p = os.path.join(root, f"async{i % 2}")
        tdist.barrier()
        t = time.perf_counter()
        {k: v.to_local().cpu() for k, v in sd.items()}
        _sync(device)
        t_copy = time.perf_counter() - t
        tdist.barrier()
        t = time.perf_counter()
        fut = checkpoint.async_save(sd, p, overwrite=True)
        t_call = time.perf_counter() - t
        fut.result()
        t_total = time.perf_counter() - t
        if i:  # round 0 allocates the staging buffers
            stage["call"].append(t_call)
            stage["total"].append(t_total)
            stage["cpu_copy"].append(t_copy)
    back = _zeros_like(sd)
    checkpoint.load(back, os.path.join(root, f"async{rounds % 2}"))
    eq = _equal(sd, back)
    lines.append(
        f"{'OK' if eq else 'FAIL'} async_save from {device}: call {_gbs(held, stage['call'])} (staging), whole save "
        f"{_gbs(held, stage['total'])}; plain .cpu() of the shards {_gbs(held, stage['cpu_copy'])}; call vs .cpu() "
        f"{_ratio(stage['cpu_copy'], stage['call'])} (rank {rank})"
    )
    return lines


def _rank(rank: int, world: int, device: str, mib: int, rounds: int, root: str, only: str) -> list[str]:
    lines = []
    for name, fn in (
        ("module", lambda: [_parallel_module(rank, world, device)]),
        ("checkpoint", lambda: _checkpoint_checks(rank, world, device, mib, rounds, root)),
    ):
        if only and name != only:
            continue
        try:
            lines += fn()
        except Exception as e:  # noqa: BLE001 - reported as a failed check, the others still run
            import traceback

            lines.append(f"FAIL {name} on {device}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--world", type=int, default=0, help="ranks (default: every visible GPU; 2 on CPU)")
    ap.add_argument("--mib", type=int, default=1024, help="checkpoint size in MiB (all ranks)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="", help="where checkpoints are written (default: a temporary dir)")
    ap.add_argument("--only", choices=("module", "checkpoint"), default="", help="run one group of checks")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("tests/gpu/checks.py: no CUDA device visible: GPU checks skipped")
        return 0
    world = a.world or (torch.cuda.device_count() if a.device == "cuda" else 2)
    backend = "nccl" if a.device == "cuda" else "gloo"
    root = a.dir or tempfile.mkdtemp(prefix="fqnckpt-gpu-")
    os.makedirs(root, exist_ok=True)
    try:
        t = time.perf_counter()
        res = run_ranks(_rank, world, a.device, a.mib, a.rounds, root, a.only, backend=backend, timeout=1200)
        failed = False
        for r, lines in enumerate(res):
            for line in lines:
                if r == 0 or not line.startswith("OK"):
                    print(f"[rank {r}] {line}" if world > 1 else line)
                failed |= line.startswith("FAIL")
        print(f"tests/gpu/checks.py: {world} rank(s), {backend}, {a.mib} MiB, {time.perf_counter() - t:.0f} s: "
              f"{'FAILED' if failed else 'all checks OK'}")  # fmt: skip
        return 1 if failed else 0
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
