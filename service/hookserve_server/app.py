"""`hookserve serve`: build the models, the engine and the server, run until a signal."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path

import torch

from .engine import Engine, EngineConfig
from .errors import ConfigError, HookserveError
from .models import (
    ARCHITECTURES,
    WEIGHT_CHOICES,
    ServedModel,
    build_model,
    imagenet_cache_path,
    resolve_device,
)
from .server import ServerOptions, create_server

log = logging.getLogger("hookserve")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if msg.startswith("{"):  # already structured (one line per call)
            return msg
        out = {"ts": round(record.created, 3), "level": record.levelname,
               "logger": record.name, "msg": msg}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def weights_per_model(models: list[str], specs: list[str]) -> dict[str, str]:
    """`--weights` values -> {model: spec}. 'SPEC' sets all, 'MODEL=SPEC' one."""
    out = dict.fromkeys(models, "auto")
    for spec in specs:
        name, sep, value = spec.partition("=")
        if sep and name in ARCHITECTURES:
            if name not in out:
                raise ConfigError(f"--weights {spec}: {name} is not among --model {models}")
            out[name] = value
        else:
            for m in out:
                out[m] = spec
    for m, v in out.items():
        if v not in WEIGHT_CHOICES and not Path(v).expanduser().is_file():
            raise ConfigError(
                f"--weights for {m}: {v!r} is neither auto/imagenet/random nor an existing "
                "file")
    return out


def no_download(weights: dict[str, str]) -> dict[str, str]:
    """`--no-download`: settle auto/imagenet from the local cache alone, before any
    code could reach the network (the container image runs this way)."""
    out = dict(weights)
    for m, v in weights.items():
        if v not in ("auto", "imagenet") or imagenet_cache_path(m).is_file():
            continue
        if v == "imagenet":
            raise ConfigError(
                f"--weights imagenet for {m}: not cached at {imagenet_cache_path(m)} and "
                "downloads are off (--no-download). Bake them into the image "
                "(--build-arg WEIGHTS=imagenet), mount a state_dict and pass "
                "--weights PATH, or mount a $TORCH_HOME that holds them")
        log.warning("%s: --weights auto with --no-download and no cached ImageNet weights: "
                    "serving RANDOM weights (features are meaningless for real use)", m)
        out[m] = "random"
    return out


def _read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read --auth-token-file {path}: {exc}") from None
    if not token:
        raise ConfigError(f"--auth-token-file {path} is empty")
    return token


def _read_file(path: str | None, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {flag} {path}: {exc}") from None


def _check_ranges(args: argparse.Namespace) -> None:
    """Numeric flags that would break the server are refused at start-up."""
    from .server import ServerOptions

    send_limit = ServerOptions.max_send_message_bytes
    positive = ("max_streams", "max_batch_size", "max_batch_bytes", "max_queue",
                "max_inflight_per_stream", "max_stream_buffer_bytes", "max_buffer_bytes",
                "max_preprocess_bytes",
                "max_image_pixels",
                "max_response_bytes", "max_input_side", "preprocess_workers",
                "max_message_bytes", "chunk_bytes", "max_side_streams",
                "max_attribution_cost", "attribution_pass_cost")
    for name in positive:
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    for name in ("max_batch_delay_ms", "queue_wait_ms", "grace_seconds", "threads",
                 "stream_idle_seconds"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must not be negative")
    if args.chunk_bytes > send_limit - (64 << 10):
        raise ConfigError(f"--chunk-bytes must leave room under the {send_limit >> 20} MiB "
                          "send limit (and stay under 4 MiB for default gRPC clients)")


def build(args: argparse.Namespace):
    """Models, engine and (unstarted) server from parsed flags."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
    _check_ranges(args)
    names = args.model or ["resnet50"]
    if len(set(names)) != len(names):
        raise ConfigError(f"--model lists a model twice: {names}")
    weights = weights_per_model(names, args.weights or [])
    if not args.download:
        weights = no_download(weights)
    device = resolve_device(args.device)
    models = []
    for name in names:
        module, info = build_model(name, weights[name], seed=args.seed)
        models.append(ServedModel(name, name, module, info, device, args.dtype,
                                  args.channels_last))
        log.info("loaded %s on %s (%s weights %s, %s)", name, device, info.source, info.name,
                 info.digest[:19])
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
    engine = Engine(models, cfg, telemetry)
    opts = ServerOptions(
        host=args.host, port=args.port, max_streams=args.max_streams,
        max_receive_message_bytes=args.max_message_bytes, chunk_bytes=args.chunk_bytes,
        tls_cert=_read_file(args.tls_cert, "--tls-cert"),
        tls_key=_read_file(args.tls_key, "--tls-key"),
        tls_client_ca=_read_file(args.tls_client_ca, "--tls-client-ca"),
        auth_token=_read_token(args.auth_token_file) if args.auth_token_file else None,
        max_side_streams=args.max_side_streams,
        stream_idle_seconds=args.stream_idle_seconds)
    return engine, create_server(engine, opts), telemetry


def start_metrics(telemetry, args: argparse.Namespace) -> tuple[str, int]:
    """Serve /metrics on --metrics-host:--metrics-port; returns the bound (addr, port)."""
    # "[::]" would fail where a container has IPv6 switched off: use 0.0.0.0.
    addr = args.metrics_host.strip("[]")
    addr = "0.0.0.0" if addr in ("", "::") else addr
    return addr, telemetry.serve(args.metrics_port, addr=addr)


def serve(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        engine, server, telemetry = build(args)
    except ConfigError as exc:
        log.error("cannot start: %s", exc)
        return 2
    if telemetry is not None:
        maddr, mport = start_metrics(telemetry, args)
        log.info("metrics on http://%s:%d/metrics", maddr, mport)
    try:
        server.start()
    except HookserveError as exc:  # e.g. limits too small for the warm-up image
        log.error("cannot start: warm-up failed: %s", exc.message)
        server.stop(0)
        return 2
    if getattr(args, "openmp_note", None):
        log.info("%s", args.openmp_note)
    log.info("hookserve listening on %s:%d (models: %s; health SERVING)", args.host,
             server.port, ", ".join(engine.models))
    stop.wait()
    log.info("signal received: draining (grace %.1fs)", args.grace_seconds)
    server.stop(args.grace_seconds)
    log.info("stopped")
    return 0
