"""Kernels: per op, the plain-torch reference beside the fast implementations.

Importing this package imports no Triton code; each fast kernel is imported when first used.
"""
