"""The ONNX function of one MSA layer: `m3compile::MSA`, a body of standard operators (see m3compile.export.onnx).

Kept apart from m3compile.export.onnx (and without postponed annotations) because onnxscript reads the annotations of the
function it compiles; importing this module registers the op's schema with onnx.
"""
import onnx
import onnxscript
from onnx.defs import OpSchema
from onnxscript import FLOAT
from onnxscript import opset20 as op

MSA_DOMAIN = "m3compile"

if not onnx.defs.has("MSA", MSA_DOMAIN):
    T = "T"
    onnx.defs.register_schema(OpSchema(
        "MSA", MSA_DOMAIN, 1,
        inputs=[OpSchema.FormalParameter(n, T) for n in ("q", "k", "v", "q_idx", "k_idx")],
        outputs=[OpSchema.FormalParameter("out", T)],
        type_constraints=[(T, ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
        attributes=[OpSchema.Attribute(a, OpSchema.AttrType.INT, "") for a in
                    ("block_size", "topk", "init_blocks", "local_blocks", "min_blocks")]
        + [OpSchema.Attribute(a, OpSchema.AttrType.FLOAT, "") for a in ("scale", "top_p")],
    ))
m3 = onnxscript.values.Opset(MSA_DOMAIN, 1)


@onnxscript.script(m3, default_opset=op)
def MSA(q_in: FLOAT, k_in: FLOAT, v_in: FLOAT, q_idx_in: FLOAT, k_idx_in: FLOAT, block_size: int, topk: int,
        init_blocks: int, local_blocks: int, scale: float, top_p: float, min_blocks: int) -> FLOAT:
    # computed in fp32 whatever the model's dtype, as the reference kernels do (kernels/indexer/naive.py,
    # kernels/sparse_attention/naive.py); the output comes back in the input's dtype
    q = op.Cast(q_in, to=1)
    k = op.Cast(k_in, to=1)
    v = op.Cast(v_in, to=1)
    q_idx = op.Cast(q_idx_in, to=1)
    k_idx = op.Cast(k_idx_in, to=1)
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    bs = op.Constant(value_int=block_size)
    neg = op.CastLike(op.Constant(value_float=float("-inf")), q)
    pos_inf = op.CastLike(op.Constant(value_float=float("inf")), q)
    # index scores s[b, g, t, j] = q_idx . k_idx / sqrt(Di), keys after the query masked before pooling
    qi = op.Transpose(q_idx, perm=[0, 2, 1, 3])
    ki = op.Unsqueeze(op.Transpose(k_idx, perm=[0, 2, 1]), op.Constant(value_ints=[1]))
    di = op.Cast(op.Shape(q_idx, start=3), to=1)
    s = op.Div(op.MatMul(qi, ki), op.Sqrt(op.CastLike(di, q)))
    t_len = op.Shape(q, start=2, end=3)
    pos = op.Range(zero, op.Squeeze(t_len), one)
    future = op.Greater(op.Unsqueeze(pos, op.Constant(value_ints=[0])), op.Unsqueeze(pos, op.Constant(value_ints=[1])))
    s = op.Where(future, neg, s)
    # block max over blocks of block_size keys (the tail block padded with -inf)
    nb = op.Div(op.Add(t_len, op.Sub(bs, one)), bs)
    padded = op.Mul(nb, bs)
    pads = op.Concat(op.Constant(value_ints=[0, 0, 0, 0, 0, 0, 0]), op.Sub(padded, t_len), axis=0)
    s_pad = op.Pad(s, pads, neg)
    shape5 = op.Concat(op.Shape(s, start=0, end=3), nb, op.Reshape(bs, op.Constant(value_ints=[1])), axis=0)
    scores = op.ReduceMax(op.Reshape(s_pad, shape5), op.Constant(value_ints=[-1]), keepdims=0)
    # visible and forced blocks (the local blocks and the first init_blocks), then top-k; -inf slots are empty
    blk = op.Range(zero, op.Squeeze(nb), one)
    qb = op.Div(pos, bs)
    blk_row = op.Unsqueeze(blk, op.Constant(value_ints=[0]))
    visible = op.LessOrEqual(blk_row, op.Unsqueeze(qb, op.Constant(value_ints=[1])))
    recent = op.Greater(blk_row, op.Unsqueeze(op.Sub(qb, op.Constant(value_int=local_blocks)), op.Constant(value_ints=[1])))
    first = op.Less(blk_row, op.Constant(value_int=init_blocks))
    # local blocks win over init blocks when the forced blocks outnumber the slots (as kernels/indexer/naive.py)
    big = op.CastLike(op.Constant(value_float=3.4028234663852886e38), q)
    # the adaptive budget's normaliser: the log-sum-exp of the candidates' logits (visible, not forced)
    cand = op.Where(op.And(visible, op.Not(op.Or(first, recent))), scores, neg)
    c_max = op.ReduceMax(cand, op.Constant(value_ints=[-1]), keepdims=1)
    c_max = op.Where(op.Equal(c_max, neg), op.CastLike(op.Constant(value_float=0.0), q), c_max)
    lse = op.Add(op.Log(op.ReduceSum(op.Exp(op.Sub(cand, c_max)), op.Constant(value_ints=[-1]), keepdims=1)), c_max)
    scores = op.Where(op.And(visible, first), big, op.Where(visible, scores, neg))
    scores = op.Where(op.And(visible, recent), pos_inf, scores)
    kk = op.Min(op.Reshape(op.Constant(value_int=topk), op.Constant(value_ints=[1])), nb)
    vals, idx = op.TopK(scores, kk, axis=-1)  # best first: the forced blocks, then the candidates
    valid = op.Not(op.Equal(vals, neg))
    # adaptive budget (top_p < 1): a candidate stays while the mass before it is below top_p, or while fewer than
    # min_blocks blocks are kept; top_p 1 keeps every slot (the fixed top-k)
    forced = op.GreaterOrEqual(vals, big)
    zero_p = op.CastLike(op.Constant(value_float=0.0), q)
    prob = op.Where(op.And(valid, op.Not(forced)), op.Exp(op.Sub(vals, lse)), zero_p)
    before = op.CumSum(prob, op.Constant(value_int=-1), exclusive=1)
    p_cut = op.CastLike(op.Constant(value_float=top_p), q)
    slot = op.Range(zero, op.Squeeze(kk), one)
    fixed = op.GreaterOrEqual(p_cut, op.CastLike(op.Constant(value_float=1.0), q))
    keep = op.Or(op.Or(forced, fixed), op.Or(op.Less(before, p_cut), op.Less(slot, op.Constant(value_int=min_blocks))))
    valid = op.And(valid, keep)
    hit = op.And(op.Equal(op.Unsqueeze(idx, op.Constant(value_ints=[-1])), blk),
                 op.Unsqueeze(valid, op.Constant(value_ints=[-1])))
    sel = op.ReduceMax(op.Cast(hit, to=1), op.Constant(value_ints=[3]), keepdims=0)  # [B, H, T, NB]
    sel_keys = op.Expand(op.Unsqueeze(sel, op.Constant(value_ints=[-1])),
                         op.Concat(op.Shape(sel), op.Reshape(bs, op.Constant(value_ints=[1])), axis=0))
    sel_keys = op.Reshape(sel_keys, op.Concat(op.Shape(sel, start=0, end=3), padded, axis=0))
    sel_keys = op.Slice(sel_keys, op.Constant(value_ints=[0]), t_len, op.Constant(value_ints=[3]))
    support = op.And(op.Cast(sel_keys, to=9), op.Not(future))
    # attention of the G query heads of each group over its support
    hkv = op.Shape(k, start=1, end=2)
    g = op.Div(op.Shape(q, start=1, end=2), hkv)
    qg = op.Reshape(q, op.Concat(op.Shape(q, start=0, end=1), hkv, g, t_len, op.Shape(q, start=3), axis=0))
    kt = op.Unsqueeze(op.Transpose(k, perm=[0, 1, 3, 2]), op.Constant(value_ints=[2]))
    a = op.Mul(op.MatMul(qg, kt), op.CastLike(op.Constant(value_float=scale), q))
    a = op.Where(op.Unsqueeze(support, op.Constant(value_ints=[2])), a, neg)
    o = op.MatMul(op.Softmax(a, axis=-1), op.Unsqueeze(v, op.Constant(value_ints=[2])))
    return op.CastLike(op.Reshape(o, op.Shape(q)), q_in)


def translate(q, k, v, q_idx, k_idx, block_size: int, topk: int, init_blocks: int, local_blocks: int,
              scale: float, top_p: float = 1.0, min_blocks: int = 0):
    """torch.ops.m3compile.msa -> one m3compile::MSA node (its function body is added to the model afterwards)."""
    return m3.MSA(q, k, v, q_idx, k_idx, block_size=block_size, topk=topk, init_blocks=init_blocks,
                  local_blocks=local_blocks, scale=scale, top_p=top_p, min_blocks=min_blocks)
