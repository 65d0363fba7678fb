"""Test support shipped in the package, not part of its API: fault injection points
(:mod:`checkpoint.testing.faults`: a save SIGKILLs itself at a named point when
``FQNCKPT_FAULT_POINT`` is set, so crash tests can stop it anywhere; a dictionary lookup
otherwise), and the byte counters every read and write updates
(:data:`checkpoint.storage.writer.stats`, an :class:`~checkpoint.storage.writer.IOStats`: bytes
written, read into targets or new tensors, and read to check digests), which tests and benchmarks
read to prove what a call read or wrote. The rank launcher the tests, examples and ``fqnckpt demo``
share is :mod:`checkpoint.ranks.launch`."""
