"""Attribution maps for a batch, computed pass by pass: Grad-CAM, HiResCAM, LayerCAM at
a tapped layer; input gradient, gradient x input, Integrated Gradients and SmoothGrad
at the input.

torch only, run on the model's thread. The batch shares one spec; targets differ per
image. Its work is a list of *rows*: one image at one point of its path (the image
itself; an Integrated Gradients point between the baseline and the image; a
SmoothGrad noisy copy, or the clean forward that picks its targets). A *pass* is one
forward of up to `PassPlan.rows` rows stacked into one tensor, then one backward per
target slot of the pass (`PassPlan.slots` of the image's k slots; top_k above that
runs in slot groups, each with its own forward). Between passes the job keeps only
each image's input and its accumulated maps, so the model's thread can run other
work (and check the call's cancel and deadline) between any two passes.

Scores of a pass's rows are summed into one scalar per slot, so one backward serves
the pass: in eval mode a row's score depends on no other row, so d(sum)/d(row) =
d(score_row)/d(row). Rows run in a fixed order (slot group, then point, then image),
so a map does not depend on how its work is cut into passes beyond float rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..attribution_spec import AttributionSpec, Baseline, ClassScore, Method, Score, TargetResult
from .tap import Tap

#: How many classes the answer's top list holds.
TOP = 5


@dataclass
class ImageAttribution:
    """One image's answer: its map (float32, CPU) and what it explains."""

    map: torch.Tensor
    targets: list[TargetResult]
    top5: list[ClassScore]


@dataclass(frozen=True)
class PassPlan:
    """How a job's work is cut: rows per pass, target slots per pass."""

    rows: int
    slots: int


def _cam(method: Method, act: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """[N, C, h, w] activation and gradient -> [N, h, w] map (before any ReLU)."""
    if method is Method.GRAD_CAM:
        alpha = grad.mean(dim=(2, 3), keepdim=True)
        return (alpha * act).sum(dim=1)
    if method is Method.HIRES_CAM:
        return (grad * act).sum(dim=1)
    return (grad.clamp_min(0) * act).sum(dim=1)  # LAYER_CAM


class AttributionJob:
    """The maps of one batch `x` [N, 3, H, W] (normalised, the model's dtype and
    layout), computed one pass per `run_pass()` call.

    `explicit[i]` is image i's target class or None (its top_k by logit). `tap` is the
    CAM methods' layer; `black` the normalised black pixel [1, 3, 1, 1] (BLACK
    baseline). Targets must already be valid class indices.
    """

    def __init__(self, model: nn.Module, x: torch.Tensor, spec: AttributionSpec,
                 explicit: list[int | None], plan: PassPlan, *, tap: Tap | None = None,
                 black: torch.Tensor | None = None,
                 grid: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.model, self.x, self.spec, self.explicit = model, x, spec, explicit
        self.tap, self._black = tap, black
        #: the tapped layer's batch as [N, C, h, w] (layouts.to_grid); None: it is
        self._grid = grid
        self.n = x.shape[0]
        self.k = spec.targets_per_image
        self.plan = plan
        method = spec.method
        self._sg = method is Method.SMOOTH_GRAD
        self._ig = method is Method.INTEGRATED_GRADIENTS
        #: points of one image's path: the IG points x -> baseline, or SmoothGrad's clean
        #: forward (point 0) then its samples; one (the image) otherwise
        self.points = spec.passes + (1 if self._sg else 0)
        self.groups = -(-self.k // plan.slots)
        self._layout = (torch.channels_last if x.is_contiguous(memory_format=torch.channels_last)
                        and not x.is_contiguous() else torch.contiguous_format)
        self.base = None
        if self._ig:  # [3, 1, 1], or a zero scalar
            self.base = (black.to(x.dtype).reshape(-1, 1, 1) if spec.ig_baseline is
                         Baseline.BLACK and black is not None
                         else torch.zeros((), dtype=x.dtype, device=x.device))
        self.targets: list[torch.Tensor | None] = [None] * self.n   # [k] long per image
        self.logits: list[torch.Tensor | None] = [None] * self.n    # [classes] float32
        self.acc: list[torch.Tensor | None] = [None] * self.n       # [k, *map] float32
        #: Integrated Gradients: scores at the image and at the baseline, [k] each
        self.f_x: list[torch.Tensor | None] = [None] * self.n
        self.f_0: list[torch.Tensor | None] = [None] * self.n
        self._gens: list[torch.Generator] = []
        self._wide: list[np.random.Generator] = []
        self._sigma: torch.Tensor | None = None
        self._cursor = (0, 0, 0)  # the next row: (slot group, point, image)
        #: passes run so far
        self.passes = 0

    def restart(self, rows: int) -> None:
        """Start over with `rows` rows a pass (after running out of memory)."""
        self.__init__(self.model, self.x, self.spec, self.explicit,
                      PassPlan(rows, self.plan.slots), tap=self.tap, black=self._black,
                      grid=self._grid)

    # -- the schedule ----------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._cursor[0] >= self.groups

    def _advance(self, q: int, p: int, i: int) -> tuple[int, int, int]:
        i += 1
        if i == self.n:
            i, p = 0, p + 1
            if p == self.points:
                q, p = q + 1, (1 if self._sg else 0)  # the clean forward runs once
        return q, p, i

    def total_passes(self) -> int:
        """Passes of the whole job (SmoothGrad's clean forwards included)."""
        rows = self.n * self.points
        per_group = -(-rows // self.plan.rows)
        if not self._sg:
            return self.groups * per_group
        clean = -(-self.n // self.plan.rows)
        samples = -(-(rows - self.n) // self.plan.rows)
        return clean + self.groups * samples

    def _next_rows(self) -> tuple[int, list[tuple[int, int]]]:
        """The next pass: its slot group and rows (point, image). A pass never mixes slot
        groups, nor SmoothGrad's clean forwards with its samples."""
        q, p, i = self._cursor
        group = q
        clean = self._sg and p == 0
        rows = []
        while q == group and len(rows) < self.plan.rows and (self._sg and p == 0) == clean:
            rows.append((p, i))
            q, p, i = self._advance(q, p, i)
        self._cursor = (q, p, i)
        return group, rows

    # -- one pass --------------------------------------------------------------------------
    def run_pass(self) -> bool:
        """Run the next pass; True once the job's work is done."""
        group, rows = self._next_rows()
        if self._sg and rows[0][0] > 0 and rows[0] == (1, 0):
            self._start_noise()  # each slot group replays the same noise
        with torch.enable_grad():
            if self._sg and rows[0][0] == 0:
                with torch.no_grad():
                    logits = self.model(self.x[[i for _, i in rows]])
                self._choose(rows, logits)
            else:
                self._gradients(group, rows)
        self.passes += 1
        return self.done

    def _row_input(self, p: int, i: int, out: torch.Tensor) -> None:
        """Write row (point p, image i)'s input into `out` [3, H, W]."""
        xi = self.x[i]
        if self._ig:
            steps = self.spec.ig_steps
            out.copy_(self.base + (xi - self.base) * ((steps - p) / steps))
        elif self._sg:
            if self._wide:   # (a 64-bit seed: numpy's PCG64 takes every bit)
                noise = torch.from_numpy(self._wide[i].standard_normal(
                    tuple(xi.shape), dtype=np.float32))
            else:
                noise = torch.randn(xi.shape, generator=self._gens[i])
            noise.mul_(self._sigma[i])
            out.copy_(xi + noise.to(xi.device, xi.dtype))
        else:
            out.copy_(xi)

    def _start_noise(self) -> None:
        """Fresh per-image generators seeded with sg_seed, drawn sample by sample: the
        noise is independent of the batch, the passes and the device."""
        # torch's CPU generator is seeded with the seed's low 32 bits alone: a seed of
        # 2**32 or more draws from numpy's PCG64, seeded with all 64 (seeds below 2**32
        # draw from torch, as they always did)
        seed = self.spec.sg_seed
        if seed >> 32:
            self._gens, self._wide = [], [np.random.default_rng(seed) for _ in range(self.n)]
        else:
            self._gens = [torch.Generator().manual_seed(seed) for _ in range(self.n)]
            self._wide = []
        if self._sigma is None:
            flat = self.x.float().flatten(1)
            self._sigma = ((flat.amax(dim=1) - flat.amin(dim=1)) * self.spec.sg_sigma).cpu()

    def _choose(self, rows: list[tuple[int, int]], logits: torch.Tensor) -> None:
        """Targets of the rows' images that have none yet, from this (clean) forward:
        the explicit one, else the top k by logit."""
        logits = logits.detach().float()
        for r, (_, i) in enumerate(rows):
            if self.targets[i] is None:
                t = logits[r].topk(self.k).indices
                if self.explicit[i] is not None:
                    t[0] = self.explicit[i]
                self.targets[i], self.logits[i] = t, logits[r].clone()

    def _gradients(self, group: int, rows: list[tuple[int, int]]) -> None:
        x = self.x
        inp = torch.empty((len(rows), *x.shape[1:]), dtype=x.dtype, device=x.device,
                          memory_format=self._layout)
        for r, (p, i) in enumerate(rows):
            self._row_input(p, i, inp[r])
        cam = self.spec.method.is_cam
        if not cam:
            inp.requires_grad_(True)
        tap = self.tap
        if tap is not None:
            with tap:
                logits = self.model(inp)
            leaf = tap.take()
        else:
            logits = self.model(inp)
            leaf = inp
        firsts = [r for r, (p, _) in enumerate(rows) if p == 0]
        if group == 0 and not self._sg and firsts:  # the image itself picks the targets
            self._choose([rows[r] for r in firsts], logits[firsts])
        s = logits.float()
        if self.spec.score is Score.SOFTMAX:
            s = s.softmax(dim=1)
        lo = group * self.plan.slots
        hi = min(self.k, lo + self.plan.slots)
        slots = torch.stack([self.targets[i][lo:hi] for _, i in rows])
        scores = s.gather(1, slots)
        del logits, s
        grid = self._grid or (lambda t: t)
        act = grid(leaf.detach().float()) if cam else None
        for j in range(hi - lo):
            (g,) = torch.autograd.grad(scores[:, j].sum(), leaf, retain_graph=j < hi - lo - 1)
            if cam:
                g = _cam(self.spec.method, act, grid(g.float()))
            self._accumulate(rows, lo + j, g)
            del g
        if self._ig:
            self._record_ends(rows, lo, hi, scores.detach())
        if tap is not None:
            tap.activation = None

    def _accumulate(self, rows: list[tuple[int, int]], slot: int, g: torch.Tensor) -> None:
        """Add slot `slot`'s gradient (or CAM map) of each row to its image's map."""
        method = self.spec.method
        for r, (p, i) in enumerate(rows):
            acc = self.acc[i]
            if acc is None:
                acc = self.acc[i] = torch.zeros((self.k, *g.shape[1:]), dtype=torch.float32,
                                                device=g.device)
            if method is Method.INTEGRATED_GRADIENTS:
                acc[slot].add_(g[r], alpha=0.5 if p in (0, self.spec.ig_steps) else 1.0)
            elif method is Method.SMOOTH_GRAD:
                acc[slot].add_(g[r])
            elif method is Method.GRADIENT_X_INPUT:
                torch.mul(g[r].float(), self.x[i].float(), out=acc[slot])
            else:
                acc[slot].copy_(g[r])

    def _record_ends(self, rows, lo: int, hi: int, scores: torch.Tensor) -> None:
        """Integrated Gradients: the scores at the image (point 0) and the baseline."""
        steps = self.spec.ig_steps
        for r, (p, i) in enumerate(rows):
            for ends, at in ((self.f_x, 0), (self.f_0, steps)):
                if p == at:
                    if ends[i] is None:
                        ends[i] = torch.zeros(self.k, dtype=torch.float32,
                                              device=scores.device)
                    ends[i][lo:hi] = scores[r]

    # -- the answers -----------------------------------------------------------------------
    def finish(self) -> list[ImageAttribution]:
        """Per image, in place on its accumulated maps: the method's last step,
        post-processing (ReLU, min-max, upsample) and the answer. Frees the job's
        state as it goes."""
        out = []
        for i in range(self.n):
            out.append(self._finish_one(i))
            self.acc[i] = None
        self.x = None
        return out

    def _finish_one(self, i: int) -> ImageAttribution:
        spec = self.spec
        maps = self.acc[i]
        delta = None
        if self._ig:
            maps.div_(spec.ig_steps).mul_((self.x[i] - self.base).float())
            delta = (maps.flatten(1).sum(dim=1) - (self.f_x[i] - self.f_0[i])).tolist()
        elif self._sg:
            maps.div_(spec.sg_samples)
        if spec.apply_relu:
            maps.clamp_min_(0)
        flat = maps.flatten(1)
        lo, hi = flat.amin(dim=1), flat.amax(dim=1)
        if spec.normalize:
            view = (self.k, *([1] * (maps.dim() - 1)))
            span = (hi - lo).view(view)
            maps.sub_(lo.view(view)).div_(span.clamp_min(1e-30))
            maps.masked_fill_(~(span > 0), 0.0)
        if spec.upsample and spec.method.is_cam:
            maps = F.interpolate(maps[None], size=tuple(self.x.shape[2:]), mode="bilinear",
                                 align_corners=False)[0]
        if spec.top_k <= 1:
            maps = maps.squeeze(0)
        maps = maps.detach().cpu().contiguous()
        logits = self.logits[i]
        probs = logits.softmax(dim=0)
        top_p, top_i = probs.topk(min(TOP, probs.shape[0]))
        tgt = self.targets[i]
        tl, tp = logits[tgt].tolist(), probs[tgt].tolist()
        lo, hi = lo.tolist(), hi.tolist()
        targets = [TargetResult(ClassScore(c, tl[j], tp[j]), lo[j], hi[j],
                                delta[j] if delta is not None else None)
                   for j, c in enumerate(tgt.tolist())]
        top5 = [ClassScore(c, lg, pr) for c, lg, pr in
                zip(top_i.tolist(), logits[top_i].tolist(), top_p.tolist(), strict=True)]
        return ImageAttribution(maps, targets, top5)


def attribute(model: nn.Module, x: torch.Tensor, spec: AttributionSpec,
              explicit: list[int | None], plan: PassPlan | None = None, *,
              tap: Tap | None = None, black: torch.Tensor | None = None
              ) -> list[ImageAttribution]:
    """All passes of a job at once (the whole batch per pass unless `plan` says)."""
    if plan is None:
        plan = PassPlan(rows=x.shape[0], slots=spec.targets_per_image)
    job = AttributionJob(model, x, spec, explicit, plan, tap=tap, black=black)
    while not job.run_pass():
        pass
    return job.finish()
