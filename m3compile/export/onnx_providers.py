"""Which onnxruntime execution providers run model.onnx in which dtype, and the check of an exported graph.

    dtype      CPUExecutionProvider                              CUDAExecutionProvider
    float32    runs                                              runs
    float16    runs (the CPU provider casts the inputs of the    runs (every operator of the graph has an fp16
               operators it has no fp16 kernel for to fp32       CUDA kernel)
               and back, so part of the compute is fp32)
    bfloat16   does not run: the CPU provider has bf16 kernels   runs (every operator that sees bf16 has a bf16
               for data movement only (no Mul, MatMul,           CUDA kernel; the MSA function computes in fp32)
               Softmax), and casts only float16 itself

The CPU column is measured (tests/export/test_onnx.py, onnxruntime 1.32). The CUDA column is read from
onnxruntime's kernel registry (docs/OperatorKernels.md, CUDAExecutionProvider): ops that have no bf16 CUDA kernel
(TopK, Pad, ReduceMax, ReduceMean, Reciprocal, Sin, Cos, Equal, Greater, Less, Range) see only fp32 or integer
inputs in the exported graph, which `missing_kernels` checks on every bf16 export for CUDA.
"""
from __future__ import annotations

from m3compile.errors import M3CompileError

__all__ = ["DTYPES", "PROVIDERS", "EXTERNAL_DATA", "RUNS", "check_pair", "missing_kernels", "CUDA_BF16_OPS"]

DTYPES = ("float32", "float16", "bfloat16")
PROVIDERS = ("cpu", "cuda")
EXTERNAL_DATA = ("auto", "always", "never")  # export-onnx --external-data
RUNS = {  # (dtype, provider) -> whether onnxruntime runs the exported graph (see the table above)
    ("float32", "cpu"): True, ("float16", "cpu"): True, ("bfloat16", "cpu"): False,
    ("float32", "cuda"): True, ("float16", "cuda"): True, ("bfloat16", "cuda"): True,
}

# ai.onnx operators with a bfloat16 CUDA kernel at opset 20 (onnxruntime docs/OperatorKernels.md)
CUDA_BF16_OPS = frozenset({
    "Abs", "Add", "Cast", "CastLike", "Compress", "Concat", "ConstantOfShape", "Div", "Dropout", "Erf", "Exp", "Expand",
    "Flatten", "Gather", "GatherElements", "GatherND", "Gelu", "Gemm", "Identity", "IsInf", "IsNaN",
    "LayerNormalization", "MatMul", "Max", "Min", "Mul", "Neg", "Pow", "ReduceSum", "Relu", "Reshape",
    "ScatterElements", "ScatterND", "Shape", "Sigmoid", "Sign", "Size", "Slice", "Softmax", "Split", "Sqrt",
    "Squeeze", "Sub", "Sum", "Tanh", "Tile", "Transpose", "Trilu", "Unsqueeze", "Where",
})


def check_pair(dtype: str, provider: str) -> None:
    """A one-line error for a dtype or provider this export does not know, or a pair onnxruntime does not run."""
    if dtype not in DTYPES:
        raise M3CompileError(f"unknown dtype {dtype!r} for the ONNX export (use one of {', '.join(DTYPES)})")
    if provider not in PROVIDERS:
        raise M3CompileError(f"unknown onnxruntime provider {provider!r} (use one of {', '.join(PROVIDERS)})")
    if not RUNS[dtype, provider]:
        runs = [d for d in DTYPES if RUNS[d, provider]]
        where = [p for p in PROVIDERS if RUNS[dtype, p]]
        raise M3CompileError(
            f"onnxruntime's {provider.upper()} provider cannot run a {dtype} graph (it has no {dtype} kernels for "
            f"Mul, MatMul or Softmax): export {' or '.join(runs)} for {provider.upper()}, or {dtype} with "
            f"--provider {' or '.join(where)}")


def missing_kernels(model, dtype: str, provider: str) -> list[str]:
    """The operators of the exported ir.Model's main graph (and its subgraphs) that see a `dtype` input the provider
    has no kernel for, as "Op(dtype)"; the custom-domain nodes are left out (their functions compute in fp32)."""
    if (dtype, provider) != ("bfloat16", "cuda"):
        return []  # fp32 everywhere, fp16 on CUDA (every op the exporter emits) and on CPU (cast by onnxruntime)
    import onnx_ir as ir

    missing = set()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        if any(v is not None and v.dtype == ir.DataType.BFLOAT16 for v in node.inputs) \
                and node.op_type not in CUDA_BF16_OPS:
            missing.add(f"{node.op_type}(bfloat16)")
    return sorted(missing)
