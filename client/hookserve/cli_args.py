"""Command-line pieces shared by every `hookserve` subcommand: the connection flags
(declared once, here), the HxW size type, and the Client those flags describe.

Both :mod:`hookserve.cli` and :mod:`hookserve.batch.cli` import this module; it imports
neither of them, so the command's modules form no cycle.
"""

from __future__ import annotations

import argparse
import os

from .types import parse_size

DEFAULT_SERVER = os.environ.get("HOOKSERVE_SERVER", "localhost:50051")

_SERVER_HELP = ("host:port, grpcs://host:port, dns:///name:port, or several "
                "comma-separated (default: %(default)s; env HOOKSERVE_SERVER)")
_SERVERS_HELP = ("host:port, grpcs://host:port or dns:///name:port (round-robin over "
                 "its addresses); repeat for several servers (default: env "
                 "HOOKSERVE_SERVER or localhost:50051)")


def size_arg(text: str) -> tuple[int, int]:
    """argparse type for a size: "HxW", or one number for a square (the SDK takes the
    same strings: :func:`hookserve.types.parse_size`)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_connection_args(p: argparse.ArgumentParser, *, repeatable: bool = False,
                        timeout_help: str = "seconds per call") -> None:
    """--server, --timeout, --ca, --cert, --key, --token-file.

    `repeatable`: --server may be given several times (a list; None when not given,
    and :func:`make_client` then reads HOOKSERVE_SERVER when the run starts).
    """
    if repeatable:
        p.add_argument("--server", action="append", help=_SERVERS_HELP)
    else:
        p.add_argument("--server", default=DEFAULT_SERVER, help=_SERVER_HELP)
    p.add_argument("--timeout", type=float, default=60.0, help=timeout_help)
    p.add_argument("--ca", help="PEM CA file to trust (TLS)")
    p.add_argument("--cert", help="PEM client certificate (mutual TLS)")
    p.add_argument("--key", help="PEM client key (mutual TLS)")
    p.add_argument("--token-file",
                   help="file with a bearer token (default: env HOOKSERVE_TOKEN)")


def add_preprocessing_args(p: argparse.ArgumentParser) -> None:
    """--native, --resize, --crop: how images become model input (default: the model's
    own resize and centre crop)."""
    p.add_argument("--native", action="store_true",
                   help="no resize or crop: maps follow each image's own size")
    p.add_argument("--resize", type=int, help="resize the shorter side to this")
    p.add_argument("--crop", type=size_arg, help="centre crop HxW (or one number)")


def servers_of(args: argparse.Namespace) -> list[str]:
    """The --server value(s) as a list (the environment's default when none was given)."""
    if isinstance(args.server, list):
        return args.server
    if args.server:
        return [args.server]
    return [os.environ.get("HOOKSERVE_SERVER", "localhost:50051")]


def make_client(args: argparse.Namespace, addresses: list[str] | None = None, **kw):
    """The Client for the connection flags (`addresses` overrides --server); `kw` goes
    to :class:`hookserve.Client` (retries, max_in_flight...)."""
    from .client import Client

    token = None
    if getattr(args, "token_file", None):
        with open(args.token_file) as fh:
            token = fh.read().strip()
    return Client(addresses or servers_of(args), timeout=args.timeout, token=token,
                  root_certificates=args.ca, certificate_chain=args.cert,
                  private_key=args.key, **kw)
