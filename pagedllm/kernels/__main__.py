"""``python -m pagedllm.kernels [--all]``: build the CPU kernels ahead of time, for the active level
(``auto``: the best one of this CPU) or, with ``--all``, for every level this CPU runs (what the
test suite runs them at). Exits non-zero when a build fails, with the compiler's reason."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pagedllm.kernels.dispatch import active_isa, build_error, module_for
from pagedllm.kernels.isa import runnable_levels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.kernels", description=__doc__)
    parser.add_argument("--all", action="store_true", help="every level this CPU runs, not only the active one")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    levels = runnable_levels() if args.all else (active_isa(),)
    failed = 0
    for level in levels:
        start = time.perf_counter()
        ok = module_for(level, verbose=args.verbose) is not None
        took = time.perf_counter() - start
        print(f"CPU kernels {level}: {'built' if ok else 'FAILED: ' + str(build_error(level))} ({took:.0f} s)")
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
