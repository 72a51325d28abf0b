"""Mistakes a new user makes with the CLI and the SDK: each gets one line saying what
to change and the right exit status, never a traceback. The commands run as real
subprocesses; the servers are real (or a listener that never answers)."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading

import pytest

import hookserve

from conftest import encode, rand_image
from helpers import hs


@pytest.fixture
def img(tmp_path):
    p = tmp_path / "a.png"
    p.write_bytes(encode(rand_image(40, 40)))
    return p


@pytest.mark.parametrize("address, words", [
    ("localhost", "has no port: use host:port"),
    ("http://localhost:50051", "hookserve speaks gRPC, not http"),
    ("localhost:abc", "port 'abc' is not a number from 1 to 65535"),
    ("localhost:70000", "port '70000' is not a number from 1 to 65535"),
    ("::1:50051", "put an IPv6 address in brackets, as in [::1]:50051"),
])
def test_an_address_that_is_not_host_port_is_refused(address, words):
    r = hs("models", "--server", address)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(ValueError, match=re.escape(words.split(":")[0])):
        hookserve.Client(address)


def test_addresses_grpc_takes_stay_accepted():
    from hookserve.endpoints import parse_targets
    for given, want in [("grpcs://example.com", (["example.com"], True)),   # TLS's 443
                        (" host:1 , [::1]:2", (["host:1", "[::1]:2"], False)),
                        ("dns:///svc:50051", (["dns:///svc:50051"], False)),
                        ("unix:/tmp/hs.sock", (["unix:/tmp/hs.sock"], False))]:
        assert parse_targets(given) == want


def test_ctrl_c_during_a_call_is_one_line_and_130(img):
    """SIGINT once the command is connected and waiting for its answer."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    connected = threading.Event()
    held = []

    def accept():
        conn, _ = listener.accept()   # the client is in its call now; never answer it
        held.append(conn)
        connected.set()
    threading.Thread(target=accept, daemon=True).start()
    p = subprocess.Popen([sys.executable, "-m", "hookserve.cli", "extract", str(img),
                          "--layers", "layer4", "--timeout", "0", "--server",
                          f"127.0.0.1:{listener.getsockname()[1]}"],
                         stderr=subprocess.PIPE, text=True)
    try:
        assert connected.wait(60)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
        for c in held:
            c.close()
        listener.close()
    assert (p.returncode, err) == (130, "interrupted\n")


def test_extract_out_into_a_missing_folder_is_refused_before_any_call(img, tmp_path,
                                                                     silent_address):
    out = tmp_path / "no" / "such" / "f.npz"
    r = hs("extract", str(img), "--layers", "layer4", "--out", str(out),
           "--server", silent_address, "--timeout", "30")
    assert r.returncode == 2 and f"--out {out}: cannot write into" in r.stderr


def test_unreadable_client_files_name_their_flag(tmp_path):
    for flag in ("--token-file", "--ca"):
        r = hs("models", flag, str(tmp_path / "missing.pem"))
        assert r.returncode == 2 and f"cannot read {flag} " in r.stderr, r.stderr
    (tmp_path / "token").write_bytes(b"\xff\xfe binary")
    r = hs("models", "--token-file", str(tmp_path / "token"))
    assert r.returncode == 2 and "--token-file" in r.stderr and "is not text" in r.stderr


def test_the_clients_own_deadline_says_to_allow_more_time(silent_address):
    r = hs("models", "--server", silent_address, "--timeout", "0.3")
    assert r.returncode == 1 and "no answer within the client's timeout" in r.stderr
    assert "--timeout" in r.stderr


def test_health_of_an_unknown_service_says_which_exist(server):
    r = hs("health", "--service", "nope", "--server", server.address)
    assert r.returncode == 1
    assert "no health status for service 'nope'" in r.stderr and "hookserve.v1" in r.stderr


def test_warm_without_compile_is_refused_at_start_up():
    r = hs("serve", "--model", "resnet18", "--weights", "random", "--port", "0",
           "--warm", "resnet18=layer9")
    assert r.returncode == 2 and "add --compile auto, or drop --warm" in r.stderr


def test_sdk_option_typos_name_the_options(server, img):
    with hookserve.Client(server.address, timeout=60) as c:
        with pytest.raises(TypeError, match=r"'reduce' \(did you mean reduction\?\): its "
                                            "options are reduction, dtype"):
            c.extract(img.read_bytes(), ["layer1"], reduce="avg")
        with pytest.raises(TypeError, match="Client\\(timeout=...\\)"):
            c.extract(img.read_bytes(), ["layer1"], timeout=3)
        with pytest.raises(TypeError, match="layer 'layer1': unknown option 'reductoin'"):
            c.extract(img.read_bytes(), {"layer1": {"reductoin": "avg"}})
        with pytest.raises(TypeError, match="its options are a dict"):
            c.extract(img.read_bytes(), {"layer1": "avg"})


def test_batch_help_gives_the_timeout_default_once():
    out = " ".join(hs("batch", "--help").stdout.split())
    assert "(default: 60.0); 0: no limit" not in out and "no limit (default: 60.0)" in out


def test_timeout_0_means_no_limit(server, img, tmp_path):
    """As --help says: 0 was passed on as a deadline of now, and every call failed."""
    r = hs("extract", str(img), "--layers", "layer4", "--timeout", "0",
           "--server", server.address)
    assert r.returncode == 0, r.stderr
    r = hs("attribute", str(img), "--timeout", "0", "--out", str(tmp_path / "maps"),
           "--server", server.address)
    assert r.returncode == 0, r.stderr


def test_extract_takes_batch_style_layer_reductions(server, img, tmp_path):
    """`--layers layer4:avg` (how `hookserve batch` names a layer's reduction) was an
    unknown layer: it is that layer with that reduction; others take --reduction."""
    import numpy as np

    out = tmp_path / "f.npz"
    r = hs("extract", str(img), "--layers", "layer4:avg,conv1,layer3:input:max",
           "--reduction", "max", "--out", str(out), "--server", server.address)
    assert r.returncode == 0, r.stderr
    got = np.load(out)
    assert {k: got[k].shape for k in got} == {"layer4": (512,), "conv1": (64,),
                                              "layer3:input": (128,)}


def test_extract_that_writes_nothing_keeps_an_earlier_npz(server, img, tmp_path):
    out = tmp_path / "keep.npz"
    assert hs("extract", str(img), "--layers", "fc", "--out", str(out), "--server",
              server.address).returncode == 0
    before = out.read_bytes()
    r = hs("extract", str(tmp_path / "nope.jpg"), "--layers", "fc", "--out", str(out),
           "--server", server.address)
    assert r.returncode == 1 and f"no arrays to write: {out} is left as it was" in r.stderr
    assert out.read_bytes() == before


@pytest.mark.parametrize("layers, words", [
    ("layer4:avg,layer4:max", "--layers gives layer4 twice"),
    ("layer4,layer4:avg", "--layers gives layer4 twice"),
    ("layer4:bogus", "--layers layer4:bogus: a reduction after ':' is one of none, avg"),
])
def test_extract_layer_mistakes_are_refused_before_any_call(img, layers, words):
    r = hs("extract", str(img), "--layers", layers, "--server", "localhost:1")
    assert r.returncode == 2 and words in r.stderr, r.stderr


@pytest.mark.parametrize("command", [
    ["extract", "a.jpg", "--layers", "fc"], ["batch", "imgs", "--out", "o.h5", "--layers", "fc"],
    ["describe"], ["models"], ["attribute", "a.jpg", "--out", "m"], ["health"]])
def test_a_mistyped_flag_names_its_subcommand(command):
    r = hs(*command, "--reductoin", "avg")
    assert r.returncode == 2
    assert (f"hookserve {command[0]}: " in r.stderr
            and "unrecognized arguments: --reductoin" in r.stderr
            and f"`hookserve {command[0]} --help` lists the flags" in r.stderr), r.stderr
    assert "usage: hookserve [-h]" not in r.stderr


@pytest.mark.parametrize("argv, meant", [
    (["serve", "--model", "resnet18", "--prot", "7502"], "--port"),
    (["serve", "--wieghts", "random"], "--weights"),
    (["serve", "--max-bach-size", "8"], "--max-batch-size"),
    (["extract", "a.jpg", "--layers", "fc", "--reductoin", "avg"], "--reduction"),
    (["extract", "a.jpg", "--layers", "fc", "--modle", "resnet18"], "--model"),
    (["batch", "in", "--out", "o.h5", "--layers", "fc", "--stremas", "3"], "--streams"),
    (["models", "--servr", "localhost:1"], "--server"),
    (["attribute", "a.jpg", "--out", "m", "--metod", "grad_cam"], "--method"),
])
def test_a_misspelled_flag_names_the_flag_meant_in_one_line(argv, meant):
    r = hs(*argv)
    assert r.returncode == 2 and f"did you mean {meant}?" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "--model 7502" not in r.stderr


@pytest.mark.parametrize("argv", [["extract"], ["describe", "a", "b"],
                                  ["attribute", "a.jpg"], ["models", "--timeout", "x"]])
def test_a_subcommands_argument_error_is_one_line(argv):
    r = hs(*argv)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"hookserve {argv[0]}: error: " in r.stderr and "--help` lists" in r.stderr


@pytest.mark.parametrize("argv, words", [
    # another command's spelling (every other command takes --model)
    (["describe", "--model", "resnet18"], "hookserve describe takes the model as its "
                                          "argument: hookserve describe MODEL"),
    (["serve", "resnet18"], "unrecognized arguments: resnet18 (a model to serve is named "
                            "with --model: --model resnet18)"),
    # HOOKSERVE_MODEL takes a comma-separated list; the flag is repeated
    (["serve", "--model", "resnet18,vgg11", "--port", "0", "--log-format", "text"],
     "unknown --model resnet18,vgg11: give each model its own --model"),
])
def test_a_command_spelled_as_another_says_its_own_spelling(argv, words):
    r = hs(*argv)
    assert r.returncode == 2 and words in r.stderr, r.stderr


def test_a_folder_given_as_an_image_points_to_batch(server, tmp_path):
    (tmp_path / "imgs").mkdir()
    r = hs("extract", str(tmp_path / "imgs"), "--layers", "fc", "--server", server.address)
    assert r.returncode == 1
    assert "it is a folder; give image files (for a folder of images, `hookserve batch` " \
           "reads it)" in r.stderr, r.stderr
    with hookserve.Client(server.address, timeout=60) as c, \
            pytest.raises(hookserve.errors.InvalidArgument, match="it is a folder"):
        c.extract(str(tmp_path / "imgs"), ["fc"])


def test_ctrl_c_while_the_command_loads_is_one_line():
    """`import hookserve` loads no gRPC, and the command's modules load inside its entry
    point: a SIGINT then (here raised by an import hook as the CLI module loads, where
    a real one lands in the first half-second) is `interrupted` and exit 130."""
    code = """
import sys
import hookserve
assert "grpc" not in sys.modules and "numpy" not in sys.modules
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "hookserve.cli":
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupt())
from hookserve.__main__ import main
main(["models"])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 130 and r.stderr == "interrupted\n", r.stderr


@pytest.mark.parametrize("argv, words", [
    (["--server", "localhost:1", "describe"], "--server goes after the command: hookserve "
     "describe --server ... (`hookserve describe --help` lists its flags)"),
    (["--verison"], "unrecognized argument --verison: give a command first"),
    (["-v"], "unrecognized argument -v: give a command first"),
])
def test_a_flag_before_the_command_says_where_it_goes(argv, words):
    r = hs(*argv)
    assert r.returncode == 2 and words in r.stderr, r.stderr


def test_argparse_prefixes_of_its_own_flags_still_work_and_a_flags_value_is_no_command():
    r = hs("--vers")
    assert r.returncode == 0 and r.stdout.startswith("hookserve "), r.stderr
    r = hs("--model", "batch", "extract", "a.jpg", "--layers", "fc")
    assert r.returncode == 2 and "--model goes after the command: hookserve extract" \
        in r.stderr, r.stderr
