"""Long-range retrieval: can the model copy a value bound thousands of tokens earlier, densely and with MSA?

Each probe plants, in real text from the data, a random binding early in the sequence and a request for it
`distance` tokens later (the distance between the value's first token in the binding and the answer's first token):

    <real text> \\nkey_8f3a1c = "29417"\\n <real text ...> \\nprint(key_8f3a1c)  # key_8f3a1c = "29417

The request ends with the binding's own words, so a model that copies by matching context (an induction head)
can answer as well as one that retrieves by name. The answer is scored teacher-forced: exact match when the
greedy (argmax) prediction of every value token is right (what greedy decoding of the value returns), and the
value's log-probability. A selection that cannot reach the
binding's block cannot copy a random value, so this separates long-range selection from local attention.
"""
from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from m3compile.config import check_size
from m3compile.errors import M3CompileError
from m3compile.io.hf_config import max_positions
from m3compile.models.decoder import Decoder

__all__ = ["retrieval", "RetrievalReport", "DistanceResult", "text_encoder", "DEFAULT_DISTANCES"]

DEFAULT_DISTANCES = (1024, 2048, 4096, 8192)
_PREFIX = 32  # real-text tokens before the binding ("early in the window")
_BATCH = 8  # probes per forward


def text_encoder(model_dir: str | os.PathLike | None, vocab_size: int) -> Callable[[str], list[int]]:
    """str -> token ids for the probes' text: the checkpoint's tokenizer.json when it has one, else UTF-8 bytes
    (byte-level models, vocab >= 256)."""
    tok_file = Path(model_dir or "") / "tokenizer.json"
    if model_dir is not None and tok_file.is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises its own exception type for malformed files
            raise M3CompileError(f"{tok_file}: cannot read tokenizer ({str(e).splitlines()[0]})") from None

        def encode(text: str) -> list[int]:
            ids = tok.encode(text, add_special_tokens=False).ids
            bad = next((i for i in ids if not 0 <= i < vocab_size), None)
            if bad is not None:
                raise M3CompileError(f"{tok_file}: gives token id {bad} for {text.strip()!r}, outside the model's "
                                     f"vocabulary [0, {vocab_size}): the tokenizer is not this model's")
            return ids
        return encode
    if vocab_size < 256:
        raise M3CompileError(f"retrieval needs the checkpoint's tokenizer.json or a byte-level model (vocab >= 256); "
                             f"none in {model_dir} and the vocab has {vocab_size}")
    return lambda text: list(text.encode("utf-8"))


def _finite(x: float | None) -> float | None:
    """JSON has no NaN or infinity (a log-probability can underflow to -inf): those become null."""
    return None if x is None or not math.isfinite(x) else x


@dataclass
class DistanceResult:
    """One distance: accuracy = share of probes whose value is reproduced exactly (greedy); logprob = mean over
    probes of the value's log-probability (nats); sparse figures are None for a model without MSA layers."""

    distance: int
    length: int  # tokens per probe sequence
    dense_accuracy: float
    dense_logprob: float
    sparse_accuracy: float | None = None
    sparse_logprob: float | None = None

    def to_dict(self) -> dict:
        return {"distance": self.distance, "length": self.length, "dense_accuracy": self.dense_accuracy,
                "sparse_accuracy": self.sparse_accuracy, "dense_logprob": _finite(self.dense_logprob),
                "sparse_logprob": _finite(self.sparse_logprob)}


@dataclass
class RetrievalReport:
    """`to_dict()` (the JSON of `m3c eval retrieval --json`) has these keys:

    task         "retrieval"
    seq_len      the longest sequence allowed; distances whose probe does not fit are in `skipped`
    probes       probes per distance; seed: the seed of the identifiers, values and text offsets
    distances    one object per evaluated distance: distance, length (tokens per probe sequence), dense_accuracy,
                 sparse_accuracy (share of probes answered exactly by greedy decoding; sparse null without MSA),
                 dense_logprob, sparse_logprob (mean log-probability of the value's tokens, nats)
    skipped      distances that did not fit seq_len
    seconds      wall time
    """

    seq_len: int
    probes: int
    seed: int
    distances: list[DistanceResult] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"task": "retrieval", "seq_len": self.seq_len, "probes": self.probes, "seed": self.seed,
                "distances": [d.to_dict() for d in self.distances], "skipped": self.skipped,
                "seconds": round(self.seconds, 2)}


@dataclass(frozen=True)
class _Probe:
    ids: list[int]
    answer: list[int]  # the value's tokens: the last len(answer) tokens of ids


def _make_probe(rng: random.Random, tokens: torch.Tensor, encode: Callable[[str], list[int]], distance: int,
                seq_len: int) -> _Probe | None:
    name, value = f"key_{rng.getrandbits(24):06x}", f"{rng.randrange(10**5):05d}"
    before, answer, after = encode(f'\n{name} = "'), encode(value), encode('"\n')
    ask = encode(f'\nprint({name})  # {name} = "')
    gap = distance - len(answer) - len(after) - len(ask)  # real text between the binding and the request
    length = _PREFIX + len(before) + distance + len(answer)
    if gap < 0:
        raise M3CompileError(f"distance {distance} is shorter than the probe itself "
                             f"({len(answer) + len(after) + len(ask)} tokens)")
    if length > seq_len:
        return None
    if tokens.numel() < _PREFIX + gap:
        raise M3CompileError(f"the data has {tokens.numel()} tokens, too few to fill a probe at distance {distance}")
    at = rng.randrange(tokens.numel() - (_PREFIX + gap) + 1)
    text = tokens[at: at + _PREFIX + gap].tolist()
    ids = text[:_PREFIX] + before + answer + after + text[_PREFIX:] + ask + answer
    return _Probe(ids, answer)


def _score(model: Decoder, probes: list[_Probe], device) -> tuple[float, float]:
    """(accuracy, mean value log-probability) of the probes, batched by shape: with a BPE tokenizer the same text
    pattern can take one token more or less, so probes of one distance need not share a length."""
    hits, logprob = 0, 0.0
    shapes: dict[tuple[int, int], list[_Probe]] = {}
    for p in probes:
        shapes.setdefault((len(p.ids), len(p.answer)), []).append(p)
    batches = [group[i: i + _BATCH] for group in shapes.values() for i in range(0, len(group), _BATCH)]
    for batch in batches:
        ids = torch.tensor([p.ids for p in batch], device=device)
        n = len(batch[0].answer)
        logits = model(ids[:, :-1])[:, -n:].float()  # the predictions of the n value tokens
        target = ids[:, -n:]
        hits += int((logits.argmax(-1) == target).all(-1).sum())
        logprob += float(torch.log_softmax(logits, -1).gather(-1, target[..., None]).sum())
    return hits / len(probes), logprob / len(probes)


@torch.no_grad()
def retrieval(model: Decoder, tokens: torch.Tensor, encode: Callable[[str], list[int]], *, seq_len: int = 4096,
              distances: tuple[int, ...] = DEFAULT_DISTANCES, probes: int = 16, seed: int = 0,
              progress: Callable[[int, int], None] | None = None) -> RetrievalReport:
    """Dense vs sparse (MSA) retrieval accuracy per distance, `probes` seeded probes each (see the module doc).

    tokens: 1-D real-text token ids (the filler); encode: str -> ids for the planted text (`text_encoder`).
    Distances whose probe sequence exceeds `seq_len` are skipped; none fitting is an error.
    """
    check_size(probes, "probes", "samples")
    if not distances:
        raise M3CompileError("no distances given")
    for d in distances:
        check_size(d, "distances")
    start = time.perf_counter()
    rng = random.Random(seed)
    device = next(model.parameters()).device
    has_msa = any(model.args.is_sparse(i) for i in range(model.args.n_layers))
    planned: dict[int, list[_Probe]] = {}
    skipped: list[int] = []
    for d in sorted(set(distances)):
        made = [_make_probe(rng, tokens, encode, d, seq_len) for _ in range(probes)]
        if any(p is None for p in made):
            skipped.append(d)
        else:
            planned[d] = made
    if not planned:
        raise M3CompileError(f"no distance in {sorted(set(distances))} fits --seq-len {seq_len} "
                             f"(a probe needs about distance + {_PREFIX + 20} tokens)")
    limit = max_positions(getattr(model, "source_config", None))
    for d, made in planned.items():
        longest = max(len(p.ids) for p in made)
        if limit is not None and longest > limit:
            raise M3CompileError(f"distance {d} needs probes of up to {longest:,} tokens, past the model's {limit:,} "
                                 f"positions (max_position_embeddings in config.json); use shorter --distances or "
                                 f"--seq-len {limit} or less")
    report = RetrievalReport(seq_len, probes, seed, skipped=skipped)
    try:
        for i, (d, made) in enumerate(planned.items()):
            model.set_selection("dense")
            dense = _score(model, made, device)
            sparse = (None, None)
            if has_msa:
                model.set_selection("index")
                sparse = _score(model, made, device)
            report.distances.append(DistanceResult(d, len(made[0].ids), *dense, *sparse))
            if progress:
                progress(i + 1, len(planned))
    finally:
        model.set_selection("index")
    report.seconds = time.perf_counter() - start
    return report
