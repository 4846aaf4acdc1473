"""Generation with paged caches: prefill each prompt, then decode all sequences token by token.

The caches, the prefill, the decode step and its CUDA graph are m3compile.runtime's; this module drives them for
a user: checks the request, sizes the caches, picks each next token (greedy or top-p sampling), stops at the
end-of-sequence token (text <-> tokens: m3compile.io.tokenizer).

    result = m3compile.generate(m3compile.load("out", device="cuda", dtype="bf16"), [[1, 2, 3], [4, 5]], 32)
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from m3compile.config import INDEX_CACHE_DTYPES, KV_CACHE_DTYPES, SELECTIONS, budget_spec, parse_budget
from m3compile.errors import M3CompileError
from m3compile.io.hf_config import check_positions
from m3compile.models.decoder import Decoder, ModelArgs
from m3compile import memory
from m3compile.ops import lowering
from m3compile.runtime.cuda_graph import DecodeStep, graph_unavailable
from m3compile.runtime.forward import lowering_default, prefill
from m3compile.runtime.paged_cache import PagedCache
from m3compile.runtime.timings import NULL_TIMINGS, Timings

__all__ = ["generate", "GenerationResult", "KV_CACHE_TORCH_DTYPES", "resolve_kv_cache", "resolve_index_cache",
           "check_answer_budget", "resolve_budgets"]


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated tokens per sequence (prompt excluded)
    prefill_logits: list[torch.Tensor]  # [vocab] logits after each prompt
    step_logits: torch.Tensor  # [steps, B, vocab] logits of each decode step (fp32)
    timings: dict | None = None  # with generate(..., timings=True): seconds per phase (runtime/timings.py)
    # with generate(..., count_blocks=True): (blocks kept, (sequence, KV group, MSA layer, step) rows) over the decode
    # steps run, finished sequences' included; None otherwise
    block_counts: tuple[int, int] | None = None

    @property
    def decode_blocks(self) -> float | None:
        """The mean blocks an MSA layer's KV group kept per decode step (None: not counted, or no such step)."""
        if not self.block_counts or not self.block_counts[1]:
            return None
        return self.block_counts[0] / self.block_counts[1]


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Next tokens [B] from logits [B, vocab]: argmax at temperature 0, else a sample from the top-p nucleus of
    softmax(logits / temperature) (drawn on the CPU, so a seed gives the same tokens on any device)."""
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits.float().cpu() / temperature
    if not bool(torch.isfinite(scaled).all()):  # a tiny temperature overflows the logits: shift them to <= 0 first
        if not bool(torch.isfinite(logits).all()):
            raise M3CompileError("the model's logits are not finite (NaN or infinity): nothing to sample from")
        shifted = logits.float().cpu()
        scaled = (shifted - shifted.amax(-1, keepdim=True)) / temperature  # -inf below the top: its probability 0
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # the most likely token always stays
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0].to(logits.device)


def generate(model: Decoder, prompts: list[list[int]] | torch.Tensor, max_new_tokens: int, *,
             index_cache_dtype: str = "auto", page_size: int | None = None,
             eos_token_id: int | Sequence[int] | None = None, temperature: float = 0.0, top_p: float = 1.0,
             seed: int | None = None, on_token: Callable[[int, int], None] | None = None,
             cuda_graph: bool | None = None, kernels: bool | None = None, kv_cache_dtype: str = "auto",
             prefill_chunk: int | None = None, timings: bool = False,
             selection: str = "index", cache_len: int | None = None, answer_budget: str | dict | None = None,
             answer_tokens: int | None = None, decode_budget: str | dict | None = None,
             count_blocks: bool = False) -> GenerationResult:
    """Generation with paged caches: prompts of any lengths, one batched decode per new token.

    Greedy by default; temperature > 0 samples from the top-p nucleus (seed: a reproducible draw).
    index_cache_dtype: "auto" (the model's dtype; fp8 when the model scores its index in fp8, index_dtype "fp8") or
    "fp8" (e4m3 index keys, one fp32 scale per page).
    kv_cache_dtype: the K/V cache's: "auto" (the model's dtype), "bf16", "fp8" (e4m3, one fp32 scale per token
    and head: half the bytes of bf16, read by the decode kernels and dequantised in registers), or "int8" (the same
    bytes: 8-bit integer rows after an exact rotation, runtime.key_shift.rotation; about 1/10 of fp8's loss on the
    real 32K model, BENCHMARKS.md).
    prefill_chunk: tokens per prefill pass (runtime.prefill). None (default): the whole prompt where its activations
    fit beside the caches, else the largest chunk that does (m3compile.memory.prefill_chunk).
    Before anything is allocated the caches and a prefill chunk's activations are counted (m3compile.memory) against
    the device's free memory (a CPU's available memory); what does not fit is an M3CompileError giving the numbers
    and what would fit (an fp8 KV cache, how many of these prompts at once, a smaller chunk, fewer positions). The
    caches hold every sequence at the longest prompt's length plus max_new_tokens, or at cache_len positions where
    that is more (the caches a longer run would allocate, with its kernels: m3compile.runtime.compile_ahead).
    page_size: tokens per cache page; MSA models use their block size (required to be equal).
    on_token(sequence, token) is called for every generated token as it is chosen (streaming).
    cuda_graph: replay the decode step as a CUDA graph (DecodeStep). None (default): on a CUDA device when the
    step is capturable (`graph_unavailable`) and at least 8 decode steps follow; eager on a CPU. True: required.
    kernels: prefill and decode run the ops' lowerings (m3compile.ops.lowering: the Triton kernels of RMSNorm, RoPE,
    the index branch, the selection and the attention); False the plain-torch references. None (default): on a
    CUDA device (lowering_default); True on a CPU runs them under TRITON_INTERPRET=1 and the references otherwise.
    timings: fill `GenerationResult.timings` with the seconds of each phase (setup: the checks and the memory plan;
    cache, prefill, graph_capture, decode, decode_per_token; release: the caches and the CUDA graph freed), the
    Triton compiles inside them apart ("compile", "compiles") and the kernel variants launched (runtime/timings.py),
    with the batch, its new tokens and new_tokens_per_s (every sequence's new tokens over the decode seconds); CUDA
    is synchronised at each phase boundary, so only when asked. Generation traces nothing and runs no pass: it
    calls the Decoder's forward over the caches (runtime.forward), and the model's projections are fused in place,
    once (Decoder.fuse_projections: one matmul for each layer's q/k/v and index q/k, one for gate/up; the same
    parameters and state dict, no memory added).
    answer_budget: the selection budget (kN, pP:FLOOR:CEILING as config.parse_budget reads it, or set_budget's
    keywords) of the last `answer_tokens` tokens of every prompt (where a question sits) and of every new token;
    the rest of each prompt keeps the model's own. The prompt is then prefilled in two parts, the model's budget
    restored after the run. A larger budget where the answer is read costs the prefill almost nothing and the decode
    what its blocks cost (BENCHMARKS.md). None (default): the one the model was converted with (`m3c convert
    --answer-budget`: config.json's sparse_answer_budget), if any; "off": the model's budget throughout.
    answer_tokens: None (default): the model's stored count, else 128.
    decode_budget: the budget of every new token (the same forms), where it should differ from the answer budget:
    e.g. the question read at 256 blocks and the answer written at the model's own budget ("off"), whose decode
    step costs what the model's does. None (default): the model's stored one, else the answer budget.
    count_blocks: count the blocks each MSA layer's KV groups keep in every decode step (a reduction a layer, on the
    device: the decode budget's cost as it ran, adaptive budgets included); GenerationResult.block_counts and
    .decode_blocks hold them.
    The stored budgets apply to the index selection alone; given ones with another selection are an error.
    eos_token_id: one id or several (a chat model's end of turn and its end of text): a sequence stops at any.
    selection: how MSA layers pick their blocks in prefill and decode (m3compile.config.SELECTIONS): "index" (the
    model), "oracle" (the blocks of most true attention mass), "dense" (every block), "recent" (the newest blocks).
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise M3CompileError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise M3CompileError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**64):
        raise M3CompileError(f"seed must be an integer in [-2**63, 2**64), got {seed!r}")
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    if not isinstance(model, Decoder):
        raise M3CompileError("generate needs a Decoder (m3compile.load or m3compile.from_preset)")
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise M3CompileError("every prompt needs at least one token")
    if max_new_tokens < 0:
        raise M3CompileError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if selection not in SELECTIONS:
        raise M3CompileError(f"unknown selection {selection!r} (use one of {', '.join(SELECTIONS)})")
    stop = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    a = model.args
    vocab = a.vocab_size
    bad = [t for p in prompts for t in p if not 0 <= t < vocab]
    if bad:
        raise M3CompileError(f"token id {bad[0]} is outside the vocabulary (size {vocab})")
    block = a.msa.block_size if a.msa is not None and any(a.is_sparse(i) for i in range(a.n_layers)) else None
    if block is not None and page_size not in (None, block):
        raise M3CompileError(f"page_size ({page_size}) must equal the MSA block size ({block}): a page is a block")
    page = block or page_size or 128
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 1):
        raise M3CompileError(f"prefill_chunk must be a whole number of tokens >= 1, got {prefill_chunk!r}")
    p0 = next(model.parameters())
    device, dtype = p0.device, p0.dtype
    timer = Timings(device) if timings else NULL_TIMINGS
    timer.mark("setup")
    index_dtype = resolve_index_cache(index_cache_dtype, a, dtype)
    kv_dtype = resolve_kv_cache(kv_cache_dtype, dtype, device)
    B = len(prompts)
    longest = max(len(p) for p in prompts)  # the last new token is never fed: positions up to longest + new - 2
    which = "" if B == 1 else f"prompt {[len(p) for p in prompts].index(longest) + 1} of {B}: "
    check_positions(longest + max_new_tokens - 1, getattr(model, "source_config", None),
                    f"{which}{longest:,} prompt tokens + {max_new_tokens:,} new tokens "
                    f"({longest + max_new_tokens - 1:,} positions)")
    if cache_len is not None and (isinstance(cache_len, bool) or not isinstance(cache_len, int) or cache_len < 1):
        raise M3CompileError(f"cache_len must be a whole number of positions >= 1, got {cache_len!r}")
    max_len = max(longest + max_new_tokens, cache_len or 0)
    if max_len > longest + max_new_tokens:
        check_positions(max_len - 1, getattr(model, "source_config", None), f"a cache of {max_len:,} positions")
    if selection == "index":  # the model's stored budgets (config.json) where none is given
        answer_budget, answer_tokens, decode_budget = resolve_budgets(model, answer_budget, answer_tokens,
                                                                      decode_budget)
    else:  # no stored budget; "off" is no budget
        answer_budget, decode_budget = (None if b == "off" else b for b in (answer_budget, decode_budget))
        answer_tokens = 128 if answer_tokens is None else answer_tokens
    own, answer, decode = _budgets(model, answer_budget, answer_tokens, selection, decode_budget)
    larger = max((b for b in (answer, decode) if b), key=lambda b: b["topk"], default=None)
    with _budget(model, larger if larger and larger["topk"] > own["topk"] else None):  # the larger one's activations
        chunk = _memory_checked_chunk(model, B, max_len, longest, page, kv_dtype, index_dtype, prefill_chunk)
    if selection in ("oracle", "recent"):  # they rank a prompt's own blocks: one prefill pass
        chunk = None
    with _restored(model) if own else contextlib.nullcontext():  # the model's budget back afterwards
        timer.mark("cache")
        cache = PagedCache(model, B, max_len, page, device, kv_dtype, index_dtype)
        model.fuse_projections()
        kernels = lowering_default(device) if kernels is None else kernels
        with lowering(kernels), timer.watch():  # the Triton kernels (CUDA by default)
            timer.mark("prefill")
            prefill_logits = []
            for b, p in enumerate(prompts):
                ids = torch.tensor(p, device=device)
                if answer is None:
                    prefill_logits.append(prefill(model, cache, b, ids, chunk, selection))
                else:  # the prompt at the model's budget, its last answer_tokens at the answer budget
                    body = max(len(p) - answer_tokens, 0)
                    if body:
                        model.set_budget(**own)
                        logits = prefill(model, cache, b, ids[:body], chunk, selection)
                    if body < len(p):
                        model.set_budget(**answer)
                        logits = prefill(model, cache, b, ids[body:], chunk, selection, start=body)
                    prefill_logits.append(logits)
                cache.seq_lens[b] = len(p)
            if decode is not None:
                model.set_budget(**decode)  # every new token at the decode budget (the answer budget's by default)
            auto = cuda_graph is None
            if auto:
                cuda_graph = max_new_tokens > 8 and graph_unavailable(model, device, kernels) is None
            timer.mark("graph_capture")  # (eager: the DecodeStep's setup only; its first steps compile in "decode")
            if count_blocks:  # the counter exists before a capture, so the captured step adds to it
                cache.count_blocks()
            try:
                step_fn = DecodeStep(model, cache, B, graph=bool(cuda_graph) and max_new_tokens > 1, kernels=kernels,
                                     selection=selection)
            except RuntimeError as e:  # a capture CUDA refused: what was not asked for explicitly falls back to eager
                if not auto:
                    raise
                warnings.warn(f"decode step not captured as a CUDA graph ({str(e).splitlines()[0][:120]}); "
                              "running eagerly")
                step_fn = DecodeStep(model, cache, B, kernels=kernels, selection=selection)
            if count_blocks:
                cache.count_blocks()  # zeroed: the capture's warm-up steps not counted
            out = [[] for _ in range(B)]
            done = [False] * B
            step_logits = []
            timer.mark("decode")
            next_tok = _pick(torch.stack(prefill_logits), temperature, top_p, generator)
            for step in range(max_new_tokens):
                chosen = next_tok.tolist()  # one host synchronisation per step
                for b in range(B):
                    if not done[b]:
                        out[b].append(chosen[b])
                        if on_token is not None:
                            on_token(b, chosen[b])
                        done[b] = chosen[b] in stop
                if stop and all(done):
                    break
                if step == max_new_tokens - 1:
                    break
                logits = step_fn(next_tok)
                step_logits.append(logits.clone() if step_fn.graph is not None else logits)
                next_tok = _pick(logits, temperature, top_p, generator)
            timer.mark("release")  # the CUDA graph and the caches freed
            counted = tuple(int(c) for c in cache.kept.tolist()) if count_blocks else None
            del step_fn, cache
            timer.stop()
        steps = torch.stack(step_logits) if step_logits else torch.empty(0, B, vocab)
        timer.add("prompt_tokens", sum(map(len, prompts)))
        timer.add("decode_steps", len(step_logits))
        timer.add("batch", B)
        timer.add("new_tokens", sum(map(len, out)))
        return GenerationResult(out, prefill_logits, steps, timer.to_dict() if timings else None, counted)


def check_answer_budget(model: Decoder, answer_budget=None, answer_tokens: int | None = None,
                        decode_budget=None) -> dict:
    """generate's answer_budget, answer_tokens and decode_budget (given, or the model's stored ones: as generate
    resolves them) checked against the model, as set_budget checks a budget -> what the index selection runs:
    {"answer_budget", "answer_tokens", "decode_budget"}, each None where the model's budget applies."""
    answer_budget, answer_tokens, decode_budget = resolve_budgets(model, answer_budget, answer_tokens, decode_budget)
    _budgets(model, answer_budget, answer_tokens, "index", decode_budget)
    return {"answer_budget": answer_budget, "answer_tokens": None if answer_budget is None else answer_tokens,
            "decode_budget": decode_budget}


def resolve_budgets(model: Decoder, answer_budget, answer_tokens, decode_budget) -> tuple:
    """generate's budget arguments with the model's stored ones in place of None (config.json's
    sparse_answer_budget, sparse_answer_tokens, sparse_decode_budget), "off" as None (the answer budget) or the
    model's own budget (the decode budget) -> (answer_budget, answer_tokens, decode_budget)."""
    m = model.args.msa if any(model.args.is_sparse(i) for i in range(model.args.n_layers)) else None
    stored_decode = None
    if answer_budget is None and m is not None:
        answer_budget, stored_decode = m.answer_budget, m.decode_budget
    if answer_budget == "off":
        answer_budget = None
    if decode_budget is None:
        decode_budget = stored_decode
    if decode_budget == "off":
        decode_budget = budget_spec(_budget_of(model)) if m is not None else None
    if answer_tokens is None:
        answer_tokens = m.answer_tokens if m is not None else 128
    return answer_budget, answer_tokens, decode_budget


def _budgets(model: Decoder, answer_budget, answer_tokens, selection, decode_budget=None) -> tuple[dict | None, ...]:
    """(the model's budget, the answer budget, the decode budget), each checked against the model; None for what is
    not given (the decode budget defaults to the answer budget)."""
    if answer_budget is None and decode_budget is None:
        return None, None, None
    if isinstance(answer_tokens, bool) or not isinstance(answer_tokens, int) or answer_tokens < 0:
        raise M3CompileError(f"answer_tokens must be a whole number of tokens >= 0, got {answer_tokens!r}")
    which = "an answer budget" if answer_budget is not None else "a decode budget"
    if selection in ("oracle", "recent", "dense"):
        raise M3CompileError(f"{which} is the index selection's; selection {selection!r} has its own")
    if model.args.msa is None or not any(model.args.is_sparse(i) for i in range(model.args.n_layers)):
        raise M3CompileError(f"{which} applies to MSA layers, and the model has none (it was never converted)")
    own = _budget_of(model)
    answer = _checked(model, answer_budget, "the answer budget")
    decode = _checked(model, decode_budget, "the decode budget") or answer
    return own, answer, decode


def _checked(model: Decoder, budget, name: str) -> dict | None:
    """One budget (kN, pP:FLOOR:CEILING or set_budget's keywords) as set_budget's keywords, its ranges and floor
    checked against the model as set_budget checks them; None stays None."""
    if budget is None:
        return None
    out = parse_budget(budget, name) if isinstance(budget, str) else dict(budget)
    if set(out) != {"top_p", "min_blocks", "topk"}:
        raise M3CompileError(f"{name} gives top_p, min_blocks and topk, got {sorted(out)}")
    with _budget(model, out):  # checked as set_budget checks it, then the model's budget again
        pass
    return out


def _budget_of(model: Decoder) -> dict:
    """The MSA layers' budget now, as set_budget's keywords."""
    m = model.args.msa
    return {"top_p": m.top_p, "min_blocks": m.min_blocks, "topk": m.topk}


@contextlib.contextmanager
def _restored(model: Decoder):
    """The MSA layers' budget as it is now, set again after the block however it ends."""
    own = _budget_of(model)
    try:
        yield
    finally:
        model.set_budget(**own)


@contextlib.contextmanager
def _budget(model: Decoder, budget: dict | None):
    """The MSA layers at `budget` (Decoder.set_budget) inside the block, at their own again after it."""
    if budget is None:
        yield
        return
    with _restored(model):
        model.set_budget(**budget)
        yield


# kv_cache_dtype (a name of m3compile.config.KV_CACHE_DTYPES) -> the K/V cache's torch dtype (None: the model's)
KV_CACHE_TORCH_DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def resolve_kv_cache(name: str, model_dtype: torch.dtype, device) -> torch.dtype:
    """The K/V cache's torch dtype for a kv_cache_dtype name ("auto": `model_dtype`), checked before any cache is
    allocated: an unknown name, or a dtype this torch build cannot hold on `device` (fp8 without float8 support),
    is a one-line M3CompileError."""
    if name not in KV_CACHE_DTYPES:
        raise M3CompileError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    dtype = KV_CACHE_TORCH_DTYPES[name]
    if dtype is None:
        return model_dtype
    try:
        torch.zeros(1, device=device).to(dtype)
    except (RuntimeError, TypeError) as e:
        raise M3CompileError(f"a {name} K/V cache needs {str(dtype).replace('torch.', '')} tensors on "
                             f"{torch.device(device)}, which this torch build does not support "
                             f"({str(e).splitlines()[0][:100]}); use bf16") from None
    return dtype


def resolve_index_cache(name: str, args: ModelArgs, model_dtype: torch.dtype) -> torch.dtype:
    """The index-key cache's torch dtype for an index_cache_dtype name: "fp8", or "auto" (fp8 where the model scores
    its index in fp8, `args.msa.index_dtype`, else `model_dtype`); any other name is a one-line M3CompileError."""
    if name not in INDEX_CACHE_DTYPES:
        raise M3CompileError(f"index_cache_dtype must be 'auto' or 'fp8', got {name!r}")
    if name != "auto" and args.msa is None:
        raise M3CompileError(f"--index-cache {name} applies to the index keys of MSA layers, and the model has none "
                             f"(it was never converted): nothing would be cached in it")
    fp8_model = args.msa is not None and args.msa.index_dtype == "fp8"
    return torch.float8_e4m3fn if name == "fp8" or fp8_model else model_dtype


def _memory_checked_chunk(model: Decoder, batch: int, max_len: int, longest: int, page: int, kv_dtype, index_dtype,
                          chunk: int | None) -> int:
    """The prefill chunk (`chunk`, or the one that fits), after checking that the caches of `batch` sequences of
    `max_len` positions and that chunk's activations fit in the model's device's free memory (m3compile.memory)."""
    p0 = next(model.parameters())
    free = memory.available_bytes(p0.device)
    plan = memory.fitted_plan(memory.ModelShape.from_args(model.args), batch, max_len, longest, free,
                              kv_dtype=kv_dtype, index_dtype=index_dtype, model_dtype=p0.dtype, chunk=chunk,
                              page=page, weights=memory.weight_bytes(model))
    memory.check_memory(plan, free, str(p0.device), auto_chunk=chunk is None, batch_of="prompts")
    return plan.chunk
