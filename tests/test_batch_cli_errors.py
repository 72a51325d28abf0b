"""Every command-line and storage-option mistake of `hookserve batch` is exit code 2
with one line and no traceback; every option has help text; a missing extra says which
pip install fixes it; --timeout bounds every call, streams included."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import grpc
import pytest

from hookserve.batch.cli import add_batch_parser
from hookserve.cli import build_parser, main

from bulk_faults import tar_bytes
from conftest import encode, rand_image

OPTS = ["--no-progress", "--layers", "fc", "--resize", "32", "--crop", "32"]


@pytest.fixture
def tar(tmp_path):
    p = tmp_path / "s.tar"
    p.write_bytes(tar_bytes([("0.png", encode(rand_image(32, 32)))]))
    return str(p)


def _one_line_exit_2(capsys, argv) -> str:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flags, words", [
    (["--listing-shards", "0"], "--listing-shards must be at least 1"),
    (["--shard", ""], "--shard must look like I/N"),
    (["--shard", "3/2"], "need 0 <= I < N"),
    (["--shard", "1/0"], "need 0 <= I < N"),
    (["--streams", "0"], "--streams must be at least 1"),
    (["--max-in-flight", "0"], "--max-in-flight must be at least 1"),
    (["--max-in-flight-bytes", "0"], "--max-in-flight-bytes must be at least 1"),
    (["--max-file-bytes", "-1"], "--max-file-bytes must be at least 1"),
    (["--shard-bytes", "0"], "--shard-bytes must be at least 1"),
    (["--retries", "-1"], "--retries must be at least 0"),
    (["--checkpoint", "0"], "--checkpoint must be at least 1"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds"),
    (["--timeout", "nan"], "argument --timeout: expected seconds"),
    (["--checkpoint-secs", "-1"], "--checkpoint-secs must be a positive number"),
    (["--streams", "many"], "argument --streams: invalid int value"),
    (["--max-in-flight-bytes", "8Q"], "argument --max-in-flight-bytes: '8Q' is not a size: "
                                      "use whole bytes, or a number with K, M or G"),
    (["--dtype", "int8"], "argument --dtype: invalid choice"),
    (["--storage-option", "novalue"], "--storage-option must look like KEY=VALUE"),
    (["--storage-option", "=x"], "--storage-option must look like KEY=VALUE"),
], ids=lambda v: "_".join(v) if isinstance(v, list) else None)
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
def test_a_bad_flag_is_one_line_exit_2(server, tar, tmp_path, capsys, flags, words,
                                       sharded):
    inputs = [tar] if sharded else [str(tmp_path)]
    err = _one_line_exit_2(capsys, ["batch", *inputs, "--out", str(tmp_path / "o.parquet"),
                                    "--server", server.address, *OPTS, *flags])
    assert words in err, err


def test_sizes_take_the_servers_units(tmp_path, capsys):
    """(--max-in-flight-bytes 8M was "invalid int value" where the server takes it)"""
    from hookserve.cli import build_parser

    args = build_parser().parse_args(
        ["batch", str(tmp_path), "--out", str(tmp_path / "o.parquet"), "--layers", "fc",
         "--max-in-flight-bytes", "8M", "--max-file-bytes", "1.5MiB", "--shard-bytes", "2G"])
    assert (args.max_in_flight_bytes, args.max_file_bytes, args.shard_bytes) == (
        8 << 20, 3 << 19, 2 << 30)


def test_a_missing_required_flag_is_one_line(capsys, tmp_path):
    err = _one_line_exit_2(capsys, ["batch", str(tmp_path), "--layers", "fc"])
    assert "--out" in err


@pytest.fixture
def no_s3_endpoint(monkeypatch):
    """S3 at an address nothing listens on, tried once."""
    s3fs = pytest.importorskip("s3fs")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.parametrize("inputs, out, extra, words", [
    (["s3://lake/{0..3}.tar"], "o.parquet", [], "cannot reach s3://lake/0.tar"),
    (["s3://lake/imgs/"], "o.parquet", [], "cannot reach s3://lake/imgs/"),
    (["LOCAL"], "s3://lake/out.parquet", [], "cannot use the output s3://lake/out.parquet"),
    (["s3://lake/0.tar"], "o.parquet", ["--storage-option", "no_such_option=1"],
     "bad --storage-option"),
    (["LIST"], "o.parquet", [], "cannot reach s3://lake/a.png"),
], ids=["tars", "prefix", "output", "unknown-option", "url-list"])
def test_a_store_that_cannot_be_used_is_one_line_exit_2(server, tar, tmp_path, capsys,
                                                        no_s3_endpoint, inputs, out,
                                                        extra, words):
    listing = tmp_path / "urls.txt"
    listing.write_text("s3://lake/a.png\ns3://lake/b.png\n")
    inputs = [{"LOCAL": tar, "LIST": str(listing)}.get(i, i) for i in inputs]
    out = out if "://" in out else str(tmp_path / out)
    t0 = time.monotonic()
    err = _one_line_exit_2(capsys, ["batch", *inputs, "--out", out, "--server",
                                    server.address, *OPTS, *extra])
    assert words in err, err
    assert time.monotonic() - t0 < 60


def test_timeout_is_the_object_stores_too():
    pytest.importorskip("s3fs")
    from hookserve.batch.remote import filesystem, set_store_timeout

    set_store_timeout(7.0)
    try:
        fs, _ = filesystem("s3://lake/x.tar", {"anon": True})
        assert fs.config_kwargs["read_timeout"] == fs.config_kwargs["connect_timeout"] == 7
        fs, _ = filesystem("s3://lake/x.tar", {"config_kwargs": {"read_timeout": 3}})
        assert fs.config_kwargs["read_timeout"] == 3  # the user's own setting wins
    finally:
        set_store_timeout(None)


_NO_PYARROW = """
import sys
sys.modules["pyarrow"] = None  # as if pyarrow were not installed
sys.modules["pyarrow.parquet"] = None
from hookserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("case", ["table-input", "image-column", "output", "sharded-output"])
def test_parquet_without_pyarrow_says_which_install_fixes_it(server, tar, tmp_path, case):
    img = tmp_path / "imgs"
    img.mkdir()
    (img / "0.png").write_bytes(encode(rand_image(32, 32)))
    table = tmp_path / "t.parquet"
    table.write_bytes(b"PAR1")  # never opened: pyarrow is missing
    argv = {"table-input": [str(table), "--out", str(tmp_path / "o")],
            "image-column": [str(table), "--image-column", "image", "--out",
                             str(tmp_path / "o")],
            "output": [str(img), "--out", str(tmp_path / "o.parquet")],
            "sharded-output": [tar, "--out", str(tmp_path / "o.parquet")]}[case]
    r = subprocess.run([sys.executable, "-c", _NO_PYARROW, "batch", *argv, "--server",
                        server.address, *OPTS], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
                       timeout=120)
    err = r.stderr.strip()
    assert r.returncode == 2, err
    assert len(err.splitlines()) == 1 and "pip install 'hookserve[batch]'" in err, err


def test_every_batch_option_has_help():
    import argparse

    sub = argparse.ArgumentParser().add_subparsers()
    p = add_batch_parser(sub)
    missing = [a.option_strings or a.dest for a in p._actions
               if not a.help or a.help == argparse.SUPPRESS]
    assert missing == []
    assert "batch" in build_parser().format_help()  # registered on the command


class _SilentServer:
    """A gRPC server that answers DescribeModel like the real one (it forwards the
    call) and takes Extract streams without ever answering: a server that hangs."""

    def __init__(self, real_address: str) -> None:
        self._ch = grpc.insecure_channel(real_address)
        describe = self._ch.unary_unary("/hookserve.v1.FeatureExtractor/DescribeModel")
        self.stop = threading.Event()

        def extract(requests, context):
            ended = threading.Event()
            context.add_callback(ended.set)
            while not (ended.is_set() or self.stop.is_set()):
                ended.wait(0.1)  # until the client cancels, or the test ends
            return iter(())

        handler = grpc.method_handlers_generic_handler("hookserve.v1.FeatureExtractor", {
            "DescribeModel": grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: describe(req, timeout=30)),
            "Extract": grpc.stream_stream_rpc_method_handler(extract)})
        from concurrent.futures import ThreadPoolExecutor
        self.server = grpc.server(ThreadPoolExecutor(8), handlers=[handler])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def close(self) -> None:
        self.stop.set()
        self.server.stop(0)
        self._ch.close()


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
def test_timeout_bounds_a_stream_that_gets_no_answer(server, tar, tmp_path, capsys,
                                                     sharded):
    silent = _SilentServer(server.address)
    folder = tmp_path / "imgs"
    folder.mkdir()
    (folder / "0.png").write_bytes(encode(rand_image(32, 32)))
    t0 = time.monotonic()
    try:
        rc = main(["batch", tar if sharded else str(folder), "--out",
                   str(tmp_path / "o.parquet"), "--server", silent.address, *OPTS,
                   "--timeout", "1", "--retries", "1"])
    finally:
        silent.close()
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert took < 30, err
    assert "(--timeout)" in (err if sharded else open(f"{tmp_path}/o.parquet.errors.csv")
                             .read()), err
    assert rc == (2 if sharded else 1), err
