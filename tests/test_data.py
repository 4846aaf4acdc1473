"""Data files: .bin bytes, .npy ids, .txt and .jsonl through the checkpoint's tokenizer.json."""
import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from m3compile import M3CompileError
from m3compile.data import load_tokens, windows


@pytest.fixture
def tokenizer_dir(tmp_path):
    vocab = {"[UNK]": 0, "def": 1, "return": 2, "x": 3, "(": 4, ")": 5, ":": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_bin_is_raw_bytes(tmp_path):
    (tmp_path / "d.bin").write_bytes(b"def f():\n")
    assert load_tokens(tmp_path / "d.bin", 256).tolist() == list(b"def f():\n")
    with pytest.raises(M3CompileError, match="byte-level"):
        load_tokens(tmp_path / "d.bin", 100)


def test_txt_and_jsonl_use_the_tokenizer(tmp_path, tokenizer_dir):
    (tmp_path / "d.txt").write_text("def x ( ) : return x")
    assert load_tokens(tmp_path / "d.txt", 7, tokenizer_dir).tolist() == [1, 3, 4, 5, 6, 2, 3]
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "def x"}) + "\n" + json.dumps({"text": "return"}) + "\n")
    assert load_tokens(tmp_path / "d.jsonl", 7, tokenizer_dir).tolist() == [1, 3, 2]
    (tmp_path / "bad.jsonl").write_text("{\"txt\": 1}\n")
    with pytest.raises(M3CompileError, match="bad.jsonl:1: expected a JSON object with a 'text' field"):
        load_tokens(tmp_path / "bad.jsonl", 7, tokenizer_dir)


def test_windows_are_inputs_plus_targets():
    w = windows(torch.arange(25), 8)
    assert w.shape == (3, 9) and w[1].tolist() == list(range(8, 17))
    assert windows(torch.arange(25), 8, max_windows=2).shape == (2, 9)
    with pytest.raises(M3CompileError, match="fewer than one sequence"):
        windows(torch.arange(8), 8)
