"""Export a real-size converted model to ONNX and check it in onnxruntime: prints the files' sizes, the export's peak
resident memory and wall time, and the largest logit difference against m3compile.load (fp32) as JSON.

    python3 benchmarks/onnx_large_export.py WORK_DIR --shape 600m                     # synthetic, built and converted
    python3 benchmarks/onnx_large_export.py WORK_DIR --shape qwen2-1.5b --dtype float16
    python3 benchmarks/onnx_large_export.py WORK_DIR --model CONVERTED_DIR --tokens 600   # an already converted model
    python3 benchmarks/onnx_large_export.py WORK_DIR --shape 600m --dtype bfloat16 --provider cuda   # onnxruntime-gpu

A synthetic shape (m3compile.bench.synthetic.SHAPES: random bf16 weights) is written to WORK_DIR/synthetic-SHAPE and
converted (`m3c convert --block-size 64 --topk 4`) once; the export (`m3c export-onnx`) runs in a child process whose
peak RSS is read from wait4. onnxruntime (the --provider's execution provider) then runs one sequence of --tokens
random ids, several blocks long, and its session is freed before m3compile.load computes the reference (fp32, on the
CPU). For an fp16 or bf16 export the same model loaded in that dtype gives PyTorch's own error; --fp64 also compares
both with the fp32 model run in fp64, which tells rounding noise from a real difference.
"""
import argparse
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from m3compile import load
from m3compile.io.shards import SourceTensors
from m3compile.bench.synthetic import write_synthetic_checkpoint

M3C = [sys.executable, "-m", "m3compile.cli"]


def converted(work: Path, shape: str, block: int, topk: int) -> Path:
    src, conv = work / f"synthetic-{shape}", work / f"synthetic-{shape}-msa-{block}-{topk}"
    if not src.exists():
        write_synthetic_checkpoint(src, shape)
    if not conv.exists():
        subprocess.run([*M3C, "convert", str(src), str(conv), "--block-size", str(block), "--topk", str(topk)],
                       check=True, stdout=subprocess.DEVNULL)
    return conv


def export(conv: Path, out: Path, dtype: str, external: str, provider: str) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of `m3c export-onnx` in a child process of its own."""
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    child = subprocess.Popen([*M3C, "export-onnx", str(conv), str(out), "--dtype", dtype, "--external-data", external,
                              "--provider", provider], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        sys.exit(f"export-onnx failed with exit status {child.returncode}")
    return time.perf_counter() - t, usage.ru_maxrss * 1024  # Linux reports KiB


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--shape", default="600m", help="a synthetic shape of m3compile.bench.synthetic.SHAPES")
    ap.add_argument("--model", type=Path, help="an already converted checkpoint instead of a synthetic shape")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--provider", default="cpu", choices=["cpu", "cuda"], help="onnxruntime's execution provider")
    ap.add_argument("--external-data", default="auto", choices=["auto", "always", "never"])
    ap.add_argument("--tokens", type=int, default=400, help="length of the compared sequence")
    ap.add_argument("--fp64", action="store_true", help="also compare with the model run in fp64 (2x its fp32 memory)")
    ap.add_argument("--json-out", type=Path, help="also write the result here")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    conv = a.model or converted(a.work, a.shape, a.block_size, a.topk)
    out = a.work / f"{conv.name}-onnx-{a.dtype}"
    params = sum(math.prod(shape) for shape, _ in SourceTensors(conv).headers.values())
    provider = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}[a.provider]
    if provider not in ort.get_available_providers():
        sys.exit(f"onnxruntime {ort.__version__} here has no {provider} (pip install onnxruntime-gpu)")
    wall, peak = export(conv, out, a.dtype, a.external_data, a.provider)

    cfg = json.loads((conv / "config.json").read_text())
    ids = torch.randint(0, cfg["vocab_size"], (1, a.tokens), generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    session = ort.InferenceSession(str(out / "model.onnx"), providers=[provider])
    (got,) = session.run(None, {"input_ids": ids.numpy()})
    ort_s = time.perf_counter() - t
    del session
    gc.collect()
    if got.dtype == np.uint16:  # bfloat16 logits, as numpy has no bf16
        got = torch.from_numpy(got.view(np.int16)).view(torch.bfloat16).float().numpy()
    got = got.astype(np.float32)
    extra = {}
    with torch.no_grad():
        same = load(conv, dtype=a.dtype)(ids).float().numpy() if a.dtype != "float32" else None
        model = load(conv, dtype="float32")
        want = model(ids).numpy()
        if same is not None:  # PyTorch's own error in that dtype, for scale
            extra["torch_same_dtype_max_abs_diff_vs_fp32"] = float(np.abs(same - want).max())
        if a.fp64:
            want64 = model.double()(ids).numpy()
            extra["max_abs_diff_vs_fp64"] = float(np.abs(got - want64).max())
            extra["torch_fp32_max_abs_diff_vs_fp64"] = float(np.abs(want - want64).max())
    diff = np.abs(got - want)
    msa = model.args.msa
    result = {
        "model": a.model.name if a.model else f"synthetic {a.shape}", "params": params, "dtype": a.dtype,
        "provider": provider,
        "block_size": msa.block_size if msa else None, "topk": msa.topk if msa else None,
        "external_data": (out / "model.onnx.data").exists(), "external_data_mode": a.external_data,
        "files": {p.name: p.stat().st_size for p in sorted(out.iterdir())},
        "fp32_weight_bytes": 4 * params, "peak_rss_bytes": peak, "peak_rss_over_fp32_weights": round(peak / (4 * params), 2),
        "export_s": round(wall, 1), "onnxruntime_load_and_run_s": round(ort_s, 1), "tokens": a.tokens,
        "max_abs_diff_vs_m3compile_load_fp32": float(diff.max()), "max_abs_logit": float(np.abs(want).max()), **extra,
        "torch": torch.__version__, "onnxruntime": ort.__version__,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
