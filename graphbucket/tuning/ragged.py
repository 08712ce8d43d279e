"""The ragged switch of a tuned ladder: from which imbalance a batch replays a balanced graph.

A bucket's ``balanced_imbalance`` t sends a batch of two or more rows to the balanced graph
when ``max_len x live >= t x total tokens`` (``imbalance`` below; a uniform batch has 1).
Whether balanced beats the ladder's split-KV graph depends on the kernels at hand (the
heads, the cache format, the GPU), so the tuner times both on ragged mixes of its own and
``choose_imbalance`` picks the threshold with the smallest worst ratio to the faster of the
two (0: balanced never pays), for all batch sizes at once or per capture size
(``choose_by_batch``: which plan wins changes with the rows). The mixes differ from
``bench/ladder_oracle.py``'s, which then checks the choice out of sample. Host arithmetic
only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


def imbalance(lens: Sequence[int]) -> float:
    """Longest x live requests / total tokens (the selector's measure; 1 when uniform)."""
    live = [n for n in lens if n > 0]
    return max(live) * len(live) / sum(live) if live else 1.0


def tuner_mixes(batch: int, max_model_len: int, *, above: int) -> list[tuple[str, list[int]]]:
    """Ragged length mixes the tuner times at ``batch`` rows: a few long requests among short
    ones, half long, and a spread, each with its longest request above ``above`` tokens
    (where ladders have the balanced topology). None at one row."""
    top = max_model_len
    if batch < 2 or top * 3 // 4 <= above:
        return []
    few = max(1, batch // 4)
    mixes = [("one-long", [top * 3 // 4] + [512] * (batch - 1)),
             ("quarter-long", [top // 2] * few + [2048] * (batch - few)),
             ("half-long", [top * 3 // 4] * (batch // 2) + [4096] * (batch - batch // 2)),
             ("spread", [top // 16 + (top // 2 - top // 16) * i // (batch - 1)
                         for i in range(batch)])]
    seen, out = set(), []
    for name, lens in mixes:  # at two rows one-long and half-long coincide
        key = tuple(sorted(lens))
        if key not in seen and max(lens) > above:
            seen.add(key)
            out.append((name, lens))
    return out


@dataclass(frozen=True, slots=True)
class RaggedSample:
    """One timed mix: the ladder's split-KV plan against the balanced plan, us per call."""

    batch: int
    mix: str
    lens: tuple[int, ...]
    split_us: float
    balanced_us: float

    @property
    def imbalance(self) -> float:
        return imbalance(self.lens)

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "mix": self.mix, "lens": list(self.lens),
                "imbalance": round(self.imbalance, 4), "split_us": self.split_us,
                "balanced_us": self.balanced_us}

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> RaggedSample:
        return cls(int(row["batch"]), str(row["mix"]), tuple(int(n) for n in row["lens"]),
                   float(row["split_us"]), float(row["balanced_us"]))


def threshold_candidates(samples: Iterable[RaggedSample]) -> list[float]:
    """0 (off), and one threshold between each pair of neighbouring measured imbalances
    (the first between 1, a uniform batch, and the smallest): every distinct split of the
    samples into split-KV and balanced."""
    values = sorted({round(s.imbalance, 4) for s in samples})
    below = [1.0, *values[:-1]]
    # Geometric midpoints: imbalance spans 1 to the batch size, the gaps grow with it.
    return [0.0] + [round((lo * hi) ** 0.5, 3) for lo, hi in zip(below, values, strict=True)]


def ratios_at(samples: Sequence[RaggedSample], threshold: float) -> list[float]:
    """Each sample's time with ``threshold`` over the faster of its two plans."""
    out = []
    for s in samples:
        pick = s.balanced_us if threshold and s.imbalance >= threshold else s.split_us
        out.append(pick / min(s.split_us, s.balanced_us))
    return out


def choose_imbalance(samples: Sequence[RaggedSample]) -> tuple[float, dict[str, Any]]:
    """The threshold with the smallest worst ratio over ``samples``, then the smallest mean;
    ties go to the higher threshold (0, off, highest of all: fewer balanced graphs replayed
    where they gain nothing). Returns (threshold, summary)."""
    if not samples:
        raise ValueError("choose_imbalance needs at least one timed ragged mix")

    def score(t: float) -> tuple[float, float, float]:
        r = ratios_at(samples, t)
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
