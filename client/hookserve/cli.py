"""The `hookserve` command: serve, describe, models, extract, attribute, health, batch."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from .cli_args import (
    STREAM_TIMEOUT,
    add_connection_args,
    add_preprocessing_args,
    classes_text,
    dtype_text,
    make_client,
    near_flag,
    size_arg,
    unique_names,
    weights_text,
)
from .tables import DTYPES, REDUCTIONS, split_reduction

#: What `describe` prints for a model without a classifier head (num_classes 0).
NO_HEAD = ("no classifier head: features only (Attribute and class names need a model "
           "with one)")

#: Exit status after stdout was closed early (`hookserve describe | head`): 128 +
#: SIGPIPE, what a shell reports for a program that the closed pipe ended.
EXIT_PIPE_CLOSED = 141


def _describe(args) -> int:
    with make_client(args) as c:
        d = c.describe(args.model, args.size)
    m = d.model
    print(f"model {m.name} ({m.architecture}) on {m.device}, {dtype_text(m)}; weights: "
          f"{weights_text(m)}")
    print(f"default preprocessing: resize {m.resize}, centre crop {m.crop[0]}x{m.crop[1]}, "
          f"mean {_floats(m.mean)}, std {_floats(m.std)}")
    print(classes_text(m) if m.num_classes else NO_HEAD)
    if m.default_cam_layer and m.num_classes:   # (no head: nothing to attribute)
        print(f"default CAM layer: {m.default_cam_layer}")
    print(f"input {d.input_size[0]}x{d.input_size[1]}: {len(d.layers)} layers\n")
    w = max(len(li.name) for li in d.layers)
    t = max(len(li.type) for li in d.layers)
    print(f"{'layer':<{w}}  {'type':<{t}}  {'output shape':<18} {'MB/image':>9}  layout")
    for li in d.layers:
        shape = "x".join(map(str, li.shape))
        print(f"{li.name:<{w}}  {li.type:<{t}}  {shape:<18} {li.bytes_per_image / 1e6:>9.3f}  "
              f"{li.layout}")
    return 0


def _floats(values) -> str:
    return "(" + ", ".join(f"{v:.4g}" for v in values) + ")"


def _models(args) -> int:
    if args.available:
        from hookserve_server.command import ARCHITECTURES  # torch-free

        print("\n".join(ARCHITECTURES))
        return 0
    with make_client(args) as c:
        for i, m in enumerate(c.list_models()):
            flag = " (default)" if i == 0 else ""
            classes = f"{classes_text(m)}, " if m.num_classes else "no head, "
            print(f"{m.name}{flag}: {m.architecture} on {m.device}, {dtype_text(m)}, {classes}"
                  f"weights {weights_text(m)}")
    return 0


def _extract(args) -> int:
    import numpy as np

    if args.out and not args.out.lower().endswith(".npz"):
        print(f"error: --out {args.out}: extract writes one .npz file, so name it "
              "NAME.npz (for .h5, .parquet or a folder of .npy files, use hookserve "
              "batch)", file=sys.stderr)
        return 2
    if args.out and os.path.isdir(args.out):
        print(f"error: --out {args.out} is a folder: name the .npz file to write",
              file=sys.stderr)
        return 2
    if args.out:
        folder = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            print(f"error: --out {args.out}: cannot write into {folder} (missing or "
                  "read-only): create it, or name a file elsewhere", file=sys.stderr)
            return 2
    try:
        layers = _layer_options([x.strip() for s in args.layers for x in s.split(",")
                                 if x.strip()])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # One key prefix per input: its path as given, made unique if given twice.
    keys = unique_names([[p] for p in args.images],
                        lambda k: [f"{k}:{layer}" for layer in layers])
    out: dict[str, np.ndarray] = {}
    failed = 0
    with make_client(args) as c:
        for r in c.extract_many(args.images, layers, model=args.model,
                                reduction=args.reduction, dtype=args.dtype,
                                l2_normalize=args.l2_normalize, native=args.native,
                                resize=args.resize, crop=args.crop, timeout=args.timeout or None):
            if r.error is not None:
                failed += 1
                print(f"{r.id}: {r.error}", file=sys.stderr)
                continue
            for layer, arr in r.features.items():
                key = f"{keys[r.index]}:{layer}" if len(args.images) > 1 else layer
                out[key] = arr
                print(f"{r.id}  {layer}  {arr.dtype}  {tuple(arr.shape)}")
    if args.out and not out:   # nothing to write: an earlier file is kept as it is
        print(f"no arrays to write: {args.out} is left as it was", file=sys.stderr)
    elif args.out:
        tmp = f"{args.out}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as fh:  # a file object: the name is kept as given (.NPZ)
                np.savez(fh, **out)
            os.replace(tmp, args.out)     # readers see the old file or the whole new one
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise OSError(f"--out {args.out}: cannot write it: {exc.strerror or exc}"
                          ) from None
        print(f"wrote {len(out)} array{'s' if len(out) != 1 else ''} to {args.out}")
    return 1 if failed else 0


def _layer_options(names: list[str]) -> dict[str, dict | None]:
    """--layers values -> the SDK's per-layer options: ``NAME:REDUCTION`` (as
    `hookserve batch` takes it, ``layer4:avg``) sets that layer's reduction; other
    layers take --reduction."""
    out: dict[str, dict | None] = {}
    for item in names:
        name, red = split_reduction(item)
        if name in out:
            raise ValueError(f"--layers gives {name} twice")
        out[name] = {"reduction": red} if red else None
    return out


def _health(args) -> int:
    from .errors import HookserveError

    with make_client(args) as c:
        try:
            status = c.health(args.service)
        except HookserveError as exc:
            print(str(exc), file=sys.stderr)
            return 1
    print(status)
    return 0 if status == "SERVING" else 1


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an argument it does not know is its own error, naming it
    and its --help (argparse leaves it to the top-level parser, whose usage says
    nothing of the subcommand's flags)."""

    def error(self, message: str):
        """One line, exit code 2: the usage block says less than --help, and pushes the
        message down."""
        if "--help" not in message:
            message += f" (`{self.prog} --help` lists the flags)"
        sys.stderr.write(f"{self.prog}: error: {' '.join(message.split())}\n")
        sys.exit(2)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extra = super().parse_known_args(args, namespace)
        if extra:
            hint = (f"{self.prog} takes the model as its argument: {self.prog} MODEL; "
                    if "--model" in extra and self.prog.endswith("describe") else "")
            near = "" if hint else near_flag(self, extra[0]).strip(" ()")
            self.error(f"unrecognized arguments: {' '.join(extra)} ({hint}"
                       + (f"{near}; " if near else "") + f"`{self.prog} --help` lists the "
                       "flags)")
        return namespace, extra


class TopParser(argparse.ArgumentParser):
    """The top-level parser: a flag before the command (``hookserve --server X
    describe``, or a mistyped ``--verison``) is named, with where it goes (argparse
    would call the flag's value an invalid command, or only say a command is
    needed)."""

    def parse_known_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        first = argv[0] if argv else ""
        own = first == "-h" or len(first) > 2 and any(   # (argparse's prefixes: --vers)
            name.startswith(first) for name in ("--help", "--version"))
        if first.startswith("-") and not own:
            commands = self._subparsers._group_actions[0].choices if self._subparsers else {}
            # a command token, not a flag's value (`--model batch` names no command)
            cmd = next((a for i, a in enumerate(argv) if a in commands and not (
                argv[i - 1].startswith("-") and "=" not in argv[i - 1])), None)
            flag = first.split("=", 1)[0]
            if cmd is not None:
                self.error(f"{flag} goes after the command: hookserve {cmd} {flag} ... "
                           f"(`hookserve {cmd} --help` lists its flags)")
            self.error(f"unrecognized argument {flag}: give a command first "
                       "(`hookserve --help` lists them), then its flags")
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = TopParser(
        prog="hookserve",
        description="Remote feature extraction from torchvision CNNs over gRPC.")
    p.add_argument("--version", action="version", version=f"hookserve {__version__}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           parser_class=CommandParser)

    from hookserve_server.command import add_serve_parser  # the one door to the server
    add_serve_parser(sub)

    s = sub.add_parser("describe", help="print a model's layers with output shapes",
                       description="List every hookable layer: name, module type, output "
                                   "shape and MB per image at an input size.")
    s.add_argument("model", nargs="?", help="model name (default: the server's default)")
    s.add_argument("--size", type=size_arg, help="input HxW (or one number) after preprocessing; "
                                  "default: the model's crop size")
    add_connection_args(s)
    s.set_defaults(func=_describe)

    s = sub.add_parser("models", help="list the models a server holds",
                       description="List the models a server holds (the first is its "
                                   "default): architecture, device, dtype, and the weights "
                                   "in use with their digest. Random weights are marked "
                                   "RANDOM: not for real use. --available lists the "
                                   "architectures `hookserve serve --model` takes instead.")
    s.add_argument("--available", action="store_true",
                   help="list the architectures a server can serve (no server is called)")
    add_connection_args(s)
    s.set_defaults(func=_models)

    s = sub.add_parser("extract", help="extract features of a few images to .npz",
                       description="Extract layers of a handful of images on one stream. "
                                   "For folders of many images use `hookserve batch`.")
    s.add_argument("images", nargs="+", help="image files")
    s.add_argument("--layers", action="append", required=True,
                   help="layer names, comma-separated or repeated (hookserve describe "
                        "lists them; NAME:input for a module's input; NAME:REDUCTION, "
                        "such as layer4:avg, for that layer's reduction)")
    s.add_argument("--model", help="model name (default: the server's default)")
    s.add_argument("--reduction", default="none", choices=list(REDUCTIONS),
                   help="for layers without their own: none (the whole tensor), avg or "
                        "max (pooled over "
                        "space: one value per channel), flatten, stats (per channel: "
                        "mean, std, min, max, zero fraction) (default: %(default)s)")
    s.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="the arrays' type; bfloat16 arrives as uint16 bit patterns "
                        "(default: %(default)s)")
    s.add_argument("--l2-normalize", action="store_true",
                   help="scale each layer's (reduced) output to unit L2 norm")
    add_preprocessing_args(s)
    s.add_argument("--out", help="write the arrays to this .npz file (keys: LAYER for one "
                                 "image, PATH:LAYER for several)")
    add_connection_args(s, timeout_default=STREAM_TIMEOUT,
                        timeout_help="seconds for the whole call (one stream carries "
                                     "every image)")
    s.set_defaults(func=_extract)

    s = sub.add_parser("health", help="ask the gRPC health service; exit 0 when SERVING",
                       description="Exit 0 when the server reports SERVING, 1 otherwise. "
                                   "Used by the container's HEALTHCHECK.")
    s.add_argument("--service", default="", help="service name ('' = the whole server)")
    add_connection_args(s)
    s.set_defaults(func=_health)

    from .cli_attribute import add_attribute_parser
    add_attribute_parser(sub)

    from .batch.cli import add_batch_parser
    add_batch_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command; the exit status: 0 done, 1 a call or an image failed, 2 the
    command could not run (bad arguments), 130 interrupted (Ctrl-C), 141 stdout was
    closed early."""
    from .errors import HookserveError

    try:
        args = build_parser().parse_args(argv)
        try:
            return args.func(args) or 0
        except HookserveError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except (ValueError, OSError) as exc:
            if isinstance(exc, BrokenPipeError):
                raise
            print(f"error: {exc}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, the status a shell gives for SIGINT
        from .batch.errors import EXIT_INTERRUPTED

        print("interrupted", file=sys.stderr)
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        # Out at once: a gRPC call the interrupt cut short would print a traceback from
        # its finalizer as the interpreter shuts down.
        os._exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as a program that SIGPIPE ends.
        # What is still buffered for stdout goes nowhere, so exiting raises nothing more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_PIPE_CLOSED


if __name__ == "__main__":
    sys.exit(main())
