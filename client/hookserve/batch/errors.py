"""How a `hookserve batch` run ends: its exit codes, the error that stops it
(:class:`Abort`), and the errors CSV that lists each image that failed."""

from __future__ import annotations

import csv
import os

EXIT_OK = 0
EXIT_SOME_FAILED = 1
EXIT_CANNOT_PROCEED = 2
EXIT_INTERRUPTED = 130


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
