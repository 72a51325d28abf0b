"""`hookserve serve`'s checks that need no torch: flags, files, addresses, ports, TLS.

They run before torch is imported and any model is loaded, so such a mistake costs
no time: gRPC itself would report a taken port only once the server is built (after
the models have loaded), as "Failed to bind"; a TLS file that is not PEM, or a key
that does not match its certificate, would pass start-up and fail every handshake.
Each check raises a ConfigError that says what to change. No torch, no grpc here.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import ipaddress
import math
import re
import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from .config import ARCHITECTURES, WEIGHT_CHOICES, env_list, known_architecture
from .errors import ConfigError
from .labels import labels_per_model
from .model_file import ModelEntry, from_flags, read_model_file

#: The largest message the server sends (gRPC's send limit; chunks stay under it).
MAX_SEND_MESSAGE_BYTES = 16 << 20

#: OpenSSL's policy refusals (key sizes, digests) that gRPC's own TLS library accepts.
_POLICY_ONLY = re.compile(r"TOO_SMALL|TOO_WEAK|MD_TOO")


def _with_port(host: str) -> str | None:
    """The host alone, when `host` holds a port (``localhost:5``, ``[::1]:5``; a link-
    local address's zone, ``fe80::1%eth0``, is the interface's name)."""
    if host.startswith("["):
        return host[:host.index("]:") + 1] if "]:" in host else None
    try:
        socket.inet_pton(socket.AF_INET6, host.split("%", 1)[0])
        return None
    except OSError:
        return host.rsplit(":", 1)[0] if ":" in host else None


def no_port(host: str, flag: str) -> None:
    """Refuse a host flag that holds a port (``localhost:5``, ``[::1]:5``)."""
    if (alone := _with_port(host)) is not None:
        raise ConfigError(f"{flag} {host} holds a port: give the host alone ({alone}), "
                          f"and the port with {flag.replace('host', 'port')}")


def listen_host(host: str, flag: str) -> str:
    """`host` as gRPC takes it: a bare IPv6 address gets its brackets."""
    host = host.strip()
    if not host:
        raise ConfigError(f"{flag} is empty: use 127.0.0.1 (this machine only), or "
                          "0.0.0.0 or [::] (every interface)")
    no_port(host, flag)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return host


def metrics_host(host: str) -> str:
    """--metrics-host for HTTP: the IPv6 wildcard becomes 0.0.0.0 (IPv6 may be off)."""
    no_port(host.strip(), "--metrics-host")
    addr = host.strip().strip("[]")
    return "0.0.0.0" if addr in ("", "::") else addr


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback one."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_bindable(host: str, port: int, flag: str) -> None:
    """ConfigError unless `host:port` could be listened on now: the port is free (no
    other process listens there), allowed, and the address is this machine's."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    foreign = 0
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                s.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                why = (f"port {port} is in use (is another server running?): stop it, or "
                       f"choose another {flag}")
            elif exc.errno == errno.EACCES:
                why = (f"port {port} needs privileges this process lacks: choose one "
                       f"above 1023 with {flag}")
            else:  # e.g. no IPv6 here: fine while another address binds
                foreign += exc.errno == errno.EADDRNOTAVAIL
                continue
            raise ConfigError(f"cannot listen on {host}:{port}: {why}") from None
    if infos and foreign == len(infos):
        raise ConfigError(f"cannot listen on {host}:{port}: {host} is not an address of "
                          "this machine")


def check_tls(cert: str, key: str, client_ca: str | None) -> None:
    """ConfigError unless `cert` holds PEM certificates, `key` is the unencrypted PEM
    private key of the first, and `client_ca` (if any) holds PEM certificates."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for path, flag in ((cert, "--tls-cert"), (client_ca, "--tls-client-ca")):
        if path:
            try:
                ctx.load_verify_locations(cafile=path)
            except (ssl.SSLError, ValueError):
                raise ConfigError(f"{flag} {path} holds no PEM certificate "
                                  "(-----BEGIN CERTIFICATE-----)") from None
    try:
        ctx.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if _POLICY_ONLY.search(reason):
            return
        if reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"--tls-key {key} is not the key of --tls-cert {cert}") \
                from None
        raise ConfigError(f"--tls-key {key} is not an unencrypted PEM private key "
                          f"({reason})") from None


@dataclass(frozen=True)
class Checked:
    """What `preflight` read and settled: the models with their weights specs, the
    listening address and the security material."""

    names: list[str]
    weights: dict[str, str]
    host: str
    tls_cert: bytes | None
    tls_key: bytes | None
    tls_client_ca: bytes | None
    auth_token: str | None
    metrics_host: str | None
    #: `--labels`: {model: path of its class names}.
    labels: dict[str, Path] = field(default_factory=dict)
    #: Every served model, in order (`--models`, or the flags).
    entries: list[ModelEntry] = field(default_factory=list)


def preflight(args: argparse.Namespace) -> Checked:
    """Every check of `hookserve serve`'s flags that needs no torch, cheapest first."""
    check_ranges(args)
    host = listen_host(args.host, "--host")
    mhost = None if args.metrics_port is None else metrics_host(args.metrics_host)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
    if args.models:   # the file says it all: a flag beside it would be dropped unseen
        given = [flag for flag, value, default in (
            ("--model", args.model, ["resnet50"]), ("--weights", args.weights, ["auto"]),
            ("--labels", args.labels, None))
            # (a HOOKSERVE_* variable, the flag's default, gives way to the file)
            if value and value != default and value != env_list(flag)]
        if given:
            raise ConfigError(f"--models {args.models} declares every model, with its "
                              f"weights and labels: drop {' and '.join(given)} (or give "
                              "them in the file)")
    entries = (read_model_file(Path(args.models).expanduser(), args.http_port is not None,
                               args.max_input_side) if args.models else models_from_flags(args))
    checked = Checked(
        names=[e.name for e in entries], weights={e.name: e.weights for e in entries},
        host=host,
        tls_cert=read_file(args.tls_cert, "--tls-cert"),
        tls_key=read_file(args.tls_key, "--tls-key"),
        tls_client_ca=read_file(args.tls_client_ca, "--tls-client-ca"),
        auth_token=read_token(args.auth_token_file) if args.auth_token_file else None,
        metrics_host=mhost, labels={e.name: e.labels for e in entries if e.labels},
        entries=entries)
    if args.tls_cert:
        check_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
    check_bindable(host, args.port, "--port")
    if mhost is not None:
        import prometheus_client  # noqa: F401  (the server extra's: missing, say so now)

        check_bindable(mhost, args.metrics_port, "--metrics-port")
    if args.http_port is not None:
        import importlib.util
        if not all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn")):
            raise ConfigError("--http-port needs the http extra: pip install "
                              "'hookserve[http]' (starlette, uvicorn)")
        check_bindable(host, args.http_port, "--http-port")
    return checked


def models_from_flags(args: argparse.Namespace) -> list[ModelEntry]:
    """The models --model, --weights and --labels declare, checked."""
    names = args.model or ["resnet50"]
    if len(set(names)) != len(names):
        raise ConfigError(f"--model lists a model twice: {names}")
    unknown = [n for n in names if not known_architecture(n)]
    if unknown:
        close = difflib.get_close_matches(unknown[0], ARCHITECTURES, n=4, cutoff=0.5)
        raise ConfigError(f"unknown --model {', '.join(unknown)}: " + (
            "give each model its own --model; " if "," in unknown[0] else
            f"closest: {', '.join(close)}; " if close else "")
                          + "`hookserve models --available` lists the torchvision "
                          "classifiers it takes")
    return from_flags(names, weights_per_model(names, args.weights or []),
                      labels_per_model(names, args.labels or []))


def weights_per_model(models: list[str], specs: list[str]) -> dict[str, str]:
    """`--weights` -> {model: spec}: 'SPEC' for all, 'MODEL=SPEC' (wins) for one."""
    every, own = "auto", {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if sep and known_architecture(name):
            if name not in models:
                raise ConfigError(f"--weights {spec}: {name} is not among --model {models}")
            own[name] = value
        else:
            every = spec
    out = {m: own.get(m, every) for m in models}
    for m, v in out.items():
        if v not in WEIGHT_CHOICES and not Path(v).expanduser().is_file():
            what = ("a folder, not a file: give the weights file in it"
                    if Path(v).expanduser().is_dir()
                    else "neither auto/imagenet/random nor an existing file")
            raise ConfigError(f"--weights for {m}: {v!r} is {what}")
    return out


def check_ranges(args: argparse.Namespace) -> None:
    """Numeric flags that would break the server are refused at start-up."""
    positive = ("max_streams", "max_batch_size", "max_batch_bytes", "max_queue",
                "max_inflight_per_stream", "max_stream_buffer_bytes", "max_buffer_bytes",
                "max_preprocess_bytes", "max_image_pixels", "max_response_bytes",
                "max_input_side", "preprocess_workers", "max_message_bytes", "chunk_bytes",
                "max_side_streams", "max_attribution_cost",
                "attribution_pass_cost", "compile_after", "compile_max_graphs",
                "compile_max_sizes", "compile_max_bytes")
    for name in positive:
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    for name in ("max_batch_delay_ms", "queue_wait_ms", "grace_seconds", "threads",
                 "stream_idle_seconds"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must not be negative")
    for name in ("port", "metrics_port", "http_port"):
        port = getattr(args, name)
        if port is not None and not 0 <= port <= 65535:
            raise ConfigError(f"--{name.replace('_', '-')} {port} is not a port: use 0 to "
                              "65535 (0 picks a free one)")
    check_cache(args)
    if args.warm and args.compile != "auto":
        raise ConfigError(f"--warm {args.warm[0]} compiles at start-up, and --compile is "
                          f"{args.compile}: add --compile auto, or drop --warm")
    if args.channels_last and args.memory_format == "contiguous":
        raise ConfigError("--channels-last and --memory-format contiguous say opposite "
                          "things: give one of them")
    ports = {"--port": args.port, "--http-port": args.http_port}
    if args.metrics_port is not None and args.metrics_host in (args.host, "0.0.0.0", "::",
                                                                 "[::]"):
        ports["--metrics-port"] = args.metrics_port
    taken: dict[int, str] = {}
    for flag, port in ports.items():
        if port and port in taken:
            raise ConfigError(f"{flag} {port} is also {taken[port]}: give each its own "
                              "port (or 0 for a free one)")
        if port:
            taken[port] = flag
    if args.chunk_bytes > MAX_SEND_MESSAGE_BYTES - (64 << 10):
        raise ConfigError(f"--chunk-bytes must leave room under the "
                          f"{MAX_SEND_MESSAGE_BYTES >> 20} MiB send limit (and stay under "
                          "4 MiB for default gRPC clients)")


def check_cache(args: argparse.Namespace) -> None:
    """The answer cache's flags: sizes, and a Redis URL the client can take."""
    if args.cache_bytes < 0 or args.cache_bytes > args.max_buffer_bytes // 2:
        raise ConfigError(f"--cache-bytes {args.cache_bytes} must be 0 to half of "
                          f"--max-buffer-bytes ({args.max_buffer_bytes // 2}): the cache's "
                          "answers come out of that budget")
    for name in ("cache_ttl_seconds", "cache_max_value_bytes", "cache_timeout_ms"):
        v = getattr(args, name)
        if not 0 < v < math.inf:   # (NaN too)
            raise ConfigError(f"--{name.replace('_', '-')} {v} must be a positive number")
    if args.cache_ttl_seconds > MAX_TTL_S:
        raise ConfigError(f"--cache-ttl-seconds {args.cache_ttl_seconds} is over "
                          f"{MAX_TTL_S} (100 years), more than Redis takes")
    if not args.cache_url:
        return
    from .cache.shared import WRITE_QUEUE_BYTES, write_queue_bytes

    queue = write_queue_bytes(args.cache_max_value_bytes)
    if args.cache_bytes + queue > args.max_buffer_bytes // 2:
        lower = ("--cache-bytes or --cache-max-value-bytes (the queue holds one value)"
                 if queue > WRITE_QUEUE_BYTES else "--cache-bytes")
        raise ConfigError(f"--cache-url: --cache-bytes {args.cache_bytes} and the Redis "
                          f"write queue ({queue} bytes) must fit in half of "
                          f"--max-buffer-bytes ({args.max_buffer_bytes // 2}): raise "
                          f"--max-buffer-bytes, or lower {lower}")
    try:
        import redis  # noqa: F401
    except ImportError:
        raise ConfigError("--cache-url needs the redis client: pip install "
                          "'hookserve[cache]'") from None
    check_cache_url(args.cache_url)


#: The longest --cache-ttl-seconds (Redis refuses an expiry past a 64-bit count of ms).
MAX_TTL_S = 100 * 365 * 24 * 3600
#: URL options that would replace the timeouts and retries --cache-timeout-ms sets.
_OWN_OPTIONS = ("timeout", "retry", "health_check", "keepalive")


def shown_url(url: str) -> str:
    """A Redis URL as messages show it: without its user and password."""
    scheme, sep, rest = url.partition("://")
    return scheme + sep + rest.split("@")[-1]


def check_cache_url(url: str) -> None:
    """A Redis URL redis-py takes as meant: scheme, port and db, no options of ours,
    and (for TCP) a host name that resolves now."""
    import urllib.parse

    from redis.connection import parse_url

    shown = shown_url(url)
    if url.split("://", 1)[0] not in ("redis", "rediss", "unix"):
        raise ConfigError(f"--cache-url {shown!r}: use redis://HOST:PORT, "
                          "rediss://HOST:PORT (TLS) or unix://PATH")
    try:
        parts = urllib.parse.urlsplit(url)
        options = parse_url(url)
    except ValueError as exc:
        raise ConfigError(f"--cache-url {shown!r}: {exc}") from None
    own = [k for k in urllib.parse.parse_qs(parts.query)
           if any(o in k.lower() for o in _OWN_OPTIONS)]
    if own:
        raise ConfigError(f"--cache-url {shown!r}: remove {', '.join(own)} from the URL; "
                          "--cache-timeout-ms sets the timeouts (and there are no retries)")
    if parts.scheme == "unix" and not parts.path:
        raise ConfigError(f"--cache-url {shown!r}: name the socket: unix:///path/redis.sock")
    if parts.scheme != "unix":
        if not parts.hostname:
            raise ConfigError(f"--cache-url {shown!r}: name the host: redis://HOST:PORT")
        if parts.port == 0:
            raise ConfigError(f"--cache-url {shown!r}: the port is 1 to 65535 (Redis's is "
                              "6379)")
        if parts.path.strip("/") and not parts.path.strip("/").isdigit():
            raise ConfigError(f"--cache-url {shown!r}: the database after the port must "
                              "be a number (redis://HOST:PORT/0)")
        host = options.get("host", "localhost")
        try:
            socket.getaddrinfo(host, options.get("port", 6379), type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ConfigError(f"--cache-url {shown!r}: cannot resolve {host!r} "
                              f"({exc.strerror or exc})") from None


def read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read --auth-token-file {path}: {_why(exc)}") from None
    if not token:
        raise ConfigError(f"--auth-token-file {path} is empty")
    return token


def read_file(path: str | None, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {flag} {path}: {_why(exc)}") from None


def _why(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or str(exc)
