"""Format and bytes: the on-disk schemas (``format``), the shard layout plan (``layout``), where bytes
are written (``writer``) and read back and validated (``reader``)."""
