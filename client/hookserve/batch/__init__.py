"""`hookserve batch`: bulk, resumable, sharded feature extraction to .h5, .parquet or .npy.

See docs/batch.md for the user's view. The package, in the order data flows:

- :mod:`.cli`: the command's flags; :mod:`.spec`: layers checked against the model,
  and the output's metadata;
- :mod:`.inputs`: listing, sorting and sharding the inputs, reading their bytes;
- :mod:`.run`: the run loop (plan, start the streams, write in input order);
- :mod:`.scheduler`: the shared work list and the parallel extraction streams with
  the in-flight bound and retries;
- :mod:`.shards`, :mod:`.readers`, :mod:`.intake`, :mod:`.remote`, :mod:`.shardrun`,
  :mod:`.sharded`: sharded runs (URLs, WebDataset tars, Parquet image columns; one part
  per input shard, and a done marker once every input is accounted for) and
  :func:`run_shard` for other schedulers;
- :mod:`.limits`: what one input may cost (the per-file cap learned from the server,
  the byte budget, flag ranges); :mod:`.streamcall`: the Extract streams, with
  ``--timeout`` applied to them;
- :mod:`.sinks`: one output format per module, over the crash-safe part writing they
  share; :mod:`.errors`: exit codes and the errors CSV; :mod:`.progress`: the bar.
"""

from __future__ import annotations

from .cli import add_batch_parser
from .errors import (
    EXIT_CANNOT_PROCEED,
    EXIT_INCOMPLETE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SOME_FAILED,
)
from .inputs import decode_name, encode_name
from .run import run  # the function (it shadows the module name in this namespace)
from .sharded import run_shard
from .shardrun import ShardIncomplete, ShardResult
from .shards import Shard, plan_shards

__all__ = ["add_batch_parser", "run", "run_shard", "plan_shards", "Shard", "ShardResult",
           "ShardIncomplete", "encode_name", "decode_name", "EXIT_OK", "EXIT_SOME_FAILED",
           "EXIT_CANNOT_PROCEED", "EXIT_INCOMPLETE", "EXIT_INTERRUPTED"]
