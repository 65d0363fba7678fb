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
    # What a rank's first capture imports otherwise (about 360 modules: aot_autograd, export,
    # networkx, ...; measured 0.3-0.4 s of CPU a rank), and the other transformers models captured.
    "fqn.capture",
    "torch._functorch.aot_autograd",
    "torch.export._trace",
    "transformers.models.bert.modeling_bert",
    "transformers.models.gpt2.modeling_gpt2",
    "tests.rank_threads",
)
