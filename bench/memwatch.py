"""The peak memory of a process tree, sampled from a process of its own (so that the sampling takes no turn of the
measured process's GIL): `python -m bench.memwatch PID`. Every RSS_EVERY_S it sums VmRSS over PID and its
descendants (itself left out) and keeps the largest single VmHWM; every PSS_EVERY_S (as bench/flower_sim.py's
watch does) it sums PSS, which walks each process's mappings in the kernel and so is read less often. When its
stdin closes it prints {"peak_total_kb", "peak_pss_kb", "peak_process_kb"} as one JSON line and exits."""

from __future__ import annotations

import json
import os
import select
import sys
import time

from bench.common import descendants, proc_mem_kb, proc_pss_kb

RSS_EVERY_S, PSS_EVERY_S = 0.2, 0.5


def main() -> int:
    root, me = int(sys.argv[1]), os.getpid()
    peak = {"peak_total_kb": 0, "peak_pss_kb": 0, "peak_process_kb": 0}
    pss_at = 0.0
    while True:
        pids = [pid for pid in descendants(root) if pid != me]
        total = 0
        for pid in pids:
            hwm, rss = proc_mem_kb(pid)
            total += rss
            peak["peak_process_kb"] = max(peak["peak_process_kb"], hwm)
        peak["peak_total_kb"] = max(peak["peak_total_kb"], total)
        if time.monotonic() >= pss_at:
            peak["peak_pss_kb"] = max(peak["peak_pss_kb"], sum(proc_pss_kb(pid) for pid in pids))
            pss_at = time.monotonic() + PSS_EVERY_S
        if select.select([sys.stdin], [], [], RSS_EVERY_S)[0] and not os.read(sys.stdin.fileno(), 1):
            break
    print(json.dumps(peak), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
