"""Bulk at data-lake scale: sharded `hookserve batch` from S3 vs local disk,
the Ray Data adapter vs the local CLI, and the client's memory from 10k to 100k images.

    python bench/bulk.py                 # the full run (a few minutes on 2 cores)
    python bench/bulk.py --quick         # smaller

One `hookserve serve` subprocess (resnet18, random weights) serves every row. Each
client run is its own `hookserve batch` subprocess, timed from start to exit (planning,
describe, extraction, upload), with its peak RSS from wait4. S3 is moto's
ThreadedMotoServer in this process on 127.0.0.1 (a real S3 API over HTTP; no network
latency, so this measures the client's S3 path, not a real bucket). Images are small and
the layer cheap (64 px, layer4:avg) so that input handling, not the model, is what the
ratios compare.

Rows:
  s3_tar / local_tar       8 WebDataset tars on S3 vs the same tars on local disk
  s3_prefix / local_dir    loose images under an S3 prefix vs a local folder
  s3_raw_get               the same objects fetched with no hookserve at all (the
                           store's own rate: a ceiling for s3_prefix)
  ray / local_dir          Ray Data map_batches(HookserveMapper) over image bytes vs
                           the local CLI over the same images
  rss_10k, rss_100k        peak client RSS over 10k and 100k tiny images (100 tars)
Writes bench/results/bulk-<UTC>.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from common import HOOKSERVE_PORT_RE, RESULTS, Proc, hookserve_exe, jpeg

HOOKSERVE = hookserve_exe()
LAYERS = ["--layers", "layer4:avg", "--resize", "64", "--crop", "64", "--no-progress"]


def _tar(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def timed_batch(argv: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """-> (seconds, peak RSS MiB, stderr) of one `hookserve batch` subprocess."""
    t0 = time.perf_counter()
    p = subprocess.Popen([HOOKSERVE, "batch", *argv], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, env=env)
    err = p.stderr.read().decode()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    dt = time.perf_counter() - t0
    if p.returncode not in (0, 1):
        raise RuntimeError(f"hookserve batch {argv} exited {p.returncode}:\n{err}")
    return dt, ru.ru_maxrss / 1024, err


def start_s3():
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request

    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(env)
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir("bench")
    return srv, fs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--no-memory", action="store_true")
    a = ap.parse_args()
    n = 320 if a.quick else 960
    tars = 8
    res: dict = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "images": n,
                 "rows": {}}
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    server = Proc("hookserve", [HOOKSERVE, "serve", "--host", "127.0.0.1", "--port", "0",
                                "--model", "resnet18", "--weights", "random", "--seed", "0",
                                "--device", "cpu", "--max-batch-size", "32",
                                "--max-batch-delay-ms", "5"], HOOKSERVE_PORT_RE)
    srv = None
    try:
        srv, fs = start_s3()
        common = ["--server", server.address, *LAYERS]
        distinct = [jpeg(s, 64) for s in range(32)]
        imgs = [distinct[i % 32] for i in range(n)]
        per = n // tars
        with tempfile.TemporaryDirectory(prefix="hookserve-bulk-") as tmp:
            os.makedirs(f"{tmp}/tars")
            os.makedirs(f"{tmp}/dir")
            for t in range(tars):
                data = _tar([(f"{t:06d}{i:04d}.jpg", imgs[t * per + i]) for i in range(per)])
                Path(f"{tmp}/tars/{t:06d}.tar").write_bytes(data)
                fs.pipe(f"bench/tars/{t:06d}.tar", data)
            for i, b in enumerate(imgs):
                Path(f"{tmp}/dir/{i:06d}.jpg").write_bytes(b)
                fs.pipe(f"bench/dir/{i:06d}.jpg", b)
            brace = f"{{000000..{tars - 1:06d}}}.tar"
            timed_batch([f"{tmp}/tars/{brace}", "--out", f"{tmp}/warm.parquet", *common])
            rows = {  # {rep}: a fresh output per repetition
                "local_tar": [f"{tmp}/tars/{brace}", "--out", tmp + "/lt{rep}.parquet"],
                "s3_tar": [f"s3://bench/tars/{brace}", "--out", "s3://bench/st{rep}.parquet"],
                "local_dir": [f"{tmp}/dir", "--out", tmp + "/ld{rep}.parquet"],
                "s3_prefix": ["s3://bench/dir/", "--out", "s3://bench/sd{rep}.parquet",
                              "--listing-shards", str(tars)],
            }
            for rep in range(3):  # interleaved, best of 3 (the machine is shared)
                for name, argv in rows.items():
                    dt, rss, _ = timed_batch([*argv[:2], argv[2].format(rep=rep), *argv[3:],
                                              *common])
                    best = res["rows"].setdefault(name, {"s": dt, "rss_mib": rss})
                    if dt <= best["s"]:
                        best.update(s=dt, rss_mib=rss)
                    say(f"{name} rep {rep}: {n / dt:.1f} img/s, {rss:.0f} MiB")
            # What the store itself gives: every loose object fetched by this process,
            # 32 concurrent GETs at a time (moto is Python on the same 2 cores).
            t0 = time.perf_counter()
            for i in range(0, n, 32):
                fs.cat([f"bench/dir/{j:06d}.jpg" for j in range(i, min(n, i + 32))])
            res["rows"]["s3_raw_get"] = {"s": time.perf_counter() - t0}
            for r in res["rows"].values():
                r["img_s"] = n / r["s"]
            R = res["rows"]
            res["ratio_s3_tar"] = R["s3_tar"]["img_s"] / R["local_tar"]["img_s"]
            res["ratio_s3_prefix"] = R["s3_prefix"]["img_s"] / R["local_dir"]["img_s"]
            if not a.no_ray:
                res["rows"]["ray"] = ray_row(server.address, imgs, say)
                res["ratio_ray"] = R["ray"]["img_s"] / R["local_dir"]["img_s"]
            if not a.no_memory:
                res["memory"] = memory_rows(server.address, tmp, a.quick, say)
    finally:
        server.stop()
        if srv is not None:
            srv.stop()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"bulk-{res['time'].replace(':', '')}.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))
    for k, v in res["rows"].items():
        print(f"{k:10s} {v['img_s']:8.1f} img/s  rss {v.get('rss_mib', 0):6.0f} MiB")
    return 0


def ray_row(address: str, imgs: list[bytes], say) -> dict:
    """Ray Data over the same image bytes: from_items -> map_batches -> materialize."""
    import ray

    from hookserve.ray import HookserveMapper

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    best = None
    try:
        for rep in range(3):
            t0 = time.perf_counter()
            # the actors wait on the server: half a CPU each lets both run on 2 cores
            ds = ray.data.from_items([{"image": b} for b in imgs]).map_batches(
                HookserveMapper, concurrency=2, batch_size=64, num_cpus=0.5,
                fn_constructor_kwargs={"target": address, "layers": ["layer4"],
                                       "reduction": "avg", "resize": 64, "crop": 64})
            n = ds.materialize().count()
            dt = time.perf_counter() - t0
            say(f"ray rep {rep}: {n / dt:.1f} img/s (actor start-up included)")
            best = dt if best is None else min(best, dt)
    finally:
        ray.shutdown()
    return {"s": best, "img_s": len(imgs) / best}


def memory_rows(address: str, tmp: str, quick: bool, say) -> dict:
    """Peak client RSS over 10k and 100k tiny images (1000 per tar), layer1:avg."""
    tiny = jpeg(0, 16)
    out = {}
    sizes = (2000, 20000) if quick else (10000, 100000)
    for total in sizes:
        folder = f"{tmp}/mem{total}"
        os.makedirs(folder)
        for t in range(total // 1000):
            Path(f"{folder}/{t:06d}.tar").write_bytes(
                _tar([(f"{t:06d}{i:04d}.jpg", tiny) for i in range(1000)]))
        dt, rss, _ = timed_batch([f"{folder}/{{000000..{total // 1000 - 1:06d}}}.tar",
                                  "--out", f"{folder}.parquet", "--server", address,
                                  "--layers", "layer1:avg", "--resize", "16", "--crop", "16",
                                  "--no-progress"])
        out[f"rss_mib_{total}"] = rss
        out[f"img_s_{total}"] = total / dt
        say(f"memory {total}: {rss:.0f} MiB peak, {total / dt:.0f} img/s")
    return out


if __name__ == "__main__":
    sys.exit(main())
