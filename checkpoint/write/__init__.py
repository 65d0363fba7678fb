"""The write pipeline: plan, write, digest, index, commit (see pipeline)."""
