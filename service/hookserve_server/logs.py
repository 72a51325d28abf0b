"""The server's log: text for people at a terminal, JSON lines for log collectors.

`hookserve serve --log-format auto|text|json` (auto: text when stderr is a terminal).
Both formats carry the same records. Two kinds of record carry more than a message:

- a call (logger ``hookserve.calls``): `extra={"fields": {...}}`, one line per call; the
  JSON format puts the fields at the top level of the object, the text format writes
  them as ``key=value`` pairs;
- a loud warning (`extra=LOUD`), e.g. random weights: in text, framed by rows of ``!``
  on lines of their own; in JSON, the same one-line message with ``"loud": true``.

No message holds a newline: a record is one line in JSON, and in text a loud warning
is the only record that takes more than one.
"""

from __future__ import annotations

import json
import logging
import sys
import time

#: `extra=` for a warning no operator should miss.
LOUD = {"loud": True}
_RULE = "!" * 78


def _fields(record: logging.LogRecord) -> dict:
    return getattr(record, "fields", None) or {}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, and a call's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname,
               "logger": record.name}
        fields = _fields(record)
        if fields:
            out.update(fields)
        else:
            out["msg"] = record.getMessage()
        if getattr(record, "loud", False):
            out["loud"] = True
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class TextFormatter(logging.Formatter):
    """`HH:MM:SS.mmm LEVEL logger: message`; a call's fields as key=value pairs."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        head = f"{stamp}.{int(record.msecs):03d} {record.levelname:<7} {record.name}:"
        fields = _fields(record)
        if fields:
            body = " ".join(f"{k}={_text(v)}" for k, v in fields.items())
        else:
            body = record.getMessage()
        line = f"{head} {body}"
        if getattr(record, "loud", False):
            line = f"{_RULE}\n{line}\n{_RULE}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _text(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or "-"
    if value == "":
        return "-"
    return str(value)


def pick_format(fmt: str, stream=None) -> str:
    """auto -> text on a terminal, else json."""
    if fmt != "auto":
        return fmt
    stream = stream or sys.stderr
    try:
        return "text" if stream.isatty() else "json"
    except (AttributeError, ValueError):  # a closed or odd stream
        return "json"


def setup_logging(level: str, fmt: str = "auto") -> str:
    """Every record to stderr in `fmt` (auto|text|json); returns the format used."""
    fmt = pick_format(fmt)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TextFormatter() if fmt == "text" else JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # torch's own INFO records (its compiler's statistics, printed at exit even when
    # start-up was interrupted) are its developers', not an operator's: warnings up
    logging.getLogger("torch").setLevel(max(logging.WARNING, root.level))
    logging.captureWarnings(True)  # Python warnings too, in the same format
    return fmt
