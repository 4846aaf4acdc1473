"""A RULER-style long-context suite (`m3c eval ruler MODEL`): every task of ruler_tasks.py at every length,
answered by greedy generation with the model's own selection (MSA), the oracle's and dense attention, scored as
RULER scores (string_match_all).

For each length, each task's samples are built once (ruler_tasks.build_samples: seeded, the same for every
selection) and generated in batches through m3compile.generate: one prefill per prompt, then the paged cached
decode, the MSA layers selecting as asked (config.SELECTIONS), over a K/V cache of the dtype asked (kv_cache:
the model's, bf16 or fp8), up to the task's max_new_tokens or the end of the answer. A sample scores the share of its expected answers found in the generated text (case-insensitive, control
characters read as newlines); a task's score is its samples' mean x 100.

    selections   m3compile.config.SELECTIONS: index (the index branch: the converted model), dense (every MSA layer
                 attends to every key), oracle (per KV group the blocks of most true attention mass, same top-k and
                 forced blocks); recent (a window of the newest blocks, the top-k's budget) as a baseline that
                 cannot retrieve
    excluded     tasks the dense model fails (below 50 at the shortest length): reported, kept out of the averages
"""
from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from m3compile.config import SELECTIONS, check_size, max_positions
from m3compile.errors import M3CompileError
from m3compile.outputs import atomic_save_figure, check_output_file
from m3compile.models.decoder import Decoder
from m3compile.runtime.generate import check_answer_budget, generate, resolve_kv_cache
from m3compile.io.tokenizer import PromptCodec
from m3compile.evaluation.ruler_tasks import TASKS, Haystacks, Sample, build_samples, check_fits

__all__ = ["ruler", "run_samples", "score", "read_text", "RulerReport", "draw_heatmap", "DEFAULT_SELECTIONS",
           "DEFAULT_LENGTHS", "PASS_SCORE"]

DEFAULT_SELECTIONS = ("dense", "index", "oracle")  # of m3compile.config.SELECTIONS
DEFAULT_LENGTHS = (4096, 8192, 16384, 32768)
PASS_SCORE = 50.0  # a task the dense model scores below this at the shortest length is excluded from averages
_CONTROL = re.compile(r"[\x00-\x1f]")


def score(text: str, answers: tuple[str, ...] | list[str]) -> float:
    """RULER's string_match_all for one sample: the share of `answers` found in `text` (both lower-cased; control
    characters of the text read as newlines, as RULER's postprocessing does)."""
    text = _CONTROL.sub("\n", text.strip()).strip().lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def read_text(path: str | os.PathLike) -> str:
    """The data file's text (UTF-8): the code haystack and the words the tasks draw."""
    path = Path(path)
    if not path.is_file():
        raise M3CompileError(f"{path}: no such data file")
    if path.suffix.lower() == ".npy":
        raise M3CompileError(f"{path}: the ruler suite builds its prompts from text; give a UTF-8 text file")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise M3CompileError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None


@dataclass
class RulerReport:
    """What `ruler` measured. `to_dict()` (the JSON of `m3c eval ruler --json`) has these keys:

    task            "ruler"
    lengths         the prompt lengths (tokens, generation included), ascending; context: the model's positions
    tasks           the task names, in suite order; selections: the selections run (of index / oracle / dense /
                    recent)
    samples, seed   samples per task and length; the seed of the prompts
    chat            whether prompts went through the checkpoint's chat template
    scores          {task: {selection: {length: score}}}, score = mean over samples of the share of expected answers
                    in the greedy answer, x 100 (RULER's string_match_all)
    max_new_tokens  {task: tokens generated at most} (RULER's per-task setting)
    excluded        tasks the dense model scores below 50 at the shortest length: kept out of `average`
    average         {selection: {length: mean score over the tasks not excluded}}, and "all" over the lengths
    stderr          the standard error of each average, as `average` ({selection: {length | "all": points}}): the
                    tasks' sample means are independent, so it is sqrt(sum over them of s^2 / n) / their count, s^2
                    a task's sample variance (x 100^2) and n its samples (at 10 samples a task's score moves in steps
                    of 10 points)
    variances       {task: {selection: {length: s^2 / n}}}: each score's squared standard error, from which the
                    standard error of an average over any set of tasks follows (another run's exclusions)
    prompt_tokens   {length: mean prompt tokens over every sample}
    decode_blocks   {length: the mean blocks an MSA layer's KV group kept per decode step with the index selection}
                    (the answer's budget as it ran, adaptive ones included; every answer step of every task), {}
                    without an index selection or MSA layers
    kv_cache        the K/V cache dtype of prefill and decode: "auto" (the model's), "bf16", "fp8" or "int8"
    answer_budget   the index selection's budget of each prompt's last answer_tokens tokens and of the answer
                    (m3compile.generate's answer_budget), or None: the model's throughout
    decode_budget   the index selection's budget of the answer where it differs from answer_budget
                    (m3compile.generate's decode_budget), or None
    seconds         wall time
    """

    lengths: list[int]
    tasks: list[str]
    selections: list[str]
    samples: int
    seed: int
    chat: bool
    context: int | None = None
    scores: dict[str, dict[str, dict[int, float]]] = field(default_factory=dict)
    variances: dict[str, dict[str, dict[int, float]]] = field(default_factory=dict)  # each score's s^2 / n
    prompt_tokens: dict[int, float] = field(default_factory=dict)
    decode_blocks: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0
    kv_cache: str = "auto"
    answer_budget: str | None = None
    answer_tokens: int | None = None
    decode_budget: str | None = None

    @property
    def excluded(self) -> list[str]:
        if "dense" not in self.selections or not self.lengths:
            return []
        return [t for t in self.tasks if self.scores[t]["dense"][self.lengths[0]] < PASS_SCORE]

    def average(self, selection: str, length: int | None = None) -> float | None:
        """Mean score of the tasks not excluded at `length` (None: over every length too)."""
        values = self._kept(self.scores, selection, length)
        return sum(values) / len(values) if values else None

    def stderr(self, selection: str, length: int | None = None) -> float | None:
        """The standard error of `average(selection, length)`, in points (None where no variance was kept)."""
        if not self.variances:
            return None
        values = self._kept(self.variances, selection, length)
        return math.sqrt(sum(values)) / len(values) if values else None

    def _kept(self, table: dict, selection: str, length: int | None) -> list[float]:
        kept = [t for t in self.tasks if t not in self.excluded]
        lengths = self.lengths if length is None else [length]
        return [table[t][selection][n] for t in kept for n in lengths]

    def to_dict(self) -> dict:
        return {
            "task": "ruler", "lengths": self.lengths, "context": self.context, "tasks": self.tasks,
            "selections": self.selections, "samples": self.samples, "seed": self.seed, "chat": self.chat,
            "scores": {t: {s: {str(n): round(v, 2) for n, v in by_len.items()} for s, by_len in by_sel.items()}
                       for t, by_sel in self.scores.items()},
            "max_new_tokens": {t: TASKS[t].max_new_tokens for t in self.tasks},
            "excluded": self.excluded,
            "average": {s: {**{str(n): _round(self.average(s, n)) for n in self.lengths},
                            "all": _round(self.average(s))} for s in self.selections},
            "stderr": {s: {**{str(n): _round(self.stderr(s, n)) for n in self.lengths},
                           "all": _round(self.stderr(s))} for s in self.selections},
            "variances": {t: {s: {str(n): round(v, 3) for n, v in by_len.items()} for s, by_len in by_sel.items()}
                          for t, by_sel in self.variances.items()},
            "prompt_tokens": {str(n): round(v, 1) for n, v in self.prompt_tokens.items()},
            "decode_blocks": {str(n): round(v, 2) for n, v in self.decode_blocks.items()},
            "kv_cache": self.kv_cache, "answer_budget": self.answer_budget, "answer_tokens": self.answer_tokens,
            "decode_budget": self.decode_budget, "seconds": round(self.seconds, 2),
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def run_samples(model: Decoder, samples: list[Sample], max_new_tokens: int, decode: Callable[[list[int]], str], *,
                stop_ids: list[int], selection: str = "index", batch: int | None = None,
                progress: Callable[[int], None] | None = None, kernels: bool | None = None,
                kv_cache: str = "auto", answer_budget: str | None = None, answer_tokens: int = 128,
                decode_budget: str | None = None, block_counts: list[int] | None = None) -> list[float]:
    """Greedy answers of `samples` (batches of `batch` prompts per generate call: each prompt prefilled once, then
    the paged cached decode) with the MSA layers selecting as `selection` (config.SELECTIONS); per sample the
    share of its answers found in the decoded text (`score`). progress(n): n more samples done. kv_cache: the K/V
    cache dtype (m3compile.generate's kv_cache_dtype); kernels, answer_budget, answer_tokens, decode_budget: as
    m3compile.generate's (the index selection's alone). block_counts: a [blocks kept, rows] pair the decode steps'
    counts are added to (GenerationResult.block_counts)."""
    out = []
    step = batch or len(samples)
    for start in range(0, len(samples), step):
        chunk = samples[start:start + step]
        answer = dict(answer_budget=answer_budget, answer_tokens=answer_tokens, decode_budget=decode_budget) \
            if selection == "index" else {}
        result = generate(model, [s.ids for s in chunk], max_new_tokens, eos_token_id=stop_ids, selection=selection,
                          kernels=kernels, kv_cache_dtype=kv_cache, count_blocks=block_counts is not None, **answer)
        if block_counts is not None and result.block_counts:
            block_counts[0] += result.block_counts[0]
            block_counts[1] += result.block_counts[1]
        for s, tokens in zip(chunk, result.tokens):
            out.append(score(decode([t for t in tokens if t not in stop_ids]), s.answers))
        if progress:
            progress(len(chunk))
    return out


def ruler(model: Decoder, codec: PromptCodec, text: str, *, tasks: list[str] | None = None,
          lengths: list[int] | None = None, samples: int = 25, seed: int = 0,
          selections: tuple[str, ...] | list[str] = DEFAULT_SELECTIONS, batch: int | None = None,
          data_name: str = "the data file", kernels: bool | None = None,
          kv_cache: str = "auto", answer_budget: str | None = None, answer_tokens: int | None = None,
          decode_budget: str | None = None, progress: Callable[[int, int, str], None] | None = None) -> RulerReport:
    """The suite (module doc): scores per task, length and selection.

    text: the data file's text (the code haystack, the words of keys and of cwe). lengths: default 4K-32K, those
    within the model's positions (m3compile.config.max_positions; a length above them is an error). Every length
    and task pair is checked to fit (ruler_tasks.check_fits) before the first prompt is generated. A model without MSA
    layers runs dense only. kv_cache: the K/V cache dtype of every prefill and decode ("auto": the model's, "bf16",
    "fp8", "int8"). answer_budget, answer_tokens: the index selection's budget of each prompt's last answer_tokens
    tokens and of its answer, decode_budget the answer's where it differs (m3compile.generate's; kN,
    pP:FLOOR:CEILING or "off"; None: the model's stored ones); the other selections run without them.
    progress(done, total, what): samples generated so far of all."""
    check_size(samples, "samples", "samples")
    if batch is not None:
        check_size(batch, "batch", "batch")
    p0 = next(model.parameters())
    resolve_kv_cache(kv_cache, p0.dtype, p0.device)  # an unknown or unsupported dtype stops before any prompt
    tasks = list(TASKS) if tasks is None else list(tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise M3CompileError(f"unknown ruler task {unknown[0] if unknown else '(none given)'!r} (tasks: "
                             f"{', '.join(TASKS)})")
    bad = [s for s in selections if s not in SELECTIONS]
    if bad or not selections:
        raise M3CompileError(f"unknown selection {bad[0] if bad else '(none given)'!r} (use {', '.join(SELECTIONS)})")
    context = max_positions(getattr(model, "source_config", None))
    if lengths is None:
        lengths = [n for n in DEFAULT_LENGTHS if context is None or n <= context] or [context]
    lengths = sorted(set(check_size(n, "lengths") for n in lengths))
    if not lengths:
        raise M3CompileError("no lengths given")
    too_long = [n for n in lengths if context is not None and n > context]
    if too_long:
        raise M3CompileError(f"length {too_long[0]} is above the model's context ({context} tokens, "
                             f"max_position_embeddings)")
    if not any(model.args.is_sparse(i) for i in range(model.args.n_layers)):
        selections = ["dense"]  # no MSA layer: every selection is dense attention
    else:
        model.args.msa.check_floor(lengths[0], f"a prompt of {lengths[0]} tokens")
    selections = list(dict.fromkeys(selections))
    budgets = {"answer_budget": None, "answer_tokens": None, "decode_budget": None}
    if "index" in selections:  # given or stored in the model, checked against the model before any prompt
        budgets = check_answer_budget(model, answer_budget, answer_tokens, decode_budget)
    elif answer_budget not in (None, "off") or decode_budget not in (None, "off"):
        raise M3CompileError("an answer or decode budget is the index selection's: add index to the selections")
    # what runs, with nothing left to the model's stored settings (None there) in generate
    answer_budget = budgets["answer_budget"] or "off"
    decode_budget = budgets["decode_budget"] or budgets["answer_budget"] or "off"
    answer_tokens = budgets["answer_tokens"] or 0
    start = time.perf_counter()
    report = RulerReport(lengths, tasks, selections, samples, seed, codec.chat, context, kv_cache=kv_cache, **budgets)
    haystacks = Haystacks(text, data_name)
    render = lambda inst: codec.prompt(inst.question, inst.answer_prefix)  # noqa: E731
    for length in report.lengths:  # every length and task pair, before any work (one tokenization each)
        for name in tasks:
            check_fits(TASKS[name], length, seed, haystacks, render, codec.encode_batch)
    total, done = len(tasks) * len(lengths) * len(selections) * samples, 0
    for name in tasks:
        report.scores[name] = {s: {} for s in selections}
        report.variances[name] = {s: {} for s in selections}
    for length in report.lengths:
        counted, kept = [], [0, 0]
        for name in tasks:
            task = TASKS[name]
            if progress:
                progress(done, total, f"{name} at {length}: building prompts")
            built = build_samples(task, length, samples, seed, haystacks, render, codec.encode_batch)
            counted += [len(s.ids) for s in built]
            for sel in selections:
                def advance(n, _what=f"{name} at {length}: {sel}"):
                    nonlocal done
                    done += n
                    if progress:
                        progress(done, total, _what)
                if progress:
                    progress(done, total, f"{name} at {length}: {sel}")
                got = run_samples(model, built, task.max_new_tokens, codec.decode, stop_ids=codec.stop_ids,
                                  selection=sel, batch=batch, progress=advance, kernels=kernels,
                                  kv_cache=kv_cache, answer_budget=answer_budget, answer_tokens=answer_tokens,
                                  decode_budget=decode_budget, block_counts=kept if sel == "index" else None)
                mean = sum(got) / len(got)
                report.scores[name][sel][length] = 100.0 * mean
                var = sum((g - mean) ** 2 for g in got) / (len(got) - 1) if len(got) > 1 else 0.0
                report.variances[name][sel][length] = 100.0**2 * var / len(got)
        report.prompt_tokens[length] = sum(counted) / len(counted)
        if kept[1]:
            report.decode_blocks[length] = kept[0] / kept[1]
    report.seconds = time.perf_counter() - start
    return report


def draw_heatmap(report: RulerReport, out: str | os.PathLike, inputs=()) -> Path:
    """Write a PNG: per selection, the score of every task (rows; excluded ones marked) at every length (columns),
    with the average over the tasks kept as the last row. Through the output guard: `out` a *.png file that is none
    of `inputs` (the model, the data) nor inside one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    check_output_file(out, inputs, suffix=".png")
    rows = [t + (" (excluded)" if t in report.excluded else "") for t in report.tasks] + ["average"]
    cols = [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in report.lengths]
    n_sel = len(report.selections)
    fig, axes = plt.subplots(1, n_sel, figsize=(1.2 + (0.9 * len(cols) + 0.6) * n_sel + 1.6, 0.4 * len(rows) + 1.4),
                             squeeze=False, sharey=True)
    for ax, sel in zip(axes[0], report.selections):
        grid = [[report.scores[t][sel][n] for n in report.lengths] for t in report.tasks]
        grid.append([math.nan if report.average(sel, n) is None else report.average(sel, n) for n in report.lengths])
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=8,
                            fontweight="bold" if i == len(grid) - 1 else "normal")
        ax.axhline(len(grid) - 1.5, color="black", linewidth=1)
        ax.set_xticks(range(len(cols)), cols)
        ax.set_title(sel)
        ax.set_xlabel("length (tokens)")
    axes[0][0].set_yticks(range(len(rows)), rows)
    fig.colorbar(image, ax=axes[0].tolist(), fraction=0.03, pad=0.02, label="score (share of answers found, %)")
    fig.suptitle(f"RULER-style suite: {report.samples} samples per task and length, greedy", fontsize=10)
    try:
        atomic_save_figure(fig, out, inputs, dpi=130, bbox_inches="tight")
    finally:
        plt.close(fig)
    return out
