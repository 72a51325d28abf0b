"""What a `hookserve batch` run extracts: the --layers list, checked against the
model the server(s) describe, and the output's metadata (compared on resume)."""

from __future__ import annotations

import difflib
import sys
import time

from .. import errors
from ..cli_args import make_client
from ..tables import REDUCTIONS, follows_size, reduced_shape, split_port, split_reduction
from ..types import Layer, parse_size
from .errors import Abort
from .limits import Cap, file_cap
from .sinks import format_of


def connect(args, addresses: list[str] | None = None):
    """The Client of a batch run (or of one of its `addresses`)."""
    return make_client(args, addresses, retries=max(3, args.retries),
                       max_in_flight=args.max_in_flight)


def parse_layers(specs: list[str], default_reduction: str, dtype: str = "float32",
                 l2_normalize: bool = False) -> list[Layer]:
    """--layers values (``name`` or ``name:reduction``, comma-separated) -> Layers.
    A name may end in ``:input`` (the module's input): ``layer3:input:stats``."""
    out, seen = [], set()
    for spec in specs:
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                name, red = split_reduction(part)
            except ValueError as exc:
                raise Abort(str(exc)) from None
            red = red or default_reduction
            if red not in REDUCTIONS:
                raise Abort(f"--reduction {red}: one of {', '.join(REDUCTIONS)}")
            if name in seen:
                raise Abort(f"--layers gives {name} twice")
            seen.add(name)
            out.append((name, red))
    if not out:
        raise Abort("give at least one layer with --layers")
    return [Layer(n, r, dtype, l2_normalize) for n, r in out]


def describe_and_check(args, client, layers) -> tuple[dict, dict, Cap]:
    """Validate model, layers and servers up front; -> (metadata, extract options, the
    per-file cap: --max-file-bytes lowered to what every server described accepts)."""
    from .. import __version__

    crop = parse_size(args.crop, "crop") if args.crop is not None else None   # (run_shard: 32)
    # dtype and l2_normalize travel inside each Layer.
    opts = {"native": args.native, "resize": args.resize, "crop": crop}
    try:
        desc = client.describe(args.model, crop)
    except errors.HookserveError as exc:
        raise Abort(f"cannot describe the model on {', '.join(client.addresses)}: {exc}"
                    ) from None
    names = {li.name for li in desc.layers}
    for layer in layers:
        if split_port(layer.name)[0] not in names:
            close = difflib.get_close_matches(layer.name, sorted(names), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise Abort(f"model {desc.model.name} has no layer {layer.name!r}{hint}; "
                         f"`hookserve describe {desc.model.name}` lists them")
    m = desc.model
    limits = [desc.max_message_bytes]
    # Several servers must compute the same features: compare their weights digests.
    if len(client.addresses) > 1:
        for addr in client.addresses:
            try:
                with connect(args, [addr]) as one:
                    other_desc = one.describe(m.name, crop)
                other = other_desc.model
                limits.append(other_desc.max_message_bytes)
            except errors.HookserveError as exc:
                print(f"warning: {addr}: {exc} (going on with the other servers)",
                      file=sys.stderr)
                continue
            if other.weights_digest != m.weights_digest:
                raise Abort(f"servers disagree on model {m.name}'s weights: "
                             f"{other.weights_digest[:19]} on {addr} vs "
                             f"{m.weights_digest[:19]}")
    if args.native:
        pre = {"mode": "native"}
    elif args.resize is None and crop is None:
        pre = {"mode": "default", "resize": m.resize, "crop": list(m.crop)}
    else:
        pre = {"mode": "resize_crop", "resize": args.resize or 0,
               "crop": list(crop) if crop else [0, 0]}
    pre.update(mean=list(m.mean), std=list(m.std))
    meta = {
        "format": "hookserve-batch/1",
        "hookserve_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": m.name,
        "architecture": m.architecture,
        "weights": {"source": m.weights_source, "name": m.weights_name,
                    "digest": m.weights_digest, "pretrained": m.pretrained},
        "layers": [{"name": li.name, "reduction": li.reduction,
                    "l2_normalize": bool(args.l2_normalize)} for li in layers],
        "dtype": args.dtype,
        "preprocessing": pre,
        "shard": args.shard or "0/1",
    }
    if format_of(args.out) == "parquet":
        for li in layers:
            shape = reduced_shape(li.reduction, desc.shape_of(li.name), desc.layout_of(li.name))
            if len(shape) != 1:
                raise Abort(f"layer {li.name} gives {shape} per image; "
                             "Parquet takes 1-D features: add --reduction avg|max|flatten "
                             f"(or {li.name}:avg), or write .h5 or a folder")
    sized = ("--native" if args.native
             else "--resize without --crop" if args.resize is not None and crop is None
             else None)   # each image's answer keeps its own size (or aspect ratio)
    if sized and format_of(args.out) == "h5":
        for li in layers:
            if follows_size(li.reduction) and len(desc.shape_of(li.name)) > 1:
                raise Abort(f"{sized} gives layer {li.name} a shape that follows each "
                             "image's size; HDF5 needs one shape: use --reduction "
                             "avg|max|stats (or --crop), or a folder output")
    return meta, opts, file_cap(args.max_file_bytes, limits)
