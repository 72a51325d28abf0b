"""`hookserve attribute`: saliency maps of a few images, written as overlays and arrays.

    hookserve attribute cat.jpg dog.png --layer layer4 --method grad_cam --out maps/

writes, per image, ``maps/<name>.png`` (the heat map over the image the model saw,
:func:`hookserve.overlay`) and ``maps/<name>.npy`` (the raw float32 map). With
``--top-k K`` (K >= 2) the array holds K maps and the overlays are
``<name>.1.png`` ... ``<name>.K.png``, most likely class first.

``<name>`` mirrors the input's path below the inputs' common folder, without its
suffix (``a/cat.png b/cat.png`` give ``maps/a/cat.*`` and ``maps/b/cat.*``); where two
inputs would still share a file (``x.png x.jpg``, or one path twice) the later keeps
its suffix (``x.jpg.*``) or gets a number (``x.png-2.*``). No input's files overwrite
another's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .attribution import AUTO_LAYER, other_methods_option
from .cli_args import (
    STREAM_TIMEOUT,
    add_connection_args,
    add_preprocessing_args,
    label_text,
    make_client,
    relative_stems,
    unique_names,
)
from .overlays import SIGNS
from .tables import BASELINES, CAM_METHODS, METHODS, SCORES


def add_attribute_parser(sub) -> None:
    s = sub.add_parser(
        "attribute", help="saliency maps (Grad-CAM and friends) as overlays and .npy",
        description="Explain a class score of a few images: per image, write "
                    "OUT/<name>.png (the map over the image the model saw) and "
                    "OUT/<name>.npy (the raw float32 map; with --top-k K of 2 or more, K "
                    "maps, and the overlays OUT/<name>.1.png ... OUT/<name>.K.png, most "
                    "likely class first). <name> mirrors the input's "
                    "path below the inputs' common folder (a/cat.png b/cat.png: OUT/a/cat.*, "
                    "OUT/b/cat.*); inputs that would still share a name keep their "
                    "suffix or get a number, so none overwrites another. See "
                    "docs/attribution.md.")
    s.add_argument("images", nargs="+", help="image files")
    s.add_argument("--out", required=True,
                   help="folder for the .png and .npy files (a name with a suffix, such "
                        "as maps.png, is refused unless that folder exists)")
    s.add_argument("--method", default="grad_cam", choices=list(METHODS),
                   help="CAM methods explain --layer; the others the input pixels "
                        "(default: %(default)s)")
    s.add_argument("--layer", help="the layer a CAM method explains (default: the model's "
                                   "default CAM layer, which `hookserve describe` shows: "
                                   "resnet layer4, vgg its last convolution, vit the last "
                                   "block's ln_1); NAME:input for a module's input; "
                                   "omit it for the input-space methods")
    s.add_argument("--model", help="model name (default: the server's default)")
    s.add_argument("--target", type=int,
                   help="class index to explain for every image (default: the predicted one)")
    s.add_argument("--top-k", type=int, default=0, help="maps for the K most likely classes")
    s.add_argument("--score", default="logit", choices=list(SCORES),
                   help="the class score explained (default: %(default)s)")
    s.add_argument("--relu", action=argparse.BooleanOptionalAction, default=None,
                   help="clamp the map at zero (default: on for the CAM methods only)")
    s.add_argument("--normalize", action="store_true", help="min-max scale the maps to [0, 1]")
    s.add_argument("--upsample", action="store_true",
                   help="CAM maps upsampled to the model's input size")
    s.add_argument("--steps", type=int, default=0,
                   help="integrated_gradients: path intervals (0: the default, 32)")
    s.add_argument("--baseline", default="zeros", choices=list(BASELINES),
                   help="integrated_gradients: the baseline (default: %(default)s)")
    s.add_argument("--samples", type=int, default=0,
                   help="smooth_grad: noisy copies (0: the default, 16)")
    s.add_argument("--sigma", type=float, default=0.0,
                   help="smooth_grad: noise, a fraction of the input's range (0: the "
                        "default, 0.15)")
    s.add_argument("--seed", type=int, default=0, help="smooth_grad: noise seed")
    s.add_argument("--alpha", type=float, default=0.5,
                   help="overlay: weight of the heat map, 0..1 (default: %(default)s)")
    s.add_argument("--clip", type=float, metavar="PERCENTILE",
                   help="overlay: the percentile of the map's magnitudes that tops the "
                        "colour scale, higher values saturate (default: 99 for the "
                        "input-space methods, 100 for the CAM methods)")
    s.add_argument("--sign", default="absolute", choices=SIGNS,
                   help="overlay: absolute values, only the positive or the negative "
                        "ones, or all with their sign on a blue-grey-red scale "
                        "(default: %(default)s)")
    add_preprocessing_args(s)
    add_connection_args(s, timeout_default=STREAM_TIMEOUT,
                        timeout_help="seconds for the whole call (one stream carries "
                                     "every image)")
    s.set_defaults(func=_attribute)


def _files(name: str, maps: int) -> list[str]:
    """The files one input writes under the base name `name`."""
    pngs = [f"{name}.png"] if maps <= 1 else [f"{name}.{k}.png" for k in range(1, maps + 1)]
    return [f"{name}.npy", *pngs]


def _check(args) -> str | None:
    """What is wrong with the arguments, before any call (None: nothing)."""
    if not 0.0 <= args.alpha <= 1.0:
        return f"--alpha must be in [0, 1], got {args.alpha}"
    if args.clip is not None and not 0.0 < args.clip <= 100.0:
        return f"--clip is a percentile in (0, 100], got {args.clip}"
    # what the SDK and the server would refuse, said in the command's own flags
    found = other_methods_option(args.method, steps=args.steps,
                                 baseline=args.baseline != "zeros", samples=args.samples,
                                 sigma=args.sigma, seed=args.seed)
    if found:
        what, owner = found
        return (f"--{what} is an option of --method {owner}, not of {args.method}: drop "
                f"it, or add --method {owner}")
    if args.upsample and args.method not in CAM_METHODS:
        return (f"--upsample is for the CAM methods' maps ({', '.join(CAM_METHODS)}): "
                f"--method {args.method}'s map has the input's size already: drop it")
    if args.layer and args.method not in CAM_METHODS:
        return (f"--method {args.method} explains the input and takes no --layer: drop "
                f"--layer {args.layer}, or use a CAM method ({', '.join(CAM_METHODS)})")
    if args.target is not None and args.top_k > 1:
        return (f"--target {args.target} and --top-k {args.top_k} each choose the classes "
                "explained: give one of the two")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return f"--out {args.out} is a file: attribute writes a folder of .png and .npy files"
    if not out.exists() and out.suffix:
        return (f"--out {args.out} names a file ({out.suffix}): attribute writes a folder "
                "of .png and .npy files; name a folder (or create this one first)")
    return None


def _attribute(args) -> int:
    import numpy as np

    from .overlays import overlay

    problem = _check(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    maps = max(1, args.top_k)
    names = unique_names(relative_stems(args.images), lambda n: _files(n, maps))
    failed = 0
    with make_client(args) as c:
        results = c.attribute_many(
            args.images, args.layer or AUTO_LAYER, args.method, model=args.model,
            targets=[args.target] * len(args.images), score=args.score, top_k=args.top_k,
            relu=args.relu, normalize=args.normalize, upsample=args.upsample,
            steps=args.steps, baseline=args.baseline, samples=args.samples,
            sigma=args.sigma, seed=args.seed, native=args.native, resize=args.resize,
            crop=args.crop, timeout=args.timeout or None)
        for r, name in zip(results, names, strict=True):
            if not r.ok:
                failed += 1
                print(f"{r.id}: {r.error}", file=sys.stderr)
                continue
            base = os.path.join(args.out, name)
            os.makedirs(os.path.dirname(base), exist_ok=True)
            np.save(base + ".npy", r.map)
            ranks = range(len(r.targets)) if len(r.targets) > 1 else [None]
            pngs = []
            for k in ranks:
                png = base + (".png" if k is None else f".{k + 1}.png")
                overlay(args.images[r.index], r, args.alpha, index=k or 0, clip=args.clip,
                        sign=args.sign).save(png)
                pngs.append(png)
            classes = ", ".join(f"{t.target.index}{label_text(t.target.label)} "
                                f"(p={t.target.prob:.3f}"
                                + ("" if t.delta is None else f", delta={t.delta:.4g}") + ")"
                                for t in r.targets)
            which = "class" if len(r.targets) == 1 else "classes"
            print(f"{r.id}  {which} {classes}  map {'x'.join(map(str, r.map.shape))}  "
                  f"-> {base}.npy, {', '.join(pngs)}")
    return 1 if failed else 0
