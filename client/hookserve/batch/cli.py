"""The `hookserve batch` command line: its flags and help texts."""

from __future__ import annotations

import argparse
import sys

from ..byte_sizes import bytes_arg
from ..cli_args import add_connection_args, size_arg
from ..tables import DTYPES, REDUCTIONS
from .command import cli_run
from .defaults import DEFAULTS
from .errors import (
    EXIT_CANNOT_PROCEED,
    EXIT_INCOMPLETE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SOME_FAILED,
)

EXIT_HELP = f"""\
exit codes:
  {EXIT_OK}    every image was written (or was already in the output)
  {EXIT_SOME_FAILED}    the run finished but some images failed: see the errors file
  {EXIT_CANNOT_PROCEED}    the run could not proceed (one line on stderr): bad arguments or
       storage options, no input, no server or store reachable, a missing extra,
       unknown model/layer, output written with other settings or locked
  {EXIT_INCOMPLETE}    sharded run: some shards have no done marker (an input not found yet,
       a network error, overload, a cut tar...): run the same command again
  {EXIT_INTERRUPTED}  interrupted (SIGINT/SIGTERM): what was done is saved; run again
"""

OUTPUT_HELP = """\
outputs (by the extension of --out):
  .h5 / .hdf5   a dataset per layer [N, ...] plus paths, sha256, size, mtime_ns;
                metadata in attrs. During a run out.h5 is a small virtual file over
                out.h5.parts/; at the end it becomes one self-contained file.
  .parquet      a folder of Parquet parts (one row per image, a fixed-size list
                column per layer; needs 1-D features: --reduction avg|max|flatten).
  .npy, no suffix or a trailing /
                a folder: <layer>/<path>.npy per image and layer, index.jsonl,
                hookserve.json. Any other suffix is an error (exit code 2).

resume: run the same command again. Images already written are skipped (matched by
path, and checked against the file's size and mtime); failed and missing images are
tried again. kill -9 loses at most the images in flight.

sharded runs (a URL, a .tar/.tar.gz, or a list or table of URLs as input,
--image-column, a URL --out, or --sharded): each input shard (a WebDataset tar, a
Parquet file or row group, a hash bucket of a listing) writes one part, then
_errors-<sid>.csv (if any failed), then, only when every input is accounted for,
_done-<sid>.json into the --out folder (.parquet dataset or .npy folder, local or
s3://, gs://...). Shards with a valid marker are skipped on the next run; workers
with different --shard share one --out. See docs/batch.md and docs/scale-out.md.
"""


def _one_line_error(prog: str):
    """argparse's error, as one line and exit code 2 (no usage block)."""
    def error(message: str):
        hint = "" if "--help" in message else " (see --help)"
        print(f"{prog}: {message}{hint}", file=sys.stderr)
        sys.exit(EXIT_CANNOT_PROCEED)
    return error



def add_batch_parser(subparsers) -> argparse.ArgumentParser:
    """Register `hookserve batch` on the `hookserve` command's subparsers."""
    p = subparsers.add_parser(
        "batch", help="extract features of many images to .h5, .parquet or .npy files",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Extract layers of every image in folders, globs, or path lists into "
                    "one output, with progress, resume, retries and sharding.",
        epilog=OUTPUT_HELP + "\n" + EXIT_HELP)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="a folder (recursive; files with image extensions), a glob ('**' "
                        "recurses; quote it), a .txt/.lst list of paths, a .csv/.tsv/"
                        ".parquet table with a path column, or an image file")
    p.add_argument("--out", required=True,
                   help="output: NAME.h5 (or .hdf5), NAME.parquet, or a folder of .npy "
                        "files (NAME.npy, no suffix, or ending in /); any other suffix is "
                        "an error")
    p.add_argument("--layers", action="append", required=True,
                   help="layer names, comma-separated or repeated; NAME:REDUCTION sets a "
                        "reduction per layer (e.g. layer4:avg,fc,layer3:input:stats)")
    p.add_argument("--model", help="model name (default: the server's default)")
    p.add_argument("--reduction", default=DEFAULTS["reduction"], choices=list(REDUCTIONS),
                   help="reduction for layers without their own (default: %(default)s)")
    p.add_argument("--dtype", default=DEFAULTS["dtype"], choices=list(DTYPES),
                   help="feature dtype; bfloat16 is stored as uint16 bit patterns")
    p.add_argument("--l2-normalize", action="store_true",
                   help="divide each image's feature by its L2 norm")
    p.add_argument("--native", action="store_true",
                   help="no resize or crop: feature maps follow each image's size")
    p.add_argument("--resize", type=int, help="resize the shorter side to this")
    p.add_argument("--crop", type=size_arg, help="centre crop HxW (or one number)")
    p.add_argument("--path-column", default=DEFAULTS["path_column"],
                   help="path column of .csv/.tsv/.parquet inputs (default: %(default)s)")
    p.add_argument("--root", help="folder that relative paths in list/table inputs are "
                                  "relative to (default: the working directory)")
    p.add_argument("--shard", metavar="I/N",
                   help="take only shard I of N (0-based), chosen by a hash of each path "
                        "(of each input shard's key in a sharded run): N jobs with "
                        "I=0..N-1 cover the input exactly once. Give each its own --out, "
                        "except in a sharded run, where all share one")
    p.add_argument("--max-file-bytes", type=bytes_arg, default=DEFAULTS["max_file_bytes"],
                   metavar="BYTES",
                   help="an input file (tar member, Parquet cell, URL) larger than this "
                        "fails alone with an error row, refused from its size before it "
                        "is read; the cap is lowered to what the server accepts (its "
                        "--max-message-bytes) (default: %(default)s)")
    p.add_argument("--streams", type=int, default=DEFAULTS["streams"],
                   help="parallel extraction streams (default: %(default)s, at most 256)")
    p.add_argument("--max-in-flight", type=int, default=DEFAULTS["max_in_flight"],
                   help="images read and not yet written, over all streams; bounds memory "
                        "and what a kill can lose (default: %(default)s)")
    p.add_argument("--max-in-flight-bytes", type=bytes_arg, default=DEFAULTS["max_in_flight_bytes"],
                   metavar="BYTES",
                   help="input bytes read and not yet answered, over all streams; bounds "
                        "the client's memory (docs/limits.md); one larger input goes "
                        "alone (default: %(default)s)")
    p.add_argument("--retries", type=int, default=DEFAULTS["retries"],
                   help="tries per image on UNAVAILABLE or overload (RESOURCE_EXHAUSTED with a "
                        "retry hint) before it counts as failed (default: %(default)s)")
    p.add_argument("--checkpoint", type=int, default=DEFAULTS["checkpoint"], metavar="N",
                   help=".h5/.parquet: make written images visible as a new part every N "
                        "images (default: %(default)s), every --checkpoint-secs, or every "
                        "256 MB. Images are safe from a kill as soon as they are written, "
                        "checkpoint or not")
    p.add_argument("--checkpoint-secs", type=float, default=DEFAULTS["checkpoint_secs"],
                   help="seconds between checkpoints (default: %(default)s)")
    p.add_argument("--no-consolidate", dest="consolidate", action="store_false",
                   help=".h5: at the end keep out.h5 as a virtual file over out.h5.parts/ "
                        "instead of copying everything into one file")
    p.add_argument("--errors", help="CSV of failed images: path, code, message "
                                    "(default: OUT.errors.csv; removed when none failed; "
                                    "an existing file must be one: an input or the "
                                    "output is refused)")
    p.add_argument("--progress", dest="progress", action="store_true",
                   default=DEFAULTS["progress"],
                   help="show the progress bar (default: only when stderr is a terminal)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="never show the progress bar")
    p.add_argument("--dry-run", action="store_true",
                   help="count the inputs (and, for a local run, those already in --out) "
                        "and exit; contacts no server")
    g = p.add_argument_group(
        "sharded runs (URLs, tars, lists or tables of URLs, --image-column, a URL --out, "
        "--sharded)")
    g.add_argument("--sharded", action="store_true",
                   help="treat the inputs as shards (one output part and done marker "
                        "each) even when they are all local")
    g.add_argument("--storage-option", action="append", default=DEFAULTS["storage_option"],
                   metavar="KEY=VALUE",
                   help="fsspec option for URL inputs and outputs, repeatable (a JSON "
                        "value is parsed: anon=true); S3 credentials and endpoint come "
                        "from the standard AWS_* environment")
    g.add_argument("--image-column",
                   help=".parquet inputs hold the images: this column has their bytes "
                        "(binary, or a Hugging Face struct<bytes, path>)")
    g.add_argument("--id-column", help="with --image-column: the column of image ids "
                                       "(default: FILE#ROW); a repeated id in a shard is "
                                       "an error row (ALREADY_EXISTS)")
    g.add_argument("--listing-shards", type=int, default=DEFAULTS["listing_shards"],
                   metavar="B", help="a folder, prefix or glob of images is cut into B "
                   "shards by a hash of each name; keep B the same for one --out "
                   "(default: %(default)s)")
    g.add_argument("--shard-bytes", type=bytes_arg, default=DEFAULTS["shard_bytes"],
                   metavar="BYTES", help="a .parquet input larger than this is one shard "
                   "per row group (default: %(default)s)")
    # --server may be repeated here.
    add_connection_args(p, repeatable=True, timeout_default=DEFAULTS["timeout"],
                        timeout_help="seconds for every call: each unary call's deadline; "
                        "an Extract stream with images outstanding is cancelled and its "
                        "images sent again after this long without an answer; each read "
                        "of an http(s) input; S3's connect and read timeouts")
    p.error = _one_line_error(p.prog)
    p.set_defaults(func=cli_run)
    return p
