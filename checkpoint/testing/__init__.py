"""Test support shipped in the package, not part of its API: fault injection points
(:mod:`checkpoint.testing.faults`: a save SIGKILLs itself at a named point when
``FQNCKPT_FAULT_POINT`` is set, so crash tests can stop it anywhere; a dictionary lookup
otherwise). The rank launcher the tests, examples and ``fqnckpt demo`` share is
:mod:`checkpoint.ranks.launch`."""
