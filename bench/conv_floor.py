"""How close a frozen, compiled graph's convolutions run to the CPU's limit, at batch 1.

    .venv/bin/python -m bench.conv_floor                  # resnet50 -> layer4, 224 px
    .venv/bin/python -m bench.conv_floor --model resnet18 --winograd

The graph is the one `--compile auto --memory-format channels_last` serves for a layer
set (inductor, freezing, channels_last; seeded random weights). Prints the time of one
call, the oneDNN convolutions' share of it (torch.profiler), each convolution shape's
multiply-adds per second, and, for scale, the BLAS matrix product's rate on the same
threads. `--winograd` also times Winograd's F(2x2, 3x3), written as torch operations
and compiled the same way, against the direct 3x3 convolution at the shapes of a
ResNet's stages: the multiplications it saves against what its transforms cost.
"""

from __future__ import annotations

import argparse
import statistics
import time
from math import prod

import torch
import torch._inductor.config as inductor
from torchvision.models import get_model
from torchvision.models.feature_extraction import create_feature_extractor


def median_ms(fn, x, n: int) -> float:
    for _ in range(5):
        fn(x)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn(x)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def conv_macs(model: torch.nn.Module, x: torch.Tensor) -> dict[tuple, int]:
    """(input shape, weight shape) -> multiply-adds, from one eager pass."""
    macs: dict[tuple, int] = {}

    def hook(mod, args, out):
        w = mod.weight
        key = (tuple(args[0].shape), tuple(w.shape))
        macs[key] = prod(out.shape[1:]) * (w.shape[1] * w.shape[2] * w.shape[3])
    hs = [m.register_forward_hook(hook) for m in model.modules()
          if isinstance(m, torch.nn.Conv2d)]
    model(x)
    for h in hs:
        h.remove()
    return macs


BT = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]
G = [[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]]
AT = [[1, 1, 1, 0], [0, 1, -1, -1]]


class Winograd(torch.nn.Module):
    """A 3x3, stride 1, padding 1 convolution as Winograd's F(2x2, 3x3)."""

    def __init__(self, conv: torch.nn.Conv2d):
        super().__init__()
        w = conv.weight.detach()
        self.register_buffer("bt", torch.tensor(BT, dtype=torch.float32))
        self.register_buffer("at", torch.tensor(AT, dtype=torch.float32))
        g = torch.tensor(G, dtype=torch.float32)
        u = torch.einsum("ak,oikl,bl->abio", g, w, g)   # [4, 4, in, out]
        self.register_buffer("u", u.reshape(16, w.shape[1], w.shape[0]).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        th, tw = (h + 1) // 2, (w + 1) // 2
        xp = torch.nn.functional.pad(x, (1, 2 * tw + 1 - w, 1, 2 * th + 1 - h))
        d = xp.unfold(2, 4, 2).unfold(3, 4, 2)            # [n, c, th, tw, 4, 4]
        v = torch.einsum("ak,nctwkl,bl->abntwc", self.bt, d, self.bt)
        m = torch.bmm(v.reshape(16, n * th * tw, c), self.u)
        m = m.reshape(4, 4, n, th, tw, -1)
        y = torch.einsum("ia,abntwo,jb->notiwj", self.at, m, self.at)
        return y.reshape(n, -1, 2 * th, 2 * tw)[:, :, :h, :w]


def winograd_rows(n: int) -> None:
    print("\n3x3 convolution, batch 1: direct (oneDNN) against Winograd F(2x2, 3x3), "
          "both compiled")
    print(f"{'channels @ side':<18}{'direct us':>11}{'winograd us':>13}{'rel. diff':>11}")
    for c, side in ((64, 56), (128, 28), (256, 14), (512, 7)):
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(c, c, 3, padding=1, bias=False).eval()
        conv = conv.to(memory_format=torch.channels_last)
        x = torch.randn(1, c, side, side).contiguous(memory_format=torch.channels_last)
        ref = conv(x)
        direct, wino = torch.compile(conv), torch.compile(Winograd(conv))
        diff = ((wino(x) - ref).abs().max() / ref.abs().max()).item()
        print(f"{f'{c} @ {side}':<18}{median_ms(direct, x, n) * 1e3:>11.0f}"
              f"{median_ms(wino, x, n) * 1e3:>13.0f}{diff:>11.1e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--layer", default="layer4")
    ap.add_argument("--side", type=int, default=224)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=60, help="timed calls per figure")
    ap.add_argument("--winograd", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    inductor.freezing = True
    torch.manual_seed(0)
    model = get_model(a.model, weights=None).eval()
    x = torch.randn(1, 3, a.side, a.side).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        m = create_feature_extractor(model, [a.layer]).to(memory_format=torch.channels_last)
        macs = conv_macs(m, x)
        fn = torch.compile(m)
        t0 = time.perf_counter()
        fn(x)
        print(f"{a.model} -> {a.layer}, batch 1, {a.side} px, {a.threads} threads: "
              f"compiled in {time.perf_counter() - t0:.1f} s")
        call = median_ms(fn, x, a.calls)
        with torch.profiler.profile(record_shapes=True) as prof:
            for _ in range(a.calls):
                fn(x)
        per_shape: dict[tuple, list[float]] = {}
        events = prof.key_averages(group_by_input_shape=True)
        profiled = sum(e.self_cpu_time_total for e in events) / a.calls / 1e3
        for e in events:
            if not e.key.startswith("mkldnn::_convolution"):
                continue
            shapes = [tuple(s) for s in e.input_shapes if len(s) == 4]
            key = next(((i, w) for i in shapes for w in shapes if (i, w) in macs), None)
            if key is not None:
                row = per_shape.setdefault(key, [0.0, 0])
                row[0] += e.self_cpu_time_total / a.calls / 1e3   # ms per call of the graph
                row[1] += e.count // a.calls
        conv_ms = sum(ms for ms, _ in per_shape.values())
        total = sum(macs[k] * k_n for k, (_, k_n) in per_shape.items())
        print(f"one call (median): {call:.2f} ms; under the profiler {profiled:.2f} ms, "
              f"of which the convolutions {conv_ms:.2f} ms ({conv_ms / profiled:.0%}): "
              f"{total / 1e9:.2f} G multiply-adds, {total / conv_ms / 1e6:.0f} G/s")
        print(f"\n{'input -> weight':<40}{'calls':>6}{'ms':>8}{'G mult-add/s':>14}")
        for (i, w), (ms, k_n) in sorted(per_shape.items(), key=lambda r: -r[1][0]):
            rate = macs[(i, w)] * k_n / ms / 1e6
            print(f"{f'{list(i[1:])} -> {list(w)}':<40}{k_n:>6}{ms:>8.2f}{rate:>14.0f}")
        side = 2048
        p, q = torch.randn(side, side), torch.randn(side, side)
        mm = median_ms(lambda t: t @ q, p, 5)
        print(f"\nfor scale: torch.mm {side}x{side}, {a.threads} threads: "
              f"{side ** 3 / mm / 1e6:.0f} G multiply-adds/s")
        if a.winograd:
            winograd_rows(a.calls)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
