"""Suite-wide set-up: what the forkserver behind ``run_ranks`` imports once for every spawned rank
(the suite's ~30 spawns import these in each rank otherwise: seconds a rank on 2 cores), and one
intra-op thread per rank (tests/rank_threads.py)."""

from checkpoint.ranks.launch import preload

preload(
    "torch._dynamo",
    "checkpoint",
    "checkpoint.loading",
    "checkpoint.saving",
    "autoparallel",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "tests.rank_threads",
)
