"""m3c export-onnx: one custom-domain node per MSA layer with a standard-op function body; onnxruntime matches
PyTorch where selection is really sparse; dense-only models use no custom domain; bad input writes nothing."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from m3compile import MSAConfig, convert_checkpoint, load
from tests.conftest import LLAMA_BYTE
from tests.test_cli import assert_clean_failure, run

# the module fixtures are built once: xdist sends this file's tests to one worker (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("onnx_export")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx")
    convert_checkpoint(LLAMA_BYTE, root / "msa", MSAConfig(block_size=16, topk=4, dense_layers=(0,)))
    code, output = run("export-onnx", root / "msa", root / "onnx")
    assert code == 0, output
    return root


def test_graph_has_one_msa_node_per_layer_and_passes_the_full_check(exported):
    model = onnx.load(str(exported / "onnx" / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    custom = [n for n in model.graph.node if n.domain == "m3compile"]
    assert [n.op_type for n in custom] == ["MSA"] * 5
    assert [f.name for f in model.functions] == ["MSA"] and {f.domain for f in model.functions} == {"m3compile"}
    assert all(node.domain in ("", "ai.onnx") for node in model.functions[0].node)  # standard operators only
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in custom[0].attribute}
    assert attrs["block_size"] == 16 and attrs["topk"] == 4 and attrs["local_blocks"] == 1


@pytest.mark.parametrize("batch,length", [(2, 150), (1, 37), (3, 1)])
def test_onnxruntime_matches_pytorch(exported, batch, length):
    """150 tokens = 10 blocks of 16 with 4 selected: the sparse path is what is compared."""
    session = ort.InferenceSession(str(exported / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    model = load(exported / "msa", dtype="float32")
    x = torch.randint(0, 256, (batch, length))
    (got,) = session.run(None, {"input_ids": x.numpy()})
    with torch.no_grad():
        want = model(x).numpy()
        dense = (model.set_sparse(False), model(x).numpy())[1]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    if length == 150:
        assert np.abs(want - dense).max() > 1e-2  # selection really dropped blocks


def test_onnxruntime_matches_the_checkpoint_loaded_in_its_own_dtype(exported):
    """The bf16 checkpoint loaded as is, then cast with .float(), is the exported model: its RoPE frequencies
    stay fp32 (rounded to bf16, the logits differed from the export by 8 at 150 tokens)."""
    session = ort.InferenceSession(str(exported / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    model = load(exported / "msa")
    assert next(model.parameters()).dtype == torch.bfloat16
    x = torch.randint(0, 256, (1, 150))
    (got,) = session.run(None, {"input_ids": x.numpy()})
    with torch.no_grad():
        want = model.float()(x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_dense_only_model_uses_no_custom_domain(tmp_path):
    convert_checkpoint(LLAMA_BYTE, tmp_path / "dense", MSAConfig(dense_layers=tuple(range(6))))
    code, output = run("export-onnx", tmp_path / "dense", tmp_path / "onnx")
    assert code == 0, output
    model = onnx.load(str(tmp_path / "onnx" / "model.onnx"))
    assert not model.functions and all(n.domain == "" for n in model.graph.node)
    assert all(o.domain != "m3compile" for o in model.opset_import)


def test_bad_input(exported, tmp_path):
    code, output = run("export-onnx", LLAMA_BYTE, tmp_path / "out")
    assert_clean_failure(code, output, tmp_path / "out", "never converted")
    code, output = run("export-onnx", exported / "msa", exported / "onnx")
    assert code == 2 and "already exists" in output
    code, output = run("export-onnx", tmp_path / "nowhere", tmp_path / "out2")
    assert_clean_failure(code, output, tmp_path / "out2", "nowhere")


def test_multimodal_checkpoint_exports_vision_and_language_graphs(tmp_path):
    """A converted minimax_m3_vl checkpoint (MoE text with native MSA, ViT with 3D windows of 2 steps) writes
    model.onnx and vision.onnx; both pass the full check and onnxruntime matches PyTorch on inputs of other sizes
    than the export's examples (a video of 3 steps: two windows, plus an image)."""
    from m3compile.models.vision import onnx_vision_inputs, patchify
    from tests.models.test_vision import _hf_vl

    _hf_vl().save_pretrained(tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "out", MSAConfig(block_size=4, topk=2, dense_layers=(0,),
                                                                     vision_window=2))
    code, output = run("export-onnx", tmp_path / "out", tmp_path / "onnx")
    assert code == 0, output
    model = load(tmp_path / "out", dtype="float32")
    for name in ("model.onnx", "vision.onnx"):
        onnx.checker.check_model(str(tmp_path / "onnx" / name), full_check=True)
    args = model.vision_args
    (pv_v, g_v), (pv_i, g_i) = patchify(torch.randn(6, 3, 8, 16), args), patchify(torch.randn(2, 3, 8, 8), args)
    pv, grid = torch.cat([pv_v, pv_i]), torch.cat([g_v, g_i])
    positions, segments = onnx_vision_inputs(grid, args, model.vision_tower.window)
    assert segments.unique().numel() == 3  # windows {0, 1} and {2} of the video, then the image
    with torch.no_grad():
        want = model.multi_modal_projector(model.vision_tower(pv, grid))
    vision = ort.InferenceSession(str(tmp_path / "onnx" / "vision.onnx"))
    got = vision.run(None, {"pixel_values": pv.numpy(), "positions": positions.numpy(),
                            "segment_ids": segments.numpy()})[0]
    assert got.shape == (7, 32) and np.abs(got - want.numpy()).max() < 1e-4
    ids = torch.randint(0, 60, (1, 23))  # 6 blocks of 4 > top-2: sparse
    with torch.no_grad():
        want = model.language(ids)
    got = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx")).run(None, {"input_ids": ids.numpy()})[0]
    assert np.abs(got - want.numpy()).max() < 1e-4


def test_moe_export_path_equals_the_routed_one():
    """MoE under torch.export runs every expert with the routing weights as a dense combine: the same output."""
    from m3compile import from_preset
    from m3compile.models.decoder import MoE

    moe = next(m for m in from_preset("m3-tiny").modules() if isinstance(m, MoE))
    x = torch.randn(37, moe.w13.shape[-1])
    probs = torch.sigmoid(moe.gate(x))
    _, idx = torch.topk(probs + moe.e_score_correction_bias, moe.top_k, dim=-1)
    w = probs.gather(1, idx)
    w = w / w.sum(-1, keepdim=True)
    with torch.no_grad():
        torch.testing.assert_close(moe._all_experts(x, idx, w), moe._routed(x, idx, w), rtol=1e-5, atol=1e-6)
