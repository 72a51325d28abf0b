"""`hookserve batch`: bulk, resumable, sharded feature extraction to .h5, .parquet or .npy.

See docs/batch.md for the user's view. The package, in the order data flows:

- :mod:`.cli`: the command's flags, with their defaults from :mod:`.defaults`;
  :mod:`.command`: :func:`run`, which hands the run to the local or the sharded run;
  :mod:`.spec`: layers checked against the model, and the output's metadata;
- the local run: :mod:`.inputs` lists, sorts and shards the inputs and reads their
  bytes; :mod:`.local_run` plans the work, starts the streams and writes in input order;
  :mod:`.scheduler` is the shared work list and the parallel extraction streams with
  the in-flight bound and retries;
- the sharded run (URLs, WebDataset tars, Parquet image columns; one part per input
  shard, and a done marker once every input is accounted for): :mod:`.shard_plan`
  plans the shards, :mod:`.readers` reads one, :mod:`.intake` starts its images within
  the byte budget, :mod:`.one_shard` extracts one (and :func:`run_shard` does one for
  other schedulers), :mod:`.shard_output` publishes its part and marker,
  :mod:`.sharded_run` runs the shards of a command; :mod:`.remote` is the fsspec and
  http side;
- :mod:`.limits`: what one input may cost (the per-file cap learned from the server,
  the byte budget, flag ranges); :mod:`.streamcall`: the Extract streams, with
  ``--timeout`` applied to them;
- :mod:`.sinks`: the local run's output formats, one per module, over the crash-safe
  part writing they share; :mod:`.errors`: exit codes and the errors CSV;
  :mod:`.progress`: the bar.
"""

from __future__ import annotations

from .cli import add_batch_parser
from .command import run
from .errors import (
    EXIT_CANNOT_PROCEED,
    EXIT_INCOMPLETE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SOME_FAILED,
)
from .inputs import decode_name, encode_name
from .one_shard import run_shard
from .shard_output import ShardIncomplete, ShardResult
from .shard_plan import Shard, plan_shards

__all__ = ["add_batch_parser", "run", "run_shard", "plan_shards", "Shard", "ShardResult",
           "ShardIncomplete", "encode_name", "decode_name", "EXIT_OK", "EXIT_SOME_FAILED",
           "EXIT_CANNOT_PROCEED", "EXIT_INCOMPLETE", "EXIT_INTERRUPTED"]
