"""`hookserve serve` as an operator meets it: its help, its safe defaults, its logs.

- every option's help is there and true (its default, its HOOKSERVE_* variable);
- it listens on loopback unless told, and warns once when it listens beyond this
  machine with neither a token nor TLS;
- `--log-format text|json` (auto: text on a terminal), and the random-weights warning
  readable in both.
"""

from __future__ import annotations

import json
import logging
import os
import pty
import subprocess
import sys

import pytest

from hookserve.cli import build_parser
from hookserve_server.logs import JsonFormatter, TextFormatter, pick_format

from helpers import R18, ServeProcess

SERVE = [sys.executable, "-m", "hookserve.cli", "serve"]


def serve_parser():
    return build_parser()._subparsers._group_actions[0].choices["serve"]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKSERVE_")}
    return {**env, **extra}


# ---------------------------------------------------------------- help
def test_every_serve_option_has_true_help(monkeypatch):
    for k in [k for k in os.environ if k.startswith("HOOKSERVE_")]:
        monkeypatch.delenv(k)
    options = [a for a in serve_parser()._actions if a.option_strings != ["-h", "--help"]]
    assert len(options) >= 39
    for a in options:
        flag = a.option_strings[0]
        env = "HOOKSERVE_" + flag[2:].upper().replace("-", "_")
        assert a.help and len(a.help) > 30, flag
        assert f"env {env})" in a.help, flag
        assert "default: None" not in a.help and a.help.count("(default:") <= 1, flag
        if a.default is None:  # unset means off: the help says so, and shows no default
            assert "(default:" not in a.help and "unset" in a.help, flag
        elif isinstance(a.default, bool):
            shown = flag if a.default else "--no-" + flag[2:]
            assert f"(default: {shown};" in a.help, flag
        elif isinstance(a.default, list):
            assert f"(default: {','.join(a.default)};" in a.help, flag
        else:  # the value itself, or a rule with this machine's value
            assert f"(default: {a.default};" in a.help or f"{a.default} here;" in a.help, flag


def test_serve_help_runs_without_torch_and_shows_no_empty_defaults():
    code = ("import sys; sys.modules['torch'] = None; from hookserve.cli import main; "
            "main(['serve', '--help'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=_clean_env())
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "default: None" not in text and "(default: resnet50; env HOOKSERVE_MODEL)" in text
    assert "exits with status 2 after one line on stderr" in text


def test_boolean_variables_take_the_usual_words(monkeypatch):
    for word, want in (("1", True), ("true", True), ("Yes", True), ("on", True),
                       ("0", False), ("false", False), ("NO", False), ("off", False)):
        monkeypatch.setenv("HOOKSERVE_DOWNLOAD", word)
        assert build_parser().parse_args(["serve"]).download is want, word
        assert build_parser().parse_args(["serve", "--download"]).download is True
    monkeypatch.setenv("HOOKSERVE_PORT", "6000")
    monkeypatch.setenv("HOOKSERVE_LOG_FORMAT", "json")
    args = build_parser().parse_args(["serve"])
    assert (args.port, args.log_format) == (6000, "json")
    assert build_parser().parse_args(["serve", "--port", "7"]).port == 7


# ---------------------------------------------------------------- safe defaults
def test_serve_listens_on_loopback_unless_told(monkeypatch):
    monkeypatch.delenv("HOOKSERVE_HOST", raising=False)
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"


def test_exposure_warning_only_beyond_loopback_without_token_or_tls():
    from hookserve_server.app import exposure_warning
    from hookserve_server.server import ServerOptions

    for host in ("127.0.0.1", "localhost", "[::1]", "127.0.0.2"):
        assert exposure_warning(ServerOptions(host=host)) is None, host
    for host in ("0.0.0.0", "[::]", "192.0.2.1"):
        warning = exposure_warning(ServerOptions(host=host))
        assert warning and "--auth-token-file" in warning and "127.0.0.1" in warning
        assert exposure_warning(ServerOptions(host=host, auth_token="t")) is None
        assert exposure_warning(ServerOptions(host=host, tls_cert=b"c", tls_key=b"k")) is None


def test_serve_on_every_interface_without_auth_logs_one_warning():
    p = ServeProcess(*R18, "--host", "0.0.0.0")
    try:
        records = [json.loads(line) for line in p.log]
    finally:
        p.kill()
    warnings = [r for r in records if r["level"] == "WARNING"]
    assert len(warnings) == 1, records
    assert "0.0.0.0" in warnings[0]["msg"] and "--auth-token-file" in warnings[0]["msg"]
    assert "listening on 0.0.0.0:" in records[-1]["msg"]


# ---------------------------------------------------------------- logs
def test_log_format_is_text_on_a_terminal_and_json_otherwise():
    class Stream:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    assert pick_format("auto", Stream(True)) == "text"
    assert pick_format("auto", Stream(False)) == "json"
    assert pick_format("json", Stream(True)) == "json"
    assert pick_format("text", Stream(False)) == "text"
    # A real process whose stderr is a terminal (a pseudo-terminal here): text.
    leader, follower = pty.openpty()
    try:
        p = subprocess.run([*SERVE, "--chunk-bytes", "0"], stderr=follower,
                           stdout=subprocess.DEVNULL, timeout=60, env=_clean_env())
        os.close(follower)
        out = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the terminal's other end is closed
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(leader)
    line = out.decode().strip()
    assert p.returncode == 2
    assert "ERROR" in line and "cannot start: --chunk-bytes must be positive" in line
    assert not line.startswith("{") and len(line.splitlines()) == 1


def _record(msg: str, *args, loud: bool = False, fields: dict | None = None):
    record = logging.LogRecord("hookserve.models", logging.WARNING, __file__, 1, msg, args,
                               None)
    if loud:
        record.loud = True
    if fields:
        record.fields = fields
    return record


def test_random_weights_warning_is_readable_in_both_formats(monkeypatch, tmp_path):
    from hookserve_server.models import build_model

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty cache
    for var in ("https_proxy", "HTTPS_PROXY"):  # and no network
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("hookserve.models")
    logger.addHandler(handler)
    try:
        build_model("resnet18", "auto", seed=3)
    finally:
        logger.removeHandler(handler)
    (warning,) = [r for r in records if r.levelno == logging.WARNING]
    text = TextFormatter().format(warning).splitlines()
    assert len(text) == 3 and text[0] == text[2] == "!" * 78
    assert "NO PRETRAINED WEIGHTS" in text[1] and "RANDOM weights (seed=3)" in text[1]
    assert "\\n" not in text[1]
    line = JsonFormatter().format(warning)
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["loud"] is True and obj["level"] == "WARNING"
    assert "NO PRETRAINED WEIGHTS" in obj["msg"]
    assert "\n" not in obj["msg"] and "!!!" not in obj["msg"]


def test_call_records_are_fields_in_json_and_key_values_in_text():
    fields = {"event": "call", "method": "Attribute", "model": "resnet18",
              "layers": ["layer4"], "attribution_method": "grad_cam", "images": 2,
              "code": "OK"}
    obj = json.loads(JsonFormatter().format(_record("x", fields=fields)))
    assert {k: obj[k] for k in fields} == fields and "msg" not in obj
    text = TextFormatter().format(_record("x", fields=fields))
    assert text.endswith("event=call method=Attribute model=resnet18 layers=layer4 "
                         "attribution_method=grad_cam images=2 code=OK")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_serve_process_logs_the_random_weights_warning_readably(fmt, tmp_path):
    """--no-download with nothing cached: random weights, loudly; then the warm-up is
    refused (the input side limit), so the process ends by itself."""
    r = subprocess.run(
        [*SERVE, "--model", "resnet18", "--weights", "auto", "--no-download",
         "--device", "cpu", "--port", "0", "--max-input-side", "16", "--log-format", fmt],
        capture_output=True, text=True, timeout=180,
        env=_clean_env(TORCH_HOME=str(tmp_path)))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    if fmt == "json":
        records = [json.loads(line) for line in lines]
        (warning,) = [x for x in records if x["level"] == "WARNING"]
        assert warning["loud"] and "\n" not in warning["msg"] and "!" not in warning["msg"]
        assert "RANDOM weights" in warning["msg"]
        assert records[-1]["level"] == "ERROR" and "warm-up" in records[-1]["msg"]
    else:
        i = next(i for i, line in enumerate(lines) if "RANDOM weights" in line)
        assert lines[i - 1] == lines[i + 1] == "!" * 78
        assert "WARNING" in lines[i] and "\\n" not in lines[i]
        assert "ERROR" in lines[-1] and "cannot start: warm-up failed" in lines[-1]
        assert not any(line.startswith("{") for line in lines)


def test_every_start_up_error_becomes_one_line():
    from hookserve_server.command import startup_error
    from hookserve_server.errors import ConfigError, ResourceExhausted

    assert startup_error(ImportError("x", name="grpc_health")) == (
        "hookserve serve needs the server extra (grpc_health is missing): "
        "pip install 'hookserve[server]'")
    # our own import failing is a fault of ours, not a missing extra
    assert "server extra" not in startup_error(ImportError("x", name="hookserve_server.x"))
    assert startup_error(ConfigError("bad\nflag")) == "cannot start: bad flag"
    assert startup_error(ResourceExhausted("too big")) == "cannot start: warm-up failed: too big"
    assert startup_error(PermissionError(13, "Permission denied", "/w.pth")) == (
        "cannot start: Permission denied (/w.pth)")
    line = startup_error(RuntimeError("boom\n" + "x" * 1000))
    assert line.startswith("cannot start: RuntimeError: boom x") and "\n" not in line
    assert line.endswith("(--log-level DEBUG logs the traceback)") and len(line) < 400


def test_torchs_own_info_records_stay_out_of_the_servers_log():
    """torch logs its compiler's statistics at INFO when the process exits (after an
    interrupted start-up too): an operator's log shows hookserve's records, and torch's
    warnings."""
    code = ("import logging; from hookserve_server.logs import setup_logging; "
            "setup_logging('INFO', 'text'); "
            "logging.getLogger('torch._subclasses.fake_tensor').info('cache_hits: 0'); "
            "logging.getLogger('torch').warning('a warning of torch'); "
            "logging.getLogger('hookserve').info('ours')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert "ours" in r.stderr and "a warning of torch" in r.stderr, r.stderr
    assert "cache_hits" not in r.stderr


@pytest.mark.parametrize("flag", ["--max-message-bytes", "--chunk-bytes", "--max-batch-bytes",
                                  "--max-stream-buffer-bytes", "--max-buffer-bytes",
                                  "--max-preprocess-bytes", "--max-response-bytes",
                                  "--cache-bytes"])
def test_every_size_flag_takes_units(flag):
    args = build_parser().parse_args(["serve", flag, "256MiB"])
    assert getattr(args, flag.lstrip("-").replace("-", "_")) == 256 << 20
    assert getattr(build_parser().parse_args(["serve", flag, "1048576"]),
                   flag.lstrip("-").replace("-", "_")) == 1 << 20


def test_a_size_of_part_of_a_byte_is_refused():
    for value in ("1.5", "0.3K"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--chunk-bytes", value])
    assert build_parser().parse_args(["serve", "--chunk-bytes", "0.5K"]).chunk_bytes == 512


def test_a_start_up_error_names_the_variable_a_flag_came_from_not_its_value(monkeypatch):
    """(the value was shown: a --cache-url's password with it)"""
    from hookserve_server.command import startup_error
    from hookserve_server.errors import ConfigError

    err = ConfigError("--cache-url 'redis://h:99999/0': Port out of range")
    monkeypatch.setenv("HOOKSERVE_CACHE_URL", "redis://user:s3cret@h:99999/0")
    monkeypatch.setattr(sys, "argv", ["hookserve", "serve", "--model", "resnet18"])
    line = startup_error(err)
    assert line.endswith("(set by HOOKSERVE_CACHE_URL)") and "s3cret" not in line
    # given on the command line (or as argparse's prefix of it): no variable to name
    for typed in (["--cache-url", "x"], ["--cache-url=x"], ["--cache-u", "x"]):
        monkeypatch.setattr(sys, "argv", ["hookserve", "serve", *typed])
        assert "set by" not in startup_error(err)
