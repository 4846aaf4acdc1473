"""Reference models: an M3-style GQA decoder that covers Llama, Mistral, Qwen2, Qwen3 and M3's text model."""
from m3compile.models.decoder import PRESETS, Decoder, ModelArgs, MSALayerArgs

__all__ = ["Decoder", "ModelArgs", "MSALayerArgs", "PRESETS"]
