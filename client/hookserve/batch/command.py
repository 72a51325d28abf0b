"""`hookserve batch`'s entry point: :func:`run` checks the flags and hands the run to
the local run (:mod:`.local_run`: local files, one output) or the sharded run
(:mod:`.sharded_run`: URLs, tars, Parquet image columns; one part per input shard)."""

from __future__ import annotations

import argparse
import os
import sys

from .errors import EXIT_CANNOT_PROCEED, Abort
from .inputs import InputError, listed_paths
from .limits import check_flags, return_freed_inputs
from .local_run import run_local
from .readers import is_tar
from .remote import expand_braces, is_url
from .sharded_run import run_sharded
from .sinks import OutputError


def run(args: argparse.Namespace) -> int:
    """Run `hookserve batch` as `args` say; returns the exit code. (An .h5 output whose
    write failed leaves the HDF5 library unable to free that file: its process may then
    crash as it ends, after the error.)"""
    return _run(args)[0]


def cli_run(args: argparse.Namespace) -> int:
    """`run` as the command does it: an .h5 output whose write failed ends the process
    at once, after its one line (with exit code 2), so that nothing frees that file."""
    code, exit_now = _run(args)
    if exit_now:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run(args: argparse.Namespace) -> tuple[int, bool]:
    """(the exit code, whether the output's failure left a file the process cannot
    free)."""
    return_freed_inputs()
    try:
        check_flags(args)
        return (run_sharded(args) if wants_shards(args) else run_local(args)), False
    except (Abort, OutputError) as exc:   # (OutputError: the output failed mid-run)
        print(f"hookserve batch: {exc}", file=sys.stderr)
        return EXIT_CANNOT_PROCEED, bool(getattr(exc, "exit_now", False))


def wants_shards(args: argparse.Namespace) -> bool:
    """Whether `args` describe a sharded run: an input is a URL, a tar or a list of
    URLs or tars, ``--image-column`` is given, ``--out`` is a URL, or ``--sharded``."""
    if getattr(args, "sharded", False) or getattr(args, "image_column", None):
        return True
    if is_url(args.out):
        return True
    return any(is_url(s) or any(_a_tar(x) or _lists_shards(x, args)
                                for x in expand_braces(s))
               for s in args.inputs)


def _a_tar(name: str) -> bool:
    return is_tar(name) and not os.path.isdir(name)


def _lists_shards(path: str, args) -> bool:
    """A local list or path table with a URL or a tar in it (a local run would send
    each tar whole, as one image)."""
    try:
        names = listed_paths(path, getattr(args, "path_column", "path"),
                             root=getattr(args, "root", None))
    except (OSError, InputError):
        return False  # the local run names the problem
    return any(is_url(n) or _a_tar(n) for n in names or ())
