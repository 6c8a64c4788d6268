"""Movement: how a block's bytes reach a device slot.

Every transfer has the ``transfer.Transfer`` surface the hooks drive (prepare, load,
wait_ready, release, synchronize, close) and reports itself. ``copy_stream``: synchronous
copies (CPU) or a CUDA copy stream with events; ``mapped``: loads from file mappings,
straight (registered pages) or packed through pinned staging slots; ``gather``: this rank's
shard H2D + all_gather over the group; ``ce_gather``: the same rebuilt by peer-to-peer copy
engines; ``copy_clock``: the H2D rate the copies reach. Host memory is ``host``'s.
"""
