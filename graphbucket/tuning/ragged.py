"""The ragged switch of a tuned ladder: from which imbalance a batch replays a balanced graph.

A bucket's ``balanced_imbalance`` t sends a batch of two or more rows to the balanced graph
when ``max_len x live >= t x total tokens`` (``imbalance`` below; a uniform batch has 1).
Whether balanced beats the ladder's split-KV graph depends on the kernels at hand (the
heads, the cache format, the GPU), so the tuner times both on ragged mixes of its own and
``choose_imbalance`` picks the threshold with the smallest worst ratio to the faster of the
two (0: balanced never pays), for all batch sizes at once or per capture size
(``choose_by_batch``: which plan wins changes with the rows), and per length range of the
longest request (``choose_switches`` over ``ragged_ranges``: at one imbalance balanced
loses at 8K and wins at 128K). Where the backend offers more than one balanced kernel,
each is timed on every mix, and per capture size and length range the kernel (or, with a
cost model, the pair; ``Bucket.balanced_kernels``) is chosen together with the switch,
against the fastest plan timed per mix, over the range's mixes and its neighbours'. The
mixes differ from ``bench/ladder_oracle.py``'s, which then checks the choice out of sample.
Host arithmetic only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from graphbucket.bucket import DEFAULT_BALANCED_KERNEL, kernel_changes
from graphbucket.tuning.kernel_pairs import best_pair, choose_kernel_pairs, faster_kernel

# Within the kernel timing's spread the decode step ranks a uniform batch's split-KV plan
# ahead of the balanced one (bench/NOTES.md, "uniform batches in the step"): a uniform batch
# needs a balanced win larger than this to switch.
UNIFORM_MARGIN = 1.03

# A range's balanced kernel (or pair) is chosen over its own mixes and those of this many
# ranges on each side (its threshold over its own), each option ranked first by its mean
# ratio to the fastest plan timed ("mean"; then its worst) or by its worst ("worst"). A
# handful of mixes per range and capture size decides between kernels a few per cent
# apart: alone, or by their worst mix, the choice loses more often on mixes it did not see
# (bench/experiments/switch_replay.py --held-out).
KERNEL_NEIGHBOUR_RANGES = 1
KERNEL_SCORE = "mean"
KERNEL_SCORES = ("worst", "mean")


def imbalance(lens: Sequence[int]) -> float:
    """Longest x live requests / total tokens (the selector's measure; 1 when uniform)."""
    live = [n for n in lens if n > 0]
    return max(live) * len(live) / sum(live) if live else 1.0


def tuner_mixes(batch: int, top: int, *, above: int, lengths: int = 1
                ) -> list[tuple[str, list[int]]]:
    """Ragged length mixes the tuner times at ``batch`` rows for the lengths ``(above,
    top]``, their longest request inside that range: at 3/4 of ``top``, or halfway between
    ``above`` and ``top`` where 3/4 falls below the range (a range cut at a bucket edge).
    One long request among short ones (512 tokens), a quarter long (the rest 2048), half
    long (the rest 4096), a spread from 1 token, and every request long (uniform: where
    balanced beats split-KV even there, the switch may send every batch of the range to
    it); a short length that would reach the long one is a fraction of it instead (1/8,
    1/4, 1/2). ``lengths=2``: the same mixes again with the longest request at 15/16 of
    ``top`` (named ``<mix>@15/16``; not where that is not above the first length), for a
    range whose best balanced kernel changes between its middle and its top. None at one
    row, or when ``top`` is not above ``above``."""
    if batch < 2 or top <= above:
        return []
    if lengths not in (1, 2):
        raise ValueError(f"lengths must be 1 or 2 (mixes per range), got {lengths!r}")
    long = max(top * 3 // 4, (above + top + 1) // 2)
    out, second = _mixes_at(batch, long), top - top // 16
    if lengths == 2 and second > long:  # a narrow range has one length
        out += [(f"{name}@15/16", lens) for name, lens in _mixes_at(batch, second)]
    return out


def _mixes_at(batch: int, long: int) -> list[tuple[str, list[int]]]:
    """``tuner_mixes``' five mixes with the longest request at ``long``."""
    few = max(1, batch // 4)

    def short(length: int, share: int) -> int:  # below the long request in short ranges
        return length if length < long else max(1, long // share)

    mixes = [("one-long", [long] + [short(512, 8)] * (batch - 1)),
             ("quarter-long", [long] * few + [short(2048, 4)] * (batch - few)),
             ("half-long", [long] * (batch // 2) + [short(4096, 2)] * (batch - batch // 2)),
             ("spread", [1 + (long - 1) * i // (batch - 1) for i in range(batch)]),
             ("uniform", [long] * batch)]
    seen, out = set(), []
    for name, lens in mixes:  # at two rows one-long and half-long coincide
        key = tuple(sorted(lens))
        if key not in seen:
            seen.add(key)
            out.append((name, lens))
    return out


def ragged_ranges(bounds: Sequence[int], above: int, *, start: int | None = None
                  ) -> list[tuple[int, int]]:
    """The length ranges ``(lo, hi]`` the ragged switch is chosen for: each bucket ending
    above ``above`` cut at the powers of two inside it, the ranges that end above ``above``.
    One bucket's hint may serve 6K to 128K, and whether balanced beats split-KV at one
    imbalance changes over that span (short requests: the planner and the merge are most of
    the balanced step). ``start`` below ``above``: the lengths ``(start, above]`` too, cut
    at powers of two whatever the buckets (below ``above`` they are narrow, and a range
    per bucket would multiply the mixes to time)."""
    out, lo = [], 0
    top = bounds[-1] if bounds else 0
    if start is not None and start < above:
        edges = [start, *[1 << k for k in range(start.bit_length(), above.bit_length())
                          if start < 1 << k < above], above]
        out += [(a, min(b, top)) for a, b in zip(edges[:-1], edges[1:], strict=True) if a < top]
    for hi in bounds:
        if hi > above:
            cuts = [1 << k for k in range(lo.bit_length(), hi.bit_length()) if lo < 1 << k < hi]
            edges = [lo, *cuts, hi]
            out += [(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > above]
        lo = hi
    return out


def range_of(ranges: Sequence[tuple[int, int]], length: int) -> int | None:
    """Index of the range holding ``length``, or None."""
    return next((i for i, (lo, hi) in enumerate(ranges) if lo < length <= hi), None)


@dataclass(frozen=True, slots=True)
class RaggedSwitch:
    """The switch chosen for lengths ``(lo, hi]``: the threshold from the smallest batch
    size, the batch sizes from which it changes (``Bucket.batch_imbalance``), and the
    balanced kernel from each batch size where it is not the backend's default
    (``Bucket.balanced_kernels``), and the second balanced kernel from each batch size where
    it changes (``Bucket.alternate_kernels``; "" for none)."""

    lo: int
    hi: int
    threshold: float
    by_batch: tuple[tuple[int, float], ...] = ()
    kernels: tuple[tuple[int, str], ...] = ()
    alternates: tuple[tuple[int, str], ...] = ()

    def kernel_for(self, batch: int) -> str:
        """The balanced kernel a capture size ``batch`` runs in this range."""
        listed = [k for b, k in self.kernels if b <= batch]
        return listed[-1] if listed else DEFAULT_BALANCED_KERNEL

    def alternate_for(self, batch: int) -> str | None:
        """The second balanced kernel of capture size ``batch`` in this range, or None."""
        listed = [k for b, k in self.alternates if b <= batch]
        return (listed[-1] if listed else "") or None

    def to_dict(self) -> dict[str, Any]:
        out = {"lo": self.lo, "hi": self.hi, "balanced_imbalance": self.threshold,
               "batch_imbalance": {str(b): t for b, t in self.by_batch}}
        if self.kernels:
            out["balanced_kernels"] = {str(b): k for b, k in self.kernels}
        if self.alternates:
            out["alternate_kernels"] = {str(b): k for b, k in self.alternates}
        return out


def _choose_range(samples: Sequence[RaggedSample], model: Any = None,
                  kernel_pool: Sequence[RaggedSample] | None = None, score: str | None = None
                  ) -> tuple[RaggedSwitch, list[float], list[float]]:
    """Per capture size, the balanced kernel (a pair of them, with a cost model) chosen
    together with a threshold (``_choose_batch``) over ``kernel_pool``'s samples of that
    size (default: this range's), then the threshold for that kernel over this range's
    samples; the switch (with lo = hi = 0), the ratio of each sample under it to the faster
    of split-KV and the balanced kernel it replays, and to the fastest plan timed on it
    (split-KV or any balanced kernel)."""
    kernels: dict[int, str] = {}
    alternates: dict[int, str] = {}
    chosen: dict[int, float] = {}
    ratios: list[float] = []
    to_fastest: list[float] = []
    pool = samples if kernel_pool is None else kernel_pool
    for batch in sorted({s.batch for s in samples}):
        mine = [s for s in samples if s.batch == batch]
        main, alt, _, _ = _choose_batch([s for s in pool if s.batch == batch], batch, model,
                                        score=score)
        replayed = [s.with_kernel(faster_kernel(model, batch, s.lens, main, alt)) for s in mine]
        fastest = [fastest_us(s) for s in mine]
        threshold = choose_imbalance(replayed, best=fastest)[0]
        kernels[batch], alternates[batch], chosen[batch] = main, alt, threshold
        ratios += ratios_at(replayed, threshold)
        to_fastest += ratios_at(replayed, threshold, fastest)
    batches = sorted(chosen)
    t, by, last = chosen[batches[0]], {}, chosen[batches[0]]
    for b in batches[1:]:
        if chosen[b] != last:
            by[b] = last = chosen[b]
    if t == 1.0:  # balanced for every batch, uniform ones too: from the smallest size timed
        by = {batches[0]: 1.0, **by}  # (one row was not), not below it
        t = 0.0
    return RaggedSwitch(0, 0, t, tuple(sorted(by.items())), kernel_changes(kernels),
                        kernel_changes(alternates, start="")), ratios, to_fastest


def _check_score(score: str | None) -> str:
    score = KERNEL_SCORE if score is None else score
    if score not in KERNEL_SCORES:
        raise ValueError(f"kernel score must be one of {KERNEL_SCORES}, got {score!r}")
    return score


def fastest_us(sample: RaggedSample) -> float:
    """The fastest plan timed on a mix: split-KV or any balanced kernel."""
    return min(sample.split_us, *sample.kernel_us().values())


def _choose_batch(samples: Sequence[RaggedSample], batch: int, model: Any = None, *,
                  score: str | None = None) -> tuple[str, str, float, list[RaggedSample]]:
    """(kernel, alternate or "", threshold, the samples with the time of the kernel the
    selector would replay) at one capture size. Every kernel alone and, with a cost model,
    every pair (the selector replays whichever the model predicts faster) is scored with
    its own best threshold against the fastest plan timed per mix, split-KV or any balanced
    kernel: a kernel that is slower on the mixes balanced loses anyway may win where the
    threshold sends batches to it. The best kernel alone is kept unless a pair beats it
    (``kernel_pairs.best_pair``); ties keep the kernel with the smaller summed ratio to the
    fastest plan per mix (then the timing order); ``score`` as ``KERNEL_SCORE``."""
    mean_first = _check_score(score) == "mean"
    times = [s.kernel_us() for s in samples]
    names = [k for k in times[0] if all(k in t for t in times)]
    if not names:
        raise ValueError(f"no balanced kernel was timed on every mix at batch {batch}")
    fastest = [fastest_us(s) for s in samples]
    summed = {k: sum(t[k] / f for t, f in zip(times, fastest, strict=True)) for k in names}
    ranked = sorted(names, key=lambda k: (round(summed[k], 9), names.index(k)))

    def option(main: str, alt: str) -> tuple[tuple[float, float], float, list[RaggedSample]]:
        replayed = [s.with_kernel(faster_kernel(model, batch, s.lens, main, alt)) for s in samples]
        threshold = choose_imbalance(replayed, best=fastest)[0]
        ratios = [a / f for a, f in zip(replayed_us(replayed, threshold), fastest,
                                        strict=True)]
        worst, mean = round(max(ratios), 4), round(sum(ratios) / len(ratios), 4)
        return ((mean, worst) if mean_first else (worst, mean)), threshold, replayed

    options = {(k, ""): option(k, "") for k in ranked}
    main = min(ranked, key=lambda k: options[k, ""][0])  # min keeps the first of equal scores
    if model is not None:

        def score(a: str, b: str) -> tuple[float, float]:
            if (a, b) not in options:
                options[a, b] = option(a, b)
            return options[a, b][0]

        pick = best_pair(main, ranked, batch, model, score)
    else:
        pick = (main, "")
    _, threshold, replayed = options[pick]
    return pick[0], pick[1], threshold, replayed


def replayed_us(samples: Sequence[RaggedSample], threshold: float) -> list[float]:
    """Each sample's time under ``threshold``: its balanced time where the switch sends it
    there, else its split-KV time."""
    return [s.balanced_us if threshold and s.imbalance >= threshold else s.split_us
            for s in samples]


def choose_switches(samples: Sequence[RaggedSample], ranges: Sequence[tuple[int, int]],
                    model: Any = None, *, neighbours: int = KERNEL_NEIGHBOUR_RANGES,
                    score: str | None = None) -> tuple[list[RaggedSwitch], dict[str, Any]]:
    """Within each range, over the samples whose longest request falls in it: per capture
    size the balanced kernel (with a ``BalancedCostModel``, a pair of them) chosen over
    those and the samples of ``neighbours`` ranges on each side, and the threshold for it
    over the range's own (``_choose_range``); a range
    with no samples takes the nearest range's choice (all samples' where none has any).
    Neighbouring ranges with the same choice are joined. Returns (switches, summary): the
    summary has the worst and mean ratio to the faster of each sample's split-KV and
    replayed balanced plan (``*_over_best``), to the fastest plan timed on it
    (``*_over_fastest``, the kernel choice's misses included), and those of one choice
    for every range. ``score`` ranks each kernel option (``_choose_batch``)."""
    score = _check_score(score)
    if not samples:
        raise ValueError("choose_switches needs at least one timed ragged mix")
    if not ranges:
        raise ValueError("choose_switches needs at least one length range")
    if neighbours < 0:
        raise ValueError(f"neighbours must be >= 0 ranges, got {neighbours}")
    kernels, timed = choose_balanced_kernels(samples)
    overall = choose_by_batch(timed)[2]
    chosen: dict[int, RaggedSwitch] = {}
    ratios: list[float] = []
    to_fastest: list[float] = []
    where = {id(s): range_of(ranges, max(s.lens)) for s in samples}
    for i in range(len(ranges)):
        mine = [s for s in samples if where[id(s)] == i]
        near = [s for s in samples if where[id(s)] is not None
                and abs(where[id(s)] - i) <= neighbours]
        if mine:
            chosen[i], mine_ratios, mine_fastest = _choose_range(mine, model, near, score)
            ratios += mine_ratios
            to_fastest += mine_fastest
    fallback = _choose_range(samples, model, score=score)[0]
    switches: list[RaggedSwitch] = []
    for i, (lo, hi) in enumerate(ranges):
        near = min(chosen, key=lambda j: (abs(j - i), j), default=None)
        pick = chosen[near] if near is not None else fallback
        switch = replace(pick, lo=lo, hi=hi)
        last = switches[-1] if switches else None
        if last and last.hi == lo and replace(last, lo=0, hi=0) == replace(pick, lo=0, hi=0):
            switches[-1] = replace(last, hi=hi)
        else:
            switches.append(switch)
    covered = [s for s in samples if range_of(ranges, max(s.lens)) is not None]
    summary = {**overall,
               "one_switch_worst_over_best": overall["worst_over_best"],
               "one_switch_mean_over_best": overall["mean_over_best"],
               "one_switch_kernels": {str(b): k for b, k in kernels.items()},
               "worst_over_best": round(max(ratios), 4) if ratios else 1.0,
               "mean_over_best": round(sum(ratios) / len(ratios), 4) if ratios else 1.0,
               "worst_over_fastest": round(max(to_fastest), 4) if to_fastest else 1.0,
               "mean_over_fastest": (round(sum(to_fastest) / len(to_fastest), 4)
                                     if to_fastest else 1.0),
               "samples_in_ranges": len(covered),
               "kernel_neighbour_ranges": neighbours,
               "kernel_score": score,
               "switches": [sw.to_dict() for sw in switches]}
    return switches, summary


@dataclass(frozen=True, slots=True)
class RaggedSample:
    """One timed mix: the ladder's split-KV plan against the balanced plan, us per call.

    ``balanced_us`` is the time of balanced kernel ``kernel``; ``by_kernel`` holds every
    balanced kernel timed on the mix, ``(name, us)`` (empty: only ``kernel`` was)."""

    batch: int
    mix: str
    lens: tuple[int, ...]
    split_us: float
    balanced_us: float
    kernel: str = DEFAULT_BALANCED_KERNEL
    by_kernel: tuple[tuple[str, float], ...] = ()

    @property
    def imbalance(self) -> float:
        return imbalance(self.lens)

    def kernel_us(self) -> dict[str, float]:
        """``{balanced kernel: us}`` of every kernel timed on this mix."""
        return dict(self.by_kernel) or {self.kernel: self.balanced_us}

    def with_kernel(self, kernel: str) -> RaggedSample:
        """The same sample, its balanced time that of ``kernel`` (one of those timed)."""
        times = self.kernel_us()
        if kernel not in times:
            raise ValueError(f"balanced kernel {kernel!r} was not timed on {self.mix} at batch "
                             f"{self.batch}; timed: {sorted(times)}")
        return replace(self, balanced_us=times[kernel], kernel=kernel)

    def to_dict(self) -> dict[str, Any]:
        out = {"batch": self.batch, "mix": self.mix, "lens": list(self.lens),
               "imbalance": round(self.imbalance, 4), "split_us": self.split_us,
               "balanced_us": self.balanced_us}
        if self.by_kernel:
            out.update(kernel=self.kernel, balanced_by_kernel=dict(self.by_kernel))
        return out

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> RaggedSample:
        by_kernel = tuple((str(k), float(us))
                          for k, us in row.get("balanced_by_kernel", {}).items())
        return cls(int(row["batch"]), str(row["mix"]), tuple(int(n) for n in row["lens"]),
                   float(row["split_us"]), float(row["balanced_us"]),
                   str(row.get("kernel", DEFAULT_BALANCED_KERNEL)), by_kernel)


def choose_balanced_kernels(samples: Sequence[RaggedSample]
                            ) -> tuple[dict[int, str], list[RaggedSample]]:
    """Per capture size, the balanced kernel with the smallest summed time over the fastest
    kernel per mix (ties: the order they were timed in, the backend's default first), and
    the samples with that kernel's balanced time. Kernels not timed on every mix of a
    batch size are not candidates there (``kernel_pairs.choose_kernel_pairs`` without a
    cost model)."""
    chosen, _, out = choose_kernel_pairs(samples)
    return chosen, out


def threshold_candidates(samples: Iterable[RaggedSample]) -> list[float]:
    """0 (off), and one threshold between each pair of neighbouring measured imbalances
    (the first between 1, a uniform batch, and the smallest): every distinct split of the
    samples into split-KV and balanced."""
    values = sorted({round(s.imbalance, 4) for s in samples})
    below = [1.0, *values[:-1]]
    # Geometric midpoints: imbalance spans 1 to the batch size, the gaps grow with it.
    return [0.0] + [round((lo * hi) ** 0.5, 3) for lo, hi in zip(below, values, strict=True)]


def ratios_at(samples: Sequence[RaggedSample], threshold: float,
              best: Sequence[float] | None = None) -> list[float]:
    """Each sample's time with ``threshold`` over the faster of its two plans (or over
    ``best``, one time per sample)."""
    if best is None:
        best = [min(s.split_us, s.balanced_us) for s in samples]
    return [us / b for us, b in zip(replayed_us(samples, threshold), best, strict=True)]


def choose_imbalance(samples: Sequence[RaggedSample], *,
                     uniform_margin: float = UNIFORM_MARGIN,
                     best: Sequence[float] | None = None) -> tuple[float, dict[str, Any]]:
    """The threshold with the smallest worst ratio over ``samples``, then the smallest mean;
    ties go to the higher threshold (0, off, highest of all: fewer balanced graphs replayed
    where they gain nothing). A uniform batch's balanced time is scored ``uniform_margin``
    slower: it is sent to the balanced graph only where it wins by more than that. Ratios
    are to the faster of each sample's two plans, or to ``best`` (one time per sample: the
    fastest of every plan timed). Returns (threshold, summary; the summary's ratios are the
    measured ones, to the faster of the two plans)."""
    if not samples:
        raise ValueError("choose_imbalance needs at least one timed ragged mix")

    scored = [replace(s, balanced_us=s.balanced_us * uniform_margin) if s.imbalance <= 1.0
              else s for s in samples]

    def score(t: float) -> tuple[float, float, float]:
        r = ratios_at(scored, t, best)
        return round(max(r), 4), round(sum(r) / len(r), 4), -(t or float("inf"))

    best = min(threshold_candidates(samples), key=score)
    chosen, off = ratios_at(samples, best), ratios_at(samples, 0.0)
    always = ratios_at(samples, 1.0)
    return best, {"balanced_imbalance": best,
                  "worst_over_best": round(max(chosen), 4),
                  "mean_over_best": round(sum(chosen) / len(chosen), 4),
                  "off_worst_over_best": round(max(off), 4),
                  "always_worst_over_best": round(max(always), 4)}


def choose_by_batch(samples: Sequence[RaggedSample]
                    ) -> tuple[float, dict[int, float], dict[str, Any]]:
    """``choose_imbalance`` per capture size: (the smallest batch size's threshold, the
    batch sizes from which it changes -> their thresholds, summary). The summary compares
    the per-batch choice with one threshold for every batch size."""
    if not samples:
        raise ValueError("choose_by_batch needs at least one timed ragged mix")
    batches = sorted({s.batch for s in samples})
    chosen = {b: choose_imbalance([s for s in samples if s.batch == b])[0] for b in batches}
    base, changes, last = chosen[batches[0]], {}, chosen[batches[0]]
    for b in batches[1:]:
        if chosen[b] != last:
            changes[b] = last = chosen[b]
    ratios = [r for b in batches
              for r in ratios_at([s for s in samples if s.batch == b], chosen[b])]
    single, summary = choose_imbalance(samples)
    summary = {**summary, "single_threshold": single,
               "single_worst_over_best": summary["worst_over_best"],
               "balanced_imbalance": base, "batch_imbalance": {str(b): t for b, t in
                                                               changes.items()},
               "worst_over_best": round(max(ratios), 4),
               "mean_over_best": round(sum(ratios) / len(ratios), 4)}
    return base, changes, summary
