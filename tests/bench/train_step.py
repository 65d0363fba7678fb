"""Train step (forward, backward, AdamW) of autoparallel's parallel module vs FSDP2, same run.

Run: ``python tests/bench/train_step.py [--pairs 7] [--profile]``. Two gloo ranks (``run_ranks``)
train transformers' ``LlamaForCausalLM`` (hidden 256, 4 layers, seq 128, global batch 8, default
attention) from the same weights: the parallel module (``AutoParallel``, default plan) and FSDP2
(``fully_shard`` on every decoder layer and the root), both under
``MixedPrecisionPolicy(param_dtype=bfloat16)`` (gradients averaged over the ranks in float32 on both
sides: ``reduce="mean"``, FSDP2's default). After 2 warm-up
steps each, ``--pairs`` timed pairs alternate which side goes first; ``os.sync()`` and a barrier
before every timed step. Prints each side's median step and range (max over ranks per step), the
throughput ratio FSDP2 / parallel (>= 1.0 means the parallel module is at least as fast), capture
and build time, and with ``--profile`` each side's top ops by self CPU time (one step, rank 0).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from checkpoint.ranks.launch import run_ranks  # noqa: E402

HIDDEN, LAYERS, SEQ, GLOBAL_BATCH, VOCAB = 256, 4, 128, 8, 2048


def _llama():
    from tests.models import hf_llama

    return hf_llama(
        VOCAB,
        HIDDEN,
        LAYERS,
        intermediate_size=4 * HIDDEN,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
    )


def _step(model, opt, ids, n_tokens: int) -> float:
    logits = model(input_ids=ids).logits
    loss = (
        F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
        / n_tokens
    )
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _timed(model, opt, ids, n_tokens) -> float:
    os.sync()
    dist.barrier()
    t = time.perf_counter()
    _step(model, opt, ids, n_tokens)
    dist.barrier()
    return time.perf_counter() - t


def _rank(rank: int, world: int, pairs: int, profile: bool) -> dict:
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from autoparallel import AutoParallel

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _llama()
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    mine = ids.chunk(world)[rank]
    n_tokens = GLOBAL_BATCH * (SEQ - 1)

    t = time.perf_counter()
    with AutoParallel(
        copy.deepcopy(model), lambda: {"args": (), "kwargs": {"input_ids": ids}}, mesh, policy
    ) as ap:
        t_capture = time.perf_counter() - t
        pmod = ap.apply_placement()
    t_build = time.perf_counter() - t - t_capture

    fsdp = copy.deepcopy(model)
    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(fsdp, mesh=mesh, mp_policy=policy)

    sides = {
        "parallel": (pmod, torch.optim.AdamW(pmod.parameters(), lr=1e-3)),
        "fsdp2": (fsdp, torch.optim.AdamW(fsdp.parameters(), lr=1e-3)),
    }
    first_loss = {name: _step(m, o, mine, n_tokens) for name, (m, o) in sides.items()}
    for m, o in sides.values():
        _step(m, o, mine, n_tokens)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(pairs):
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        for name in order:
            times[name].append(_timed(*sides[name], mine, n_tokens))
    out = {"times": times, "capture": t_capture, "build": t_build, "first_loss": first_loss}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        out["profile"] = {}
        for name in sides:
            if rank == 0:
                with prof(activities=[ProfilerActivity.CPU]) as p:
                    _step(*sides[name], mine, n_tokens)
                out["profile"][name] = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
            else:
                _step(*sides[name], mine, n_tokens)  # the peer of rank 0's profiled step
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    a = parser.parse_args()
    results = run_ranks(_rank, 2, a.pairs, a.profile, backend="gloo", timeout=1800)
    r0 = results[0]
    print(
        f"Llama hidden {HIDDEN}, {LAYERS} layers, seq {SEQ}, global batch {GLOBAL_BATCH}, 2 gloo ranks, bf16"
    )
    print(
        f"capture {max(r['capture'] for r in results):.2f} s, build {max(r['build'] for r in results):.2f} s"
    )
    print(f"first-step loss (rank 0): {r0['first_loss']}")
    med = {}
    for name in r0["times"]:
        steps = [max(r["times"][name][i] for r in results) for i in range(a.pairs)]  # slowest rank
        med[name] = statistics.median(steps)
        print(
            f"{name:9s} median {med[name]:.3f} s/step  range {min(steps):.3f}-{max(steps):.3f}  ({a.pairs} steps)"
        )
    print(f"throughput parallel / FSDP2: x{med['fsdp2'] / med['parallel']:.2f} (goal >= 1.0)")
    for name, table in r0.get("profile", {}).items():
        print(f"{name}: one step on rank 0, top ops by self CPU time")
        print(table)


if __name__ == "__main__":
    main()
