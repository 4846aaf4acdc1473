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
