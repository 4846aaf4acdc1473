"""Kernels: per op, the plain-torch reference beside the fast implementations.

One package per op, laid out as flash-linear-attention's fla/ops/<op>/:

    kernels/<op>/__init__.py    the op's launchers, autograd.Function and public functions (`m3compile.kernels.<op>`)
    kernels/<op>/naive.py       its plain-torch reference: fp32, query-chunked, obviously correct
    kernels/<op>/_tl_*.py       its Triton kernels, imported when a kernel is first launched
    kernels/naive_common.py     what the references share (fp32 upcast, query chunking, input checks, fp8 quantisation)
    kernels/_common.py          what the launchers share; kernels/_tl_common.py: what the Triton kernels share

Importing this package, an op's package or a naive module imports no Triton code; each fast kernel is imported
when first used.
"""
