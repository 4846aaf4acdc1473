"""Token data for calibration and evaluation: .bin raw bytes, .npy token ids, .txt/.jsonl text via tokenizer.json."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from m3compile.errors import M3CompileError

__all__ = ["load_tokens", "windows", "read_tokenizer"]


def load_tokens(path: str | os.PathLike, vocab_size: int, tokenizer_dir: str | os.PathLike | None = None) -> torch.Tensor:
    """A 1-D int64 tensor of token ids, validated against the vocabulary."""
    path = Path(path)
    if not path.is_file():
        raise M3CompileError(f"{path}: no such data file")
    suffix = path.suffix.lower()
    if suffix == ".bin":
        if vocab_size < 256:
            raise M3CompileError(f"{path}: raw bytes need a byte-level model (vocab >= 256), this one has {vocab_size}")
        ids = torch.from_numpy(np.fromfile(path, dtype=np.uint8).astype(np.int64))
    elif suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except ValueError as e:
            raise M3CompileError(f"{path}: not a plain .npy array ({e})") from None
        if not np.issubdtype(arr.dtype, np.integer):
            raise M3CompileError(f"{path}: token ids must be integers, got dtype {arr.dtype}")
        ids = torch.from_numpy(arr.reshape(-1).astype(np.int64))
    elif suffix in (".txt", ".jsonl"):
        ids = _tokenize(path, tokenizer_dir)
    else:
        raise M3CompileError(f"{path}: unknown data format {suffix!r} (use .bin, .npy, .txt or .jsonl)")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
        raise M3CompileError(f"{path}: token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    return ids


def read_tokenizer(tok_file: str | os.PathLike):
    """A checkpoint's tokenizer.json as a `tokenizers.Tokenizer` (the one reader of data files and of
    io.tokenizer.TextCodec); a malformed file is a one-line M3CompileError."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(tok_file))
    except Exception as e:  # tokenizers raises its own exception type for malformed files
        raise M3CompileError(f"{tok_file}: cannot read tokenizer ({str(e).splitlines()[0]})") from None


def _tokenize(path: Path, tokenizer_dir) -> torch.Tensor:
    tok_file = Path(tokenizer_dir or "") / "tokenizer.json"
    if tokenizer_dir is None or not tok_file.is_file():
        raise M3CompileError(f"{path}: text data needs the checkpoint's tokenizer.json, none found in {tokenizer_dir}")
    tok = read_tokenizer(tok_file)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise M3CompileError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None
    if path.suffix.lower() == ".jsonl":
        texts = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    value = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError, IndexError):
                    raise M3CompileError(f"{path}:{i}: expected a JSON object with a 'text' field") from None
                if not isinstance(value, str):
                    raise M3CompileError(f"{path}:{i}: the 'text' field must be a string, got "
                                         f"{type(value).__name__} {json.dumps(value)[:40]}")
                texts.append(value)
    else:
        texts = [text]
    return torch.tensor([i for enc in tok.encode_batch(texts) for i in enc.ids], dtype=torch.long)


def windows(ids: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping [N, seq_len + 1] windows (inputs plus the next-token targets)."""
    if max_windows is not None and max_windows < 1:
        raise M3CompileError(f"max_windows must be >= 1, got {max_windows} (None for every window)")
    n = (ids.numel() - 1) // seq_len
    if n < 1:
        raise M3CompileError(f"the data has {ids.numel()} tokens, fewer than one sequence of {seq_len} + 1")
    if max_windows is not None:
        n = min(n, max_windows)
    return torch.stack([ids[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])
