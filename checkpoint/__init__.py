"""checkpoint: sharded safetensors checkpoints in eager FQNs, from one process or many ranks."""
