"""The M3-style vision tower, projector and multimodal wrapper against transformers' minimax_m3_vl."""
import pytest
import torch
import transformers

import m3compile
from m3compile.io.tensor_names import vision_names, vision_release_names
from m3compile.models.vision import MultimodalDecoder, apply_window, patchify

IMAGE, VIDEO = 60, 61


def _hf_vl(dense_text: bool = False):
    text = dict(
        vocab_size=64, hidden_size=32, intermediate_size=16, dense_intermediate_size=24, shared_intermediate_size=8,
        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, index_n_heads=2, index_head_dim=8, index_block_size=4, index_topk_blocks=2,
        index_local_blocks=1, layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse", "sparse"], bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, rope_parameters={"rope_type": "axial", "rope_theta": 1e4})
    if dense_text:
        text["layer_types"] = ["full_attention"] * 3
    cfg = transformers.MiniMaxM3VLConfig(text_config=text, vision_config=vision, projector_hidden_size=24,
                                         image_token_index=IMAGE, video_token_index=VIDEO)
    model = transformers.MiniMaxM3SparseForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "vision" not in name:
                p.normal_(0.0, 0.3)
            elif "layer_norm" in name or "layrnorm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = _hf_vl()
    path = tmp_path_factory.mktemp("vl") / "m3vl"
    hf.save_pretrained(path)
    ours = m3compile.load(path, dtype="float32")
    return hf, ours


def _inputs(args):
    frames_img = torch.randn(1, 3, 8, 8)  # one image: a 2 x 2 patch grid, one merged token
    frames_vid = torch.randn(6, 3, 8, 16)  # 6 frames -> 3 temporal steps of 2 x 4 patches, 6 merged tokens
    pv_i, g_i = patchify(frames_img, args)
    pv_v, g_v = patchify(frames_vid, args)
    return pv_i, g_i, pv_v, g_v


def test_loads_as_multimodal_with_vision_weights(pair):
    hf, ours = pair
    assert isinstance(ours, MultimodalDecoder)
    assert ours.vision_args.hidden_size == 32 and ours.vision_args.axis_dim == 4


def test_vision_tower_matches_transformers(pair):
    """transformers attends across the whole clip: our tower with windows >= the clip length is the same model."""
    hf, ours = pair
    pv_i, g_i, pv_v, g_v = _inputs(ours.vision_args)
    pv, grid = torch.cat([pv_i, pv_v]), torch.cat([g_i, g_v])
    with torch.no_grad():
        want = hf.model.vision_tower(pixel_values=pv, grid_thw=grid).last_hidden_state.squeeze(0)
        apply_window(ours, 8)
        got = ours.vision_tower(pv, grid)
        apply_window(ours, 1)
        per_frame = ours.vision_tower(pv, grid)
        apply_window(ours, None)
        baseline = ours.vision_tower(pv, grid)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(per_frame, baseline)  # W = 1 is the per-frame model exactly
    assert torch.equal(per_frame[:4], got[:4])  # an image is one temporal step either way
    assert (per_frame[4:] - got[4:]).abs().max() > 1e-3  # video frames meet only with W > 1


def test_merged_embeddings_and_logits_match_transformers(pair):
    hf, ours = pair
    pv_i, g_i, pv_v, g_v = _inputs(ours.vision_args)
    ids = torch.cat([torch.randint(0, 50, (5,)), torch.full((1,), IMAGE), torch.randint(0, 50, (9,)),
                     torch.full((6,), VIDEO), torch.randint(0, 50, (12,))])[None]
    apply_window(ours, 8)
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pv_i, image_grid_thw=g_i, pixel_values_videos=pv_v,
                  video_grid_thw=g_v).logits
        got = ours(ids, pv_i, g_i, pv_v, g_v)
    apply_window(ours, None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bad_multimodal_input_names_the_mismatch(pair):
    _, ours = pair
    pv_i, g_i, pv_v, g_v = _inputs(ours.vision_args)
    ids = torch.tensor([[1, 2, IMAGE, IMAGE, 3]])
    with pytest.raises(ValueError, match=r"image placeholders \(2\) do not match .* \(1 "):
        ours(ids, pv_i, g_i)
    with pytest.raises(ValueError, match="placeholder tokens but no video input"):
        ours(torch.tensor([[1, VIDEO]]))
    with pytest.raises(ValueError, match="not divisible by the temporal patch"):
        patchify(torch.randn(3, 3, 8, 8), ours.vision_args)
    with pytest.raises(ValueError, match="empty video"):
        patchify(torch.randn(0, 3, 8, 8), ours.vision_args)
    with pytest.raises(ValueError, match="video 0 is empty"):
        ours.visual_tokens(pv_i[:0], torch.tensor([[0, 2, 2]]))
    with pytest.raises(ValueError, match="pixel_values must be"):
        ours.visual_tokens(pv_i[:, :5], g_i)


def test_vision_release_names_round_trip(pair):
    _, ours = pair
    state = {k: v for k, v in ours.state_dict().items() if not k.startswith("language.")}
    release = vision_release_names(state)
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in release
    assert "patch_merge_mlp.linear_1.weight" in release and "multi_modal_projector.linear_1.weight" in release
    assert vision_names(release).keys() == state.keys()


def test_vit_3d_window_pass_on_a_traced_tower(pair):
    from m3compile.graph.pass_manager import PassManager
    from m3compile.graph.tracing import trace
    from m3compile.ops import frame_segments, window_segments
    from m3compile.passes.vit_3d_window import ViT3DWindow

    _, ours = pair
    pv_i, g_i, pv_v, g_v = _inputs(ours.vision_args)
    pv, grid = torch.cat([pv_i, pv_v]), torch.cat([g_i, g_v])
    tower = ours.vision_tower
    gm = trace(tower)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert frame_segments in targets and window_segments not in targets
    with torch.no_grad():
        per_frame = gm(pv, grid)
        report = PassManager([ViT3DWindow(2)]).run(gm)[0]
        windowed = gm(pv, grid)
        apply_window(ours, 2)
        native = tower(pv, grid)
        apply_window(ours, None)
    assert report.replaced == ours.vision_args.n_layers
    assert torch.equal(windowed, native)
    assert not torch.equal(windowed, per_frame)
    assert PassManager([ViT3DWindow(2)]).run(gm)[0].replaced == 0  # idempotent
    gm1 = trace(tower)
    PassManager([ViT3DWindow(1)]).run(gm1)
    with torch.no_grad():
        assert torch.equal(gm1(pv, grid), per_frame)  # W = 1 reproduces the per-frame model exactly


def test_windows_isolate_segments(pair):
    """Changing a frame changes its own window's patch features; every other window stays bit-identical."""
    _, ours = pair
    args = ours.vision_args
    frames = torch.randn(12, 3, 8, 8)  # 6 temporal steps of 2 x 2 patches -> windows of steps [0-3], [4-5]
    pv, grid = patchify(frames, args)
    frames2 = frames.clone()
    frames2[10:12] += 1.0  # temporal step 5: the second window
    pv2, _ = patchify(frames2, args)
    apply_window(ours, 4)
    with torch.no_grad():
        a, b = ours.vision_tower(pv, grid), ours.vision_tower(pv2, grid)
    apply_window(ours, None)
    assert torch.equal(a[:16], b[:16])  # window 1: steps 0-3, 4 patches each
    assert not torch.equal(a[16:], b[16:])


def test_convert_keeps_vision_and_windows_it(pair, tmp_path):
    hf, ours = pair
    src = tmp_path / "src"
    hf.save_pretrained(src)
    out = tmp_path / "out"
    report = m3compile.convert_checkpoint(src, out, m3compile.MSAConfig(block_size=4, topk=2, dense_layers=(0,),
                                                                         vision_window=2))
    assert [p.name for p in report.passes] == ["gqa_to_msa", "vit_3d_window"]
    assert report.passes[0].replaced == 0 and report.passes[1].replaced == 2  # text: natively MSA already
    import json
    from safetensors import safe_open

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vision_config"]["vit_3d_window"] == 2
    files = list(out.glob("*.safetensors"))
    names = set()
    for f in files:
        with safe_open(str(f), "pt") as h:
            names |= set(h.keys())
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in names
    assert "patch_merge_mlp.linear_2.bias" in names
    conv = m3compile.load(out, dtype="float32")
    assert isinstance(conv, MultimodalDecoder) and conv.vision_tower.window == 2
    pv_i, g_i, pv_v, g_v = _inputs(conv.vision_args)
    apply_window(ours, 2)
    with torch.no_grad():
        torch.testing.assert_close(conv.vision_tower(pv_v, g_v), ours.vision_tower(pv_v, g_v), rtol=0, atol=0)
    apply_window(ours, None)


def test_inspect_shows_both_rewrites(pair, tmp_path):
    from click.testing import CliRunner

    from cli import main
    from m3compile.tools.inspect import inspect

    hf, _ = pair
    src = tmp_path / "src"
    hf.save_pretrained(src)
    rep = inspect(src, config=m3compile.MSAConfig(block_size=4, topk=2, dense_layers=(0,), vision_window=3))
    assert [p["name"] for p in rep.passes] == ["vit_3d_window"]  # the text model is natively MSA already
    assert rep.vision["attention_ops"] == 2 and rep.vision["window_before"] == 1 and rep.vision["window_after"] == 3
    out = CliRunner().invoke(main, ["inspect", str(src), "--block-size", "4", "--topk", "2"])
    assert out.exit_code == 0, out.output
    assert "vision tower: 2 layers" in out.output and "3D windows of <= 4 temporal steps" in out.output


def test_convert_a_dense_multimodal_model_applies_both_rewrites(tmp_path):
    """Dense text + per-frame ViT in, MSA text + 3D-window ViT out; at a length that fits the top-k (MSA is then
    exactly dense) and windows that hold the whole clip, the converted model equals transformers' model."""
    hf = _hf_vl(dense_text=True)
    hf.save_pretrained(tmp_path / "src")
    report = m3compile.convert_checkpoint(tmp_path / "src", tmp_path / "out",
                                          m3compile.MSAConfig(block_size=16, topk=4, dense_layers=(0,), vision_window=3))
    assert [(p.name, p.replaced) for p in report.passes] == [("gqa_to_msa", 2), ("vit_3d_window", 2)]
    conv = m3compile.load(tmp_path / "out", dtype="float32")
    assert conv.args.sparse_layers == (False, True, True) and conv.vision_tower.window == 3
    pv_i, g_i, pv_v, g_v = _inputs(conv.vision_args)
    ids = torch.cat([torch.randint(0, 50, (7,)), torch.full((1,), IMAGE), torch.full((6,), VIDEO),
                     torch.randint(0, 50, (20,))])[None]  # 34 tokens <= 4 blocks of 16
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pv_i, image_grid_thw=g_i, pixel_values_videos=pv_v,
                  video_grid_thw=g_v).logits
        got = conv(ids, pv_i, g_i, pv_v, g_v)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_convert_command_of_a_multimodal_checkpoint_shows_each_layer(tmp_path):
    """`m3c convert`'s table reads each layer's change from the report, so the ViT pass beside gqa_to_msa (whose
    lines name no layer) is shown, not mistaken for a layer."""
    from click.testing import CliRunner

    from m3compile.cli import main

    _hf_vl(dense_text=True).save_pretrained(tmp_path / "src")
    out = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--block-size", "16",
                                    "--topk", "4"])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert "kept dense (dense_layers)" in text and "attention -> MSA" in text
    assert "pass vit_3d_window: replaced 2 attention ops" in text
