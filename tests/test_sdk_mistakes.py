"""SDK calls a new user gets a little wrong: each is refused at once with a message
that says what to pass, or does what the user meant; none crashes the process,
sends nonsense, or loses answers already computed.
"""

from __future__ import annotations

import io
import math
import re

import numpy as np
import pytest
from PIL import Image

import hookserve

from conftest import encode, rand_image
from helpers import hs

SMALL = rand_image(48, 48, seed=21)


def test_a_client_certificate_without_its_key_is_refused_not_a_crash(tmp_path):
    """gRPC aborts the whole process (SIGABRT) on a certificate without its key."""
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    with pytest.raises(ValueError, match="certificate_chain and private_key go together"):
        hookserve.Client("localhost:1", certificate_chain=cert)
    with pytest.raises(ValueError, match="certificate_chain and private_key go together"):
        hookserve.Client("localhost:1", private_key=key)
    r = hs("models", "--cert", str(cert), "--server", "localhost:1")
    assert r.returncode == 2 and "certificate_chain and private_key go together" in r.stderr


@pytest.mark.parametrize("timeout, ok", [(math.inf, True), (1e10, True), (None, True),
                                         (0, False), (-1, False), (math.nan, False),
                                         ("5", False), (True, False)])
def test_timeouts_are_seconds_above_0_or_none(server, timeout, ok):
    if not ok:
        with pytest.raises(ValueError, match="None for no limit"):
            hookserve.Client(server.address, timeout=timeout)
        with server.client() as c, pytest.raises(ValueError, match="None for no limit"):
            list(c.extract_many([SMALL], ["fc"], timeout=timeout))
        return
    with hookserve.Client(server.address, timeout=timeout) as c:   # (inf, huge: no limit)
        assert c.extract(SMALL, ["fc"])["fc"].shape == (1000,)
        assert [r.ok for r in c.extract_many([SMALL], ["fc"], timeout=timeout)] == [True]


@pytest.mark.parametrize("one", ["cat.jpg", b"\x89PNG", SMALL, Image.fromarray(SMALL)])
def test_one_image_passed_to_a_many_call_is_refused(server, one):
    with server.client() as c:
        with pytest.raises(TypeError, match="pass an iterable of images, such as \\[image\\]"):
            c.extract_many(one, ["fc"])
        with pytest.raises(TypeError, match="pass an iterable of images"):
            c.attribute_many(one)


def test_16_bit_pil_images_are_reduced_as_16_bit_files_are(server):
    g16 = (np.random.default_rng(3).integers(0, 65536, (48, 48))).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(g16).save(buf, "PNG")   # a 16-bit PNG: the server keeps its high byte
    with server.client() as c:
        as_file = c.extract(buf.getvalue(), ["fc"])["fc"]
        for img in (Image.fromarray(g16), Image.fromarray(g16.astype(np.int32))):  # I;16, I
            np.testing.assert_array_equal(c.extract(img, ["fc"])["fc"], as_file)
        with pytest.raises(hookserve.errors.InvalidArgument, match="mode F .* convert it"):
            c.extract(Image.fromarray(g16.astype(np.float32) / 65535), ["fc"])


def test_images_that_raise_midway_give_their_answers_first(server):
    """The answers of the images before the failure are the caller's; then it raises."""
    def images():
        for i in range(5):
            yield rand_image(32, 32, seed=i)
        raise RuntimeError("the source broke")

    got = []
    with server.client() as c:
        with pytest.raises(RuntimeError, match="the source broke"):
            for r in c.extract_many(images(), ["fc"], max_in_flight=8):
                got.append(r.index)
    assert got == [0, 1, 2, 3, 4]


def test_ids_are_strings(server):
    with server.client() as c, pytest.raises(TypeError, match="ids are strings: id 0 is 1"):
        list(c.extract_many([SMALL], ["fc"], ids=[1]))


def test_extract_out_that_is_a_folder_is_refused_before_any_call(tmp_path):
    img = tmp_path / "a.png"
    img.write_bytes(encode(SMALL))
    (tmp_path / "d.npz").mkdir()
    r = hs("extract", str(img), "--layers", "fc", "--out", str(tmp_path / "d.npz"),
           "--server", "localhost:1")
    assert r.returncode == 2 and "is a folder: name the .npz file" in r.stderr, r.stderr


@pytest.mark.parametrize("options, words", [
    ({"steps": 5}, "steps is an option of integrated_gradients, not of grad_cam"),
    ({"baseline": "black"}, "baseline is an option of integrated_gradients"),
    ({"sigma": 0.3}, "sigma is an option of smooth_grad"),
    ({"samples": 4}, "samples is an option of smooth_grad"),
])
def test_options_of_another_attribution_method_are_refused(server, tmp_path, options,
                                                           words):
    """They would be ignored: the user meant another method, or nothing."""
    with server.client() as c, pytest.raises(ValueError, match=words):
        c.attribute(SMALL, "layer4", method="grad_cam", **options)
    img = tmp_path / "x.png"
    img.write_bytes(encode(SMALL))
    flag, value = next(iter(options.items()))
    r = hs("attribute", str(img), f"--{flag}", str(value), "--out", str(tmp_path / "m"),
           "--server", server.address)
    owner = words.split(" of ")[1].split(",")[0]   # the CLI says it in its own flags
    assert r.returncode == 2 and f"--{flag} is an option of --method {owner}" in r.stderr, \
        r.stderr


@pytest.mark.parametrize("options, words", [
    ({"method": "smooth_grad", "sigma": 1e38}, "sigma is a fraction of the input's range"),
    ({"method": "smooth_grad", "sigma": 1e-50}, "sigma is a fraction of the input's range"),
    ({"method": "grad_cam", "top_k": 2**33}, "top_k must be a whole number from 0 to"),
    ({"method": "integrated_gradients", "steps": 2**32 + 1}, "steps must be a whole number"),
    ({"method": "smooth_grad", "seed": 2**64}, "seed must be a whole number from 0 to"),
    ({"method": "grad_cam", "relu": "no"}, "relu is True or False"),
    ({"method": "grad_cam", "normalize": "no"}, "normalize is True or False"),
    ({"method": "gradient", "upsample": True}, "upsample is for the CAM methods' maps"),
])
def test_attribute_options_out_of_their_range_are_named(server, options, words):
    """Each was sent as given: a sigma that overflowed answered a map made of NaN
    forwards, a tiny one became the default, 'no' was taken as true, and integers out
    of range failed with protobuf's 'Value out of range' naming no option."""
    with server.client() as c, pytest.raises(ValueError, match=words):
        c.attribute(SMALL, **options)


def test_max_in_flight_is_a_whole_number_of_images(server):
    for bad in (0, -1, 1.5, "8"):
        with pytest.raises(ValueError, match="max_in_flight must be a whole number"):
            hookserve.Client(server.address, max_in_flight=bad)
        with server.client() as c, pytest.raises(ValueError, match="max_in_flight"):
            c.extract_many([SMALL], ["fc"], max_in_flight=bad)


def test_the_asyncio_client_in_a_plain_with_says_async_with():
    with pytest.raises(TypeError, match="used with `async with`"):
        with hookserve.aio.Client("localhost:1"):
            pass


def test_tls_on_one_side_only_says_what_to_change(pki, server):
    from conftest import RunningServer

    tls = RunningServer(["--model", "resnet18", "--weights", "random", "--tls-cert",
                         str(pki["server"].cert_path), "--tls-key",
                         str(pki["server"].key_path)])
    try:
        with hookserve.Client(tls.address, timeout=30, retries=0) as c, \
                pytest.raises(hookserve.errors.Unavailable, match="if the server uses TLS, "
                                                                  "address it as grpcs://"):
            c.list_models()
    finally:
        tls.stop(2.0)
    with hookserve.Client(f"grpcs://{server.address}", timeout=30, retries=0) as c, \
            pytest.raises(hookserve.errors.Unavailable, match="does not speak TLS on this "
                                                              "port"):
        c.list_models()


def test_a_connection_that_fails_says_what_to_change(make_server):
    import socket

    from helpers import hs

    with socket.socket() as sock:   # a port nothing listens on (bound, never listening)
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
        with hookserve.Client(dead, timeout=30, retries=0) as c, \
                pytest.raises(hookserve.errors.Unavailable, match="nothing listens there: "
                                                                  "start `hookserve serve`"):
            c.list_models()
        r = hs("describe", "--server", dead, "--timeout", "30")
        assert r.returncode == 1 and "nothing listens there" in r.stderr, r.stderr
    with hookserve.Client("no-such-host.invalid:50051", timeout=30, retries=0) as c, \
            pytest.raises(hookserve.errors.Unavailable, match="the host name does not "
                                                              "resolve: check its spelling"):
        c.list_models()
    s = make_server("--model", "resnet18", "--weights", "random", "--metrics-port", "0")
    with hookserve.Client(f"127.0.0.1:{s.metrics_port}", timeout=30, retries=0) as c, \
            pytest.raises(hookserve.errors.Unavailable, match="that port speaks HTTP/1, "
                                                              "not gRPC"):
        c.list_models()


def _late_writer(fifo, data: bytes, within: float = 60.0) -> None:
    """Write `data` into the named pipe once a reader has it open, not before (its
    open with O_NONBLOCK fails with ENXIO while no reader has)."""
    import errno
    import os
    import time

    end = time.monotonic() + within
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as e:
            if e.errno != errno.ENXIO or time.monotonic() > end:
                raise
            time.sleep(0.001)
    os.set_blocking(fd, True)
    with open(fd, "wb") as fh:
        fh.write(data)


def test_a_pipe_is_read_and_a_device_that_never_ends_stops_at_the_send_limit(
        server, tmp_path, monkeypatch):
    """A named pipe is read as a file, also when its writer opens it after the client
    (it read as empty); one no one writes to is refused after a bounded wait; /dev/zero
    is read up to the client's send limit, not until memory runs out; a socket is
    refused; the rest goes on."""
    import os
    import socket
    import threading

    import hookserve.images

    fifo, unwritten = tmp_path / "pipe.png", tmp_path / "nobody-writes.png"
    os.mkfifo(fifo)
    os.mkfifo(unwritten)   # (its open waited for a writer for ever)
    data = encode(SMALL)
    writer = threading.Thread(target=_late_writer, args=(fifo, data))
    writer.start()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock.png"))
    good = tmp_path / "good.png"
    good.write_bytes(data)
    try:
        with server.client(options=[("grpc.max_send_message_length", 1 << 20)]) as c:
            monkeypatch.setattr(hookserve.images, "PIPE_WAIT_S", 60.0)
            piped = c.extract(fifo, ["layer1"])["layer1"]
            monkeypatch.setattr(hookserve.images, "PIPE_WAIT_S", 0.5)
            zero, socket_file, empty, ok = c.extract_many(
                ["/dev/zero", str(tmp_path / "sock.png"), str(unwritten), str(good)],
                ["layer1"])
    finally:
        writer.join()
        sock.close()
    np.testing.assert_array_equal(piped, ok.features["layer1"])
    assert isinstance(zero.error, hookserve.ResourceExhausted)
    assert f"its file of more than {1 << 20} bytes is over this client's limit" \
        in str(zero.error)
    assert isinstance(empty.error, hookserve.InvalidArgument)
    assert "no one wrote to this named pipe within 0.5 s: start its writer" \
        in str(empty.error)
    assert isinstance(socket_file.error, hookserve.InvalidArgument)
    assert "it is a socket or a block device, not a file" in str(socket_file.error)


def test_a_file_over_the_clients_send_limit_is_refused_from_its_size(server, tmp_path):
    big = tmp_path / "clip.mp4"
    with big.open("wb") as fh:   # sparse: its size, no bytes written
        fh.truncate(5 << 20)
    small = tmp_path / "ok.png"
    small.write_bytes(encode(SMALL))
    with server.client(options=[("grpc.max_send_message_length", 1 << 20)]) as c:
        r, ok = c.extract_many([str(big), str(small)], ["layer1"])
        with pytest.raises(hookserve.ResourceExhausted) as one:
            c.extract(big, ["layer1"])
    assert isinstance(r.error, hookserve.ResourceExhausted)
    for err in (r.error, one.value):
        assert f"its file of {5 << 20} bytes is over this client's limit of {1 << 20}" \
            in str(err)
        assert "grpc.max_send_message_length" in str(err)
    assert ok.error is None


def test_bfloat16_widening_takes_bit_patterns_only():
    bits = np.array([0x3FC0, 0x4000], np.uint16)   # 1.5, 2.0
    np.testing.assert_array_equal(hookserve.bfloat16_to_float32(bits), [1.5, 2.0])
    for wrong in (np.array([1.5], np.float32), np.array([1.5], np.float16)):
        with pytest.raises(TypeError, match=f"not {wrong.dtype}: an array that is float "
                                            "already needs no widening"):
            hookserve.bfloat16_to_float32(wrong)


@pytest.mark.parametrize("call, error, words", [
    (lambda c: c.extract(SMALL, "layer4,fc"), ValueError,
     "give several layers as a list, e.g. ['layer4', 'fc']"),
    (lambda c: c.extract(SMALL, ["layer4:avg"]), ValueError,
     "give a reduction as an option, e.g. {'layer4': {'reduction': 'avg'}}"),
    (lambda c: c.extract(SMALL, 4), TypeError, "layers are a name, a list of names"),
    (lambda c: c.extract([SMALL, SMALL], ["fc"]), hookserve.InvalidArgument,
     "several images go to extract_many"),
    (lambda c: c.extract(np.ascontiguousarray(SMALL.transpose(2, 0, 1)), ["fc"]),
     hookserve.InvalidArgument, "channels first, a.transpose(1, 2, 0) makes it HxWxC"),
    (lambda c: c.attribute(SMALL, "grad_cam"), ValueError,
     "'grad_cam' is an attribution method, given where the layer goes: "
     "attribute(image, method='grad_cam')"),
    (lambda c: c.attribute(SMALL, target="cat"), ValueError,
     "target of image 0 must be a class index or None, got 'cat'"),
    (lambda c: c.attribute(SMALL, target=float("nan")), ValueError,
     "target of image 0 must be a class index or None, got nan"),
    # extract's layers are a list; attribute explains one layer (protobuf's own
    # "bad argument type" said neither)
    (lambda c: c.attribute(SMALL, ["layer4"]), TypeError,
     "layer ['layer4']: an attribution explains one layer, named by a string"),
    (lambda c: c.attribute_many([SMALL], layer=5).__next__(), TypeError,
     "layer 5: an attribution explains one layer"),
    # on/off options are booleans ("yes" was sent as true, or a protobuf TypeError)
    (lambda c: c.extract(SMALL, {"fc": {"l2_normalize": "yes"}}), ValueError,
     "l2_normalize is True or False, got 'yes'"),
    (lambda c: c.extract(SMALL, ["fc"], native="no"), ValueError,
     "native is True or False, got 'no'"),
    # a URL is no path ("No such file or directory")
    (lambda c: c.extract("https://example.com/cat.jpg", ["fc"]), hookserve.InvalidArgument,
     "a URL is not read here (images are local paths, bytes, PIL images or arrays): "
     "fetch it and pass its bytes, or give it to `hookserve batch`"),
])
def test_a_call_spelled_as_elsewhere_says_the_sdks_spelling(server, call, error, words):
    with server.client() as c, pytest.raises(error) as err:
        call(c)
    assert words in str(err.value)


def test_a_file_url_is_its_path_and_an_array_subclass_its_array(server, tmp_path):
    """(a non-contiguous np.matrix aborted the process inside numpy)"""
    from urllib.request import pathname2url

    f = tmp_path / "a cat.png"
    f.write_bytes(encode(SMALL))
    grey = SMALL[:, :, 0]
    with server.client() as c:
        np.testing.assert_array_equal(c.extract("file://" + pathname2url(str(f)), ["fc"])["fc"],
                                      c.extract(str(f), ["fc"])["fc"])
        np.testing.assert_array_equal(
            c.extract(np.asmatrix(grey.copy())[:, ::-1][:, ::-1], ["fc"])["fc"],
            c.extract(grey, ["fc"])["fc"])


def test_a_torch_tensor_image_says_how_to_pass_it(server):
    torch = pytest.importorskip("torch")
    with server.client() as c, pytest.raises(hookserve.InvalidArgument,
                                             match=r"img.permute\(1, 2, 0\)"):
        c.extract(torch.zeros(3, 8, 8), ["fc"])


def test_options_none_means_the_defaults(server):
    with hookserve.Client(server.address, options=None) as c:
        assert c.list_models()


@pytest.mark.parametrize("kw, words", [
    ({"token": 123}, "token is the server's bearer token as a str, not int"),
    ({"retries": -1}, "retries is how many times a failed call is tried again, 0 or more"),
    ({"retry_backoff": float("nan")}, "retry_backoff is the first wait in seconds"),
    ({"target": 44010}, 'address 44010: give "host:port" (a string), or a list of them'),
    ({"root_certificates": "/nonexistent/ca.pem"},
     "root_certificates '/nonexistent/ca.pem': cannot read it (No such file or directory)"),
    # (gRPC: INTERNAL "Invalid metadata", and its own log line)
    ({"token": "s3c\nret"}, "token holds a control character (a tab, a line end)"),
    # (a TypeError of grpc's internals, an int() ValueError, or a limit of 1 byte)
    ({"options": {"grpc.max_receive_message_length": None}},
     "option grpc.max_receive_message_length=None: a byte count (-1: no limit)"),
    ({"options": {"grpc.max_send_message_length": True}},
     "option grpc.max_send_message_length=True: a byte count"),
    ({"options": "abc"}, "options 'abc': give gRPC channel options as (name, value) pairs "
                         "or a dict"),
    ({"options": [("grpc.enable_retries",)]}, "give gRPC channel options as (name, value)"),
])
def test_client_settings_out_of_their_kind_are_refused(kw, words):
    kw = {"target": "localhost:1", **kw}
    with pytest.raises((TypeError, ValueError), match=re.escape(words)):
        hookserve.Client(kw.pop("target"), **kw)


def test_options_as_a_dict_and_a_token_given_with_its_scheme_work(token_server):
    from conftest import TOKEN

    with hookserve.Client(token_server.address, token=f"Bearer {TOKEN}",
                          options={"grpc.max_send_message_length": 1 << 20}) as c:
        assert c.list_models()
        with pytest.raises(hookserve.ResourceExhausted):
            c.extract(bytes(2 << 20), ["fc"])


def test_layers_and_targets_in_the_kinds_users_hold(server):
    torch = pytest.importorskip("torch")
    with server.client() as c:
        want = c.extract(SMALL, ["layer1", "fc"])
        for layers in ({"layer1", "fc"}, (n for n in ["layer1", "fc"]),
                       {"layer1": None, "fc": None}.keys(), np.array(["layer1", "fc"])):
            got = c.extract(SMALL, layers)
            assert set(got) == {"layer1", "fc"}
            np.testing.assert_array_equal(got["fc"], want["fc"])
        (a,) = c.attribute_many([SMALL], targets=torch.tensor([3]))
        assert a.target == 3


@pytest.mark.parametrize("given, path", [
    ("FILE:///tmp/x.jpg", "/tmp/x.jpg"),            # schemes and hosts in any case
    ("file://LOCALHOST/tmp/a%20b.jpg", "/tmp/a b.jpg"),
    ("file:img.jpg", "img.jpg"),                    # relative
    ("img.jpg", "img.jpg"),
])
def test_file_urls_are_their_paths(given, path):
    from hookserve.images import _local_path

    assert _local_path(given) == path


@pytest.mark.parametrize("given, words", [
    ("ftp://host/a.jpg", "a URL is not read here"),
    ("data:image/png;base64,iVBOR", "a URL is not read here"),
    ("file://nas/share/a.jpg", "a file URL of another host (nas) is not read here"),
    ("file:///tmp/a#1.jpg", "write a '#' or a '?' of the file's name as %23 or %3F"),
])
def test_urls_that_are_not_read_say_what_to_do(given, words):
    """(each read as a missing file: "No such file or directory", or a fragment cut
    off, reading another file)"""
    from hookserve.images import _local_path

    with pytest.raises(ValueError, match=re.escape(words)):
        _local_path(given)


def test_an_answer_over_the_clients_own_receive_limit_says_so(server):
    """(gRPC words it as a request over the server's limit: the advice was to raise the
    server's --max-message-bytes, 64 MiB, for a 2 MiB answer chunk)"""
    with hookserve.Client(server.address, retries=0, options={
            "grpc.max_receive_message_length": 1 << 20}) as c:
        for call in (lambda: c.extract(SMALL, ["layer1"], resize=512, crop=512),
                     lambda: list(c.extract_many([SMALL], ["layer1"], resize=512, crop=512))):
            with pytest.raises(hookserve.ResourceExhausted) as err:
                call()
            assert "if it was an answer, it is over this client's receive limit of " \
                   f"{1 << 20} bytes: raise it" in str(err.value)
