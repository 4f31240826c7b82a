"""What verifying a checkpoint's manifest costs: CRC-32 throughput from the page cache and from the disk.

    python benchmarks/checkpoint_verify.py [--gib 2] [--dir /tmp] [--files 8]

Writes a file of `--gib` GiB of random bytes in `--dir`, then times `spmd_grpo.run.manifest.file_crc32` on
it twice: right after writing (the pages are cached: what the save's own checksums cost) and after
`posix_fadvise(DONTNEED)` has dropped that file's pages (a resume on a fresh node reads from the disk). Also
times the hashes the manifest could have used, in memory. Prints MB/s and what a 7B checkpoint would take at
each rate: the checkpoint holds the fp32 master weights (28 GB) and Adam's two moments (56 GB), ~85 GB.
Then splits the same bytes over `--files` files with a manifest (a checkpoint's per-rank shards) and times
`verify_manifest(checksums=True)` from the disk, one file at a time and `VERIFY_THREADS` at a time, in the
same run: the ratio is what the parallel reads give on this machine's storage and cores.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHECKPOINT_7B_GB = 85.0


def _rate(label: str, nbytes: int, seconds: float) -> None:
    mbps = nbytes / seconds / 1e6
    print(
        f"{label:<34} {mbps:8.0f} MB/s   7B checkpoint ({CHECKPOINT_7B_GB:.0f} GB): {CHECKPOINT_7B_GB * 1e3 / mbps:6.0f} s"
    )


def main() -> None:
    from spmd_grpo.run.manifest import file_crc32

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--files", type=int, default=8)
    args = ap.parse_args()
    nbytes = int(args.gib * (1 << 30))
    if nbytes <= 0:
        ap.error(f"--gib must be > 0, got {args.gib}")
    block = os.urandom(64 << 20)
    for name, fn in [("crc32", zlib.crc32), ("blake2b", lambda b: hashlib.blake2b(b).digest())]:
        start = time.perf_counter()
        fn(block)
        _rate(f"{name}, in memory", len(block), time.perf_counter() - start)
    with tempfile.NamedTemporaryFile(dir=args.dir) as f:
        for offset in range(0, nbytes, len(block)):  # exactly --gib GiB: whole blocks, then the rest
            f.write(block[: nbytes - offset])
        f.flush()
        os.fsync(f.fileno())
        size = os.path.getsize(f.name)
        start = time.perf_counter()
        file_crc32(Path(f.name))
        _rate("file_crc32, page cache", size, time.perf_counter() - start)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        file_crc32(Path(f.name))
        _rate("file_crc32, from disk", size, time.perf_counter() - start)
    _parallel(block, nbytes, args.files, Path(args.dir))


def _parallel(block: bytes, nbytes: int, num_files: int, where: Path) -> None:
    from spmd_grpo.run import manifest

    with tempfile.TemporaryDirectory(dir=where) as d:
        root, names = Path(d), [f"__{i}_0.distcp" for i in range(num_files)]
        for name in names:
            with open(root / name, "wb") as f:
                left = nbytes // num_files
                while left > 0:
                    f.write(block[:left])
                    left -= len(block)
                f.flush()
                os.fsync(f.fileno())  # written back, so that dropping the pages below drops them
        manifest.write_manifest(root, manifest.file_entries(root, names))
        timings = {}
        for threads in (1, manifest.VERIFY_THREADS):
            for name in names:  # from the disk, as a resume on a fresh node reads them
                with open(root / name, "rb") as f:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            manifest.VERIFY_THREADS = threads
            start = time.perf_counter()
            assert manifest.verify_manifest(root, checksums=True) == []
            timings[threads] = time.perf_counter() - start
            _rate(f"verify_manifest, {num_files} files, {threads} threads", nbytes, timings[threads])
        print(f"parallel / one at a time: {timings[1] / timings[max(timings)]:.2f}x faster")


if __name__ == "__main__":
    main()
