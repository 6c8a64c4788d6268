"""Sequence parallelism (Ulysses): one DiT forward spread over the ranks of an SP group.

``ulysses`` owns the attention (the all-to-all from sequence shards to head shards and back,
and the gather of the output tokens); ``tokens`` the pure layout of a padded token shard and
its key mask; ``processors`` the families' diffusers attention processors that call it;
``sharding`` attaches them and the split/slice/gather hooks to a loaded DiT so its forward
runs on this rank's shard of the tokens. The model runner calls ``shard_pipeline`` once
after loading when the replica runs with ``sequence_parallel_size > 1``.
"""

from ditserve.engine.parallel.sharding import shard_pipeline
from ditserve.engine.parallel.ulysses import SequenceGroup

__all__ = ["SequenceGroup", "shard_pipeline"]
