"""Host storage: how the streamed blocks' bytes sit in host memory.

Pinned slabs (``slabs``), this rank's pinned shards (``shard_slabs``), views of read-only file
mappings (``mapped``, registered in place by ``registration``), and the plan the weights
package hands over (``weight_plan``; what it binds is found by ``engine.weights``). Every
backing has the ``backing.HostBacking`` surface and reports itself; host allocation and
pinning live in ``memory``. Nothing here moves bytes to a device (``movement`` does).
"""
