"""Benchmark: save and load on S3 (moto's server on 127.0.0.1, started here) with fqnckpt against
DCP's ``FsspecWriter`` / ``FsspecReader`` on the same server (moto in its own process) and the
same state, in the same run
(not collected by pytest).

    python tests/bench/s3_save_load.py [--mib 64] [--tensors 16] [--rounds 5]

Goal: ratio DCP time / fqnckpt time >= 1.0x for both save and load.
The state is ``--tensors`` float32 tensors of ``--mib`` MiB in all, one process. Each round runs
the four timings in alternating order (fqnckpt first on even rounds, DCP first on odd ones);
fqnckpt saves with ``overwrite=True`` over its previous round (commit: index last, old objects
deleted after), DCP into a fresh prefix each round (it cannot replace a checkpoint). Loads are
into preallocated tensors (fqnckpt ``load``, DCP ``dcp.load`` in place); every load is checked
against the saved values. Both use their defaults (fqnckpt: :class:`TransferConfig`'s part size
and parts in flight, or ``--part-mib`` / ``--in-flight``; DCP: one file per rank written by one
thread through ``fsspec.open``). Prints the median and range of each
time and of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import checkpoint  # noqa: E402
from tests.s3_server import make_bucket, start_moto_process  # noqa: E402


def _state(mib: int, n: int) -> dict[str, torch.Tensor]:
    per = mib * (1 << 20) // (4 * n)
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(per // 256, 256, generator=g) for i in range(n)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--part-mib", type=int, default=None, help="fqnckpt upload part size (default: TransferConfig's)")
    ap.add_argument("--in-flight", type=int, default=None, help="fqnckpt parts in flight (default: TransferConfig's)")
    args = ap.parse_args()
    from checkpoint.storage.objstore import TransferConfig

    kw = {}
    if args.part_mib:
        kw["part_size"] = args.part_mib << 20
    if args.in_flight:
        kw["parts_in_flight"] = args.in_flight
    transfer = TransferConfig(**kw)

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    warnings.filterwarnings("ignore")  # DCP warns that no process group is initialized
    server, port = start_moto_process()  # its own process: no interpreter lock shared with the client
    make_bucket(port, "bench")
    opts = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s"}
    state = _state(args.mib, args.tensors)
    nbytes = sum(t.nbytes for t in state.values())
    times: dict[str, list[float]] = {"ours save": [], "dcp save": [], "ours load": [], "dcp load": []}

    def ours_save(r: int) -> None:
        checkpoint.save(state, "s3://bench/ours/ck", overwrite=True, storage_options=opts, transfer=transfer)

    def dcp_save(r: int) -> None:
        dcp.save(state, storage_writer=FsspecWriter(f"s3://bench/dcp/ck-{r}", **opts))

    def ours_load(r: int) -> None:
        target = {k: torch.empty_like(v) for k, v in state.items()}
        checkpoint.load(target, "s3://bench/ours/ck", storage_options=opts)
        assert all(torch.equal(target[k], state[k]) for k in state)

    def dcp_load(r: int) -> None:
        target = {k: torch.empty_like(v) for k, v in state.items()}
        dcp.load(target, storage_reader=FsspecReader(f"s3://bench/dcp/ck-{r}", **opts))
        assert all(torch.equal(target[k], state[k]) for k in state)

    def timed(name: str, fn, r: int) -> None:
        t0 = time.perf_counter()
        fn(r)
        times[name].append(time.perf_counter() - t0)

    ours_save(-1), dcp_save(-1), ours_load(-1), dcp_load(-1)  # warm-up: sessions, imports
    for r in range(args.rounds):
        order = [("ours", ours_save, ours_load), ("dcp", dcp_save, dcp_load)]
        if r % 2:
            order.reverse()
        for who, save_fn, _ in order:
            timed(f"{who} save", save_fn, r)
        for who, _, load_fn in order:
            timed(f"{who} load", load_fn, r)
    server.kill()
    server.wait()

    def fmt(xs: list[float]) -> str:
        return f"median {statistics.median(xs):.3f} (range {min(xs):.3f}-{max(xs):.3f})"

    print(f"state: {args.tensors} float32 tensors, {nbytes / 2**20:.0f} MiB; {args.rounds} alternated rounds; "
          f"moto S3 on 127.0.0.1; fqnckpt parts {transfer.part_size >> 20} MiB x {transfer.parts_in_flight} in flight")
    for name, xs in times.items():
        print(f"  {name:10s} s: {fmt(xs)}  {nbytes / 2**20 / statistics.median(xs):.0f} MiB/s")
    for op in ("save", "load"):
        ratios = [d / o for d, o in zip(times[f"dcp {op}"], times[f"ours {op}"])]
        print(f"  {op} ratio DCP/fqnckpt: {fmt(ratios)}x (goal >= 1.0x)")


if __name__ == "__main__":
    main()
