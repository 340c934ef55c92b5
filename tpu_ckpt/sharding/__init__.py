"""How a leaf becomes pieces: the sharding callback and its policies, validation of what a
callback returns, bounded data files, and which leaves are optimizer slots."""

from tpu_ckpt.sharding._bounded_files import bounded
from tpu_ckpt.sharding._local_indices import local_indices
from tpu_ckpt.sharding._pieces import (
    LocalPieces,
    ShardableTensor,
    ShardingCallback,
    WriteBalance,
    describe_sharding,
    index_to_slice,
    on_cpu,
    on_one_cpu,
    planned,
)
from tpu_ckpt.sharding._policies import (
    BUILT_IN_POLICIES,
    MaxShardSizePolicy,
    ShardByDevicePolicy,
    ShardByTaskPolicy,
)
from tpu_ckpt.sharding._slots import (
    SlotPredicate,
    slot_keys,
)
from tpu_ckpt.sharding._validation import validate_shards

__all__ = [
    "BUILT_IN_POLICIES",
    "LocalPieces",
    "MaxShardSizePolicy",
    "ShardByDevicePolicy",
    "ShardByTaskPolicy",
    "ShardableTensor",
    "ShardingCallback",
    "SlotPredicate",
    "WriteBalance",
    "bounded",
    "describe_sharding",
    "index_to_slice",
    "local_indices",
    "on_cpu",
    "on_one_cpu",
    "planned",
    "slot_keys",
    "validate_shards",
]
