"""What the node's weight hash costs: `provider.models.weight_hash` (sha256 of a GGUF file, cached
by path, size and modification time in `weight_hashes.json`) on a file of a few hundred MB made by
concatenating copies of the bundled SmolLM2 GGUF in a temporary directory.

Three cases, each timed over several rounds (the median is printed, with the range):

- cold: no cache entry, the file's pages dropped from the page cache first (posix_fadvise
  DONTNEED after an fsync), so the disk is read — the first start of a node on a model it never
  hashed;
- page cache: no cache entry, the file already in memory — what `models pull` pays to check the
  file it has just written;
- cached: the second call, answered from `weight_hashes.json` — every later start of the node.

Run: PYTHONPATH=src .venv/bin/python bench/weight_hash.py [--copies 4] [--rounds 3]
Prints a table; record it in bench/RESULTS.md with the date and machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from darkbloom.provider.bundled_model import bundled_gguf_path
from darkbloom.provider.models import HASH_CACHE_NAME, weight_hash


def build_file(directory: Path, copies: int) -> Path:
    source = bundled_gguf_path()
    target = directory / f"smollm2-x{copies}.gguf"
    with target.open("wb") as out:
        for _ in range(copies):
            with source.open("rb") as part:
                shutil.copyfileobj(part, out, 16 << 20)
        out.flush()
        os.fsync(out.fileno())
    return target


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(rounds: int, before: Callable[[], None], call: Callable[[], str]) -> list[float]:
    seconds = []
    for _ in range(rounds):
        before()
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=4, help="copies of the bundled GGUF in the file")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="darkbloom-bench-hash-") as scratch:
        directory = Path(scratch)
        path = build_file(directory, args.copies)
        cache = directory / HASH_CACHE_NAME
        size = path.stat().st_size

        def forget() -> None:
            cache.unlink(missing_ok=True)

        def forget_and_drop() -> None:
            forget()
            drop_page_cache(path)

        def hash_once() -> str:
            return weight_hash(path, cache)

        hash_once()  # warms the interpreter (hashlib, json) and the page cache
        cases = [("cold (disk read)", timed(args.rounds, forget_and_drop, hash_once)),
                 ("page cache", timed(args.rounds, forget, hash_once))]
        hash_once()
        cases.append(("cached (second call)", timed(args.rounds, lambda: None, hash_once)))

    gigabytes = size / 1e9
    print(f"weight_hash on {size / 1e6:.1f} MB ({args.copies} x the bundled GGUF), {args.rounds} rounds, "
          f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print()
    print("| case | median | range | per GB | throughput |")
    print("|---|---|---|---|---|")
    for name, seconds in cases:
        median = statistics.median(seconds)
        per_gb = median / gigabytes
        rate = f"{gigabytes / median:.2f} GB/s" if median >= 1e-3 else "—"
        print(f"| {name} | {_duration(median)} | {_duration(min(seconds))} – {_duration(max(seconds))} | "
              f"{_duration(per_gb)} | {rate} |")


def _duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


if __name__ == "__main__":
    main()
