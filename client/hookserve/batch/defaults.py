"""The defaults of `hookserve batch`'s flags, declared once.

The command line takes them (``--help`` shows them), :func:`~.one_shard.run_shard`
takes those of a sharded run as keyword arguments, and :func:`~.shard_plan.plan_shards`
its sharding ones.
"""

from __future__ import annotations

from ..cli_args import CALL_TIMEOUT
from .inputs import MAX_FILE_BYTES
from .limits import IN_FLIGHT_BYTES

#: Flag (as an argparse dest) -> its default.
DEFAULTS = {
    "model": None, "reduction": "none", "dtype": "float32", "l2_normalize": False,
    "native": False, "resize": None, "crop": None, "path_column": "path", "root": None,
    "shard": None, "max_file_bytes": MAX_FILE_BYTES, "streams": 4, "max_in_flight": 128,
    "max_in_flight_bytes": IN_FLIGHT_BYTES, "retries": 5, "checkpoint": 1024,
    "checkpoint_secs": 60.0, "consolidate": True, "errors": None, "progress": None,
    "dry_run": False, "sharded": False, "storage_option": [], "image_column": None,
    "id_column": None, "listing_shards": 64, "shard_bytes": 256 << 20,
    "timeout": CALL_TIMEOUT, "ca": None, "cert": None, "key": None, "token_file": None,
}
#: Flags only a local run reads: :func:`~.one_shard.run_shard` does not take them.
LOCAL_ONLY = frozenset({"checkpoint", "checkpoint_secs", "consolidate", "errors"})
