"""How a `hookserve batch` run ends: its exit codes, the error that stops it
(:class:`Abort`), which failures are final (:func:`is_final`), and the errors CSV that
lists each image that failed."""

from __future__ import annotations

import csv
import os

EXIT_OK = 0
EXIT_SOME_FAILED = 1
EXIT_CANNOT_PROCEED = 2
#: A sharded run left shards without a done marker: an error a rerun can fix.
EXIT_INCOMPLETE = 3
EXIT_INTERRUPTED = 130

#: Failures that are the input's own (corrupt, unsupported, over a cap, a link member,
#: a repeated id): a rerun would fail the same way, so a shard that has only these is
#: done. Every other code (NOT_FOUND, UNAVAILABLE, RESOURCE_EXHAUSTED, DATA_LOSS, a
#: missing extra's FAILED_PRECONDITION, ...) may pass on a rerun: its shard stays open.
FINAL_CODES = frozenset({"INVALID_ARGUMENT", "OUT_OF_RANGE", "ALREADY_EXISTS"})


def is_final(code: str) -> bool:
    """Whether a failure with this status code name is final (see FINAL_CODES)."""
    return code in FINAL_CODES


class Abort(Exception):
    """The run cannot proceed; the message says why."""


def errors_path(args) -> str:
    return args.errors or (args.out.rstrip("/") + ".errors.csv")


class ErrorsFile:
    """``path,code,message`` rows, flushed one by one (a kill keeps what was written).

    The file is created at the start of a run and removed at its end when no image
    failed.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.count = 0
        # ids are valid UTF-8 (inputs.encode_name); backslashreplace keeps this file from
        # ever raising on text that is not
        self._fh = open(path, "w", newline="", encoding="utf-8",  # noqa: SIM115
                        errors="backslashreplace")
        self._csv = csv.writer(self._fh)
        self._csv.writerow(["path", "code", "message"])
        self._fh.flush()

    def add(self, path: str, code: str, message: str) -> None:
        self._csv.writerow([path, code, message])
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        self._fh.close()
        if self.count == 0:
            os.unlink(self.path)


def one_line(exc: BaseException) -> str:
    """An error's first line, as the run reports it."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
