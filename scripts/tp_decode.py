"""Tensor-parallel decode TPOT: the bucket ladder against fixed-1 at TP=N, numerics vs TP=1.

Each rank holds a ``TPMLADecoder`` shard whose per-rank shape is ``--preset`` (DeepSeek-V3
at TP8: 16 heads, MLP 2304), so the unsharded model has N times the heads and MLP columns;
the two all-reduces per layer run through NCCL inside every captured graph. Per context
(default 1K and 100K) and policy (``fixed-1``, ``ladder``) it prints TPOT: CUDA-event time
of back-to-back ``runner.step`` calls (same step count on every rank, so the collectives
stay matched), median of ``--reps`` runs, rank 0's and the slowest rank's. Before timing,
each rank decodes every context with the unsharded model on its own GPU (TP=1, same seed
and cache) and checks the TP output against it (rel L2), with the per-step key check on
and one step under ``torch.cuda.set_sync_debug_mode("error")``.

    python3 scripts/tp_decode.py --world-size 2                  # N GPUs, spawns N ranks
    torchrun --nproc-per-node 2 scripts/tp_decode.py             # or one process per GPU
    python3 scripts/tp_decode.py --cpu --world-size 2            # gloo smoke test on CPU

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends are forced below): on shared
hosts a program that uses it can take the GPUs out of service. ``--cpu`` runs the tiny
model (8 heads, split N ways) through the Triton interpreter with gloo: a smoke test of
the same code path whose timings mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Triton reads the interpreter flag at import: set it before any graphbucket kernel module
# loads, in this process and (inherited) in spawned ranks, when the kernels run on the CPU.
if "--cpu" in sys.argv[1:] or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from graphbucket.backends import get_backend  # noqa: E402
from graphbucket.distributed import capture_all, tp_session, with_key_check  # noqa: E402
from graphbucket.ladder import Bucket, BucketLadder  # noqa: E402
from graphbucket.models import (  # noqa: E402
    PRESETS,
    MLADecoder,
    TPMLADecoder,
    decode_batch,
    prefill_random,
    random_block_table,
    tiny,
    tp_full_config,
)
from graphbucket.runner import GraphBucketRunner  # noqa: E402

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
POLICIES = ("fixed-1", "ladder")
GPU = dict(contexts=[1024, 100_000], max_model_len=131072, page_size=64, tol=2e-2)
# CPU smoke: a ladder whose top bucket splits, as the GPU's 100K bucket does.
CPU = dict(contexts=[20, 200], max_model_len=256, page_size=16, tol=1e-4)


def force_no_multicast() -> None:
    for name, value in NO_MULTICAST.items():
        if os.environ.get(name, value) != value:
            print(f"note: overriding {name}={os.environ[name]} with {value} (multicast stays off)")
        os.environ[name] = value


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


# ---- one rank -----------------------------------------------------------------------------


class Rank:
    """One rank's models, inputs and runners."""

    def __init__(self, args, session) -> None:
        self.args, self.session, self.rank = args, session, session.rank
        self.ladder_buckets: list[tuple[int, int]] = []
        self.geo = CPU if args.cpu else GPU
        self.device, self.dtype = session.device, torch.float32 if args.cpu else torch.bfloat16
        per_rank = PRESETS[args.preset](num_layers=args.layers)
        self.full_config = tiny(args.layers) if args.cpu else tp_full_config(per_rank,
                                                                                args.world_size)
        page, top = self.geo["page_size"], self.geo["max_model_len"]
        pages = -(-top // page)
        self.full = MLADecoder(self.full_config, num_pages=args.batch * pages, page_size=page,
                               dtype=self.dtype, device=self.device, seed=args.seed)
        self.table = random_block_table(args.batch, pages, self.full.num_pages,
                                        np.random.default_rng(args.seed))
        prefill_random(self.full, self.table, [top] * args.batch, seed=args.seed)
        self.tp = TPMLADecoder.from_full(self.full, rank=self.rank, world_size=args.world_size)
        gen = torch.Generator(device=self.device).manual_seed(args.seed)
        self.hidden = torch.randn(args.batch, self.full_config.hidden_size, generator=gen,
                                  device=self.device).to(self.dtype)

    def runner(self, policy: str, model: MLADecoder) -> GraphBucketRunner:
        cfg, top = model.config, self.geo["max_model_len"]
        kw = {"num_sms": 16} if self.args.cpu else {}
        backend = get_backend("triton", device=self.device, kv_lora_rank=cfg.kv_lora_rank,
                              qk_rope_dim=cfg.qk_rope_dim, **kw)
        ladder = None
        if policy == "ladder" and self.args.cpu:
            ladder = BucketLadder([Bucket(32, 1), Bucket(top, top)], top)
        elif policy == "ladder" and self.args.ladder:
            ladder = BucketLadder.load(self.args.ladder)
        return self.session.register(GraphBucketRunner.for_policy(
            policy, model, spec=model.buffer_spec(top), batch_sizes=[self.args.batch],
            max_model_len=top, sm_scale=cfg.sm_scale, backend=backend, ladder=ladder,
            progress=False))

    def batch(self, context: int):
        cols = -(-context // self.tp.page_size)
        return decode_batch(self.tp, [context] * self.args.batch, self.table[:, :cols],
                            self.hidden)

    def check_numerics(self) -> dict:
        """TP output vs the unsharded model (TP=1 on this GPU), per policy and context."""
        errors: dict = {}
        group = self.session.cpu_group
        for policy in POLICIES:
            tp = with_key_check(self.runner(policy, self.tp), group, enabled=True)
            one = self.runner(policy, self.full)
            capture_all([tp], group=group)
            one.capture()
            for context in self.geo["contexts"]:
                batch = self.batch(context)
                want = one.step(batch).clone()
                errors[f"{policy}@{context}"] = err = rel_l2(tp.step(batch), want)
                if err > self.geo["tol"]:
                    raise AssertionError(f"rank {self.rank} {policy} context {context}: TP "
                                         f"differs from TP=1 by rel L2 {err:.2e}")
            if self.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("error")  # no sync on the TP replay path
                try:
                    tp.runner.step(self.batch(self.geo["contexts"][-1]))
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            self.session.close_runners()
        return errors

    def drop_full_model(self) -> None:
        self.full = None  # its runners are closed; free its weights and caches for timing
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def tpot(self) -> list[dict]:
        rows = []
        for policy in POLICIES:
            runner = self.runner(policy, self.tp)
            capture_all([runner], group=self.session.cpu_group)
            if policy == "ladder":
                self.ladder_buckets = [b.to_dict() for b in runner.ladder]
            for context in self.geo["contexts"]:
                batch = self.batch(context)
                ms = time_steps(lambda b=batch, r=runner: r.step(b), cuda=not self.args.cpu,
                                steps=self.args.steps, reps=self.args.reps)
                per_rank = [None] * self.args.world_size
                dist.all_gather_object(per_rank, ms, group=self.session.cpu_group)
                plan = runner.plan_for(runner.selector.choose([context] * self.args.batch))
                rows.append({"policy": policy, "context": context, "batch": self.args.batch,
                             "tpot_ms": round(ms, 4), "tpot_ms_slowest_rank":
                             round(max(per_rank), 4), "splits": plan.num_kv_splits})
            self.session.close_runners()
        return rows


def time_steps(step: Callable[[], object], *, cuda: bool, steps: int, reps: int) -> float:
    """Median ms per step over ``reps`` runs of ``steps`` back-to-back steps. The counts are
    fixed (not adapted to the measured time) so every rank runs the same collectives."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        step()
    sync()
    samples = []
    for _ in range(reps):
        if cuda:
            start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            for _ in range(steps):
                step()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop) / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            samples.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(samples)


def run_rank(rank: int, args, init_method: str, local_rank: int | None = None) -> None:
    device = "cpu" if args.cpu else f"cuda:{rank if local_rank is None else local_rank}"
    if args.cpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    with tp_session(backend="gloo" if args.cpu else "nccl", rank=rank,
                    world_size=args.world_size, init_method=init_method, device=device,
                    timeout=datetime.timedelta(minutes=10)) as session:
        me = Rank(args, session)
        errors = me.check_numerics()
        me.drop_full_model()
        rows = me.tpot()
        if rank == 0:
            report(args, me, errors, rows)


def report(args, me: Rank, errors: dict, rows: list[dict]) -> None:
    cfg = me.tp.config
    print(f"TP={args.world_size} {me.full_config.name}: {cfg.num_heads} heads and MLP "
          f"{cfg.intermediate_size} per rank, {cfg.num_layers} layers, batch {args.batch}, "
          f"{'fp32 CPU (gloo)' if args.cpu else 'bf16 ' + torch.cuda.get_device_name()}")
    print("numerics vs TP=1 (rel L2): " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    at = {(r["policy"], r["context"]): r for r in rows}
    print(f"{'context':>8} {'fixed-1 ms':>11} {'ladder ms':>10} {'splits':>7} {'speedup':>8}")
    for context in me.geo["contexts"]:
        fix, lad = at[("fixed-1", context)], at[("ladder", context)]
        print(f"{context:>8} {fix['tpot_ms']:>11.3f} {lad['tpot_ms']:>10.3f} "
              f"{lad['splits']:>7} {fix['tpot_ms'] / lad['tpot_ms']:>7.2f}x")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = "cpu" if args.cpu else torch.cuda.get_device_name().split()[-1].lower()
        path = os.path.join(args.out, f"{name}-tp{args.world_size}-tpot.json")
        clock = "wall clock (CPU smoke: not a measurement)" if args.cpu else "CUDA events"
        meta = {"world_size": args.world_size, "model": me.full_config.name,
                "per_rank_heads": cfg.num_heads, "layers": cfg.num_layers,
                "ladder": me.ladder_buckets,
                "torch": torch.__version__, "nccl": None if args.cpu else
                ".".join(map(str, torch.cuda.nccl.version())),
                "command": " ".join(["python3"] + sys.argv),
                "timing": f"{clock} over {args.steps} back-to-back runner.step calls, "
                          f"median of {args.reps}"}
        meta["gpu"] = "CPU" if args.cpu else torch.cuda.get_device_name()
        meta["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        data = {"meta": meta, "numerics_rel_l2": errors, "rows": rows}
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
        with open(os.path.splitext(path)[0] + ".md", "w") as f:
            f.write(markdown(data))
        print(f"wrote {path} and its .md")


def markdown(data: dict) -> str:
    """A saved run as a short markdown table: TPOT per context, fixed-1 against the ladder."""
    meta, rows = data["meta"], data["rows"]
    at = {(r["policy"], r["context"]): r for r in rows}
    lines = [f"# Tensor-parallel decode, TP={meta['world_size']} ({meta.get('gpu', 'GPU')})", "",
             f"{meta.get('date', '')}, torch {meta['torch']}, NCCL {meta['nccl']}; "
             f"{meta['model']}: {meta['per_rank_heads']} heads per rank, {meta['layers']} "
             f"layers, batch {rows[0]['batch']}. {meta['timing']}. Command: "
             f"`{meta['command']}`", "",
             "Numerics, TP output against the unsharded model on one GPU (rel L2): "
             + ", ".join(f"{k} {v:.1e}" for k, v in data["numerics_rel_l2"].items()) + ".", "",
             "| context | fixed-1 ms | ladder ms | ladder splits | fixed-1 / ladder | "
             "slowest rank, ladder ms |", "|---|---|---|---|---|---|"]
    for context in sorted({r["context"] for r in rows}):
        fix, lad = at[("fixed-1", context)], at[("ladder", context)]
        lines.append(f"| {context} | {fix['tpot_ms']:.3f} | {lad['tpot_ms']:.3f} | "
                     f"{lad['splits']} | {fix['tpot_ms'] / lad['tpot_ms']:.2f}x | "
                     f"{lad['tpot_ms_slowest_rank']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--cpu", action="store_true", help="gloo + tiny model smoke test on CPU")
    ap.add_argument("--preset", default="deepseek-v3-tp8", choices=sorted(PRESETS),
                    help="per-rank shape (GPU); the unsharded model is N times wider")
    ap.add_argument("--layers", type=int, default=None, help="default: 4 (GPU), 1 (CPU)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ladder", default=None, help="ladder JSON (default: the runner's: the "
                    "shipped tuned ladder of the GPU and per-rank heads, else default_ladder)")
    ap.add_argument("--steps", type=int, default=None, help="default: 50 (GPU), 2 (CPU)")
    ap.add_argument("--reps", type=int, default=None, help="default: 5 (GPU), 1 (CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for the JSON rows (rank 0)")
    ap.add_argument("--render", metavar="JSON", help="only rewrite the markdown of a saved run")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            text = markdown(json.load(f))
        with open(os.path.splitext(args.render)[0] + ".md", "w") as f:
            f.write(text)
        return
    args.layers = args.layers or (1 if args.cpu else 4)
    args.steps = args.steps or (2 if args.cpu else 50)
    args.reps = args.reps or (1 if args.cpu else 5)
    force_no_multicast()
    if "LOCAL_RANK" in os.environ:  # torchrun: this process is one rank
        args.world_size = int(os.environ["WORLD_SIZE"])
        check_devices(args)
        run_rank(int(os.environ["RANK"]), args, "env://", int(os.environ["LOCAL_RANK"]))
        return
    check_devices(args)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mp.spawn(run_rank, args=(args, "env://"), nprocs=args.world_size)


def check_devices(args) -> None:
    if args.cpu:
        if tiny().num_heads % args.world_size:
            sys.exit(f"--cpu splits the tiny model's {tiny().num_heads} heads: --world-size "
                     "must divide it (1, 2, 4 or 8)")
        return
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < args.world_size:
        sys.exit(f"tp_decode.py --world-size {args.world_size} needs {args.world_size} CUDA "
                 f"GPUs, found {found}. Run it on a machine with {args.world_size} GPUs (e.g. "
                 f"nvidia-h200-x{args.world_size}), or add --cpu for the gloo smoke test")


if __name__ == "__main__":
    main()
