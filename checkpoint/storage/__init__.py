"""Format and bytes: the on-disk schemas (``format``), the shard layout plan (``layout``), where bytes
are written (``writer``) and read back and validated (``reader``). Object storage through fsspec
(``s3://``, ``memory://``, ...) and ``file://``: ``bytestore`` is the bottom layer (the
:class:`~checkpoint.storage.bytestore.ByteStore` interface: list, stat, ranged read,
write / multipart, conditional commit, delete), implemented by ``bytestore.LocalStore`` (local
directories: plain local paths and ``file://``) and ``objstore`` (fsspec: requests, retries,
bounded uploads); above it, written once for every backend: ``commit`` (what a checkpoint owns by
record, leftovers and their cleanup, removal and retention, completeness; the object stores'
commit point; local ones commit by rename in ``checkpoint.storage.local_commit``; saves upload through ``checkpoint.write.upload``),
``remote_reader`` and ``opening`` (one ``open_checkpoint`` for both); ``secrets`` scrubs every
message; ``urls`` / ``location`` say which paths are URLs and resolve them to a byte store."""
