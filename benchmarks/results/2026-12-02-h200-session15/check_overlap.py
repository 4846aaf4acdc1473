"""GPU check: sparse attention over several query chunks (two partial buffers, the combine on a side stream) against
one chunk (one buffer, no side stream), 128K, Llama-3-8B and M3 attention shapes. Prints one JSON line per shape."""
import json
import torch
from m3compile.kernels import sparse_attention as sa
from m3compile.kernels.indexer import select_blocks

for H, Hkv in ((32, 8), (64, 4)):
    T, D = 131072, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    q, k, v = (rnd(1, T, n, D).transpose(1, 2) for n in (H, Hkv, Hkv))
    blocks = select_blocks(rnd(1, T, Hkv, 128), rnd(1, T, 128), block_size=128, topk=16)
    many = sa.sparse_attention(q, k, v, blocks, block_size=128)
    torch.cuda.synchronize()
    one = sa.sparse_attention(q, k, v, blocks, block_size=128, max_partial_bytes=1 << 40)
    torch.cuda.synchronize()
    err = ((many.float() - one.float()).norm() / one.float().norm()).item()
    print(json.dumps(dict(heads=H, kv_heads=Hkv, T=T, rel_err_chunks_vs_one=err,
                          max_abs=(many.float() - one.float()).abs().max().item())), flush=True)
    del q, k, v, blocks, many, one
    torch.cuda.empty_cache()
