import torch, sys
from torch.profiler import profile, ProfilerActivity
from m3compile.bench.distill import DistillBenchConfig, _models
from m3compile.train.distill import DistillConfig, DistillStep
cfg = DistillBenchConfig(model="smollm2-135m", seq_len=8192, batch=2, block=64, topk=8)
dense, sparse, _ = _models(cfg)
x = torch.randint(0, 49152, (2, 8192), device="cuda")
step = DistillStep(sparse, DistillConfig(steps=1, seq_len=8192, batch=2, dtype="bfloat16"), "cuda", sys.argv[1])
for _ in range(3): step(x)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    step(x); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by=sys.argv[2] if len(sys.argv) > 2 else "self_cuda_time_total", row_limit=40, max_name_column_width=60))
