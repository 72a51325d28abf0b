"""`hookserve serve` flags. Torch-free, so `--help` works without the server extra.

Every flag has a HOOKSERVE_* environment equivalent (flag name upper-cased,
dashes to underscores); repeatable flags take a comma-separated list there.
A flag given on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import os

MiB = 1 << 20


def memory_bytes() -> int:
    """Physical memory, or the cgroup (container) limit when that is lower."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    for path in ("/sys/fs/cgroup/memory.max",                     # cgroup v2
                 "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v1
        try:
            with open(path) as fh:
                limit = fh.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def default_buffer_bytes() -> int:
    """--max-buffer-bytes default: a quarter of memory, at least 256 MiB."""
    return max(256 * MiB, memory_bytes() // 4)


def _env(flag: str) -> str:
    return "HOOKSERVE_" + flag.lstrip("-").upper().replace("-", "_")


class _Append(argparse.Action):
    """`append`, except that the first value given on the command line replaces the
    default (which may come from the environment) instead of adding to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest)
        items = [] if current is self.default else list(current)
        items.append(values)
        setattr(namespace, self.dest, items)


def _add(p: argparse.ArgumentParser, flag: str, *, default=None, type=str, help: str,
         repeat: bool = False, choices=None, is_bool: bool = False) -> None:
    env = _env(flag)
    raw = os.environ.get(env)
    if is_bool:
        value = default if raw is None else raw.strip().lower() in ("1", "true", "yes", "on")
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=value,
                       help=f"{help} (env {env})")
        return
    if raw is not None:
        value = [type(v.strip()) for v in raw.split(",") if v.strip()] if repeat else type(raw)
    else:
        value = default
    shown = ",".join(map(str, value)) if isinstance(value, list) else value
    p.add_argument(flag, default=value, type=type, action=_Append if repeat else "store",
                   choices=choices, help=f"{help} (default: {shown}; env {env})")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    _add(g, "--model", default=None, repeat=True,
         help="architecture to serve; repeat for several (the first is the default "
              "model). One of resnet18/34/50/101/152, vgg11/13/16/19 and their _bn "
              "variants. Default: resnet50")
    _add(g, "--weights", default=None, repeat=True,
         help="auto | imagenet | random | PATH to a state_dict file, for every model; "
              "or MODEL=SPEC for one model (repeatable). auto = imagenet when cached or "
              "downloadable, else random with a loud warning. Default: auto")
    _add(g, "--download", default=True, is_bool=True,
         help="let auto/imagenet download ImageNet weights that are not cached in "
              "$TORCH_HOME; with --no-download start-up never touches the network "
              "(imagenet then fails when not cached, auto serves random weights)")
    _add(g, "--seed", default=0, type=int, help="seed for --weights random")
    _add(g, "--device", default="auto",
         help="auto (cuda:0 when CUDA is available, else cpu), cpu, or cuda:N")
    _add(g, "--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
         help="dtype the models compute in (float16/bfloat16 are meant for GPUs)")
    _add(g, "--channels-last", default=False, is_bool=True,
         help="run convolutions in channels_last memory format (faster on GPUs)")
    _add(g, "--threads", default=0, type=int,
         help="torch intra-op threads on the CPU; 0 keeps torch's default. Unless "
              "OMP_WAIT_POLICY or GOMP_SPINCOUNT is set, they spin ~0.1 ms between "
              "parallel regions (GOMP_SPINCOUNT=10000) before sleeping")

    g = p.add_argument_group("network")
    _add(g, "--host", default="[::]", help="address to bind")
    _add(g, "--port", default=50051, type=int, help="port; 0 picks a free one and logs it")
    _add(g, "--max-streams", default=128, type=int,
         help="concurrent work streams (Extract and Attribute together); more get "
              "RESOURCE_EXHAUSTED with a retry hint (health checks and unary calls have "
              "threads of their own)")
    _add(g, "--max-side-streams", default=16, type=int,
         help="concurrent calls of each streaming method other than Extract and Attribute "
              "(health Watch, reflection); more get RESOURCE_EXHAUSTED. Threads are kept "
              "for them and for unary calls, so open streams never block health checks")
    _add(g, "--stream-idle-seconds", default=300.0, type=float,
         help="cancel a health Watch or reflection stream after this long with no message "
              "either way (Extract and Attribute are never cut for silence); 0 never")
    _add(g, "--max-message-bytes", default=64 * MiB, type=int,
         help="largest request message (one encoded image plus framing)")
    _add(g, "--chunk-bytes", default=2 * MiB, type=int,
         help="tensor bytes per response message (kept under gRPC's 4 MiB default)")
    _add(g, "--grace-seconds", default=30.0, type=float,
         help="on SIGTERM/SIGINT: time to finish in-flight images before exiting")

    g = p.add_argument_group("batching and limits")
    _add(g, "--max-batch-size", default=32, type=int, help="images per forward pass")
    _add(g, "--max-batch-delay-ms", default=5.0, type=float,
         help="longest a batch waits for more images while some are still being decoded")
    _add(g, "--max-batch-bytes", default=1024 * MiB, type=int,
         help="activation bytes per batch, counting per image the larger of the requested "
              "layers' outputs and the largest layer output computed on the way; an image "
              "whose largest single layer output is over it gets RESOURCE_EXHAUSTED")
    _add(g, "--max-queue", default=1024, type=int,
         help="images admitted (decoding or waiting for the model) across all calls; "
              "beyond it images wait --queue-wait-ms, then get RESOURCE_EXHAUSTED")
    _add(g, "--queue-wait-ms", default=2000.0, type=float,
         help="how long an image waits for room in a full queue")
    _add(g, "--max-inflight-per-stream", default=64, type=int,
         help="images one stream may have unanswered; the stream then waits")
    _add(g, "--max-stream-buffer-bytes", default=256 * MiB, type=int,
         help="answer bytes one stream may have reserved and not yet sent. Each image's "
              "answer size is known from its header before it is decoded and reserved "
              "first; while the buffer is full the stream's requests are not read "
              "(backpressure). An answer bigger than this gets RESOURCE_EXHAUSTED")
    _add(g, "--max-buffer-bytes", default=default_buffer_bytes(), type=int,
         help="the same across all streams: answer bytes reserved and not yet sent. "
              "Default: a quarter of the machine's (or the container's) memory")
    _add(g, "--max-preprocess-bytes", default=default_buffer_bytes(), type=int,
         help="estimated peak memory of the images being decoded and resized at once "
              "(24 bytes a decoded pixel + 26 a resized one, from the header); images "
              "wait for room, one that could never fit gets RESOURCE_EXHAUSTED. "
              "Default: a quarter of the machine's (or the container's) memory")
    _add(g, "--max-image-pixels", default=50_000_000, type=int,
         help="largest image (width x height), checked before decoding")
    _add(g, "--max-response-bytes", default=1024 * MiB, type=int,
         help="largest estimated answer for one image (all layers, after reduction)")
    _add(g, "--max-input-side", default=8192, type=int,
         help="largest height or width of the model input and of the resized image "
              "before a crop (e.g. a 1x1000 image resized to 256 would be 256x256000), "
              "checked from the image header before decoding")
    _add(g, "--max-attribution-cost", default=1024, type=int,
         help="largest Attribute work in forward-equivalents: points x (1 + 2 x top_k), "
              "points being 1, steps + 1 (integrated_gradients) or samples (smooth_grad, "
              "plus 1). A costlier spec gets INVALID_ARGUMENT; an Attribute batch, and so "
              "one call's work on the model at once, stays within it too")
    _add(g, "--attribution-pass-cost", default=16, type=int,
         help="forward-equivalents of one Attribute pass (rows x (1 + 2 x targets); one "
              "row always runs): between passes the model's thread runs other calls' "
              "work and checks the call's cancel and deadline")
    _add(g, "--gpu-decode", default=False, is_bool=True,
         help="decode plain RGB JPEGs on the model's CUDA device with torchvision's "
              "decode_jpeg; other images, CPU models and decoder failures use the CPU")
    _add(g, "--preprocess-workers", default=min(8, os.cpu_count() or 2), type=int,
         help="threads decoding and resizing images")

    g = p.add_argument_group("security")
    _add(g, "--tls-cert", default=None, help="PEM certificate chain; enables TLS")
    _add(g, "--tls-key", default=None, help="PEM private key for --tls-cert")
    _add(g, "--tls-client-ca", default=None,
         help="PEM CA bundle; clients must present a certificate it signed (mutual TLS)")
    _add(g, "--auth-token-file", default=None,
         help="file holding a bearer token every call but health checks must send")

    g = p.add_argument_group("observability")
    _add(g, "--metrics-port", default=None, type=int,
         help="serve Prometheus metrics on this port (0 picks one); off when unset. "
              "The endpoint has no auth: it shows call and image counts by model and "
              "status code, latencies, batch sizes and bytes sent, never image data or ids")
    _add(g, "--metrics-host", default="127.0.0.1",
         help="address the metrics endpoint binds: loopback by default; 0.0.0.0 (or a "
              "pod IP) for a Prometheus on another host")
    _add(g, "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
         help="log level")
