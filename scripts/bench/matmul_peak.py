"""This machine's matmul peak at a thread count: best torch.matmul GFLOP/s of large square matrices.

    python scripts/bench/matmul_peak.py [--threads 1] [--seconds 1.0]

For float32 and bfloat16 and sizes 512/1024/2048 (larger ones skipped when a single product would
exceed the time budget, as bf16 does on CPUs without bf16 instructions), repeats C = A @ B for about ``--seconds`` and keeps
the best rate (2 n^3 FLOPs per product) per wall second and per CPU second of this process; the CPU-time
figure is the one comparable across runs on a machine shared with other jobs. Prints ``BENCH_RESULT``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, set_threads  # noqa: E402


def best_rate(n: int, dtype, seconds: float) -> tuple[float, float]:
    """Best (wall, CPU) GFLOP/s over blocks of products lasting >= 50 ms each (process_time is coarse)."""
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    w0 = time.perf_counter()
    torch.matmul(a, b, out=out)  # warm-up (packing buffers, thread pool) and a first estimate
    reps = max(1, int(0.05 / (time.perf_counter() - w0)))
    best_wall = best_cpu = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(reps):
            torch.matmul(a, b, out=out)
        w1, c1 = time.perf_counter(), time.process_time()
        flops = 2.0 * n**3 * reps
        best_wall = max(best_wall, flops / (w1 - w0) / 1e9)
        best_cpu = max(best_cpu, flops / max(c1 - c0, 1e-9) / 1e9)
        if w1 > deadline:
            return best_wall, best_cpu


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=1.0, help="per dtype and size")
    args = parser.parse_args()
    set_threads(args.threads)
    import torch

    result = {"threads": torch.get_num_threads()}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        rates: dict[int, tuple[float, float]] = {}
        for n in (512, 1024, 2048):
            # bf16 without hardware support runs at ~1 GFLOP/s: skip sizes whose one product would
            # take longer than the time budget
            if rates and 2.0 * n**3 / (max(w for w, _ in rates.values()) * 1e9) > args.seconds:
                break
            rates[n] = best_rate(n, dtype, args.seconds)
        result[f"{name}_gflops"] = max(w for w, _ in rates.values())
        result[f"{name}_cpu_gflops"] = max(c for _, c in rates.values())
        result[f"{name}_by_size"] = {str(n): round(w, 1) for n, (w, _) in rates.items()}
    emit(result)


if __name__ == "__main__":
    main()
