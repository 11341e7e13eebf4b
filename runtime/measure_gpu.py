"""The GPU sweep of ``autopar calibrate --backend nccl``: what one device's kernels achieve and,
with two GPUs or more, the collectives over NCCL.

On GPU 0: square-matmul FLOP/s per dtype and the memory bandwidth (as the CPU sweep), eager
casts between float32 and bfloat16, then what
the shape-derived cost model reads (``passes/cost/efficiency.py``): a grid of bfloat16 GEMM
shapes timed as a training step runs them (back to back), and fused attention's forward +
backward by sequence and head size. Collectives run with one GPU per rank; a machine with one
GPU has no link to measure, and its profile keeps the preset's.

    measurements = calibrate_gpus(ranks=(2, 4))
    measurements["gemms"][0]
    {'batch': 1, 'm': 2048, 'n': 1024, 'k': 256, 'dtype': 'bfloat16', 'seconds': 6.1e-06}
"""

from __future__ import annotations

import datetime
import platform
import time

import torch
import torch.nn.functional as F

from autopar.ir import ConfigError
from autopar.runtime.measure import (
    KINDS,
    matmul_dtype,
    measure_collectives,
    measure_matmul,
    measure_memory_bandwidth,
    synchronize,
    timed,
)
from autopar.runtime.spawn import run_local

GPU_SIZES_BYTES = tuple(2**16 * 4**k for k in range(7))  # 64 KiB, 256 KiB, ..., 256 MiB: NVLink needs big messages
GPU_MATMUL_SIZES = (1024, 2048, 4096, 8192)
GPU_DTYPES = ("float32", "tf32", "bfloat16", "float16")
# rows x columns x depth as transformer layers run them: thin depth (a head's k), square, deep (an FFN's)
GEMM_GRID = tuple((1, m, n, k) for m in (2048, 8192) for n in (1024, 4096, 16384) for k in (256, 1024, 4096, 16384))
ATTENTION_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
ATTENTION_HEAD_DIMS = (64, 128)
ATTENTION_TOKENS, ATTENTION_HIDDEN = 16384, 2048  # FlashAttention-2's benchmark: batch x sequence 16k, hidden 2048
BACKWARD_OVER_FORWARD = 2.5  # FlashAttention's FLOP convention (as passes/cost/efficiency.py)
LOOP_S = 0.02  # a timed loop this long amortizes the launch gaps and the synchronization at its ends
CAST_ELEMENTS = 2**28  # 1 GiB of float32: many times any L2


def per_call_seconds(fn, device, repeats: int = 3) -> float:
    """Seconds of one call of ``fn`` when calls run back to back, as a step launches its kernels:
    the best of ``repeats`` loops, each about ``LOOP_S`` long, over its number of calls."""
    fn()  # warm-up: library heuristics, workspace allocation
    synchronize(device)
    calls = max(3, min(200, int(LOOP_S / max(timed(fn, device), 1e-6))))

    def loop():
        for _ in range(calls):
            fn()

    return min(timed(loop, device) for _ in range(repeats)) / calls


def measure_gemms(shapes, dtype: str = "bfloat16", device="cuda") -> list[dict]:
    """Seconds of each (batch, m, n, k) product ``[batch,] m x k @ k x n`` in ``dtype``."""
    records = []
    with torch.no_grad(), matmul_dtype(dtype) as torch_dtype:
        for batch, m, n, k in shapes:
            lead = (batch,) if batch > 1 else ()
            a = torch.randn(*lead, m, k, device=device, dtype=torch_dtype)
            b = torch.randn(*lead, k, n, device=device, dtype=torch_dtype)
            seconds = per_call_seconds(lambda a=a, b=b: torch.matmul(a, b), device)
            records.append({"batch": batch, "m": m, "n": n, "k": k, "dtype": dtype, "seconds": seconds})
    return records


def measure_casts(device="cuda", elements: int = CAST_ELEMENTS) -> dict[str, float]:
    """Bytes/s (read + written) of eager torch's casts between float32 and bfloat16, back to back:
    ``narrowing`` (float32 to bfloat16, as mixed precision copies its masters) and ``widening``
    (bfloat16 to float32, as a gradient goes back to its master)."""
    wide = torch.randn(elements, device=device)
    narrow = wide.to(torch.bfloat16)
    moved = elements * (wide.element_size() + narrow.element_size())
    return {
        "narrowing": moved / per_call_seconds(lambda: wide.to(torch.bfloat16), device),
        "widening": moved / per_call_seconds(lambda: narrow.to(torch.float32), device),
    }


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> float:
    """Forward + backward FLOPs of attention in FlashAttention's convention (forward 4·b·h·s²·d,
    halved when causal; backward 2.5x the forward)."""
    return 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0) * (1 + BACKWARD_OVER_FORWARD)


def measure_attention(cases, dtype: str = "bfloat16", device="cuda") -> list[dict]:
    """Seconds of ``scaled_dot_product_attention``'s forward + backward per (batch, heads, seq,
    head_dim, causal), and its FLOP/s in FlashAttention's convention."""
    records = []
    for batch, heads, seq, head_dim, causal in cases:
        q, k, v = (
            torch.randn(batch, heads, seq, head_dim, device=device, dtype=getattr(torch, dtype), requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=getattr(torch, dtype))

        def step(q=q, k=k, v=v, grad=grad, causal=causal):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            torch.autograd.grad(out, (q, k, v), grad)

        seconds = per_call_seconds(step, device)
        flops = attention_flops(batch, heads, seq, head_dim, causal)
        records.append(
            {
                **dict(batch=batch, heads=heads, seq=seq, head_dim=head_dim, causal=causal, dtype=dtype),
                **dict(seconds=seconds, flops_per_s=flops / seconds),
            }
        )
    return records


def attention_cases(seqs=ATTENTION_SEQS, head_dims=ATTENTION_HEAD_DIMS) -> list[tuple]:
    """FlashAttention-2's benchmark grid: ATTENTION_TOKENS tokens (batch x sequence), hidden
    ATTENTION_HIDDEN (heads x head size), causal and full."""
    return [
        (max(1, ATTENTION_TOKENS // seq), ATTENTION_HIDDEN // head_dim, seq, head_dim, causal)
        for causal in (True, False)
        for head_dim in head_dims
        for seq in seqs
    ]


def _gpu_collectives(rank: int, world_size: int, sizes_bytes, repeats: int) -> list[dict]:
    torch.cuda.set_device(rank)  # one device per rank, as torchrun's LOCAL_RANK
    return measure_collectives(rank, world_size, sizes_bytes, repeats, device=f"cuda:{rank}")


def calibrate_gpus(ranks=(2, 4), quick: bool = False, progress=print) -> dict:
    """The GPU sweep: matmul FLOP/s per dtype (float32, TF32, bfloat16, float16), memory
    bandwidth, the bfloat16 GEMM grid and attention on GPU 0, then every collective kind over
    NCCL for each group size, one GPU per rank, messages of 64 KiB to 256 MiB (none on a
    machine with one GPU). Same record format as :func:`autopar.runtime.measure.calibrate`,
    with the device's name and memory; no contention or rendezvous records."""
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found == 0:
        raise ConfigError(
            "calibrating with nccl measures this machine's GPUs and it has none: "
            "calibrate gloo (the default) on a CPU machine, or run this on the GPU machine"
        )
    if found > 1 and found < max(ranks):
        raise ConfigError(
            f"calibrating NCCL over {max(ranks)} ranks needs {max(ranks)} GPUs, this machine has {found}: "
            "pass --ranks with at most that many"
        )
    sizes, repeats = (GPU_SIZES_BYTES[:-2], 10) if quick else (GPU_SIZES_BYTES, 30)
    started = time.perf_counter()
    measured_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    device = torch.device("cuda", 0)
    progress(f"matmul FLOP/s on {torch.cuda.get_device_name(device)}, {', '.join(GPU_DTYPES)}")
    matmul = measure_matmul(GPU_DTYPES, GPU_MATMUL_SIZES, repeats=10, device=device)
    progress("  " + ", ".join(f"{dtype} {rate / 1e12:.1f} TFLOP/s" for dtype, rate in matmul.items()))
    memory_bandwidth = measure_memory_bandwidth(2**30, repeats=10, device=device)
    progress(f"memory bandwidth, one 1 GiB copy: {memory_bandwidth / 1e9:.0f} GB/s")
    casts = measure_casts(device, CAST_ELEMENTS // 16 if quick else CAST_ELEMENTS)
    progress("eager casts: " + ", ".join(f"{kind} {rate / 1e9:.0f} GB/s" for kind, rate in casts.items()))
    grid = GEMM_GRID[::2] if quick else GEMM_GRID
    progress(f"bfloat16 GEMMs: {len(grid)} shapes, back to back")
    gemms = measure_gemms(grid, "bfloat16", device)
    cases = attention_cases(ATTENTION_SEQS[1:-1] if quick else ATTENTION_SEQS)
    progress(f"attention forward + backward, bfloat16: {len(cases)} cases")
    attention = measure_attention(cases, "bfloat16", device)
    collectives = []
    if found == 1:
        progress("one GPU: no link to measure; the profile keeps its preset's links")
    for world_size in ranks if found > 1 else ():
        progress(
            f"collectives over {world_size} GPUs on NCCL: {len(KINDS)} kinds x {len(sizes)} sizes, {repeats} repeats"
        )
        collectives += run_local(_gpu_collectives, world_size, sizes, repeats, timeout_s=600, backend="nccl")[0]
    properties = torch.cuda.get_device_properties(device)
    return {
        "backend": "nccl",
        "matmul": matmul,
        "memory_bandwidth": memory_bandwidth,
        "casts": casts,
        "gemms": gemms,
        "attention": attention,
        "contention": [],
        "collectives": collectives,
        "sync": [],
        "cores": 0,
        "device_name": properties.name,
        "memory_bytes": properties.total_memory,
        "measured_at": measured_at,
        "host": f"{platform.node()} ({torch.cuda.device_count()} x {properties.name}, torch {torch.__version__})",
        "threads_per_rank": 1,
        "quick": quick,
        "seconds": time.perf_counter() - started,
    }
