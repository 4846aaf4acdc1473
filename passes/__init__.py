"""Graph passes, one file each. See passes/README.md for the pipeline."""
from passes.gqa_to_msa import GQAToMSA
from passes.kl_distill import KLDistill
from passes.lower_triton import LowerTriton
from passes.vit_3d_window import ViT3DWindow

__all__ = ["GQAToMSA", "KLDistill", "LowerTriton", "ViT3DWindow"]
