"""``python -m customops``: the live support matrix; ``python -m customops bench ...``: benchmarks.

The matrix checks every cell right then (nothing is read from a list): one row per op of the op
table, one column per capability. A failing cell shows why; the exit status is 0 only when every
applicable cell passes.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from .bench import main as bench_main

        return bench_main(argv[1:])
    from .matrix import main as matrix_main

    return matrix_main(argv)


if __name__ == "__main__":
    sys.exit(main())
