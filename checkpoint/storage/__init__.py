"""Format and bytes: the on-disk schemas (``format``), the shard layout plan (``layout``), where bytes
are written (``writer``) and read back and validated (``reader``). Object storage through fsspec
(``s3://``, ``memory://``, ...): ``urls`` / ``location`` (which paths are URLs), ``objstore``
(requests, retries, bounded uploads), ``remote_commit`` (commit without rename), ``remote_save``,
``remote_reader`` and ``opening`` (one ``open_checkpoint`` for both)."""
