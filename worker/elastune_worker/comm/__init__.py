"""Storage-channel collectives (LambdaML style): workers of one job average gradients through Redis or
Memcached instead of a collective library, so pods need no network path to each other. No torch here:
the trainer converts tensors to flat float32 numpy arrays and back.
"""

from elastune_worker.comm.allreduce import (
    DEFAULT_TTL_S,
    CollectiveAborted,
    CollectiveTimeout,
    StorageAllReduce,
    chunk_bounds,
    grad_key,
    merged_key,
)
from elastune_worker.comm.channel import (
    DEFAULT_MAX_ITEM_SIZE,
    ChannelError,
    ChannelUnavailable,
    MemcachedChannel,
    RedisChannel,
    StorageChannel,
    make_channel,
    redact_url,
)

__all__ = [
    "DEFAULT_MAX_ITEM_SIZE",
    "DEFAULT_TTL_S",
    "ChannelError",
    "ChannelUnavailable",
    "CollectiveAborted",
    "CollectiveTimeout",
    "MemcachedChannel",
    "RedisChannel",
    "StorageAllReduce",
    "StorageChannel",
    "chunk_bounds",
    "grad_key",
    "make_channel",
    "merged_key",
    "redact_url",
]
