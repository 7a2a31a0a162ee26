"""How long the manifest check of a saved model takes: write a model-sized folder, record it, verify it.

    mamba-parallel bench verify [--gb 14] [--files 3] [--workers N] [--dir PATH] [--json PATH]

The folder mimics a sharded bf16 model folder (``--gb`` 14 ~ a 7B model: 7e9 parameters x 2 bytes) split into
``--files`` shards of random bytes. Times the manifest write (hash + fsync, what ``save_pretrained`` adds) and the
verification (what every load adds), and prints both with the rate and the time extrapolated to 14 GB (a 7B
bf16 model folder) and to 84 GB (a 7B training checkpoint: fp32 weights + AdamW's two moments). The files were
just written, so they are read from the page cache: the figure is the hashing rate on this machine's cores; a
cold read is bounded by the disk instead (the larger of the two times applies).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

from mamba_parallel import manifest as mf

SEVEN_B_MODEL_GB = 14.0
SEVEN_B_CHECKPOINT_GB = 84.0


def _write_shards(folder: str, total: int, files: int) -> list[str]:
    block = os.urandom(64 << 20)
    names = []
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        left = total // files + (total % files if i == files - 1 else 0)
        with open(os.path.join(folder, name), "wb") as fh:
            while left > 0:
                n = min(left, len(block))
                fh.write(block[:n])
                left -= n
        names.append(name)
    return names


def run(gb: float, files: int, workers: int | None, base: str | None) -> dict:
    folder = tempfile.mkdtemp(prefix="bench-verify-", dir=base)
    try:
        total = int(gb * 1e9)
        names = _write_shards(folder, total, files)
        t0 = time.perf_counter()
        mf.write_manifest(folder, names, writer="bench verify", workers=workers)
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        mf.verify_folder(folder, workers=workers)
        t_verify = time.perf_counter() - t0
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rate = total / t_verify / 1e9
    return {"bytes": total, "files": files, "workers": mf._workers(workers), "cpus": os.cpu_count(),
            "manifest_write_s": round(t_write, 3), "verify_s": round(t_verify, 3), "verify_gb_per_s": round(rate, 3),
            "verify_7b_model_s": round(SEVEN_B_MODEL_GB / rate, 2),
            "verify_7b_checkpoint_s": round(SEVEN_B_CHECKPOINT_GB / rate, 2),
            "measured_at_7b_scale": abs(gb - SEVEN_B_MODEL_GB) < 0.5, "source": "page cache (files just written)"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mamba-parallel bench verify", description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=SEVEN_B_MODEL_GB, help="folder size in GB (default: 14, a 7B bf16 "
                                                                     "model)")
    p.add_argument("--files", type=int, default=3, help="number of shards (default: 3)")
    p.add_argument("--workers", type=int, default=None, help="hashing threads (default: one per CPU core)")
    p.add_argument("--dir", default=None, help="where to write the folder (default: the system temp folder)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the result here")
    args = p.parse_args(argv)
    if args.gb <= 0 or args.files < 1:
        p.error("--gb must be > 0 and --files >= 1")
    free = shutil.disk_usage(args.dir or tempfile.gettempdir()).free
    if free < args.gb * 1e9 * 1.05:
        p.error(f"--gb {args.gb}: only {free / 1e9:.1f} GB free in {args.dir or tempfile.gettempdir()}")
    result = run(args.gb, args.files, args.workers, args.dir)
    print(f"{result['bytes'] / 1e9:.1f} GB in {result['files']} files, {result['workers']} threads on "
          f"{result['cpus']} CPUs: manifest written in {result['manifest_write_s']:.2f} s, verified in "
          f"{result['verify_s']:.2f} s ({result['verify_gb_per_s']:.2f} GB/s) -> 7B model folder (14 GB) "
          f"{result['verify_7b_model_s']:.1f} s, 7B training checkpoint (84 GB) {result['verify_7b_checkpoint_s']:.1f} s")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
