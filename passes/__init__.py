"""Graph passes, one file each. See passes/README.md for the pipeline; m3compile.pipelines puts them in order."""
from m3compile.passes.fuse_msa import FuseMSA
from m3compile.passes.gqa_to_msa import GQAToMSA
from m3compile.passes.kl_distill import KLDistill, StripKLDistill
from m3compile.passes.vit_3d_window import ViT3DWindow

__all__ = ["GQAToMSA", "KLDistill", "StripKLDistill", "ViT3DWindow", "FuseMSA"]
