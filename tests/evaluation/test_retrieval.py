"""m3c eval retrieval: a model that provably copies (a hand-built induction circuit) succeeds densely and
fails when MSA may only see the most recent blocks; probes are seeded and planted in real text; bad input."""
import json
import math

import pytest
import torch

from m3compile.errors import M3CompileError
from m3compile.data import load_tokens
from m3compile.models.decoder import Decoder, ModelArgs, MSALayerArgs
from m3compile.evaluation.retrieval import retrieval, text_encoder
from tests.conftest import EVAL_DATA
from tests.cli.test_cli import assert_clean_failure, run

CTX = 5  # tokens of context the induction head matches
CODE = 32  # width of a token's random code


def induction_model(msa: MSALayerArgs | None = None) -> Decoder:
    """A 2-layer byte-level Decoder whose weights are set by hand so that it copies: layer 0 has one head per offset
    o = 1..CTX-1 that attends (by RoPE phase alone, through q/k biases) to position t - o and writes that token's
    code into residual slot o; layer 1's head 0 matches the last CTX tokens at the query (slots 0..CTX-1) against the
    CTX tokens before each key (slots 1..CTX) and copies the key's token into the output slot, which lm_head reads.
    MLPs are zero. Layer 1 is an MSA layer when `msa` is given."""
    d, L = CODE, CTX
    rope = 32
    H, hd = (L + 2) * d, rope + L * d
    args = ModelArgs(vocab_size=256, hidden_size=H, n_layers=2, n_heads=L, n_kv_heads=L, head_dim=hd,
                     intermediate_size=8, rotary_dim=rope, rope_theta=10000.0, qkv_bias=True,
                     sparse_layers=(False, msa is not None), msa=msa)
    model = Decoder(args).eval()
    g = torch.Generator().manual_seed(0)
    codes = torch.randn(256, d, generator=g)
    codes = codes / codes.norm(dim=-1, keepdim=True)
    slot = lambda i: slice(i * d, (i + 1) * d)  # noqa: E731
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in [model.model.norm] + [m for layer in model.model.layers
                                           for m in (layer.input_layernorm, layer.post_attention_layernorm)]:
            norm.weight.fill_(1.0)
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, slot(0)] = codes
        # layer 0: head o attends to t - o. Score = scale * s^2 * sum_i cos((t - j - o) f_i), maximal at j = t - o
        a0 = model.model.layers[0].self_attn
        f = 1.0 / (10000.0 ** (torch.arange(0, rope, 2).float() / rope))
        delta = torch.arange(1, 2048).float()
        margin = float((1 - torch.cos(delta[:, None] * f)).sum(-1).min())  # the runner-up's deficit
        s2 = 40.0 / (margin * hd**-0.5)
        kappa0 = math.sqrt(H)  # the input norm scales a unit code to norm sqrt(H)
        for o in range(1, L):
            qb = a0.q_proj.bias.view(L, hd)[o]
            kb = a0.k_proj.bias.view(L, hd)[o]
            qb[: rope // 2], qb[rope // 2: rope] = math.sqrt(s2) * torch.cos(o * f), -math.sqrt(s2) * torch.sin(o * f)
            kb[: rope // 2] = math.sqrt(s2)
            a0.v_proj.weight.view(L, hd, H)[o, :d, slot(0)] = torch.eye(d) / kappa0
            a0.o_proj.weight.view(H, L, hd)[slot(o), o, :d] = torch.eye(d)
        # layer 1, head 0: q = codes of x_t .. x_{t-L+1}, k = codes of x_{j-1} .. x_{j-L}, v = code of x_j
        a1 = model.model.layers[1].self_attn
        kappa1 = math.sqrt(H / L)  # L unit codes in the residual
        w = math.sqrt(25.0 / (hd**-0.5 * kappa1**2))  # 25 nats of score per matched token
        for l in range(L - 1):
            a1.q_proj.weight[rope + l * d: rope + (l + 1) * d, slot(l)] = w * torch.eye(d)
            a1.k_proj.weight[rope + l * d: rope + (l + 1) * d, slot(l + 1)] = w * torch.eye(d)
        a1.v_proj.weight[:d, slot(0)] = torch.eye(d) / kappa1
        a1.o_proj.weight[slot(L + 1), :d] = torch.eye(d)
        model.lm_head.weight[:, slot(L + 1)] = 12.0 * codes
    return model


@pytest.fixture(scope="module")
def tokens():
    return load_tokens(EVAL_DATA, 256)


def test_dense_copies_and_recent_blocks_only_fail(tokens):
    encode = text_encoder(None, 256)
    recent = MSALayerArgs(index_heads=CTX, index_dim=16, block_size=16, topk=4, init_blocks=0, local_blocks=4)
    report = retrieval(induction_model(recent), tokens, encode, seq_len=512, distances=(200, 400, 1000),
                       probes=8, seed=0)
    assert report.skipped == [1000]
    by = {d.distance: d for d in report.distances}
    for d in (200, 400):
        assert by[d].dense_accuracy >= 0.85, report.to_dict()
        assert by[d].sparse_accuracy <= 0.15, report.to_dict()
        assert by[d].sparse_logprob < by[d].dense_logprob - 5


def test_all_blocks_selected_matches_dense_and_probes_are_seeded(tokens):
    encode = text_encoder(None, 256)
    full = MSALayerArgs(index_heads=CTX, index_dim=16, block_size=16, topk=12)  # 192 tokens: every block
    model = induction_model(full)
    a = retrieval(model, tokens, encode, seq_len=192, distances=(120,), probes=3, seed=3)
    b = retrieval(model, tokens, encode, seq_len=192, distances=(120,), probes=3, seed=3)
    (r,) = a.distances
    assert r.sparse_accuracy == r.dense_accuracy == 1.0 and r.sparse_logprob == pytest.approx(r.dense_logprob, abs=1e-3)
    assert a.to_dict()["distances"] == b.to_dict()["distances"]


def test_bad_input_is_one_line():
    model = induction_model()
    encode = text_encoder(None, 256)
    toks = torch.randint(0, 256, (5000,))
    with pytest.raises(M3CompileError, match="fits --seq-len"):
        retrieval(model, toks, encode, seq_len=128, distances=(1024, 2048))
    with pytest.raises(M3CompileError, match="shorter than the probe"):
        retrieval(model, toks, encode, seq_len=128, distances=(5,))
    with pytest.raises(M3CompileError, match="probes"):
        retrieval(model, toks, encode, seq_len=128, distances=(50,), probes=0)
    with pytest.raises(M3CompileError, match="tokenizer.json"):
        text_encoder(None, 100)


def test_cli_retrieval_with_a_tokenizer_model(tmp_path):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = EVAL_DATA.read_bytes()[:40000].decode("utf-8", errors="replace")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    ckpt = tmp_path / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512)).save_pretrained(ckpt)
    tok.save(str(ckpt / "tokenizer.json"))
    data = tmp_path / "text.txt"
    data.write_text(text)
    code, output = run("eval", "retrieval", ckpt, "--data", data, "--seq-len", 200, "--distances",
                       "60,120,4096", "--probes", 2, "--json")
    assert code == 0, output
    d = json.loads(output)
    assert d["task"] == "retrieval" and d["skipped"] == [4096] and [r["distance"] for r in d["distances"]] == [60, 120]
    assert all(r["sparse_accuracy"] is None and math.isfinite(r["dense_logprob"]) for r in d["distances"])
    code, output = run("eval", "retrieval", ckpt, "--data", data, "--seq-len", 200, "--distances", "60",
                       "--probes", 2)
    assert code == 0 and "retrieval" in output and "dense acc" in output, output
    assert_clean_failure(*run("eval", "retrieval", ckpt, "--data", data, "--seq-len", 200,
                              "--distances", "1024,2048"), None, "fits --seq-len")
    assert_clean_failure(*run("eval", "retrieval", ckpt, "--data", data, "--distances", "1k"), None,
                         "--distances")
