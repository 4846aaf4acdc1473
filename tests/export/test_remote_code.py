"""Converted checkpoints in `transformers` (remote code, m3compile.export.remote_code): the MSA model that
modeling_m3compile.py builds gives m3compile.load's logits (fp32, 1e-4) and m3compile.generate's greedy tokens, on
tiny Llama / Qwen2 / Qwen3 shapes and on the byte-level model at block 64 / top-8; a load without remote code fails or,
through the dense class named explicitly, runs dense; older checkpoints and distill / train outputs keep working."""
import ast
import io
import json
import sys

import pytest
import torch
import transformers

import m3compile
from m3compile import DistillConfig, MSAConfig, TrainConfig, convert_checkpoint
from m3compile.data import load_tokens
from m3compile.export.remote_code import MODELING_FILE
from m3compile.io.hf_config import REMOTE_MODEL_TYPE
from tests.conftest import CALIB_DATA, EVAL_DATA, LLAMA_BYTE

BASE = dict(vocab_size=256, hidden_size=48, intermediate_size=40, num_hidden_layers=3, max_position_embeddings=512,
            bos_token_id=None, eos_token_id=None)
TINY = {  # source models with what each adds to the modeling file's path
    "llama3-rope": (transformers.LlamaConfig, dict(num_attention_heads=6, num_key_value_heads=2, head_dim=8, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 500000.0})),
    "qwen2-bias-tied": (transformers.Qwen2Config, dict(num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=True)),
    "qwen3-qknorm": (transformers.Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16)),
}
TINY_MSA = MSAConfig(block_size=8, topk=2, dense_layers=(0,))  # 45 tokens: 6 blocks, 2 selected: really sparse


def hf_load(path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32,
                                                             **kwargs).eval()


def tiny_source(case, path, shapes=TINY):
    cls, extra = shapes[case]
    model = transformers.AutoModelForCausalLM.from_config(cls(**dict(BASE, **extra)))
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    model.eval().save_pretrained(path)
    return path


def assert_same_model(path, x, prompt, steps):
    """transformers with remote code against m3compile: logits of x (fp32, 1e-4), greedy tokens after prompt."""
    hf, ours = hf_load(path), m3compile.load(path, dtype="float32")
    assert type(hf).__name__ == "M3CompileForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), rtol=1e-4, atol=1e-4)
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, return_dict_in_generate=True)
    got = out.sequences[0, len(prompt):].tolist()
    assert got == m3compile.generate(ours, [prompt], steps, kernels=False).tokens[0]  # the CLI's choice on a CPU
    cache = getattr(out, "cache", None) or out.past_key_values  # transformers 5.2x / earlier
    assert cache.get_seq_length() == len(prompt) + steps - 1  # decoded token by token from the cache
    return hf, ours


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Each tiny source converted (layer 0 dense, block 8, top-2)."""
    root = tmp_path_factory.mktemp("remote")
    out = {}
    for case in TINY:
        src = tiny_source(case, root / f"{case}-src")
        convert_checkpoint(src, root / case, TINY_MSA)
        out[case] = root / case
    return out


@pytest.fixture(scope="module")
def llama_byte(tmp_path_factory):
    out = tmp_path_factory.mktemp("remote") / "llama-byte-msa"
    convert_checkpoint(LLAMA_BYTE, out, MSAConfig(block_size=64, topk=8, dense_layers=(0,)))
    return out


@pytest.mark.parametrize("case", list(TINY))
def test_tiny_models_match_m3compile(tiny, case):
    cfg = json.loads((tiny[case] / "config.json").read_text())
    assert cfg["model_type"] == REMOTE_MODEL_TYPE and cfg["source_model_type"] == TINY[case][0].model_type
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_m3compile.M3CompileForCausalLM"
    x = torch.randint(0, 256, (2, 45))
    hf, _ = assert_same_model(tiny[case], x, x[0, :30].tolist(), 6)  # decode at 30-35: past top-2 x 8 tokens
    assert hf.model.layers[1].self_attn.msa and not hf.model.layers[0].self_attn.msa


def test_dense_llama_byte_block64_top8_matches_m3compile(llama_byte):
    text = load_tokens(EVAL_DATA, 256)[:700].long()
    assert_same_model(llama_byte, text[None], text[:600].tolist(), 5)  # 600 tokens = 10 blocks > top-8


def test_adaptive_budget_matches_m3compile(tmp_path):
    """A model converted with an adaptive budget (top-p 0.7 of 2-8 blocks of 8 tokens): transformers' logits and
    greedy tokens are m3compile's, on its torch path and through m3compile's kernels."""
    src = tiny_source("qwen2-bias-tied", tmp_path / "src")
    convert_checkpoint(src, tmp_path / "msa", MSAConfig(block_size=8, topk=8, dense_layers=(0,), top_p=0.7,
                                                         min_blocks=2))
    x = torch.randint(0, 256, (2, 90))
    hf, ours = assert_same_model(tmp_path / "msa", x, x[0, :70].tolist(), 5)
    with torch.no_grad():
        want = hf(x).logits
        hf.model.layers[1].self_attn.s.top_p = 1.0  # the layers' shared settings: the fixed top-8 differs here
        assert (hf(x).logits - want).abs().max() > 1e-3
        hf.model.layers[1].self_attn.s.top_p = 0.7
        hf.model.msa_backend = "m3compile"  # the kernels (interpreted: one forward is most of this test's time)
        torch.testing.assert_close(hf(x).logits, want, rtol=1e-4, atol=1e-4)
    assert ours.args.msa.top_p == 0.7


def test_a_stored_answer_budget_generates_as_m3compile_does(tmp_path):
    """A model converted with an answer budget (the prompt's last 12 tokens at top-6, the answer at top-p 0.9 of 1-4
    blocks of 8): transformers' generate() gives m3compile.generate's greedy tokens (it applies the stored budgets,
    its plain forward does not), alone and in a left-padded batch; without the budgets the tokens differ."""
    src = tiny_source("qwen2-bias-tied", tmp_path / "src")
    convert_checkpoint(src, tmp_path / "msa", MSAConfig(block_size=8, topk=2, dense_layers=(0,), answer_budget="k6",
                                                         answer_tokens=12, decode_budget="p0.9:1:4"))
    torch.manual_seed(3)
    x = torch.randint(0, 256, (2, 70))
    hf, ours = assert_same_model(tmp_path / "msa", x, x[0, :60].tolist(), 8)
    a, b = x[0, :60].tolist(), x[1, :47].tolist()
    with torch.no_grad():
        mask = torch.tensor([[1] * 60, [0] * 13 + [1] * 47])
        both = hf.generate(torch.tensor([a, [0] * 13 + b]), attention_mask=mask, max_new_tokens=8,
                           do_sample=False)[:, 60:].tolist()
    assert both == m3compile.generate(ours, [a, b], 8, kernels=False).tokens
    with torch.no_grad():  # each step's logits, which greedy tokens of random weights may hide
        got = hf.generate(torch.tensor([a]), max_new_tokens=4, do_sample=False, output_logits=True,
                          return_dict_in_generate=True).logits
    want = m3compile.generate(ours, [a], 4, kernels=False)
    want = [want.prefill_logits[0], *want.step_logits[:, 0]]
    torch.testing.assert_close(torch.stack([g[0] for g in got]), torch.stack(want), rtol=1e-4, atol=1e-4)
    plain = m3compile.generate(ours, [a], 4, kernels=False, answer_budget="off")
    assert (plain.prefill_logits[0] - want[0]).abs().max() > 1e-3  # the budgets change what is compared
    assert (plain.step_logits[:, 0] - torch.stack(want[1:])).abs().max() > 1e-3


def test_left_padded_batch_generates_each_prompt_as_alone(tiny):
    hf = hf_load(tiny["qwen3-qknorm"])
    a, b = torch.randint(0, 256, (30,)).tolist(), torch.randint(0, 256, (19,)).tolist()
    ids = torch.tensor([a, [0] * 11 + b])
    mask = torch.tensor([[1] * 30, [0] * 11 + [1] * 19])
    with torch.no_grad():
        both = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)[:, 30:].tolist()
        alone = [hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):].tolist() for p in (a, b)]
    assert both == alone


def test_m3compile_kernels_path_matches_torch_path(tiny):
    """backend "m3compile": the prompt's forward through m3compile's Triton kernels (here in Triton's interpreter on
    CPU; on CUDA "auto" takes this path) against the modeling file's own torch code."""
    hf = hf_load(tiny["llama3-rope"])
    x = torch.randint(0, 256, (2, 45))
    with torch.no_grad():
        want = hf(x).logits
        hf.model.msa_backend = "m3compile"
        got = hf(x).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_generate_with_an_fp8_cache_and_the_memory_check(tiny, monkeypatch):
    """generate(kv_cache="fp8"): transformers' fp8 cache with one scale per position and head (Fp8RowLayer; the
    index keys riding in the keys are quantised too) gives decode logits within e4m3's precision of the default
    cache's, under 3% relative error at every step, and kv_cache="int8" (Int8RowLayer) under 1% (measured: int8
    0.12% against fp8's 0.6-0.8% on this prompt, fp8 0.5-1.1% over 10 prompts; 9 + 6 positions: every
    block selected, so the comparison is the K/V rounding alone; past the top-k a random tiny model's near-tied
    blocks flip under quantised index keys); generate() first counts the cache and the prompt's forward with
    m3compile's count and stops, before generating, when they do not fit."""
    hf = hf_load(tiny["llama3-rope"])
    x = torch.randint(0, 256, (1, 9))
    runs = {}
    with torch.no_grad():
        for kv in ("auto", "fp8"):
            runs[kv] = hf.generate(x, max_new_tokens=6, do_sample=False, kv_cache=kv, return_dict_in_generate=True,
                                   output_logits=True)
    cache = getattr(runs["fp8"], "cache", None) or runs["fp8"].past_key_values
    assert type(cache).__name__ == "QuantizedCache" and cache.get_seq_length() == 14
    want, got = runs["auto"].logits[0], runs["fp8"].logits[0]  # the prompt's own logits: no cache read yet
    assert torch.equal(got, want)
    errs = []
    for step in range(1, 6):  # decode steps read the fp8 cache: same inputs as far as the tokens agree
        if not torch.equal(runs["auto"].sequences[0, :9 + step], runs["fp8"].sequences[0, :9 + step]):
            break
        errs.append(((runs["fp8"].logits[step] - runs["auto"].logits[step]).norm()
                     / runs["auto"].logits[step].norm()).item())
    assert len(errs) >= 3 and 0 < min(errs) and max(errs) < 0.03, errs
    with torch.no_grad():  # the int8 layer: integer rows after a rotation, read back to within 1% here
        int8 = hf.generate(x, max_new_tokens=6, do_sample=False, kv_cache="int8", return_dict_in_generate=True,
                           output_logits=True)
    errs8 = [((int8.logits[step] - runs["auto"].logits[step]).norm() / runs["auto"].logits[step].norm()).item()
             for step in range(1, 6) if torch.equal(runs["auto"].sequences[0, :9 + step], int8.sequences[0, :9 + step])]
    assert len(errs8) >= 3 and 0 < max(errs8) < 0.01, errs8
    with pytest.raises(ValueError, match="kv_cache must be"):
        hf.generate(x, max_new_tokens=2, kv_cache="int4")
    memory = sys.modules[type(hf).__module__].m3c_memory
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1e4)
    with pytest.raises(m3compile.M3CompileError, match=r"^not enough memory: 1 x 15 positions need .* free; "):
        hf.generate(x, max_new_tokens=6, do_sample=False)


def test_modeling_file_runs_without_m3compile(tiny, monkeypatch):
    """The file imports only torch, transformers and the standard library outside its optional import of
    m3compile's kernels, and it builds and runs with m3compile unimportable."""
    path = tiny["qwen2-bias-tied"]
    tree = ast.parse((path / MODELING_FILE).read_text())
    top = {(n.module if isinstance(n, ast.ImportFrom) else n.names[0].name).split(".")[0]
           for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    assert top == {"__future__", "copy", "math", "os", "warnings", "torch", "transformers"}
    ours = m3compile.load(path, dtype="float32")
    for name in [m for m in sys.modules if m == "m3compile" or m.startswith("m3compile.")]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in [m for m in sys.modules if m.startswith("transformers_modules")]:
        monkeypatch.delitem(sys.modules, name)  # import the modeling file afresh
    hf = hf_load(path)
    assert sys.modules[type(hf).__module__].m3c_sparse is None
    x = torch.randint(0, 256, (1, 45))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), rtol=1e-4, atol=1e-4)


def test_without_remote_code_transformers_refuses_or_runs_dense_when_told(llama_byte, monkeypatch):
    """No trust_remote_code: AutoConfig / AutoModelForCausalLM stop with transformers' error (non-interactive; a
    terminal is asked [y/N] first), trust_remote_code=False too. Naming the dense class builds the dense model
    (transformers warns of the model type and of the unused index tensors): the converted model without MSA."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    for kwargs in ({}, {"trust_remote_code": False}):
        with pytest.raises(ValueError, match="trust_remote_code=True"):
            transformers.AutoModelForCausalLM.from_pretrained(llama_byte, **kwargs)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        transformers.AutoConfig.from_pretrained(llama_byte)
    dense = transformers.LlamaForCausalLM.from_pretrained(llama_byte, dtype=torch.float32).eval()
    ours = m3compile.load(llama_byte, dtype="float32")
    ours.set_selection("dense")
    x = load_tokens(EVAL_DATA, 256)[:600].long()[None]
    with torch.no_grad():
        torch.testing.assert_close(dense(x).logits, ours(x), rtol=1e-4, atol=1e-4)


def test_older_checkpoints_load_and_distill_train_outputs_run_in_transformers(tiny, tmp_path):
    """A checkpoint in the earlier form (model_type llama + sparse_attention_config, no auto_map) loads in
    m3compile as before; distilling it writes the remote-code form, and so does train."""
    path = tiny["llama3-rope"]
    old = tmp_path / "old"
    old.mkdir()
    for f in path.iterdir():
        if f.is_file() and f.name not in ("config.json", MODELING_FILE):
            (old / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    del cfg["auto_map"], cfg["source_model_type"]
    (old / "config.json").write_text(json.dumps(cfg))
    x = torch.randint(0, 256, (1, 45))
    with torch.no_grad():
        torch.testing.assert_close(m3compile.load(old, dtype="float32")(x), m3compile.load(path, dtype="float32")(x))
    m3compile.distill(old, CALIB_DATA, tmp_path / "distilled", DistillConfig(steps=1, seq_len=48, warmup_steps=0))
    m3compile.train(tmp_path / "distilled", CALIB_DATA, tmp_path / "trained", TrainConfig(steps=1, seq_len=48))
    for out in ("distilled", "trained"):
        cfg = json.loads((tmp_path / out / "config.json").read_text())
        assert cfg["model_type"] == REMOTE_MODEL_TYPE and cfg["source_model_type"] == "llama"
        assert_same_model(tmp_path / out, x, x[0, :30].tolist(), 3)


def test_every_output_rewrites_the_fields_that_name_code(tiny, tmp_path):
    """A converted model whose config.json names other code (auto_map to evil.Evil, custom_pipelines) distils, trains,
    re-converts and saves into outputs whose auto_map, architectures and model_type are the product's own: each
    loads in transformers as the MSA model beside its modeling file, and none names the source's code."""
    from m3compile.conversion.save import save

    src = tmp_path / "tampered"
    src.mkdir()
    for f in tiny["qwen3-qknorm"].iterdir():
        if f.is_file():
            (src / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.Evil"},
               custom_pipelines={"evil": {"impl": "evil.Pipeline"}}, architectures=["Evil"])
    (src / "config.json").write_text(json.dumps(cfg))
    m3compile.distill(src, CALIB_DATA, tmp_path / "distilled", DistillConfig(steps=1, seq_len=16, holdout_tokens=0))
    m3compile.train(src, CALIB_DATA, tmp_path / "trained", TrainConfig(steps=1, seq_len=16, holdout_tokens=0))
    convert_checkpoint(src, tmp_path / "converted", None)
    model = m3compile.load(src, dtype="float32")
    gm, report = m3compile.convert(model, TINY_MSA)
    save(gm, report, tmp_path / "saved", source_config=model.source_config)
    x = torch.randint(0, 256, (1, 20))
    for out in ("distilled", "trained", "converted", "saved"):
        written = json.loads((tmp_path / out / "config.json").read_text())
        assert written["auto_map"] == {"AutoConfig": "modeling_m3compile.M3CompileConfig",
                                       "AutoModelForCausalLM": "modeling_m3compile.M3CompileForCausalLM"}, out
        assert (written["model_type"], written["source_model_type"]) == (REMOTE_MODEL_TYPE, "qwen3"), out
        assert written["architectures"] == ["M3CompileForCausalLM"] and "custom_pipelines" not in written, out
        with torch.no_grad():
            torch.testing.assert_close(hf_load(tmp_path / out)(x).logits,
                                       m3compile.load(tmp_path / out, dtype="float32")(x), rtol=1e-4, atol=1e-4)
