"""AutoParallel flow on 2 CPU ranks: meta model -> capture -> DTensor module -> init -> forward.

Run from the repository root: ``python examples/autoparallel_flow.py``. Prints, per rank, the
max absolute difference of the parallel module's local logits against the eager model holding the
same weights (float32 and bf16 mixed precision).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.models when run as a script

import torch  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402

from autoparallel import AutoParallel, MixedPrecisionPolicy, apply_mixed_precision  # noqa: E402
from checkpoint.ranks.launch import run_ranks  # noqa: E402
from tests.models import TinyConfig, TinyTransformer  # noqa: E402


def flow(rank: int, world_size: int, param_dtype) -> float:
    cfg = TinyConfig()
    global_batch = 4 * world_size
    with torch.device("meta"):
        model = TinyTransformer(cfg)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))

    def input_fn():
        return torch.randint(0, cfg.vocab, (global_batch, cfg.seq))

    policy = MixedPrecisionPolicy(param_dtype=param_dtype) if param_dtype else None
    with AutoParallel(model, input_fn, mesh, mp_policy=policy) as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        plan = autop.optimize_placement()
        pmod = autop.apply_placement(plan)
    pmod.to_empty(device="cpu")
    torch.manual_seed(0)
    pmod.init_weights()  # the user's own single-device init code

    tokens = torch.randint(0, cfg.vocab, (global_batch, cfg.seq), generator=torch.Generator().manual_seed(1))
    out = pmod(tokens.chunk(world_size)[rank])  # local shard in, local shard out

    eager = TinyTransformer(cfg)
    eager.load_state_dict({k: v.full_tensor() for k, v in pmod.state_dict().items()})
    apply_mixed_precision(eager, policy)
    ref = eager(tokens).chunk(world_size)[rank]
    if rank == 0:
        print(f"plan: {sum(1 for p in plan.values() if p[0].is_shard())} of {len(plan)} tensors sharded")
        print(f"fqn_map: {len(pmod.fqn_map)} tensors, tied {pmod.fqn_map.alias_groups()}")
    return (out.float() - ref.float()).abs().max().item()


def main() -> None:
    for dtype in (None, torch.bfloat16):
        diffs = run_ranks(flow, 2, dtype, backend="gloo", timeout=180)
        name = "float32" if dtype is None else f"mixed precision {dtype}"
        print(f"{name}: max |parallel - eager| per rank = {diffs}")


if __name__ == "__main__":
    main()
