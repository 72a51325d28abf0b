"""`hookserve serve`: check the settings, build the models, the engine and the server,
run until a signal.

Every check runs before the first model is loaded: `preflight.py` (no torch: flags,
files, TLS material, addresses, ports, model names, weights specs), then `check` here
(device, ImageNet cache). A mistake ends start-up with a ConfigError, which command.py reports
in one line with exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

import torch

from . import precision
from .architectures import is_timm
from .cache.front import AnswerCache
from .cache.local import LocalCache
from .cache.shared import SharedCache
from .engine import Engine, EngineConfig
from .engine.config import CompileSettings, parse_warm
from .errors import ConfigError, HookserveError
from .labels import model_labels
from .logs import LOUD
from .memory_format import channels_last
from .models import (
    ServedModel,
    build_model,
    defaults_for,
    imagenet_cache_path,
    resolve_device,
)
from .openmp import release_team
from .preflight import Checked, is_loopback, metrics_host, preflight, shown_url
from .server import HookServer, ServerOptions, create_server

log = logging.getLogger("hookserve")


def no_download(weights: dict[str, str], archs: dict[str, str] | None = None
                ) -> dict[str, str]:
    """`--no-download`: settle auto/imagenet from the local cache alone, before any
    code could reach the network (the container image runs this way). `archs`: each
    model's architecture, when it is not the model's name."""
    out = dict(weights)
    for m, v in weights.items():
        arch = (archs or {}).get(m, m)
        if v not in ("auto", "imagenet") or is_timm(arch) or imagenet_cache_path(arch).is_file():
            continue
        if v == "imagenet":
            raise ConfigError(
                f"--weights imagenet for {m}: not cached at {imagenet_cache_path(m)} and "
                "downloads are off (--no-download). Bake them into the image "
                "(--build-arg WEIGHTS=imagenet), mount a state_dict and pass "
                "--weights PATH, or mount a $TORCH_HOME that holds them")
        log.warning("%s: NO PRETRAINED WEIGHTS: --weights auto with --no-download and no "
                    "cached ImageNet weights, so serving RANDOM weights: features are "
                    "meaningless for real use", m, extra=LOUD)
        out[m] = "random"
    return out


def check(args: argparse.Namespace, pre: Checked | None = None):
    """`preflight` (unless done), then the checks that need torch: the device, the
    ImageNet cache. ConfigError on a mistake, before any model is loaded.
    Returns (model names, {model: weights spec}, device, server options)."""
    pre = pre or preflight(args)
    device = resolve_device(args.device)
    weights = pre.weights if args.download else no_download(
        pre.weights, {e.name: e.arch for e in pre.entries})
    options = ServerOptions(
        host=pre.host, port=args.port, max_streams=args.max_streams,
        max_receive_message_bytes=args.max_message_bytes, chunk_bytes=args.chunk_bytes,
        tls_cert=pre.tls_cert, tls_key=pre.tls_key, tls_client_ca=pre.tls_client_ca,
        auth_token=pre.auth_token, max_side_streams=args.max_side_streams,
        stream_idle_seconds=args.stream_idle_seconds, http_port=args.http_port,
        http_tls_files=(args.tls_cert, args.tls_key, args.tls_client_ca)
        if args.tls_cert else None)
    return pre.names, weights, device, options


def _device_of(e) -> torch.device:
    """A model file entry's own device (ConfigError naming the model)."""
    try:
        return resolve_device(e.device)
    except ConfigError as exc:
        raise ConfigError(f"model {e.name}: {exc}") from None


def build(args: argparse.Namespace, pre: Checked | None = None):
    """Models, engine and (unstarted) server from parsed flags (`pre`: their
    `preflight`, when already done)."""
    pre = pre or preflight(args)
    names, weights, device, options = check(args, pre)
    warm = tuple(parse_warm(w, args.max_batch_size, args.max_input_side)
                 for w in args.warm or [])   # (before any model loads)
    own = {e.name: e.precision for e in pre.entries if e.precision}
    precisions = precision.per_model(names, args.precision or [], own)  # (the file wins)
    devices = {e.name: _device_of(e) if e.device else device for e in pre.entries}
    for e in pre.entries:  # every model's precision before any model loads
        precision.check(precisions[e.name], devices[e.name], e.dtype or args.dtype, e.name,
                        in_file=args.models if e.name in own else "")
    if args.threads:
        torch.set_num_threads(args.threads)
    models = []
    for e in pre.entries:
        name = e.name
        dev, dtype = devices[name], e.dtype or args.dtype
        try:
            module, info = build_model(e.arch, weights[name], args.seed, e.transform_input)
        except ConfigError as exc:   # a model file's entry is named, as its other errors are
            if not args.models:
                raise
            raise ConfigError(f"model {name} in {args.models}: {exc}") from None
        labels = model_labels(name, e.arch, info.source, info.num_classes, e.labels,
                              args.models if args.models and e.labels else "")
        cl = channels_last(args.memory_format, args.channels_last, e.arch, dev)
        defaults = e.preprocessing_over(defaults_for(e.arch))
        try:
            models.append(ServedModel(name, e.arch, module, info, dev, dtype, cl, labels,
                                      defaults, precisions[name]))
        except HookserveError as exc:  # its input size does not fit the architecture
            where = " (preprocessing.crop)" if e.crop else ""
            raise ConfigError(f"model {name}: input size {defaults.crop[0]}x"
                              f"{defaults.crop[1]}{where}: {exc.message}") from None
        log.info("loaded %s (%s) on %s (%s weights %s, %s)", name, e.arch, dev, info.source,
                 info.name, info.digest[:19])
    telemetry = None
    if args.metrics_port is not None:
        from .metrics import PrometheusTelemetry
        telemetry = PrometheusTelemetry()
    cfg = EngineConfig(
        max_batch_size=args.max_batch_size, max_batch_delay_ms=args.max_batch_delay_ms,
        max_batch_bytes=args.max_batch_bytes, max_queue=args.max_queue,
        queue_wait_s=args.queue_wait_ms / 1000.0,
        max_inflight_per_stream=args.max_inflight_per_stream,
        max_stream_buffer_bytes=args.max_stream_buffer_bytes,
        max_buffer_bytes=args.max_buffer_bytes,
        max_preprocess_bytes=args.max_preprocess_bytes,
        max_image_pixels=args.max_image_pixels, max_response_bytes=args.max_response_bytes,
        max_input_side=args.max_input_side, preprocess_workers=args.preprocess_workers,
        gpu_decode=args.gpu_decode, max_attribution_cost=args.max_attribution_cost,
        attribution_pass_cost=args.attribution_pass_cost)
    engine = Engine(models, cfg, telemetry, cache=build_cache(args, telemetry))
    engine.compile_graphs(CompileSettings(
        args.compile, args.compile_after, args.compile_max_graphs, args.compile_max_bytes,
        warm, args.compile_backend,
        args.compile_max_sizes))
    return engine, create_server(engine, options), telemetry


def build_cache(args: argparse.Namespace, telemetry) -> AnswerCache | None:
    """The answer cache the flags ask for, or None."""
    if not args.cache_bytes and not args.cache_url:
        return None
    shared = None
    if args.cache_url:
        shared = SharedCache(args.cache_url, args.cache_ttl_seconds,
                             args.cache_max_value_bytes, args.cache_timeout_ms / 1000.0,
                             telemetry)
        refused = shared.refusal()
        if refused is not None:
            shared.close()
            raise ConfigError(f"--cache-url {shown_url(args.cache_url)!r}: Redis refuses "
                              f"it: {refused}")
    return AnswerCache(LocalCache(args.cache_bytes, telemetry), shared, telemetry,
                       gpu_decode=args.gpu_decode)


def start_metrics(telemetry, args: argparse.Namespace) -> tuple[str, int]:
    """Serve /metrics on --metrics-host:--metrics-port; returns the bound (addr, port)."""
    addr = metrics_host(args.metrics_host)
    try:
        return addr, telemetry.serve(args.metrics_port, addr=addr)
    except OSError as exc:
        raise OSError(f"cannot serve metrics on {addr}:{args.metrics_port}: {exc.strerror} "
                      "(--metrics-host, --metrics-port)") from None


def exposure_warning(opts: ServerOptions) -> str | None:
    """The warning for a server anyone on the network can call, or None."""
    if opts.auth_token or opts.tls_cert or is_loopback(opts.host):
        return None
    return (f"listening on {opts.host}, beyond this machine, with neither "
            "--auth-token-file nor TLS: anyone who can reach this port can use the "
            "server. Set --auth-token-file and/or --tls-cert and --tls-key, or --host "
            "127.0.0.1 to take calls from this machine only")


def start(args: argparse.Namespace, pre: Checked | None = None,
          openmp_note: str | None = None) -> HookServer:
    """Build, serve metrics, warm up and report SERVING; on a failure, what was started
    is stopped and the error raised. The log's last start-up line says where it
    listens (after the OpenMP wait policy in force, and any exposure warning)."""
    engine, server, telemetry = build(args, pre)
    try:
        server.listen()
        if telemetry is not None:
            maddr, mport = start_metrics(telemetry, args)
            log.info("metrics on http://%s:%d/metrics", maddr, mport)
        server.ready()
    except BaseException:
        server.stop(0)
        raise
    release_team()  # only the model threads keep OpenMP teams from now on
    if openmp_note:
        log.info("%s", openmp_note)
    if warning := exposure_warning(server.opts):
        log.warning("%s", warning)
    log.info("hookserve listening on %s:%d (models: %s; health SERVING)", server.opts.host,
             server.port, ", ".join(engine.models))
    if server.http is not None:
        log.info("Open Inference Protocol REST routes on %s:%d (/v2)", server.opts.host,
                 server.http.port)
    return server


def stop_on_signals() -> threading.Event:
    """An Event that SIGTERM and SIGINT set (from now on, start-up included)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    return stop


def run_until(stop: threading.Event, server: HookServer, grace_seconds: float) -> int:
    """Serve until `stop` is set, then drain for up to `grace_seconds`."""
    stop.wait()
    log.info("signal received: draining (grace %.1fs)", grace_seconds)
    server.stop(grace_seconds)
    log.info("stopped")
    return 0
