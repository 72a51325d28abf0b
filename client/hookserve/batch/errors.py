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


#: The errors file's first line.
HEADER = ["path", "code", "message"]


def check_errors_path(path: str, out: str, owned: tuple[frozenset[str], tuple[str, ...]],
                      given: bool = True) -> None:
    """Refuse (:class:`Abort`) an errors file the run must not write: a folder, one in
    a folder that does not exist (when `given` with --errors: the default, beside the
    output, is in the folder the output makes), the output itself or a file inside it
    (or its parts; in a folder output, the files the run writes there), and an existing
    file that is no errors file (an input image, say), which writing would destroy. An
    earlier run's errors file given as this run's input list is read before it is
    written again (the retry: ``hookserve batch OUT.errors.csv --out OUT``).
    A device or a pipe (``/dev/null``) is written, never removed."""
    p = os.path.abspath(path)
    flag = f"--errors {path}"
    if os.path.isdir(p):
        raise Abort(f"{flag} is a folder: name a file (the default is OUT.errors.csv)")
    o = os.path.abspath(out.rstrip("/") or out)
    if given and not os.path.isdir(os.path.dirname(p)) and not p.startswith(o + os.sep):
        raise Abort(f"{flag}: the folder {os.path.dirname(p)} does not exist")
    # `owned` (`sinks.owned_paths`): a file output and its parts; in a folder output,
    # the files the run writes (a file of the user's beside them is not touched)
    files, folders = owned
    if p in files or p.startswith(tuple(f + os.sep for f in folders)):
        raise Abort(f"{flag} is {'the output' if p == o else 'inside the output'} "
                    f"(--out {out}): name a file outside it")
    if os.path.isfile(p) and os.path.getsize(p) > 0:
        try:
            with open(p, newline="", encoding="utf-8") as fh:
                first = next(csv.reader([fh.readline()]), [])
        except UnicodeDecodeError:
            first = []
        except OSError as exc:
            raise Abort(f"cannot read {flag}: {exc.strerror}") from None
        if first != HEADER:
            raise Abort(f"{flag} exists and is no errors file of hookserve batch (it does "
                        "not start with path,code,message): writing it would destroy it; "
                        "name another file")


class ErrorsFile:
    """``path,code,message`` rows, flushed one by one (a kill keeps what was written).

    The file is created at the start of a run and removed at its end when no image
    failed (a device or a pipe, ``/dev/null``, is only written). `check_errors_path`
    says which paths a run may write.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.count = 0
        self._plain = not os.path.exists(path) or os.path.isfile(path)
        # ids are valid UTF-8 (inputs.encode_name); backslashreplace keeps this file from
        # ever raising on text that is not
        try:
            self._fh = open(path, "w", newline="", encoding="utf-8",  # noqa: SIM115
                            errors="backslashreplace")
        except OSError as exc:
            raise Abort(f"cannot write --errors {path}: {exc.strerror}") from None
        self._csv = csv.writer(self._fh)
        self._csv.writerow(HEADER)
        self._fh.flush()

    def add(self, path: str, code: str, message: str) -> None:
        self._csv.writerow([path, code, message])
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        self._fh.close()
        if self.count == 0 and self._plain:
            os.unlink(self.path)


def one_line(exc: BaseException) -> str:
    """An error's first line, as the run reports it."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
