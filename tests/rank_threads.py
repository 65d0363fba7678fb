"""Imported once by the forkserver behind ``run_ranks`` (see tests/conftest.py), before any rank
forks: every spawned rank then runs torch ops on one intra-op thread, as torchrun gives each of
several processes on a node (``OMP_NUM_THREADS=1``). The suite's worlds of 2 and 4 ranks share 2
cores; with a 2-thread OpenMP pool per rank they oversubscribe them (pool threads spin for cores
the other ranks hold): 15-20 % more CPU per rank measured on the 4-rank spawn of
tests/test_autoparallel_ranks.py. Ranks started with ``start_method="spawn"`` keep torch's default."""

import torch

torch.set_num_threads(1)
