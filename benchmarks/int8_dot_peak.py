"""The CPU's ceiling for the int8 kernel's arithmetic on AVX2: pmaddubsw alone, as fast as it issues.

The int8 linear kernel (kernels/csrc/quant_int8_cpu.cpp) spends its multiplies in pmaddubsw (32 byte
products, summed in pairs into int16). Once many activation rows share each weight (prompts, 16
streams' decode) the kernel is bound by that instruction, not by memory, so its issue rate bounds
prompt processing and batched decode. This compiles a loop of independent pmaddubsw (12 accumulators,
nothing else in the loop, nothing spilled) with the system's gcc and runs it in one process, then in
one process per core at once; it prints integer GOPS (2 operations per byte product) for each, the
figure to set beside the GOPS that benchmarks/packed_gemm.py prints for the kernel.

    .venv/bin/python benchmarks/int8_dot_peak.py [--processes 2] [--iterations 200000000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#define CHAINS 12
int main(int argc, char** argv) {
  const long iterations = atol(argv[1]);
  /* CHAINS accumulators and two operands: 14 of the 16 ymm registers, nothing spilled */
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(1), acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_setzero_si256();
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long n = 0; n < iterations; ++n) {
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(a, b));
    __asm__ volatile("" : "+x"(a), "+x"(b));  /* keeps the loop from being folded */
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  const double seconds = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
  int sink = 0;
  for (int i = 0; i < CHAINS; ++i) sink += _mm256_extract_epi16(acc[i], 0);
  printf("%.1f %d\n", iterations * CHAINS * 64.0 / seconds / 1e9, sink & 1);
  return 0;
}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="processes run at once")
    parser.add_argument("--iterations", type=int, default=200_000_000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = os.path.join(tmp, "peak.c"), os.path.join(tmp, "peak")
        with open(source, "w") as f:
            f.write(SOURCE)
        subprocess.run(["gcc", "-O2", "-mavx2", source, "-o", binary], check=True)
        command = [binary, str(args.iterations)]
        one = float(subprocess.run(command, check=True, capture_output=True, text=True).stdout.split()[0])
        print(f"pmaddubsw, one process: {one:.1f} GOPS")
        runs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(args.processes)]
        rates = [float(p.communicate()[0].split()[0]) for p in runs]
        shown = " + ".join(f"{r:.1f}" for r in rates)
        print(f"pmaddubsw, {args.processes} processes at once: {sum(rates):.1f} GOPS ({shown})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
