"""m3compile.load's compute dtype: the stored one by default (bf16 stays bf16 on a CPU), "auto" as m3c's commands
pick it (float32 on a CPU), or the one named; the logits of each as the stored weights give them."""
import pytest
import torch
import transformers

import m3compile


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16") / "llama"
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=None, eos_token_id=None)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype, want", [(None, torch.bfloat16), ("auto", torch.float32), ("float16", torch.float16),
                                         (torch.float32, torch.float32)], ids=["stored", "auto", "named", "torch"])
def test_load_computes_in_the_dtype_it_says(bf16_checkpoint, dtype, want):
    model = m3compile.load(bf16_checkpoint, **({} if dtype is None else {"dtype": dtype}))
    assert {p.dtype for p in model.parameters()} == {want}
    x = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        logits = model(x)
        exact = m3compile.load(bf16_checkpoint, dtype="float32")(x)  # the stored bf16 weights, computed in fp32
    assert logits.dtype == want
    tolerance = 0.0 if want == torch.float32 else 0.05  # the half-precision ones round as they compute
    torch.testing.assert_close(logits.float(), exact, rtol=tolerance, atol=tolerance)
