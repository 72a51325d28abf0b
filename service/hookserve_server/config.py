"""`hookserve serve` flags. Torch-free, so `--help` works without the server extra.

Every flag has a HOOKSERVE_* environment equivalent (`env_name`; repeatable flags take a
comma-separated list there, `env_list`). A flag on the command line wins over it."""

from __future__ import annotations

import argparse
import os

from hookserve.byte_sizes import parse_bytes

from .spec import DType

MiB = 1 << 20

#: Served architectures (--model): torchvision's image classifiers,
#: ``torchvision.models.list_models(module=torchvision.models)``, written out so that
#: start-up checks names before torch loads (tests/test_architectures.py keeps the two
#: equal for the torchvision installed).
ARCHITECTURES: tuple[str, ...] = (
    "alexnet", "convnext_base", "convnext_large", "convnext_small", "convnext_tiny",
    "densenet121", "densenet161", "densenet169", "densenet201", "efficientnet_b0",
    "efficientnet_b1", "efficientnet_b2", "efficientnet_b3", "efficientnet_b4",
    "efficientnet_b5", "efficientnet_b6", "efficientnet_b7", "efficientnet_v2_l",
    "efficientnet_v2_m", "efficientnet_v2_s", "googlenet", "inception_v3", "maxvit_t",
    "mnasnet0_5", "mnasnet0_75", "mnasnet1_0", "mnasnet1_3", "mobilenet_v2",
    "mobilenet_v3_large", "mobilenet_v3_small", "regnet_x_16gf", "regnet_x_1_6gf",
    "regnet_x_32gf", "regnet_x_3_2gf", "regnet_x_400mf", "regnet_x_800mf", "regnet_x_8gf",
    "regnet_y_128gf", "regnet_y_16gf", "regnet_y_1_6gf", "regnet_y_32gf", "regnet_y_3_2gf",
    "regnet_y_400mf", "regnet_y_800mf", "regnet_y_8gf", "resnet101", "resnet152",
    "resnet18", "resnet34", "resnet50", "resnext101_32x8d", "resnext101_64x4d",
    "resnext50_32x4d", "shufflenet_v2_x0_5", "shufflenet_v2_x1_0", "shufflenet_v2_x1_5",
    "shufflenet_v2_x2_0", "squeezenet1_0", "squeezenet1_1", "swin_b", "swin_s", "swin_t",
    "swin_v2_b", "swin_v2_s", "swin_v2_t", "vgg11", "vgg11_bn", "vgg13", "vgg13_bn",
    "vgg16", "vgg16_bn", "vgg19", "vgg19_bn", "vit_b_16", "vit_b_32", "vit_h_14",
    "vit_l_16", "vit_l_32", "wide_resnet101_2", "wide_resnet50_2",
)
#: The prefix of a timm model name (`--model timm:resnet50d`; the `timm` extra).
TIMM_PREFIX = "timm:"


def known_architecture(name: str) -> bool:
    """A torchvision classifier's name, or a timm model's (checked when timm loads)."""
    return name in ARCHITECTURES or (name.startswith(TIMM_PREFIX) and len(name) > 5)


#: --weights values other than a file's path.
WEIGHT_CHOICES = ("auto", "imagenet", "random")


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


def byte_size(value: str) -> int:
    """"512MiB", "2G", "1048576": whole bytes (`hookserve.byte_sizes`, as the batch command
    reads its sizes), naming the HOOKSERVE_* variable a bad default came from."""
    try:
        return parse_bytes(value)
    except ValueError as exc:
        where = f"{value.env}=" if isinstance(value, _FromEnv) else ""
        raise argparse.ArgumentTypeError(f"{where}{exc}") from None


def env_name(flag: str) -> str:   # (a flag's HOOKSERVE_* variable)
    return "HOOKSERVE_" + flag.lstrip("-").upper().replace("-", "_")


def env_list(flag: str) -> list[str]:   # a repeated flag's variable: comma-separated
    return [v.strip() for v in os.environ.get(env_name(flag), "").split(",") if v.strip()]


#: Values a boolean HOOKSERVE_* variable may take.
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class _FromEnv(str):
    """A default read from a HOOKSERVE_* variable. argparse converts a string default
    when it parses (and only if the flag was not given), so a bad value is refused like
    a bad flag, by name, and only by `hookserve serve`."""

    env: str

    def __new__(cls, value: str, env: str) -> _FromEnv:
        out = super().__new__(cls, value)
        out.env = env
        return out


def _converter(type, choices=None):
    """`type` for argparse, saying which variable held a value it cannot take."""
    kind = {int: "an integer", float: "a number"}.get(type, "valid")

    def convert(value: str):
        if not isinstance(value, _FromEnv):
            return type(value)
        try:
            out = type(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value.env}={str(value)!r} is not {kind}") \
                from None
        if choices is not None and out not in choices:
            raise argparse.ArgumentTypeError(
                f"{value.env}={str(value)!r}: choose from {', '.join(choices)}")
        return out

    convert.__name__ = type.__name__  # argparse's "invalid int value" names it
    return convert


def _to_bool(value: str) -> bool:
    word = value.strip().lower()
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    raise argparse.ArgumentTypeError(
        f"{getattr(value, 'env', 'value')}={str(value)!r} is not a boolean: use "
        f"{'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}")


class _Bool(argparse.BooleanOptionalAction):
    """--flag / --no-flag, whose environment default is checked when parsed."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.type = _to_bool  # used only for a default from the environment


class _Append(argparse.Action):
    """`append`, except that the first value given on the command line replaces the
    default (which may come from the environment) instead of adding to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest)
        items = [] if current is self.default else list(current)
        items.append(values)
        setattr(namespace, self.dest, items)


def _add(p: argparse.ArgumentParser, flag: str, *, default=None, type=str, help: str,
         repeat: bool = False, choices=None, is_bool: bool = False, metavar=None,
         shown: str | None = None) -> None:
    """One flag with its HOOKSERVE_* variable. The help ends with the default, unless
    it is None (the help text then says what unset means), and the variable's name;
    `shown` replaces the default's display (e.g. one computed on this machine)."""
    env = env_name(flag)
    raw = os.environ.get(env)
    value = default if raw is None else env_list(flag) if repeat else _FromEnv(raw, env)
    if raw is not None:
        shown = None  # the variable's value, not the built-in default
    if shown is None and value is not None:
        shown = ",".join(value) if isinstance(value, list) else str(value)
        if is_bool and raw is None:
            shown = flag if value else "--no-" + flag[2:]
    help = f"{help} (default: {shown}; env {env})" if shown else f"{help} (env {env})"
    if is_bool:
        p.add_argument(flag, action=_Bool, default=value, help=help)
        return
    p.add_argument(flag, default=value, type=_converter(type, choices),
                   action=_Append if repeat else "store", choices=choices,
                   metavar=metavar, help=help)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    _add(g, "--model", default=["resnet50"], repeat=True, metavar="ARCH",
         help="architecture to serve: any torchvision image classifier (resnet50, vgg16, "
              "efficientnet_b0, convnext_tiny, vit_b_16, ...; `hookserve models "
              "--available` lists them), or timm:NAME with the timm extra (weights from a "
              "file); repeat for several, the first being the default model")
    _add(g, "--weights", default=["auto"], repeat=True, metavar="SPEC",
         help="auto | imagenet | random | PATH to a state_dict file, for every model; or "
              "MODEL=SPEC for one model (repeatable). auto: ImageNet weights when cached "
              "or downloadable, else seeded random weights with a loud warning")
    _add(g, "--models", default=None, metavar="FILE",
         help="a TOML file declaring the served models ([[model]] tables: name, "
              "architecture, weights, labels, dtype, device, precision, transform_input, "
              "preprocessing); it replaces --model, --weights and --labels, and its first "
              "model is the default. When unset, the models come from --model")
    _add(g, "--labels", default=None, repeat=True, metavar="MODEL=PATH",
         help="class names of a model: a text file, one name a line in class-index order "
              "(repeatable; a bare PATH when one model is served). They reach Attribute's "
              "answers, ListModels and describe. When unset, --weights imagenet brings "
              "torchvision's ImageNet names and other weights none")
    _add(g, "--download", default=True, is_bool=True,
         help="let auto/imagenet download ImageNet weights that are not cached in "
              "$TORCH_HOME; with --no-download start-up never touches the network "
              "(imagenet then fails when not cached, auto serves random weights)")
    _add(g, "--seed", default=0, type=int, metavar="N",
         help="seed of random weights (--weights random, and auto's fallback)")
    _add(g, "--device", default="auto",
         help="auto (cuda:0 when CUDA is available, else cpu), cpu, or cuda:N")
    _add(g, "--dtype", default="float32", choices=[d.label for d in DType],
         help="dtype the models compute in (float16/bfloat16 are meant for GPUs)")
    _add(g, "--channels-last", default=False, is_bool=True,
         help="the same as --memory-format channels_last")
    _add(g, "--memory-format", default="auto", choices=["auto", "channels_last",
                                                        "contiguous"],
         help="layout of the models' weights and activations: channels_last (NHWC) or "
              "contiguous (NCHW); auto: channels_last for ResNet and VGG on CUDA, where "
              "measured faster; contiguous on the CPU, where channels_last is faster "
              "for batches but slower for one image (docs/performance.md). Answers are "
              "returned in the same layout either way; contiguous gives torchvision's "
              "features bit for bit, channels_last within float rounding")
    _add(g, "--precision", default=["fp32"], repeat=True, metavar="PREC",
         help="fp32 | bf16 | fp16 for every model, or MODEL=PREC for one (repeatable): "
              "bf16/fp16 run the Extract forward under autocast with float32 weights; "
              "bf16 needs a CPU with bfloat16 instructions or a GPU, fp16 a GPU; the "
              "differences from fp32 are in docs/performance.md")
    _add(g, "--compile", default="off", choices=["auto", "off"],
         help="auto: compile the pruned extraction graph of each layer set served often "
              "(inductor; frozen on the CPU) in a background thread while the eager path serves, "
              "switching at a batch boundary; off: the eager path alone. Rules and "
              "measurements: docs/performance.md")
    _add(g, "--compile-after", default=2, type=int, metavar="N",
         help="with --compile auto: compile a layer set at a batch size bucket (a power of "
              "two) and input size once N batches asked for it")
    _add(g, "--warm", repeat=True, metavar="SPEC",
         help="with --compile auto: compile at start-up (in the background) "
              "MODEL=LAYER[+LAYER...][@HxW][#BATCH], e.g. resnet50=layer4+layer3:input; "
              "size: the model's default crop, batch: 1 (repeatable); unset: none")
    _add(g, "--compile-max-sizes", default=2, type=int, metavar="N",
         help="with --compile auto: input sizes (height x width) compiled per layer set, "
              "the first N to become due; batches of other sizes stay eager")
    _add(g, "--compile-max-graphs", default=8, type=int, metavar="N",
         help="compiled graphs kept, least recently used dropped first")
    _add(g, "--compile-max-bytes", default="2GiB", type=byte_size, metavar="SIZE",
         help="estimated memory of the graphs kept (a graph over it alone is not): "
              "twice the weights each reaches on the CPU (frozen), once on CUDA")
    _add(g, "--compile-backend", default="inductor", choices=["inductor", "eager"],
         help="torch.compile backend: inductor serves; eager runs the same machinery "
              "without code generation (to check a deployment's compile path quickly)")
    _add(g, "--threads", default=0, type=int, metavar="N",
         help="torch intra-op threads on the CPU; 0 keeps torch's default. Unless "
              "OMP_WAIT_POLICY or GOMP_SPINCOUNT is set, they spin ~0.1 ms between "
              "parallel regions (GOMP_SPINCOUNT=10000) before sleeping")

    g = p.add_argument_group("network")
    _add(g, "--host", default="127.0.0.1",
         help="address to listen on: loopback by default, so only this machine can "
              "call; 0.0.0.0 or [::] for every interface (then set --auth-token-file "
              "or TLS: without either, start-up logs a warning)")
    _add(g, "--port", default=50051, type=int, metavar="PORT",
         help="gRPC port; 0 picks a free one and logs it")
    _add(g, "--max-streams", default=128, type=int, metavar="N",
         help="concurrent work calls (Extract, Attribute, ExtractImage, OIP infer); "
              "more get RESOURCE_EXHAUSTED with a retry hint (health checks and other "
              "unary calls have threads of their own)")
    _add(g, "--max-side-streams", default=16, type=int, metavar="N",
         help="concurrent calls of each other streaming method (health Watch, "
              "reflection); more get RESOURCE_EXHAUSTED. Threads are kept for them and "
              "for unary calls, so open streams never block health checks")
    _add(g, "--stream-idle-seconds", default=300.0, type=float, metavar="S",
         help="cancel a health Watch or reflection stream after this long with no "
              "message either way (work calls are never cut for silence); 0: never")
    _add(g, "--http-port", type=int, metavar="PORT",
         help="also serve the Open Inference Protocol's REST routes (KServe v2: /v2/...) "
              "on this port (0 picks one), on the same host, token and TLS; off when "
              "unset. Needs the http extra (starlette, uvicorn)")
    _add(g, "--max-message-bytes", default=64 * MiB, type=byte_size, metavar="SIZE",
         help="largest request message the server accepts (one encoded image plus "
              "framing); larger ones get RESOURCE_EXHAUSTED")
    _add(g, "--chunk-bytes", default=2 * MiB, type=byte_size, metavar="SIZE",
         help="tensor bytes per response message; keep it under 4 MiB, the receive "
              "limit of default gRPC clients")
    _add(g, "--grace-seconds", default=30.0, type=float, metavar="S",
         help="on SIGTERM/SIGINT: time to finish in-flight images before exiting")

    g = p.add_argument_group("batching and limits")
    _add(g, "--max-batch-size", default=32, type=int, metavar="N",
         help="images per forward pass")
    _add(g, "--max-batch-delay-ms", default=5.0, type=float, metavar="MS",
         help="longest a batch waits for more images while some are still being decoded")
    _add(g, "--max-batch-bytes", default=1024 * MiB, type=byte_size, metavar="SIZE",
         help="activation bytes per batch, counting per image the larger of the requested "
              "layers' outputs and the largest layer output computed on the way (for "
              "Attribute, the graph kept for the backward pass); an image over it on its "
              "own gets RESOURCE_EXHAUSTED")
    _add(g, "--max-queue", default=1024, type=int, metavar="N",
         help="images admitted (decoding or waiting for the model) across all calls; "
              "beyond it images wait --queue-wait-ms, then get RESOURCE_EXHAUSTED")
    _add(g, "--queue-wait-ms", default=2000.0, type=float, metavar="MS",
         help="how long an image waits for room in a full queue")
    _add(g, "--max-inflight-per-stream", default=64, type=int, metavar="N",
         help="images one stream may have unanswered; the stream then waits")
    _add(g, "--max-stream-buffer-bytes", default=256 * MiB, type=byte_size, metavar="SIZE",
         help="answer bytes one stream may have reserved and not yet sent. Each image's "
              "answer size is known from its header before it is decoded and reserved "
              "first; while the buffer is full the stream's requests are not read "
              "(backpressure). An answer bigger than this gets RESOURCE_EXHAUSTED")
    quarter = (f"a quarter of the machine's or the container's memory, at least 256 MiB: "
               f"{default_buffer_bytes()} here")
    _add(g, "--max-buffer-bytes", default=default_buffer_bytes(), type=byte_size,
         metavar="SIZE", shown=quarter,
         help="the same across all streams: answer bytes reserved and not yet sent")
    _add(g, "--max-preprocess-bytes", default=default_buffer_bytes(), type=byte_size,
         metavar="SIZE", shown=quarter,
         help="estimated peak memory of the images being decoded and resized at once "
              "(24 bytes a decoded pixel + 26 a resized one, from the header); images "
              "wait for room, one that could never fit gets RESOURCE_EXHAUSTED")
    _add(g, "--max-image-pixels", default=50_000_000, type=int, metavar="N",
         help="largest image (width x height), checked from the header before decoding")
    _add(g, "--max-response-bytes", default=1024 * MiB, type=byte_size, metavar="SIZE",
         help="largest estimated answer for one image (all layers, after reduction)")
    _add(g, "--max-input-side", default=8192, type=int, metavar="PIXELS",
         help="largest height or width of the model input and of the resized image "
              "before a crop (e.g. a 1x1000 image resized to 256 would be 256x256000), "
              "checked from the image header before decoding")
    _add(g, "--max-attribution-cost", default=1024, type=int, metavar="N",
         help="largest Attribute work in forward-equivalents: passes x (1 + 2 x top_k), "
              "passes being 1, steps + 1 (integrated_gradients) or samples (smooth_grad, "
              "+ 1 forward). A costlier spec gets INVALID_ARGUMENT; a batch, and so one "
              "call's work on the model at once, stays within it too")
    _add(g, "--attribution-pass-cost", default=16, type=int, metavar="N",
         help="forward-equivalents of one Attribute pass (rows x (1 + 2 x targets); one "
              "row always runs): between passes the model's thread runs other calls' "
              "work and checks the call's cancel and deadline")
    _add(g, "--gpu-decode", default=False, is_bool=True,
         help="decode plain RGB JPEGs on the model's CUDA device with torchvision's "
              "decode_jpeg; other images, CPU models and decoder failures use the CPU")
    workers = min(8, os.cpu_count() or 2)
    _add(g, "--preprocess-workers", default=workers, type=int, metavar="N",
         shown=f"the CPU cores, at most 8: {workers} here",
         help="threads decoding and resizing images")

    g = p.add_argument_group("answer cache (docs/cache.md)")
    _add(g, "--cache-bytes", default="0", type=byte_size, metavar="SIZE",
         help="keep answers in memory, least recently used out, up to this size (512MiB, "
              "2G, or bytes); an answer is keyed by the image's bytes, the weights and "
              "the spec, so repeated work is computed once. Its bytes come out of "
              "--max-buffer-bytes (at most half of it); 0: off")
    _add(g, "--cache-url", metavar="URL",
         help="also keep answers in Redis, shared by replicas: redis://[user:password@]"
              "HOST:PORT[/DB], rediss:// for TLS or unix://PATH (needs hookserve[cache]); "
              "timeouts and retries are not URL options; a password is better given in "
              "HOOKSERVE_CACHE_URL than on the command line; off when unset")
    _add(g, "--cache-ttl-seconds", default=86400, type=int, metavar="S",
         help="how long Redis keeps an answer")
    _add(g, "--cache-max-value-bytes", default="16MiB", type=byte_size, metavar="SIZE",
         help="largest answer (one layer's, encoded) written to Redis")
    _add(g, "--cache-timeout-ms", default=50.0, type=float, metavar="MS",
         help="longest a Redis lookup may delay an image, name lookup and connecting "
              "included; a slower or failed lookup is a miss, and Redis is skipped for a "
              "second after a failure")

    g = p.add_argument_group("security")
    _add(g, "--tls-cert", metavar="PEM",
         help="certificate chain (PEM) the server presents; with --tls-key it turns TLS "
              "on (plaintext when unset)")
    _add(g, "--tls-key", metavar="PEM",
         help="the unencrypted private key (PEM) of --tls-cert; unset without TLS")
    _add(g, "--tls-client-ca", metavar="PEM",
         help="CA bundle (PEM); clients must present a certificate it signed (mutual "
              "TLS; needs --tls-cert and --tls-key). When unset, clients need none")
    _add(g, "--auth-token-file", metavar="PATH",
         help="file holding a bearer token that every call but health checks must send "
              "('authorization: Bearer <token>'); off when unset")

    g = p.add_argument_group("observability")
    _add(g, "--metrics-port", type=int, metavar="PORT",
         help="serve Prometheus metrics on this port (0 picks one); off when unset. "
              "The endpoint has no auth: it shows call and image counts by model and "
              "status code, latencies, batch sizes and bytes sent, never image data or ids")
    _add(g, "--metrics-host", default="127.0.0.1", metavar="HOST",
         help="address the metrics endpoint binds: loopback by default; 0.0.0.0 (or a "
              "pod IP) for a Prometheus on another host")
    _add(g, "--log-format", default="auto", choices=["auto", "text", "json"],
         help="text: one readable line per record; json: one JSON object per line; "
              "auto: text when stderr is a terminal, else json")
    _add(g, "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
         help="least severe records logged (INFO logs start-up, and one line per call)")
