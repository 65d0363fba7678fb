"""Train a small Llama on 2 ranks (activation checkpointing, bf16), checkpoint it in the background
with a CheckpointManager, resume on another world size.

Run from anywhere: ``python examples/llama_train_resume.py [--steps 6] [--resume-world-size 1]``.

1. ``transformers.LlamaForCausalLM`` (random init, tied embeddings) is built on the meta device
   with activation checkpointing on every decoder layer (transformers' own
   ``activation_checkpointing_enable``), captured by :class:`autoparallel.AutoParallel` under a
   bf16 ``MixedPrecisionPolicy`` on a 2-rank gloo mesh; the captured graph keeps one
   ``torch.ops.higher_order.tag_activation_checkpoint`` per layer (counted and printed);
2. ``init_weights()`` (transformers' own init code) runs on the parallel module's DTensors;
3. AdamW with a linear-warmup LR schedule trains ``--steps`` steps; after each step up to
   ``--save-after`` a :class:`checkpoint.CheckpointManager` (``keep_latest=2``, async) saves model,
   optimizer and ``extra_state`` (step, LR scheduler, RNG state) to ``root/step-0000000k``: the
   call returns once the state is staged, the files are written in the background while training
   goes on (eager FQNs, one set of full-tensor files per checkpoint);
4. a new parallel module on ``--resume-world-size`` ranks resumes with ``load_latest`` (each rank
   reads only its slices; the scheduler is restored in place, the step comes back in the dict)
   and trains the remaining steps: its losses must match the uninterrupted run's (same global
   batches; only reduction order differs). Each rank's loss is its own batch's mean (as
   transformers' ``out.loss``); the parallel module averages the gradients over the ranks (as
   FSDP2 does), so the update is the global batch's on every world size.

Prints the tag count, the saved key names, the kept checkpoints, the longest time a save blocked
training, and a table of losses per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download anything

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402

import checkpoint  # noqa: E402
from autoparallel import AutoParallel, MixedPrecisionPolicy  # noqa: E402
from checkpoint.ranks.launch import run_ranks  # noqa: E402

GLOBAL_BATCH = 4  # sequences per step, split over the ranks (a multiple of every world size used)
SEQ = 16
LR = 1e-2
LOSS_TOL = 5e-3  # |resumed - uninterrupted| per step: bf16 compute, other local batch sizes
TAG = torch.ops.higher_order.tag_activation_checkpoint


def llama_config():
    """A 2-layer Llama (hidden 64, 4 heads, 2 KV heads, vocab 256) with tied embeddings and
    transformers' default attention (sdpa)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
        use_cache=False,  # a KV cache serves generation; capture refuses it as an output
    )


def tokens(step: int) -> torch.Tensor:
    """The global batch of ``step``: int64 ``[GLOBAL_BATCH, SEQ]``, the same on every run. Each row
    counts up from a random start by a random stride (mod vocab): learnable, so the loss falls."""
    g = torch.Generator().manual_seed(step)
    vocab = llama_config().vocab_size
    start = torch.randint(0, vocab, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % vocab


def parallel_llama(mesh):
    """Meta Llama with AC on every layer -> parallel module on ``mesh`` (bf16 params in compute).

    Returns ``(module, number of tag_activation_checkpoint nodes in the captured graph)``.
    """
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config())
    model.activation_checkpointing_enable({"use_reentrant": False})  # every decoder layer
    model.train()  # transformers checkpoints only in training mode
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with AutoParallel(
        model, lambda: {"args": (), "kwargs": {"input_ids": tokens(0)}}, mesh, mp_policy=policy
    ) as autop:
        n_tags = sum(1 for n in autop.captured.gm.graph.nodes if n.target is TAG)
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])  # logits: local rows
        pmod = autop.apply_placement()
    return pmod, n_tags


def train(rank: int, world_size: int, steps: int, root: str, resume: bool, save_after: int | None) -> dict:
    """One rank: build, init (or resume model, optimizer, scheduler and step from the newest
    checkpoint under ``root``), train up to step ``steps - 1``; returns the global loss of each
    step (float, mean token cross-entropy), the tag count, the saved keys and the resumed step."""
    warnings.filterwarnings("ignore", message="DTensor random operators")
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    pmod, n_tags = parallel_llama(mesh)
    pmod.to_empty(device=mesh.device_type)
    torch.manual_seed(0)
    pmod.init_weights()  # transformers' init, run unchanged on DTensors (also fills rotary buffers)
    opt = torch.optim.AdamW(pmod.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3)  # warmup
    # background_staging: the optimizer's tensors are copied during the next forward / backward;
    # opt.step() waits for that copy (nothing else writes them in this loop).
    manager = checkpoint.CheckpointManager(root, keep_latest=2, async_save=True, background_staging=True)
    out: dict = {"tags": n_tags, "losses": {}, "blocked_s": 0.0}
    first = 0
    if resume:
        extra = {"step": None, "lr_scheduler": sched, "rng": None}
        step = manager.load_latest(pmod, opt, extra)  # strict; reshards to this mesh
        report = manager.last_report
        torch.set_rng_state(extra["rng"])
        first = extra["step"] + 1
        out["resumed_step"] = step
        out["loaded"] = len([k for k in report.loaded_keys if not k.startswith("extra_state.")])
        out["extra_loaded"] = sorted(k for k in report.loaded_keys if k.startswith("extra_state."))
        out["optimizer_loaded"] = report.optimizer_loaded
    vocab = llama_config().vocab_size
    for step in range(first, steps):
        batch = tokens(step).chunk(world_size)[rank]
        logits = pmod(input_ids=batch).logits
        # This rank's mean token loss (as transformers' ``out.loss``): the parallel module averages
        # the gradients over the ranks (reduce="mean", as FSDP2), giving the global batch's mean's.
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, vocab).float(), batch[:, 1:].reshape(-1)
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        out["losses"][step] = total.item()
        if not resume and step <= save_after:
            t = time.perf_counter()
            extra = {"step": step, "lr_scheduler": sched, "rng": torch.get_rng_state()}
            manager.save(step, pmod, opt, extra)  # returns at once; staged and written in the background
            out["blocked_s"] = max(out["blocked_s"], time.perf_counter() - t)
            out["saved_keys"] = sorted(pmod.state_dict())
    manager.wait()  # the last background save has committed
    out["kept"] = [os.path.basename(p) for p in map(manager.path, manager.steps())]
    out["staging_bytes"] = manager.staging_bytes
    return out


def run(
    steps: int = 6, save_after: int = 2, resume_world_size: int | tuple[int, ...] = 1, workdir: str | None = None
) -> dict:
    """Train ``steps`` steps on 2 ranks (saving after step ``save_after``), then resume on
    ``resume_world_size`` ranks (each of several world sizes in turn, from the same checkpoint).
    Returns ``{"tags", "state_dict_keys", "stored_keys", "alias_groups", "loaded", "extra_loaded",
    "optimizer_loaded", "resumed_step", "kept", "blocked_s", "staging_bytes", "uninterrupted":
    {step: loss}, "resumed": {step: loss}, "resumed_on": {world size: {step: loss}},
    "max_loss_diff", "checkpoint", "seconds": {phase: seconds}}``; ``resumed`` and the load
    figures are the first resume's, ``max_loss_diff`` is over all of them."""
    worlds = (resume_world_size,) if isinstance(resume_world_size, int) else tuple(resume_world_size)
    workdir = workdir or tempfile.mkdtemp(prefix="llama-resume-")
    root = os.path.join(workdir, "checkpoints")
    t0 = time.perf_counter()
    first = run_ranks(train, 2, steps, root, False, save_after, backend="gloo", timeout=300)
    seconds = {"train 2 ranks": time.perf_counter() - t0}
    rest = list(range(save_after + 1, steps))
    resumed_on = {}
    for w in worlds:
        t = time.perf_counter()
        resumed_on[w] = run_ranks(train, w, steps, root, True, None, backend="gloo", timeout=300)[0]
        seconds[f"resume {w} ranks"] = time.perf_counter() - t
    resumed = resumed_on[worlds[0]]
    ckpt = checkpoint.CheckpointManager(root).latest()
    full, res = first[0]["losses"], resumed["losses"]
    with checkpoint.open_checkpoint(ckpt) as reader:  # what is on disk: eager FQNs, tied alias recorded
        stored, aliases = sorted(reader.keys()), [list(g) for g in reader.alias_groups]
    return {
        "tags": first[0]["tags"],
        "state_dict_keys": first[0]["saved_keys"],
        "stored_keys": stored,
        "alias_groups": aliases,
        "loaded": resumed["loaded"],
        "extra_loaded": resumed["extra_loaded"],
        "optimizer_loaded": resumed["optimizer_loaded"],
        "resumed_step": resumed["resumed_step"],
        "kept": first[0]["kept"],
        "blocked_s": max(r["blocked_s"] for r in first),
        "staging_bytes": first[0]["staging_bytes"],
        "uninterrupted": full,
        "resumed": res,
        "resumed_on": {w: r["losses"] for w, r in resumed_on.items()},
        "max_loss_diff": max(abs(full[s] - r["losses"][s]) for r in resumed_on.values() for s in rest),
        "checkpoint": ckpt,
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-after", type=int, default=2, help="save after this step (0-based)")
    p.add_argument("--resume-world-size", type=int, default=1)
    p.add_argument("--workdir", help="keep the checkpoint here (default: a temporary directory, removed)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llama-resume-") as tmp:  # removed at the end unless --workdir
        r = run(a.steps, a.save_after, a.resume_world_size, a.workdir or tmp)
    layers = llama_config().num_hidden_layers
    print(f"captured graph: {r['tags']} tag_activation_checkpoint ops for {layers} decoder layers")
    print(
        f"saved {len(r['stored_keys'])} tensors in eager FQNs to {r['checkpoint']}, e.g. {r['stored_keys'][:2]}"
    )
    print(f"tied names (stored once): {r['alias_groups']}")
    print(f"kept checkpoints: {r['kept']}; a save blocked training at most {r['blocked_s'] * 1e3:.0f} ms "
          f"(staging {r['staging_bytes'] / 2**20:.1f} MiB per rank)")  # fmt: skip
    print(
        f"resumed on {a.resume_world_size} rank(s) from step {r['resumed_step']}: {r['loaded']} tensors, "
        f"optimizer {r['optimizer_loaded']}, extra state {r['extra_loaded']}"
    )
    print(f"{'step':>4}  {'2 ranks':>10}  {f'resumed ({a.resume_world_size})':>13}  {'|diff|':>8}")
    for step, loss in r["uninterrupted"].items():
        res = r["resumed"].get(step)
        cells = f"{res:13.6f}  {abs(res - loss):8.1e}" if res is not None else ""
        print(f"{step:4d}  {loss:10.6f}  {cells}".rstrip())
    ok = r["tags"] == layers and r["max_loss_diff"] < LOSS_TOL
    print(f"max |diff| {r['max_loss_diff']:.1e} (limit {LOSS_TOL:g})")
    print("; ".join(f"{k} {v:.1f}s" for k, v in r["seconds"].items()), "->", "OK" if ok else "FAILED")
    print(
        f"checkpoint kept in {r['checkpoint']}"
        if a.workdir
        else "temporary checkpoint removed (--workdir DIR keeps it)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
