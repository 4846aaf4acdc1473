"""`m3c bench`: what the project's figures are measured with, one module per subcommand.

    kernels.py   `m3c bench kernels`, `backward`, `vision`: the Triton kernels against dense SDPA and FlexAttention
    model.py     `m3c bench model`: the whole model, dense against converted and lowered (time to first token, decode)
    distill.py   `m3c bench distill`: distillation and training steps against the frozen dense forward
    common.py    what the model benches share: their models, CUDA-event timing, per-stage profiler attribution
    op_count.py  a step's host dispatches (aten ops, Triton launches) by layer and stage, counted without a GPU

Only the command line and the tests import this package; the library (m3compile outside bench/) never does.
"""
