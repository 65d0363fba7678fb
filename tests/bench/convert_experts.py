"""experts-to-fused on a 20,000-tensor MoE checkpoint vs safetensors load_file + save_file of the
same bytes (not collected by pytest). Goal: time <= 3x the reference, peak tensor
memory <= 2x the largest layer's experts.

Each round runs both in the same process, their order alternating between rounds; prints median
and range of the ratio and the machine's load average.
Memory: an upper bound of the tensor bytes the conversion holds at once (the group's inputs, every
op's outputs as if all stayed alive, plus outputs kept for the writer), over one layer's expert
bytes; and the peak RSS growth of a fresh subprocess doing the migration, beside the same figure
for a plain renaming migrate of the same file (the reader / writer path's own RSS).

    python tests/bench/convert_experts.py [--layers 52] [--experts 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SAMPLER = r"""
import threading
anon = {"base": kib("RssAnon"), "peak": 0, "run": True}
def _sample():  # anonymous memory only: the file pages safetensors maps are the page cache's
    while anon["run"]:
        anon["peak"] = max(anon["peak"], kib("RssAnon"))
        threading.Event().wait(0.002)
threading.Thread(target=_sample, daemon=True).start()
"""
CHILD = r"""
import json, resource, sys
import torch, transformers
import checkpoint
from checkpoint.convert import plan as plan_mod

def kib(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field))

cfg = transformers.Qwen3MoeConfig(**json.loads(sys.argv[3]))
with torch.device("meta"):
    model = transformers.Qwen3MoeForCausalLM(cfg)
held = {"peak": 0, "group": 0}
def nbytes(values):
    return sum(t.nbytes for v in values for t in (v if isinstance(v, list) else [v]))
class Counted:  # every op's outputs counted as if all stayed alive: an upper bound of the group's tensors
    def __init__(self, op):
        self.op = op
    def apply(self, values, dims):
        out = self.op.apply(values, dims)
        held["group"] += nbytes(out)
        return out
orig_ops, orig_compute = plan_mod._ops, plan_mod.ConversionPlan.compute
plan_mod._ops = lambda rule, *shards: tuple(Counted(op) for op in orig_ops(rule, *shards))
def compute(self, g):
    held["group"] = sum(self.catalog.nbytes(k) for k in g.source_keys())  # the inputs read
    out = orig_compute(self, g)
    cached = sum(t.nbytes for t in self._cache.values())
    held["peak"] = max(held["peak"], cached + held["group"])
    return out
plan_mod.ConversionPlan.compute = compute
SAMPLER
checkpoint.migrate(sys.argv[1], sys.argv[2] + ".warm", recipe="experts-to-fused", model=model)  # lazy imports, caches
import gc; gc.collect()
anon["base"] = anon["peak"] = kib("RssAnon")
base = kib("VmRSS")
checkpoint.migrate(sys.argv[1], sys.argv[2], recipe="experts-to-fused", model=model)
anon["run"] = False
peak = min(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, kib("VmHWM"))
print(json.dumps({"rss_growth": (peak - base) * 1024, "held_peak": held["peak"], "anon_growth": (anon["peak"] - anon["base"]) * 1024}))
"""
PLAIN = r"""
import json, resource, sys
import torch, transformers
import checkpoint

def kib(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field))

SAMPLER
checkpoint.migrate(sys.argv[1], sys.argv[2] + ".warm", rules=[("^model", "model")])  # lazy imports, caches
import gc; gc.collect()
anon["base"] = anon["peak"] = kib("RssAnon")
base = kib("VmRSS")
checkpoint.migrate(sys.argv[1], sys.argv[2], rules=[("^model", "model")])
anon["run"] = False
peak = min(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, kib("VmHWM"))
print(json.dumps({"rss_growth": (peak - base) * 1024, "anon_growth": (anon["peak"] - anon["base"]) * 1024}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=52)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--inter", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    import checkpoint

    cfgd = dict(vocab_size=128, hidden_size=a.hidden, intermediate_size=a.hidden * 2, moe_intermediate_size=a.inter,
                num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=a.experts, num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
    cfg = transformers.Qwen3MoeConfig(**cfgd)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(cfg)
    from transformers.core_model_loading import revert_weight_conversion

    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    hub = revert_weight_conversion(model, sd)
    layer_experts = sum(t.nbytes for k, t in hub.items() if k.startswith("model.layers.0.mlp.experts."))
    total = sum(t.nbytes for t in hub.values())
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "hub.safetensors")
        save_file({k: v.contiguous() for k, v in hub.items()}, src)
        del sd, hub
        print(f"{len(load_file(src))} tensors, {total / 2**20:.1f} MiB, one layer's experts {layer_experts / 2**20:.2f} MiB")
        def reference(r: int) -> float:
            t0 = time.perf_counter()
            save_file(load_file(src), os.path.join(d, f"ref{r}.safetensors"))
            return time.perf_counter() - t0

        def convert(r: int) -> float:
            t0 = time.perf_counter()
            checkpoint.migrate(src, os.path.join(d, f"out{r}"), recipe="experts-to-fused", model=model)
            return time.perf_counter() - t0

        ratios = []
        for r in range(a.rounds):  # alternated order: neither side always runs on a warm cache
            if r % 2 == 0:
                ref, ours = reference(r), convert(r)
            else:
                ours, ref = convert(r), reference(r)
            ratios.append(ours / ref)
            print(f"round {r}: safetensors load_file+save_file {ref:.2f} s, experts-to-fused {ours:.2f} s, ratio {ours / ref:.2f}")
        print(f"load average (1, 5, 15 min) after the rounds: {os.getloadavg()}")
        print(f"time ratio vs load_file+save_file: median {statistics.median(ratios):.2f} "
              f"(range {min(ratios):.2f}-{max(ratios):.2f}; goal <= 3)")  # fmt: skip
        out = subprocess.run([sys.executable, "-c", CHILD.replace("SAMPLER\n", SAMPLER), src, os.path.join(d, "mem"), json.dumps(cfgd)],
                             capture_output=True, text=True, check=True, timeout=600)  # fmt: skip
        m = json.loads(out.stdout.strip().splitlines()[-1])
        out = subprocess.run([sys.executable, "-c", PLAIN.replace("SAMPLER\n", SAMPLER), src, os.path.join(d, "plain")],
                             capture_output=True, text=True, check=True, timeout=600)  # fmt: skip
        plain = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"tensors held by the conversion (upper bound): {m['held_peak'] / layer_experts:.2f}x one layer's experts (goal <= 2)")
        print(f"subprocess peak RSS growth: experts-to-fused {m['rss_growth'] / 2**20:.1f} MiB, plain renaming migrate "
              f"{plain['rss_growth'] / 2**20:.1f} MiB (checkpoint {total / 2**20:.1f} MiB)")  # fmt: skip
        print(f"peak anonymous memory growth in a second migration (RssAnon, sampled every 2 ms): experts-to-fused "
              f"{m['anon_growth'] / 2**20:.1f} MiB = {m['anon_growth'] / layer_experts:.1f}x one layer's experts; "
              f"plain renaming migrate {plain['anon_growth'] / 2**20:.1f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
