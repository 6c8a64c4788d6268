"""Host storage: how the streamed blocks' bytes sit in host memory.

Pinned slabs (``slabs``), this rank's pinned shards (``shard_slabs``), views of read-only file
mappings (``mapped``, registered in place by ``registration``), and where the loader found
them (``weight_plan``, ``safetensors_mmap``, ``backing_choice``, ``runtime_cache``). Every
backing has the ``backing.HostBacking`` surface and reports itself; host allocation and
pinning live in ``memory``. Nothing here moves bytes to a device (``movement`` does).
"""
