"""Cost of mesh-independent ``init_weights()`` vs the former per-shard rule, same run, same module.

Run: ``python tests/bench/init_cost.py [--world 2] [--pairs 5] [--size small|example] [--threads N]``.
``--threads`` sets ``torch.set_num_threads`` on each rank (both rules alike; default: torch's).

The parallel module of a Llama (transformers ``LlamaForCausalLM``, built on meta, FSDP-style
``Shard(0)`` plan from ``AutoParallel``) on ``world`` gloo ranks; ``init_weights()`` is
transformers' own init code. Time: ``pairs`` pairs on the same module, alternating which rule goes
first, ``os.sync()`` before each timed step; median and range of the per-pair ratio
(mesh-independent / per-shard). Memory: each rule once in a fresh set of ranks: peak RSS during
init minus RSS before it (Linux ``VmHWM`` after resetting it through ``/proc/self/clear_refs``),
printed next to the rank's local parameter bytes and the largest full tensor, so a full tensor made
during init would show. Timings on a shared machine are noisy: compare ratios, not seconds.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

SIZES = {
    # The examples/llama_train_resume.py model, and a larger one of the same shape family.
    "example": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "small": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
}


def _build(size: str, mesh):
    from torch.distributed.tensor import Shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from autoparallel import AutoParallel

    cfg = LlamaConfig(**SIZES[size], max_position_embeddings=16, tie_word_embeddings=True, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    tokens = torch.zeros(2 * mesh.size(), 16, dtype=torch.int64)
    with AutoParallel(model, lambda: {"args": (), "kwargs": {"input_ids": tokens}}, mesh) as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        pmod = autop.apply_placement()
    pmod.to_empty(device=mesh.device_type)
    return pmod


def _use_rule(pmod, mesh_independent: bool) -> None:
    from autoparallel import wrap_init_weights

    # transformers marks initialized modules / tensors and skips them in later init_weights() calls.
    for obj in [*pmod.modules(), *pmod.parameters(), *pmod.buffers()]:
        obj.__dict__.pop("_is_hf_initialized", None)

    for mod in pmod.modules():  # drop earlier per-instance wrappers, then wrap with the rule
        mod.__dict__.pop("init_weights", None)
    wrap_init_weights(pmod, mesh_independent=mesh_independent)


def _timed_init(pmod, mesh_independent: bool) -> float:
    import torch.distributed as dist

    _use_rule(pmod, mesh_independent)
    torch.manual_seed(0)
    os.sync()
    dist.barrier()
    t = time.perf_counter()
    pmod.init_weights()
    dist.barrier()
    return time.perf_counter() - t


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _time_rank(rank, world, size, pairs, threads):
    from torch.distributed.device_mesh import init_device_mesh

    if threads:
        torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    pmod = _build(size, init_device_mesh("cpu", (world,)))
    _timed_init(pmod, True), _timed_init(pmod, False)  # warm both paths once
    rows = []
    for i in range(pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        got = {rule: _timed_init(pmod, rule) for rule in order}
        rows.append((got[True], got[False]))
    return rows


def _memory_rank(rank, world, size, mesh_independent, threads):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    if threads:
        torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    pmod = _build(size, init_device_mesh("cpu", (world,)))
    _use_rule(pmod, mesh_independent)
    local = sum(t._local_tensor.nbytes for t in pmod.state_dict().values() if isinstance(t, DTensor))
    largest = max(t.numel() * t.element_size() for t in pmod.state_dict().values())
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    torch.manual_seed(0)
    pmod.init_weights()
    return {"peak_extra": (_status_kib("VmHWM") - before) * 1024, "local": local, "largest_full": largest}


def main() -> None:
    from checkpoint.ranks.launch import run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    rows = run_ranks(
        _time_rank, args.world, args.size, args.pairs, args.threads, backend="gloo", timeout=1200
    )[0]
    ratios = [a / b for a, b in rows]
    mi = [a for a, _ in rows]
    ps = [b for _, b in rows]
    threads = args.threads or torch.get_num_threads()
    print(
        f"Llama '{args.size}', {args.world} ranks x {threads} threads, Shard(0) plan, {args.pairs} pairs (rank 0):"
    )
    print(
        f"  init_weights mesh-independent  median {statistics.median(mi):7.3f} s  range {min(mi):.3f}-{max(mi):.3f}"
    )
    print(
        f"  init_weights per-shard (before) median {statistics.median(ps):7.3f} s  range {min(ps):.3f}-{max(ps):.3f}"
    )
    print(
        f"  ratio mesh-independent / per-shard: median x{statistics.median(ratios):.2f}  "
        f"range x{min(ratios):.2f}-x{max(ratios):.2f}  (goal <= x2)"
    )
    for rule in (True, False):
        mem = run_ranks(
            _memory_rank, args.world, args.size, rule, args.threads, backend="gloo", timeout=1200
        )[0]
        name = "mesh-independent" if rule else "per-shard (before)"
        print(
            f"  peak extra RSS during init, {name:18s}: {mem['peak_extra'] / 2**20:7.1f} MiB "
            f"(local params+buffers {mem['local'] / 2**20:.1f} MiB, largest full tensor "
            f"{mem['largest_full'] / 2**20:.1f} MiB)"
        )


if __name__ == "__main__":
    main()
