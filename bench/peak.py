"""Run a module as ``python -m`` would, then write its peak RSS (``VmHWM``) to ``$BENCH_PEAK_FILE``.

    python -m bench.peak processor.cli replay FILE

Why not ``ru_maxrss`` from ``wait4``: Linux carries the high-water mark of the forked
parent's image across ``exec`` into it, so a child of a large harness process would
report the harness's size. ``VmHWM`` belongs to the address space the program runs in,
which ``exec`` creates afresh.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
from pathlib import Path


def vm_hwm_kib(pid: int | str = "self") -> int:
    """Peak resident set size of a process's address space, in KiB (0 if unreadable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text(encoding="ascii").splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _write_peak(path: str) -> None:
    Path(path).write_text(str(vm_hwm_kib()), encoding="ascii")


def main() -> None:
    if len(sys.argv) < 2:
        sys.stderr.write("usage: python -m bench.peak MODULE [ARGS...]\n")
        sys.exit(2)
    target = os.environ.get("BENCH_PEAK_FILE")
    if target:
        atexit.register(_write_peak, target)
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
