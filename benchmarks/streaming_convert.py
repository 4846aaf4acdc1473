"""Convert a synthetic 7B Llama-style checkpoint (bf16, ~12.9 GB) and report wall time and
peak resident memory, against a plain copy of the same bytes on the same disk.

    python3 benchmarks/streaming_convert.py WORK_DIR [--shape 7b] [--max-shard-size 5GB]
"""
import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from m3compile.bench.synthetic import write_synthetic_checkpoint


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--shape", default="7b")
    ap.add_argument("--max-shard-size", default="5GB")
    a = ap.parse_args()
    src, out, copy = a.work / f"synthetic-{a.shape}", a.work / f"synthetic-{a.shape}-msa", a.work / "copy"
    if not src.exists():
        t = time.perf_counter()
        write_synthetic_checkpoint(src, a.shape)
        print(f"wrote {src} in {time.perf_counter() - t:.1f} s")
    shards = sorted(src.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in shards)
    largest = max(f.stat().st_size for f in shards)
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir(parents=True)
    t = time.perf_counter()
    for f in shards:
        shutil.copyfile(f, copy / f.name)
    subprocess.run(["sync"], check=True)
    copy_s = time.perf_counter() - t
    shutil.rmtree(copy)
    cmd = [sys.executable, "-m", "m3compile.cli", "convert", str(src), str(out), "--force", "--max-shard-size", a.max_shard_size,
           "--json"]
    t = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["sync"], check=True)
    convert_s = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # bytes (Linux reports KiB)
    result = {
        "shape": a.shape, "source_bytes": total, "source_shards": len(shards), "largest_shard_bytes": largest,
        "copy_s": round(copy_s, 1), "convert_s": round(convert_s, 1), "convert_over_copy": round(convert_s / copy_s, 2),
        "peak_rss_bytes": peak, "rss_target_bytes": 2 * largest + 10**9,
        "output_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
