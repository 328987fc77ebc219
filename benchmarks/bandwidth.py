"""Memory bandwidth of this machine, as STREAM measures it: the ceiling a decode token's weight
reads run into.

A small C program, compiled here at run time (``cc -O3 -march=native -fopenmp``), times two
loops over arrays of doubles on 1 and 2 threads (OpenMP, static schedule, each thread touching
its own part first so that its pages are its own):

- **triad**: ``a[i] = b[i] + s·c[i]``, counted as STREAM counts it: 3 arrays × 8 bytes an
  element (the write-allocate read of ``a`` is not counted);
- **read**: ``sum += b[i]`` (four vector accumulators): 8 bytes an element, only loads. A decode
  step mostly reads (weights, K/V), so this is the figure a roofline divides by.

Each figure is the best of ``--repeats`` passes (STREAM's choice: the run the machine disturbed
least), with the median beside it. The default array is 4x the last-level cache (read from
/sys), at least 256 MiB, and no more than an eighth of the memory available; ``--sizes-mib``
adds smaller ones to show where the caches end. On a VM the last-level cache /sys reports is the
host's, shared with other tenants.

    .venv/bin/python benchmarks/bandwidth.py
    .venv/bin/python benchmarks/bandwidth.py --threads 1 2 --sizes-mib 16 64 256 --json out.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
BUILD_DIR = BENCH_DIR / "out" / "bandwidth"

C_SOURCE = r"""
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef double v8d __attribute__((vector_size(64)));

static double triad(double *a, const double *b, const double *c, long n, double s) {
    double t = omp_get_wtime();
#pragma omp parallel for simd schedule(static)
    for (long i = 0; i < n; i++) a[i] = b[i] + s * c[i];
    return omp_get_wtime() - t;
}

static double sum_read(const double *b, long n, double *out) {
    double total = 0.0;
    double t = omp_get_wtime();
#pragma omp parallel reduction(+ : total)
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        long blocks = n / 32, per = (blocks + nt - 1) / nt;
        long lo = id * per, hi = lo + per < blocks ? lo + per : blocks;
        v8d s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        for (long j = lo; j < hi; j++) {
            const v8d *p = (const v8d *)(b + 32 * j);
            s0 += p[0];
            s1 += p[1];
            s2 += p[2];
            s3 += p[3];
        }
        v8d s = s0 + s1 + s2 + s3;
        for (int k = 0; k < 8; k++) total += s[k];
    }
    t = omp_get_wtime() - t;
    *out += total;
    return t;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s elements repeats threads...\n", argv[0]);
        return 2;
    }
    long n = atol(argv[1]) / 32 * 32;
    int repeats = atoi(argv[2]);
    double *a = aligned_alloc(64, n * sizeof(double));
    double *b = aligned_alloc(64, n * sizeof(double));
    double *c = aligned_alloc(64, n * sizeof(double));
    if (!a || !b || !c) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    double sink = 0.0;
    for (int arg = 3; arg < argc; arg++) {
        int threads = atoi(argv[arg]);
        omp_set_num_threads(threads);
#pragma omp parallel for schedule(static)
        for (long i = 0; i < n; i++) {
            a[i] = 1.0;
            b[i] = 2.0;
            c[i] = 0.5;
        }
        triad(a, b, c, n, 3.0);  /* warm: pages, frequency */
        sum_read(b, n, &sink);
        for (int r = 0; r < repeats; r++) {
            double tt = triad(a, b, c, n, 3.0);
            double tr = sum_read(b, n, &sink);
            printf("{\"threads\": %d, \"elements\": %ld, \"triad_s\": %.9f, \"read_s\": %.9f}\n",
                   threads, n, tt, tr);
        }
        fflush(stdout);
    }
    fprintf(stderr, "check %g\n", sink + a[n / 2]);
    return 0;
}
"""


# ----------------------------------------------------------------------------- the machine


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


# the flags that decide which kernels run (pyserve's and llama.cpp's)
KERNEL_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


def caches() -> list[dict]:
    """The caches /sys lists for cpu0: level, type, size in bytes, CPUs sharing it."""
    found = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            text = (index / "size").read_text().strip()
            size = int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1]]
            found.append(
                {
                    "level": int((index / "level").read_text()),
                    "type": (index / "type").read_text().strip(),
                    "bytes": size,
                    "shared_cpu_list": (index / "shared_cpu_list").read_text().strip(),
                }
            )
        except (OSError, ValueError, KeyError):
            continue
    return found


def mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def machine() -> dict:
    """What a benchmark's figures were measured on."""
    flags = set(cpu_flags())
    return {
        "cpu": cpu_model(),
        "nproc": os.cpu_count(),
        "kernel_flags": [f for f in KERNEL_FLAGS if f in flags],
        "hypervisor": "hypervisor" in flags,
        "caches": caches(),
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "loadavg": list(os.getloadavg()),
    }


def describe(m: dict) -> str:
    llc = max(m["caches"], key=lambda c: c["level"], default=None)
    cache = f", LLC L{llc['level']} {llc['bytes'] >> 20} MiB" if llc else ""
    vm = " (VM)" if m["hypervisor"] else ""
    return (
        f"{m['cpu']}{vm}, nproc {m['nproc']}, {m['mem_total_gib']} GiB{cache}; "
        f"flags: {' '.join(m['kernel_flags'])}"
    )


# ----------------------------------------------------------------------------- the probe


def build() -> Path:
    """The probe binary, compiled once per source and compiler into benchmarks/out/."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    flags = ["-O3", "-march=native", "-fopenmp"]
    key = hashlib.sha256((C_SOURCE + cc + " ".join(flags)).encode()).hexdigest()[:12]
    binary = BUILD_DIR / f"stream-{key}"
    if binary.is_file():
        return binary
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    source = BUILD_DIR / f"stream-{key}.c"
    source.write_text(C_SOURCE)
    subprocess.run([cc, *flags, str(source), "-o", str(binary)], check=True)
    return binary


def measure(size_bytes: int, threads: list[int], repeats: int) -> list[dict]:
    """Best and median GB/s of triad and read over ``repeats`` passes, per thread count, with
    arrays of ``size_bytes`` each."""
    binary = build()
    elements = size_bytes // 8
    env = dict(os.environ, OMP_PROC_BIND="true", OMP_WAIT_POLICY="PASSIVE")
    env.pop("OMP_NUM_THREADS", None)
    run = subprocess.run(
        [str(binary), str(elements), str(repeats), *map(str, threads)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    out = []
    for t in threads:
        mine = [r for r in rows if r["threads"] == t]
        n = mine[0]["elements"]
        triad = [24 * n / r["triad_s"] / 1e9 for r in mine]
        read = [8 * n / r["read_s"] / 1e9 for r in mine]
        out.append(
            {
                "threads": t,
                "array_mib": round(8 * n / 2**20),
                "triad_gbs": round(max(triad), 2),
                "triad_gbs_median": round(statistics.median(triad), 2),
                "read_gbs": round(max(read), 2),
                "read_gbs_median": round(statistics.median(read), 2),
                "repeats": len(mine),
            }
        )
    return out


def default_size() -> int:
    llc = max((c["bytes"] for c in caches()), default=32 << 20)
    return int(min(max(4 * llc, 256 << 20), mem_available() // 8))


def probe(threads: list[int], repeats: int, sizes_mib: list[int] | None = None) -> dict:
    """The whole probe: the machine, then per array size the figures per thread count; the
    largest size's figures are the result (``triad_gbs``/``read_gbs`` keyed by threads)."""
    big = default_size()
    sizes = sorted({*(m << 20 for m in sizes_mib or []), big})
    started = time.time()
    results = []
    for size in sizes:
        results.extend(measure(size, threads, repeats))
    largest = [r for r in results if r["array_mib"] == round(big / 2**20)]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": machine(),
        "loadavg_before": machine()["loadavg"],
        "repeats": repeats,
        "rows": results,
        "triad_gbs": {str(r["threads"]): r["triad_gbs"] for r in largest},
        "read_gbs": {str(r["threads"]): r["read_gbs"] for r in largest},
        "array_mib": round(big / 2**20),
    }


def print_probe(result: dict) -> None:
    print(f"machine: {describe(result['machine'])}")
    print(f"date: {result['date']}, load average {result['machine']['loadavg']}")
    print(
        f"{'array MiB':>10} {'threads':>7} {'triad GB/s':>11} {'(median)':>9} "
        f"{'read GB/s':>10} {'(median)':>9}"
    )
    for r in result["rows"]:
        print(
            f"{r['array_mib']:>10} {r['threads']:>7} {r['triad_gbs']:>11.1f} "
            f"{r['triad_gbs_median']:>9.1f} {r['read_gbs']:>10.1f} {r['read_gbs_median']:>9.1f}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=10, help="passes; the best is reported")
    parser.add_argument(
        "--sizes-mib",
        type=int,
        nargs="*",
        default=[],
        help="smaller arrays to measure too (each array; the default size always runs)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    result = probe(args.threads, args.repeats, args.sizes_mib)
    print_probe(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
