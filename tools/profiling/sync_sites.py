"""A ``deepinfer`` command with every call that makes the host wait for the device counted by call site.

    python tools/profiling/sync_sites.py bench structured --model deepinfer-tiny-v4.1 --batch-size 32

torch's sync debug mode warns at each synchronizing CUDA call (``.item()``, a copy to pageable host memory, ...);
here each warning is counted by the five frames above it, and the most frequent sites are printed when the command
ends: a wait hidden inside a host phase of a step shows up as a site with one count per step. CUDA only.
"""

from __future__ import annotations

import collections
import sys
import traceback
import warnings

import torch


def main(argv: list[str]) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("sync_sites.py counts CUDA synchronizations: it needs a GPU")
    sites: collections.Counter[str] = collections.Counter()
    shown = warnings.showwarning

    def count(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing" not in str(message):
            shown(message, category, filename, lineno, file, line)
            return
        frames = traceback.extract_stack()[-6:-1]
        sites[" <- ".join(f"{f.filename.rsplit('/deepinfer/', 1)[-1]}:{f.lineno}" for f in reversed(frames))] += 1

    warnings.showwarning = count
    warnings.simplefilter("always")  # a site warns on every call, not only its first
    torch.cuda.set_sync_debug_mode("warn")
    from deepinfer.cli import main as deepinfer_main

    try:
        deepinfer_main(argv)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        for site, n in sites.most_common(12):
            print(f"{n:8d}  {site}")


if __name__ == "__main__":
    main(sys.argv[1:])
