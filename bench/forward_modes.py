"""The model's forward alone, in each execution mode, side by side in one process.

    python bench/forward_modes.py                        # resnet50 -> avgpool, CPU
    python bench/forward_modes.py --device cuda --batch 1 64
    python bench/forward_modes.py --modes eager,compiled --batch 8

Each mode runs the same pruned graph (resnet50 truncated after ``--layer``, as an
extraction of that layer does) on the same random input. Rows: images/s per batch
size, the first call's time (compile warm-up for compiled modes), and the largest
difference from eager fp32 relative to eager's largest magnitude. Rounds alternate the
modes so drift hits all of them. Writes bench/results/<UTC>-forward.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torchvision.models import get_model
from torchvision.models.feature_extraction import create_feature_extractor

MODES = {
    # name: (dtype, channels_last, compiled, autocast)
    "eager": (torch.float32, False, False, False),
    "eager_cl": (torch.float32, True, False, False),
    "compiled": (torch.float32, False, True, False),
    "compiled_cl": (torch.float32, True, True, False),
    "bf16_autocast": (torch.float32, False, False, True),
    "bf16_autocast_cl": (torch.float32, True, False, True),
    "bf16_compiled": (torch.float32, False, True, True),
    "fp16": (torch.float16, False, False, False),
    "fp16_cl": (torch.float16, True, False, False),
    "fp16_compiled_cl": (torch.float16, True, True, False),
    "fp16_graphs_cl": (torch.float16, True, "reduce-overhead", False),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(arch: str, layer: str, mode: str, device: torch.device):
    dtype, cl, compiled, autocast = MODES[mode]
    torch.manual_seed(0)
    m = create_feature_extractor(get_model(arch, weights=None).eval(), [layer])
    m = m.to(device=device, dtype=dtype)
    if cl:
        m = m.to(memory_format=torch.channels_last)
    fn = m
    if compiled:
        if device.type == "cpu":
            import torch._inductor.config as ic

            # inductor's settings are per thread; this thread compiles (on its first
            # call). torch.compile(options={"freezing": True}) would not freeze.
            ic.freezing = True
        # "reduce-overhead" replays CUDA graphs (CUDA only).
        fn = torch.compile(m, mode=compiled if isinstance(compiled, str) else None)

    def run(x: torch.Tensor) -> torch.Tensor:
        x = x.to(device=device, dtype=dtype)
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.inference_mode():
            if autocast:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    return fn(x)[layer].float()
            return fn(x)[layer].float()
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--layer", default="avgpool")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--side", type=int, default=224)
    ap.add_argument("--modes", default=None, help="comma list (default: all for the device)")
    ap.add_argument("--seconds", type=float, default=3.0, help="timed per mode and batch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    device = torch.device(a.device)
    modes = a.modes.split(",") if a.modes else [
        m for m in MODES if device.type == "cuda" or not m.startswith("fp16")]
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    gen = torch.Generator().manual_seed(1)
    xs = {b: torch.randn(b, 3, a.side, a.side, generator=gen) for b in a.batch}
    runs, first, diff = {}, {}, {}
    ref = build(a.arch, a.layer, "eager", device)
    want = {b: ref(x).cpu() for b, x in xs.items()}
    for mode in modes:
        runs[mode] = build(a.arch, a.layer, mode, device)
        for b, x in xs.items():
            t0 = time.perf_counter()
            got = runs[mode](x).cpu()
            sync(device)
            first[(mode, b)] = time.perf_counter() - t0
            scale = float(want[b].abs().max()) or 1.0
            diff[(mode, b)] = float((got - want[b]).abs().max()) / scale
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(a.rounds):
        for mode in modes:
            for b, x in xs.items():
                x_dev = x.to(device)
                runs[mode](x_dev)
                sync(device)
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < a.seconds / a.rounds:
                    runs[mode](x_dev)
                    n += 1
                sync(device)
                rates.setdefault((mode, b), []).append(n * b / (time.perf_counter() - t0))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{a.arch} -> {a.layer}, {a.side}px, {name}, torch {torch.__version__}")
    print(f"{'mode':<18}" + "".join(f"{'b' + str(b) + ' img/s':>12}" for b in a.batch)
          + f"{'first call s':>14}{'max rel diff':>14}")
    rows = []
    for mode in modes:
        r = [statistics.median(rates[(mode, b)]) for b in a.batch]
        f = max(first[(mode, b)] for b in a.batch)
        d = max(diff[(mode, b)] for b in a.batch)
        print(f"{mode:<18}" + "".join(f"{v:>12.1f}" for v in r) + f"{f:>14.2f}{d:>14.1e}")
        rows.append({"mode": mode, "img_s": dict(zip(map(str, a.batch), r, strict=True)),
                     "first_call_s": f, "max_rel_diff": d})
    out = a.out or (Path(__file__).parent / "results"
                    / time.strftime("%Y%m%dT%H%M%SZ-forward.json", time.gmtime()))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"arch": a.arch, "layer": a.layer, "device": name,
                               "torch": torch.__version__, "side": a.side, "rows": rows},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
