"""`hookserve serve`: its parser, and running it with one way to fail at start-up.

This is the one module of the server package that the client's `hookserve` command
imports (for `serve`). Importing it loads no torch, so `hookserve --help` and
`hookserve serve --help` work without the server extra.

Every start-up failure ends alike: one line on stderr, exit status 2, no traceback.
That covers bad flags and HOOKSERVE_* values (argparse, one line here), what
`preflight` refuses before torch is even imported (ranges, files, TLS material,
addresses, ports), a missing server extra, and what `app.start` refuses (models,
device, weights, warm-up). Once logging is set up the line is a log record (text or
JSON, as --log-format says); before that, plain text.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from hookserve.cli_args import near_flag

from .config import ARCHITECTURES, add_serve_arguments, env_name  # noqa: F401  (models --available)
from .errors import ConfigError, HookserveError
from .logs import setup_logging
from .openmp import set_wait_default
from .preflight import preflight

#: Exit status of a failed start-up (as for argparse's own errors).
EXIT_STARTUP = 2
#: Exit status after Ctrl-C during start-up.
EXIT_INTERRUPTED = 130
SERVER_EXTRA = "pip install 'hookserve[server]'"

log = logging.getLogger("hookserve")


class ServeParser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block: `serve` has 40 flags), and
    arguments it does not know are its own error rather than the top-level parser's."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {' '.join(message.split())} "
                         f"(`{self.prog} --help` lists the flags)\n")
        sys.exit(EXIT_STARTUP)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}" + self._hint(extra))
        return namespace, extra

    def _hint(self, extra: list[str]) -> str:
        """The flag a misspelled one likely meant; else, for a bare word first (no
        flag before it: ``hookserve serve resnet18``), how a model is named."""
        if not extra[0].startswith("-"):
            return f" (a model to serve is named with --model: --model {extra[0]})"
        return near_flag(self, extra[0])


def add_serve_parser(sub) -> argparse.ArgumentParser:
    """`serve` on the `hookserve` command's subparsers."""
    p = sub.add_parser(
        "serve", help="run the server (needs the server extra)",
        description="Serve VGG/ResNet models over gRPC, on 127.0.0.1:50051 unless told "
                    "otherwise. Every flag has a HOOKSERVE_* environment equivalent; a "
                    "flag on the command line wins.",
        epilog="A start-up failure (a bad flag or file, a port in use, bad weights, no "
               "such device, a missing extra) exits with status 2 after one line on "
               "stderr. SIGTERM or SIGINT drains (--grace-seconds), then exits 0.")
    p.__class__ = ServeParser  # argparse makes every subparser of the parent's class
    add_serve_arguments(p)
    p.set_defaults(func=run)
    return p


def startup_error(exc: BaseException) -> str:
    """The one line that reports a start-up failure."""
    if isinstance(exc, ImportError) and not _ours(exc.name):
        return (f"hookserve serve needs the server extra ({exc.name or exc} is missing): "
                f"{SERVER_EXTRA}")
    if isinstance(exc, ConfigError):
        text = str(exc) + _from_env(str(exc))
    elif isinstance(exc, HookserveError):  # e.g. limits too small for the warm-up image
        # (the advice after the last colon is a client's: send a smaller image)
        head, _, _advice = exc.message.rpartition(": ")
        text = (f"warm-up failed: {head}: the model's own default input needs more, so "
                "raise that limit" if "--" in head else f"warm-up failed: {exc.message}")
    elif isinstance(exc, OSError):
        text = str(exc) if not exc.strerror else f"{exc.strerror} ({exc.filename or exc})"
    else:  # unforeseen: its first 300 characters, and where the rest is
        detail = " ".join(str(exc).split())[:300]
        text = f"{type(exc).__name__}: {detail} (--log-level DEBUG logs the traceback)"
    return "cannot start: " + " ".join(text.split())


def _from_env(text: str) -> str:
    """Where the first flag a start-up error names got its value, when that was its
    HOOKSERVE_* variable and not the command line: the user never typed the flag."""
    flag = next(iter(re.findall(r"--[a-z][a-z0-9-]+", text)), None)
    given = (a.split("=", 1)[0] for a in sys.argv[1:] if a.startswith("--") and len(a) > 2)
    if flag is None or any(flag.startswith(a) for a in given):   # (argparse's prefixes)
        return ""
    env = env_name(flag)   # (its value is not shown: a --cache-url holds a password)
    return f" (set by {env})" if env in os.environ else ""


def _ours(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in ("hookserve", "hookserve_server")


def run(args: argparse.Namespace) -> int:
    """`hookserve serve`: start, or fail in one line with EXIT_STARTUP; then serve
    until a signal and drain."""
    openmp_note = set_wait_default()  # before torch loads its OpenMP runtime
    setup_logging(args.log_level, args.log_format)
    try:
        pre = preflight(args)  # before torch loads: such a mistake costs no time
        from . import app

        stop = app.stop_on_signals()
        server = app.start(args, pre, openmp_note)
    except KeyboardInterrupt:  # Ctrl-C before the handlers were in place
        log.error("interrupted while starting: not serving")
        return EXIT_INTERRUPTED
    except Exception as exc:
        log.debug("start-up failed", exc_info=True)
        log.error("%s", startup_error(exc))
        return EXIT_STARTUP
    return app.run_until(stop, server, args.grace_seconds)
