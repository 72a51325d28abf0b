"""Every start-up failure of `hookserve serve`, each run as a real process: exit status 2,
one line on stderr that says what to change, no traceback.

The processes run in parallel (a few at a time) from one fixture; each test reads its
case's result. Failures found before a model is loaded leave stderr with that one line
alone; a failure after loading (the warm-up) follows the start-up log, and is its only
ERROR record.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torchvision

from certs import CA
from helpers import small_server

SERVE = [sys.executable, "-m", "hookserve.cli", "serve"]
CPU_R18 = small_server("--device", "cpu")
SAVE_HINT = "torch.save(model.state_dict(), PATH)"


@dataclass
class Case:
    argv: list[str]
    words: tuple[str, ...]                 # all must be in the error line
    env: dict[str, str] | None = None
    code: str | None = None                # run `python -c code` instead of the CLI
    after_load: bool = False               # fails after the models loaded


NO_EXTRA = ("import sys; sys.modules[{m!r}] = None; from hookserve.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
TLS = ["--tls-cert", "{d}/server.pem", "--tls-key", "{d}/server.key"]

#: "{d}" is the folder of the files `_write_files` makes; "{port}" a port in use.
CASES: dict[str, Case] = {
    # argparse: flags and HOOKSERVE_* values
    "flag_not_an_int": Case(["--port", "abc"], ("argument --port", "'abc'")),
    "flag_unknown": Case(["--bogus"], ("unrecognized arguments: --bogus",)),
    "flag_missing_value": Case(["--port"], ("argument --port", "expected one")),
    "flag_bad_choice": Case(["--dtype", "float64"], ("argument --dtype", "float64")),
    "env_not_an_int": Case([], ("HOOKSERVE_PORT='abc' is not an integer",),
                           env={"HOOKSERVE_PORT": "abc"}),
    "env_not_a_bool": Case([], ("HOOKSERVE_DOWNLOAD='maybe' is not a boolean",),
                           env={"HOOKSERVE_DOWNLOAD": "maybe"}),
    "env_bad_choice": Case([], ("HOOKSERVE_LOG_FORMAT='xml'", "choose from"),
                           env={"HOOKSERVE_LOG_FORMAT": "xml"}),
    # preflight: before torch is imported
    # a value out of range from a variable names the variable, not only the flag
    "env_out_of_range": Case([*CPU_R18, "--port", "0"], (
        "--max-batch-size must be positive (set by HOOKSERVE_MAX_BATCH_SIZE)",),
        env={"HOOKSERVE_MAX_BATCH_SIZE": "0"}),
    "port_in_use": Case([*CPU_R18, "--port", "{port}"], ("port {port} is in use", "--port")),
    "metrics_port_in_use": Case([*CPU_R18, "--port", "0", "--metrics-port", "{port}"],
                                ("port {port} is in use", "--metrics-port")),
    "port_out_of_range": Case([*CPU_R18, "--port", "70000"], ("--port 70000 is not a port",)),
    "host_not_here": Case([*CPU_R18, "--host", "192.0.2.1"],
                          ("192.0.2.1 is not an address of this machine",)),
    "host_empty": Case([*CPU_R18, "--host", " "], ("--host is empty",)),
    "limit_not_positive": Case([*CPU_R18, "--chunk-bytes", "0"], ("--chunk-bytes must be",)),
    "tls_cert_without_key": Case([*CPU_R18, *TLS[:2]], ("--tls-cert and --tls-key go together",)),
    "tls_cert_unreadable": Case([*CPU_R18, "--tls-cert", "{d}/nope.pem", *TLS[2:]],
                                ("cannot read --tls-cert {d}/nope.pem",)),
    "tls_cert_not_pem": Case([*CPU_R18, "--tls-cert", "{d}/not.pem", *TLS[2:]],
                             ("--tls-cert {d}/not.pem holds no PEM certificate",)),
    "tls_key_of_another_cert": Case([*CPU_R18, *TLS[:3], "{d}/stranger.key"],
                                    ("is not the key of --tls-cert",)),
    "tls_key_not_pem": Case([*CPU_R18, *TLS[:3], "{d}/not.pem"],
                            ("is not an unencrypted PEM private key",)),
    "tls_client_ca_not_pem": Case([*CPU_R18, *TLS, "--tls-client-ca", "{d}/not.pem"],
                                  ("--tls-client-ca {d}/not.pem holds no PEM certificate",)),
    "token_file_missing": Case([*CPU_R18, "--auth-token-file", "{d}/nope"],
                               ("cannot read --auth-token-file {d}/nope",)),
    "token_file_empty": Case([*CPU_R18, "--auth-token-file", "{d}/empty-token"], ("is empty",)),
    # missing extras
    "no_torch": Case([], ("needs the server extra", "pip install 'hookserve[server]'"),
                     code=NO_EXTRA.format(m="torch")),
    "no_prometheus_client": Case(["--metrics-port", "0"],
                                 ("prometheus_client is missing",
                                  "pip install 'hookserve[server]'"),
                                 code=NO_EXTRA.format(m="prometheus_client")),
    # models, device, weights: torch imported, no model loaded yet
    "unknown_model": Case(["--model", "resnet51", "--weights", "random"],
                          ("unknown --model resnet51", "resnet50")),
    "model_twice": Case(["--model", "resnet18", "--model", "resnet18"],
                        ("lists a model twice",)),
    "bad_device": Case([*CPU_R18, "--device", "tpu:0"], ("device", "tpu:0")),
    "cuda_without_cuda": Case([*CPU_R18, "--device", "cuda:0"], ("CUDA is not available",)),
    "weights_not_a_file": Case(["--model", "resnet18", "--weights", "{d}/nope.pth"],
                               ("neither auto/imagenet/random nor an existing file",)),
    "weights_whole_model": Case(["--model", "resnet18", "--weights", "{d}/whole.pth"],
                                ("a whole model", SAVE_HINT)),
    "weights_other_architecture": Case(["--model", "resnet18", "--weights", "{d}/vgg.pth"],
                                       ("does not match architecture resnet18",)),
    "weights_garbage": Case(["--model", "resnet18", "--weights", "{d}/garbage.pth"],
                            ("not a file torch.save writes", SAVE_HINT)),
    "imagenet_not_cached_offline": Case(
        ["--model", "resnet18", "--weights", "imagenet", "--no-download"],
        ("downloads are off", "--weights PATH")),
    # the answer cache's Redis URL: read as redis-py reads it, and nothing of ours in it
    "cache_url_port": Case([*CPU_R18, "--cache-url", "redis://127.0.0.1:abc/0"],
                           ("--cache-url", "'abc'")),
    "cache_url_db": Case([*CPU_R18, "--cache-url", "redis://127.0.0.1:6379/x"],
                         ("--cache-url", "database", "must be a number")),
    "cache_url_timeout": Case([*CPU_R18, "--cache-url",
                               "redis://127.0.0.1:6379/0?socket_timeout=30"],
                              ("remove socket_timeout", "--cache-timeout-ms")),
    "cache_url_host": Case([*CPU_R18, "--cache-url", "redis://no-such-host.invalid:6379/0"],
                           ("--cache-url", "cannot resolve 'no-such-host.invalid'")),
    "cache_url_password_not_echoed": Case(
        [*CPU_R18, "--cache-url", "redis://user:s3cret@127.0.0.1:99999/0"],
        ("--cache-url", "127.0.0.1:99999/0", "Port out of range")),
    # after loading: the warm-up image cannot pass the limits
    "warmup_refused": Case([*CPU_R18, "--max-input-side", "16"], (
        "warm-up failed", "(--max-input-side): the model's own default input needs more, "
        "so raise that limit"), after_load=True),
}


def _write_files(d: Path) -> None:
    torch.save(torchvision.models.resnet18(), d / "whole.pth")
    torch.save(torchvision.models.vgg11().state_dict(), d / "vgg.pth")
    (d / "garbage.pth").write_bytes(b"\x00not a checkpoint")
    (d / "empty-token").write_text("\n")
    (d / "not.pem").write_text("hello\n")
    server = CA("ca", d).issue("server", server=True)
    stranger = CA("other", d).issue("stranger", server=True)
    for issued, name in ((server, "server"), (stranger, "stranger")):
        issued.cert_path.rename(d / f"{name}.pem")
        issued.key_path.rename(d / f"{name}.key")


def _env(tmp: Path, extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKSERVE_")}
    env.update(TORCH_HOME=str(tmp / "torch-home"), PYTHONUNBUFFERED="1", **(extra or {}))
    return env


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Iterator[dict[str, tuple[int, str, Case]]]:
    """Each case's (exit status, stderr, case with its placeholders filled in); the
    processes run four at a time, and their files are removed after the module."""
    d = tmp_path_factory.mktemp("startup")
    _write_files(d)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    fill = {"d": str(d), "port": taken.getsockname()[1]}

    def run(case: Case) -> tuple[int, str, Case]:
        case = Case([a.format(**fill) for a in case.argv],
                    tuple(w.format(**fill) for w in case.words), case.env, case.code,
                    case.after_load)
        argv = ([sys.executable, "-c", case.code, "serve", *case.argv] if case.code
                else [*SERVE, *case.argv])
        p = subprocess.run(argv, capture_output=True, text=True, timeout=240,
                           env=_env(d, case.env), stdin=subprocess.DEVNULL)
        return p.returncode, p.stderr, case

    try:
        with ThreadPoolExecutor(4) as pool:
            out = dict(zip(CASES, pool.map(run, CASES.values()), strict=True))
    finally:
        taken.close()
    yield out
    shutil.rmtree(d, ignore_errors=True)


def _message(line: str) -> str:
    """A log record's message (JSON) or argparse's plain line."""
    return json.loads(line)["msg"] if line.startswith("{") else line


@pytest.mark.parametrize("name", CASES)
def test_startup_failure_is_one_line_and_exit_2(results, name):
    if name == "cuda_without_cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc, stderr, case = results[name]
    lines = stderr.splitlines()
    assert rc == 2, stderr
    assert "Traceback" not in stderr and "\x1b" not in stderr, stderr
    assert "s3cret" not in stderr  # a password in --cache-url is never echoed
    if case.after_load:  # the start-up log, then the one error record
        records = [json.loads(line) for line in lines]  # every line is one record
        errors = [r for r in records if r["level"] == "ERROR"]
        assert len(errors) == 1 and records[-1] is errors[0], stderr
        message = errors[0]["msg"]
    else:
        assert len(lines) == 1, stderr
        message = _message(lines[0])
    for words in case.words:
        assert words in message, message
    assert "weights_only=False" not in message and len(message) < 600
