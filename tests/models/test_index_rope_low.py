"""An index head narrower than the rotary width (a cheaper indexer): index rope "low".

Its Di/2 channel pairs turn at the model's Di/2 lowest RoPE frequencies (kernels/norm_rope/index_rope.py), so index scores
depend on relative position only; the init fits exactly those pairs (models/index_init.py); the converter writes
sparse_attention_config.sparse_index_rope "low", and every path (traced graph, reload, lowered kernels, remote code)
runs the same rule.
"""
import json

import pytest
import torch
import transformers

import m3compile
from m3compile import MSAConfig, convert_checkpoint
from m3compile.kernels import norm_rope
from m3compile.kernels.norm_rope.index_rope import index_rope_tables
from m3compile.ops import apply_rope, index_norm_rope, lowering
from m3compile.models.index_init import init_index_weights


def apply_index_rope(x, cos, sin, rope):
    """The index RoPE alone (these tests' reference): the main branch's RoPE on the rule's tables."""
    return apply_rope(x, *index_rope_tables(cos, sin, x.shape[-1], rope))


def tables(T, R, theta=10000.0, offset=0):
    inv = 1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    f = (torch.arange(T, dtype=torch.float64) + offset)[:, None] * inv
    emb = torch.cat((f, f), -1)[None]
    return emb.cos(), emb.sin()


def scores(q, k, cos, sin, rope):
    """[T, T] scores of one query head against one key head, both at every position."""
    qr = apply_index_rope(q.expand(1, cos.shape[1], 1, -1), cos, sin, rope)[0, :, 0]
    kr = apply_index_rope(k.expand(1, cos.shape[1], 1, -1), cos, sin, rope)[0, :, 0]
    return qr @ kr.T


@pytest.mark.parametrize("Di", [2, 6, 8])
def test_low_rule_is_a_rotation_and_keeps_the_lowest_frequencies(Di):
    """Scores under "low" depend on t - s only (M3's cut rule at Di < R does not); the table is the last Di/2
    frequencies of the NeoX table, twice; at Di >= R both rules are the main table."""
    torch.manual_seed(0)
    R, T = 16, 24
    q, k = torch.randn(Di, dtype=torch.float64), torch.randn(Di, dtype=torch.float64)
    cos, sin = tables(T, R)
    s = scores(q, k, cos, sin, "low")
    shifted = scores(q, k, *tables(T, R, offset=57), "low")
    torch.testing.assert_close(s, shifted, rtol=0, atol=1e-10)
    if Di > 2:  # the cut rule mixes two frequencies per pair: not a function of t - s
        assert (scores(q, k, cos, sin, "m3") - scores(q, k, *tables(T, R, offset=57), "m3")).abs().max() > 1e-3
    c, _ = index_rope_tables(cos, sin, Di, "low")
    n = Di // 2
    torch.testing.assert_close(c, torch.cat((cos[..., R // 2 - n:R // 2], cos[..., R // 2 - n:R // 2]), -1))
    for rope in ("m3", "low"):
        torch.testing.assert_close(index_rope_tables(cos, sin, 20, rope)[0], cos)
    with pytest.raises(ValueError, match="even index dim"):
        index_rope_tables(cos, sin, 5, "low")


@pytest.mark.parametrize("T,Di,heads,rope", [(1, 6, 3, "low"), (37, 6, 3, "low"), (40, 4, 1, "low"), (1, 32, 3, "tile"),
                                             (37, 24, 3, "tile"), (40, 32, 1, "tile")])
def test_index_rope_rule_kernels_match_reference(T, Di, heads, rope):
    """The index RoPE kernel and the fused index branch (Triton under the interpreter) against the reference,
    for "low" and "tile" (tests/models/test_index_rope_tile.py): odd lengths and pair counts, a tile that is not a whole
    multiple of R, one token, one head."""
    torch.manual_seed(1)
    R, hidden = 16, 24
    cos, sin = (t.float() for t in tables(T, R))
    x = torch.randn(2, T, heads, Di)
    c, s = index_rope_tables(cos, sin, Di, rope)
    torch.testing.assert_close(norm_rope.rope(x, c, s, width=c.shape[-1]), apply_index_rope(x, cos, sin, rope))
    h = torch.randn(2, T, hidden)
    wq, wk = torch.randn(heads * Di, hidden) / 5, torch.randn(Di, hidden) / 5
    nq, nk = torch.randn(Di) / 3, torch.randn(Di) / 3
    with lowering():
        got = index_norm_rope(torch.cat((h @ wq.T, h @ wk.T), -1), nq, nk, cos, sin, 1e-6, rope)
    from m3compile.kernels.norm_rope import naive as ref
    q = ref.gemma_rms_norm((h @ wq.T).view(2, T, heads, Di), nq, 1e-6)
    k = ref.gemma_rms_norm((h @ wk.T).view(2, T, 1, Di), nk, 1e-6)
    torch.testing.assert_close(got[0], apply_index_rope(q, cos, sin, rope), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], apply_index_rope(k, cos, sin, rope)[:, :, 0], rtol=1e-5, atol=1e-5)


def test_narrow_init_is_exact_on_the_kept_pairs_with_one_kv_head():
    """One KV head: the fit is exact, so the narrow index score equals the dense group-mean logit restricted to the
    Di/2 lowest-frequency pairs, at every pair of positions."""
    torch.manual_seed(2)
    hidden, D, Hq, Di, T = 20, 16, 3, 6, 19
    wq, wk = torch.randn(Hq * D, hidden, dtype=torch.float64), torch.randn(D, hidden, dtype=torch.float64)
    wqi, wki = init_index_weights(wq, wk, n_heads=Hq, n_kv_heads=1, head_dim=D, rope_dim=D, index_dim=Di)
    x = torch.randn(T, hidden, dtype=torch.float64)
    cos, sin = tables(T, D)
    qi = apply_index_rope((x @ wqi.T).view(1, T, 1, Di), cos, sin, "low")[0, :, 0]
    ki = apply_index_rope((x @ wki.T).view(1, T, 1, Di), cos, sin, "low")[0, :, 0]
    qd = apply_rope((x @ wq.T).view(1, T, Hq, D), cos, sin)[0].mean(1)  # group-mean query [T, D]
    kd = apply_rope((x @ wk.T).view(1, T, 1, D), cos, sin)[0, :, 0]
    keep = torch.cat((torch.arange(D // 2 - Di // 2, D // 2), torch.arange(D - Di // 2, D)))
    torch.testing.assert_close(qi @ ki.T, qd[:, keep] @ kd[:, keep].T, rtol=1e-9, atol=1e-9)
    with pytest.raises(m3compile.M3CompileError, match="odd"):
        init_index_weights(wq, wk, n_heads=Hq, n_kv_heads=1, head_dim=D, rope_dim=D, index_dim=5)


SMALL = dict(vocab_size=256, hidden_size=48, intermediate_size=48, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=None, eos_token_id=None)


def test_narrow_index_head_on_every_path(tmp_path):
    """A Llama with head dim 16 (6 query / 2 KV heads, hidden 48) converted with index dim 6 (block 8, top-2; 45 tokens: really sparse): the config
    says "low", and the in-memory graph, the streamed checkpoint reloaded, its lowered kernels and transformers
    with the remote code all give the same logits, and decoding from the paged caches the same greedy tokens; an odd
    narrow index dim is refused."""
    src = every_path(tmp_path, 6, "low")
    with pytest.raises(m3compile.M3CompileError, match="odd"):
        m3compile.convert(m3compile.load(src, dtype="float32"), MSAConfig(block_size=8, topk=2, index_dim=5))


def every_path(tmp_path, index_dim: int, rope: str, onnx: bool = False):
    """SMALL converted at `index_dim` (block 8, top-2, layer 0 dense; 45 tokens): the config names `rope`, and the
    in-memory graph, the reloaded checkpoint, its lowered kernels, the remote code and the ONNX export (onnxruntime)
    give the same logits (the ONNX export only with `onnx`: it costs the suite 15 s a rule), and
    greedy decoding from the paged caches the remote code's tokens. Returns the source checkpoint's directory."""
    torch.manual_seed(3)
    src = tmp_path / "src"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval().save_pretrained(src)
    cfg = MSAConfig(block_size=8, topk=2, dense_layers=(0,), index_dim=index_dim)
    convert_checkpoint(src, tmp_path / "conv", cfg)
    sparse = json.loads((tmp_path / "conv" / "config.json").read_text())["sparse_attention_config"]
    assert sparse["sparse_index_rope"] == rope and sparse["sparse_index_dim"] == index_dim
    assert f"x{index_dim} rope {rope}, block 8" in (tmp_path / "conv" / "conversion_report.json").read_text()
    reloaded = m3compile.load(tmp_path / "conv", dtype="float32")
    assert reloaded.args.msa.index_rope == rope
    gm, _ = m3compile.convert(m3compile.load(src, dtype="float32"), cfg)
    x = torch.randint(0, 256, (2, 45))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "conv", trust_remote_code=True,
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        want = reloaded(x)
        outputs = {"in-memory graph": gm(x), "lowered": m3compile.lower(reloaded)(x), "remote code": hf(x).logits}
    for name, got in outputs.items():
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    prompt = x[0, :30].tolist()  # decode from the paged caches at 30-35: past top-2 x 8 tokens
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, 30:].tolist()
    assert m3compile.generate(reloaded, [prompt], 6, kernels=False).tokens[0] == theirs
    if onnx:
        import onnxruntime as ort
        session = ort.InferenceSession(str(m3compile.export_onnx(tmp_path / "conv", tmp_path / "onnx")))
        got = session.run(None, {session.get_inputs()[0].name: x[:1].numpy()})[0]
        torch.testing.assert_close(torch.from_numpy(got), want[:1], rtol=1e-4, atol=1e-4, msg=lambda m: f"onnx: {m}")
    return src
