"""The `hookserve` command (`python -m hookserve` too).

The command's modules load inside `main`, so Ctrl-C while they load (gRPC, numpy: about
half a second) is one line and exit status 130, as it is once the command runs; and
gRPC's own log level is set before gRPC loads.
"""

from __future__ import annotations

import os
import sys

#: The status a shell gives a program SIGINT ended (batch/errors.EXIT_INTERRUPTED).
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    # gRPC's own log lines below ERROR (a peer's failed TLS handshake, ...) are not the
    # command's to print, nor in its log format: off unless the environment sets a
    # level. gRPC reads this once, as it loads: so before the CLI's modules load.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        from .cli import main as run
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
