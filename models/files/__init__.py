"""Files Lantern writes and owns: atomic writes, owned folders and their locks, checksums, cache keys (torch-free
but for ``digests``)."""
