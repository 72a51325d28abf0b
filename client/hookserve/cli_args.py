"""Command-line pieces shared by every `hookserve` subcommand: the connection flags
(declared once, here), the HxW size type, the Client those flags describe, and how
outputs are named (one name per input, never shared).

Both :mod:`hookserve.cli` and :mod:`hookserve.batch.cli` import this module; it imports
neither of them, so the command's modules form no cycle.
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from .types import parse_size

DEFAULT_SERVER = os.environ.get("HOOKSERVE_SERVER", "localhost:50051")
#: --timeout of the one-shot calls (describe, models, health) and of one whole stream
#: (extract, attribute: every image on one call), in seconds.
CALL_TIMEOUT = 60.0
STREAM_TIMEOUT = 600.0

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


def seconds_arg(text: str) -> float:
    """argparse type for --timeout: seconds, 0 for no limit."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected seconds (0: no limit), got {text!r}")
    return value


def add_connection_args(p: argparse.ArgumentParser, *, repeatable: bool = False,
                        timeout_help: str = "seconds per call",
                        timeout_default: float = CALL_TIMEOUT) -> None:
    """--server, --timeout, --ca, --cert, --key, --token-file.

    `repeatable`: --server may be given several times (a list; None when not given,
    and :func:`make_client` then reads HOOKSERVE_SERVER when the run starts).
    """
    if repeatable:
        p.add_argument("--server", action="append", help=_SERVERS_HELP)
    else:
        p.add_argument("--server", default=DEFAULT_SERVER, help=_SERVER_HELP)
    p.add_argument("--timeout", type=seconds_arg, default=timeout_default, metavar="SECONDS",
                   help=f"{timeout_help}; 0: no limit (default: %(default)s)")
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

    def read(flag: str, path: str | None) -> bytes | None:
        if not path:
            return None
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except OSError as exc:
            raise OSError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None

    token = read("--token-file", getattr(args, "token_file", None))
    try:
        text = token.decode().strip() if token is not None else None
    except UnicodeDecodeError:
        raise ValueError(f"--token-file {args.token_file} is not text (UTF-8): it holds "
                         "the token alone") from None
    return Client(addresses or servers_of(args), timeout=args.timeout or None, token=text,
                  root_certificates=read("--ca", args.ca),
                  certificate_chain=read("--cert", args.cert),
                  private_key=read("--key", args.key), **kw)


def weights_text(m: Any) -> str:
    """A model's weights as the CLI prints them, random ones marked as such, and
    ImageNet ones whose file is not torchvision's published one."""
    mark = ("  [RANDOM: not for real use]" if not m.pretrained
            else "  [UNVERIFIED: not torchvision's published file]"
            if m.weights_source == "imagenet" and not m.weights_verified else "")
    return f"{m.weights_source} {m.weights_name} {m.weights_digest[:19]}{mark}"


def dtype_text(m: Any) -> str:
    """A model's dtype as the CLI prints it, with its arithmetic when that is not fp32
    (``float32, bf16 autocast``)."""
    return m.dtype if m.precision == "fp32" else f"{m.dtype}, {m.precision} autocast"


def classes_text(m: Any) -> str:
    """A model's classes as the CLI prints them: the count, and the first names."""
    if not m.labels:
        return f"{m.num_classes} classes"
    # (a name that holds ", " itself is quoted, so that the list reads one way)
    shown = ", ".join(repr(n) if "," in n else n for n in m.labels[:3]) + (
        ", ..." if len(m.labels) > 3 else "")
    return f"{m.num_classes} classes ({shown})"


def label_text(label: str) -> str:
    """A class's name after its index, as the CLI prints it ("" when unnamed)."""
    return f" {label!r}" if label else ""


def relative_stems(paths: Sequence[str]) -> list[list[str]]:
    """Output name candidates per input path, best first: the path relative to the
    inputs' common folder without its suffix (``a/cat.png`` and ``b/cat.png`` give
    ``a/cat`` and ``b/cat``; inputs in one folder give bare stems), then with it."""
    absolute = [os.path.abspath(p) for p in paths]
    try:
        common = os.path.commonpath([os.path.dirname(a) for a in absolute])
        rel = [os.path.relpath(a, common) for a in absolute]
    except ValueError:  # different drives: no common folder
        rel = [os.path.basename(a) for a in absolute]
    out = []
    for r in rel:
        stem, suffix = os.path.splitext(r)
        out.append([stem, r] if suffix else [stem])
    return out


def unique_names(candidates: Sequence[Sequence[str]],
                 files: Callable[[str], list[str]]) -> list[str]:
    """One name per input such that no two inputs write the same file.

    `candidates[i]` lists input i's names, best first; `files(name)` the files (or
    keys) a name writes. An input keeps its first candidate when no other input's
    first candidate shares a file with it; the others take, in input order, their
    first free candidate, then the last one with ``-2``, ``-3``... (the same path
    given twice). Names are compared without case, as a case-insensitive file system
    would.
    """
    def fold(name: str) -> set[str]:
        return {f.casefold() for f in files(name)}

    firsts = Counter(f for c in candidates for f in fold(c[0]))
    names: list[str | None] = [c[0] if all(firsts[f] == 1 for f in fold(c[0])) else None
                               for c in candidates]
    taken = {f for n in names if n is not None for f in fold(n)}
    for i, c in enumerate(candidates):
        if names[i] is None:
            more = (f"{c[-1]}-{k}" for k in itertools.count(2))
            names[i] = next(n for n in itertools.chain(c, more) if not fold(n) & taken)
            taken |= fold(names[i])
    return [n for n in names if n is not None]


def near_flag(parser: argparse.ArgumentParser, word: str) -> str:
    """" (did you mean --port?)" for a misspelled flag (``--prot``), the nearest of
    `parser`'s own; "" when none is near or `word` is no flag."""
    if not word.startswith("--"):
        return ""
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    near = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1, cutoff=0.7)
    return f" (did you mean {near[0]}?)" if near else ""
