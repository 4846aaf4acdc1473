"""m3c export-onnx: one custom-domain node per MSA layer with a standard-op function body; onnxruntime matches
PyTorch where selection is really sparse, reading the weights from model.onnx.data (external data); float16 runs on
the CPU provider, bfloat16 is written for CUDA and refused for CPU; dense-only models use no custom domain; bad
input (not converted, no room, too large for one file, a provider that cannot run the dtype, a failed write) writes
nothing."""
import errno
import os
import shutil
from collections import namedtuple

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

import m3compile.export.onnx as onnx_export
from m3compile import MSAConfig, convert_checkpoint, load
from m3compile.export.onnx_providers import missing_kernels
from m3compile.bench.synthetic import write_synthetic_checkpoint
from tests.conftest import LLAMA_BYTE
from tests.cli.test_cli import assert_clean_failure, run

# the module fixtures are built once: xdist sends this file's tests to one worker (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("onnx_export")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx")
    convert_checkpoint(LLAMA_BYTE, root / "msa", MSAConfig(block_size=16, topk=4, dense_layers=(0,)))
    code, output = run("export-onnx", root / "msa", root / "onnx", "--external-data", "always")
    assert code == 0, output
    return root


# 2 layers (the first dense), hidden 64: the dtype exports
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=97)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    write_synthetic_checkpoint(root / "src", SMALL)
    convert_checkpoint(root / "src", root / "msa", MSAConfig(block_size=16, topk=2, dense_layers=(0,)))
    return root


def test_weights_are_external_data_beside_model_onnx(exported, tmp_path):
    """--external-data always: the directory holds model.onnx (the graph) and model.onnx.data (every weight,
    named relative to model.onnx), the checker reads the pair from the path, and the pair runs from another
    directory."""
    out = exported / "onnx"
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.onnx.data"]
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    weights = [t for t in model.graph.initializer if int(np.prod(t.dims)) >= 256]
    assert len(weights) > 40 and all(t.data_location == onnx.TensorProto.EXTERNAL for t in weights)
    info = [{e.key: e.value for e in t.external_data} for t in weights]
    assert {i["location"] for i in info} == {"model.onnx.data"}
    weight_bytes = 4 * sum(int(np.prod(t.dims)) for t in weights)  # fp32
    assert sum(int(i["length"]) for i in info) == (out / "model.onnx.data").stat().st_size >= weight_bytes > 7 * 10**6
    assert (out / "model.onnx").stat().st_size < 10**6
    onnx.checker.check_model(str(out / "model.onnx"), full_check=True)
    x = torch.randint(0, 256, (1, 40))
    os.rename(out, tmp_path / "moved")
    try:
        (got,) = ort.InferenceSession(str(tmp_path / "moved" / "model.onnx")).run(None, {"input_ids": x.numpy()})
    finally:
        os.rename(tmp_path / "moved", out)
    with torch.no_grad():
        np.testing.assert_allclose(got, load(exported / "msa", dtype="float32")(x).numpy(), rtol=1e-4, atol=1e-4)


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
        dense = (model.set_selection("dense"), model(x).numpy())[1]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    if length == 150:
        assert np.abs(want - dense).max() > 1e-2  # selection really dropped blocks


def test_adaptive_budget_exports_and_matches_pytorch(small, tmp_path):
    """A model converted with an adaptive budget (top-p 0.5 of 2-8 blocks): the MSA node carries top_p and
    min_blocks, and onnxruntime keeps the blocks PyTorch keeps (at 150 tokens: 10 blocks, the ceiling 8)."""
    convert_checkpoint(small / "src", tmp_path / "msa", MSAConfig(block_size=16, topk=8, dense_layers=(0,), top_p=0.5,
                                                                  min_blocks=2))
    code, output = run("export-onnx", tmp_path / "msa", tmp_path / "onnx")
    assert code == 0, output
    model = onnx.load(str(tmp_path / "onnx" / "model.onnx"))
    (node,) = [n for n in model.graph.node if n.domain == "m3compile"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["top_p"] == pytest.approx(0.5) and attrs["min_blocks"] == 2 and attrs["topk"] == 8
    session = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    ours = load(tmp_path / "msa", dtype="float32")
    x = torch.randint(0, 97, (2, 150))
    (got,) = session.run(None, {"input_ids": x.numpy()})
    with torch.no_grad():
        want = ours(x).numpy()
        ours.set_budget(top_p=1.0)  # the same model at its fixed ceiling
        fixed = ours(x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.abs(want - fixed).max() > 1e-3


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


def test_float16_runs_on_the_cpu_provider(small):
    """float16 weights and compute: onnxruntime's CPU provider runs the file, within PyTorch's own fp16 error of
    the fp32 model (measured: 0.004 against PyTorch fp16's 0.010, logits up to 3.8), where selection is sparse."""
    code, output = run("export-onnx", small / "msa", small / "fp16", "--dtype", "float16")
    assert code == 0, output
    model = onnx.load(str(small / "fp16" / "model.onnx"))
    weights = [t for t in model.graph.initializer if t.name.endswith("weight") or len(t.dims) == 2]
    assert weights and {t.data_type for t in weights} == {onnx.TensorProto.FLOAT16}
    x = torch.randint(0, SMALL["vocab_size"], (2, 103))
    (got,) = ort.InferenceSession(str(small / "fp16" / "model.onnx")).run(None, {"input_ids": x.numpy()})
    assert got.dtype == np.float16
    fp32 = load(small / "msa", dtype="float32")
    with torch.no_grad():
        want = fp32(x).numpy()
        torch_fp16 = load(small / "msa", dtype="float16")(x).float().numpy()
        dense = (fp32.set_selection("dense"), fp32(x).numpy())[1]
    assert np.abs(want - dense).max() > 0.1  # the selection really dropped blocks
    assert np.abs(got.astype(np.float32) - want).max() <= 2 * np.abs(torch_fp16 - want).max()


def test_bfloat16_is_written_for_cuda_and_refused_by_the_cpu_provider(small):
    """bfloat16 for CUDA: bf16 weights, the full check passes, every operator that sees bf16 has a bf16 CUDA kernel
    (onnxruntime's registry); the CPU provider indeed cannot load it, which is why --provider cpu refuses it."""
    code, output = run("export-onnx", small / "msa", small / "bf16", "--dtype", "bfloat16", "--provider", "cuda")
    assert code == 0, output
    path = str(small / "bf16" / "model.onnx")
    onnx.checker.check_model(path, full_check=True)
    graph = ir.load(path)
    weights = [v for v in graph.graph.initializers.values() if len(v.shape) == 2]
    assert weights and {v.dtype for v in weights} == {ir.DataType.BFLOAT16}
    assert missing_kernels(graph, "bfloat16", "cuda") == []
    with pytest.raises(Exception, match="NOT_IMPLEMENTED|Could not find an implementation"):
        ort.InferenceSession(path, providers=["CPUExecutionProvider"])


def test_missing_kernels_names_the_operators_without_a_cuda_bf16_kernel():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.BFLOAT16, [4])
    k = onnx.numpy_helper.from_array(np.array([2], dtype=np.int64), "k")
    nodes = [onnx.helper.make_node("Mul", ["x", "x"], ["y"]), onnx.helper.make_node("TopK", ["y", "k"], ["v", "i"])]
    out = [onnx.helper.make_tensor_value_info(n, t, None) for n, t in (("v", onnx.TensorProto.BFLOAT16),
                                                                     ("i", onnx.TensorProto.INT64))]
    model = onnx.helper.make_model(onnx.helper.make_graph(nodes, "g", [x], out, [k]))
    graph = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(model))
    assert missing_kernels(graph, "bfloat16", "cuda") == ["TopK(bfloat16)"]
    assert missing_kernels(graph, "float16", "cuda") == missing_kernels(graph, "float32", "cpu") == []


def test_dense_only_model_uses_no_custom_domain(small, tmp_path):
    """A checkpoint marked converted (its conversion_report.json) whose layers are all dense."""
    shutil.copytree(small / "src", tmp_path / "dense")
    (tmp_path / "dense" / "conversion_report.json").write_text("{}")
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


def _no_room(path):
    return namedtuple("usage", "total used free")(10**9, 10**9 - 10**6, 10**6)


@pytest.mark.parametrize("args,patch,needle", [
    (["--dtype", "bfloat16"], None, "CPU provider cannot run a bfloat16 graph"),
    (["--dtype", "float64"], None, "Invalid value for '--dtype'"),
    (["--provider", "tpu"], None, "Invalid value for '--provider'"),
    (["--external-data", "never"], ("SINGLE_FILE_MAX", 10**6), "do not fit one protobuf file"),
    ([], ("shutil.disk_usage", _no_room), "not enough room in"),
], ids=["bf16-on-cpu", "unknown-dtype", "unknown-provider", "never-too-large", "no-room"])
def test_refused_before_the_work(exported, tmp_path, monkeypatch, args, patch, needle):
    """One line, exit 2, nothing written, and the checkpoint never loaded."""
    monkeypatch.setattr(onnx_export, "load", lambda *a, **k: pytest.fail("loaded before refusing"))
    if patch:
        monkeypatch.setattr(f"m3compile.export.onnx.{patch[0]}", patch[1])
    code, output = run("export-onnx", exported / "msa", tmp_path / "out", *args)
    assert_clean_failure(code, output, tmp_path / "out", needle)


def _graph_failing_after(path, n_good):
    """The exported graph of `path`, whose initializer number n_good raises ENOSPC when its bytes are written."""
    graph = ir.load(str(path))
    victim = [v for v in graph.graph.initializers.values() if v.const_value.nbytes > 1024][n_good]

    def full():
        raise OSError(errno.ENOSPC, "No space left on device")

    victim.const_value = ir.LazyTensor(full, victim.const_value.dtype, victim.const_value.shape)
    return graph


def test_a_failed_or_interrupted_write_leaves_nothing(exported, tmp_path, monkeypatch):
    """The disk filling up half-way through model.onnx.data: one line, no output, no partial directory; Ctrl-C
    half-way through: the same. (The export step is replaced by the fixture's graph: only the writing runs.)"""
    graph = _graph_failing_after(exported / "onnx" / "model.onnx", 20)
    monkeypatch.setattr(onnx_export, "_export", lambda *a: {"model.onnx": graph})
    code, output = run("export-onnx", exported / "msa", tmp_path / "full", "--external-data", "always")
    assert_clean_failure(code, output, tmp_path / "full", "No space left on device")

    monkeypatch.setattr(onnx_export, "_export", lambda *a: {"model.onnx": ir.load(str(exported / "onnx/model.onnx"))})

    def interrupt(done, total, what):
        if total and done > total // 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        onnx_export.export_onnx(exported / "msa", tmp_path / "ctrl-c", external_data="always", progress=interrupt)
    assert not (tmp_path / "ctrl-c").exists() and not list(tmp_path.glob(".ctrl-c.partial-*"))


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
