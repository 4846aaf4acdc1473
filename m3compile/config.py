"""MSAConfig: what the GQA -> MSA rewrite produces, with M3's key names on the way out; dtype and selection names.

Importing this imports no torch (the command line reads the names at startup); parse_dtype imports it when called.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from m3compile.errors import M3CompileError

__all__ = ["MSAConfig", "EvalConfig", "parse_dtype", "parse_size", "parse_sizes", "check_size", "SIZE_LIMITS",
           "check_msa_ranges", "check_floor_fits", "check_question_budgets", "max_positions", "budget_words",
           "parse_budget", "budget_spec", "DTYPES", "INDEX_DTYPES",
           "INDEX_ROPES", "SELECTIONS", "KV_CACHE_DTYPES", "INDEX_CACHE_DTYPES", "RULER_TASKS", "MAX_BLOCK_SIZE",
           "MAX_TOPK", "MAX_INDEX_DIM", "MAX_INDEX_HEADS", "FORMAT_VERSION", "FORMAT_VERSION_KEY"]

# How the index branch scores: "auto" in the dtype it computes in (bf16 under bf16), "fp8" as e4m3 x e4m3 with one
# scale per key token and per query (token, head), fp32 accumulation (kernels/indexer/)
INDEX_DTYPES = ("auto", "fp8")
# The index branch's RoPE rule (kernels/norm_rope/index_rope.py): "m3" the main table cut to the index width
# (transformers' M3 rule; a rotation only when index_dim >= the rotary width R); "low" the index head's Di/2 rotary
# pairs turn at the main table's Di/2 lowest frequencies (what the converter writes when index_dim < R:
# sparse_index_rope "low");
# "tile" an index head wider than R turns every one of its Di/2 pairs, each at one of the main table's R/2
# frequencies, every frequency at least once (what the converter writes when index_dim > R = head_dim:
# sparse_index_rope "tile"; the init fits a dense pair's groups with as many shared-key ranks as it has index pairs)
INDEX_ROPES = ("m3", "low", "tile")
# How an MSA layer picks the key blocks it attends to, on every path (the model's forward, the paged prefill and
# decode, evaluation, the RULER-style suite): "index" the index branch's top-k (the converted model itself),
# "oracle" the blocks of most dense group-mean attention mass (what a perfect index branch would pick), "dense"
# every visible key, "recent" the newest blocks (a sliding window with the top-k's budget: a baseline)
SELECTIONS = ("index", "oracle", "dense", "recent")
# The paged K/V cache's dtype: "auto" (the model's), "bf16", "fp8" (e4m3 with one scale per token and head) or "int8"
# (the same bytes: integer rows after an exact rotation); the index-key cache's: "auto" (the model's, fp8 where it
# scores its index in fp8) or "fp8"
KV_CACHE_DTYPES = ("auto", "bf16", "fp8", "int8")
INDEX_CACHE_DTYPES = ("auto", "fp8")
# The RULER-style suite's tasks, in its order (m3compile.evaluation.ruler_tasks.TASKS builds them): named here so that
# the command line lists them without building the suite
RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")

# The largest MSA settings accepted (M3: block 128, top-16, 4 index heads of 128): far past any model, well short of
# what would exhaust memory or overflow the kernels' offsets
MAX_BLOCK_SIZE = 1 << 16
MAX_TOPK = 1 << 16
MAX_INDEX_DIM = 1024
MAX_INDEX_HEADS = 1024

# The format of what a converted config.json's sparse_attention_config means, written under FORMAT_VERSION_KEY (a key
# of m3compile's, beside M3's own). A reader refuses a version newer than its own, whose keys it could misread; a
# config without the key (written before it existed, or M3's own) is version 1. Raise it when a key's meaning changes.
FORMAT_VERSION = 1
FORMAT_VERSION_KEY = "m3compile_format_version"
# The ceilings of sizes: every size a command takes (a length, a chunk, a number of samples, a batch, decode steps) is
# parsed by parse_size and checked against its kind's ceiling before anything is allocated. Far past any real run,
# short of a request that would exhaust memory before a later check could see it
SIZE_LIMITS = {
    "length": 1 << 24,  # tokens of a sequence, prompt, prefill chunk, window or generation: 16M, 16x M3's 1M context
    "samples": 10_000,  # prompts per ruler task and length, retrieval probes per distance
    "batch": 1024,  # sequences (windows, prompts) run at once
    "decode steps": 1 << 16,  # decode steps of one timing
}
_SIZE_UNITS = {"length": "tokens", "samples": "samples", "batch": "sequences", "decode steps": "steps"}
_SIZE_SUFFIXES = {"K": 1024, "M": 1024 * 1024}


def check_size(value, name: str, kind: str = "length") -> int:
    """`value` as a size of `kind` (SIZE_LIMITS): a whole number in [1, the ceiling]; `name` labels the error."""
    limit, unit = SIZE_LIMITS[kind], _SIZE_UNITS[kind]
    if not _is_int(value):
        raise M3CompileError(f"{name} must be a whole number of {unit}, got {value!r}")
    if value < 1:
        raise M3CompileError(f"{name} must be >= 1, got {value}")
    if value > limit:
        raise M3CompileError(f"{name} {value:,} is past the ceiling of {limit:,} {unit}")
    return value


def parse_size(value, name: str, kind: str = "length") -> int:
    """The one parser of sizes: an int, or a text such as 4096, 8K or 1M (K = 1024, M = 1024 x 1024; 1.5K is 1536),
    checked by check_size. Not a number, not whole, not finite (inf) or past the ceiling: a one-line error naming
    `name` and the ceiling."""
    if isinstance(value, str):
        text = value.strip().upper()
        scale = _SIZE_SUFFIXES.get(text[-1:], 1)
        try:
            number = float(text[:-1] if scale > 1 else text) * scale
        except ValueError:
            raise M3CompileError(f"{name}: expected a size such as 4096, 8K or 1M, got {value!r}") from None
        if math.isnan(number):
            raise M3CompileError(f"{name}: expected a size such as 4096, 8K or 1M, got {value!r}")
        limit = SIZE_LIMITS[kind]
        if number > limit:
            raise M3CompileError(f"{name} {value.strip()} is past the ceiling of {limit:,} {_SIZE_UNITS[kind]}")
        if number != int(number):
            raise M3CompileError(f"{name} {value.strip()} is not a whole number of {_SIZE_UNITS[kind]}")
        value = int(number)
    return check_size(value, name, kind)


def parse_sizes(text: str, name: str, kind: str = "length") -> tuple[int, ...]:
    """Comma-separated sizes (8K,32K,1M), each by parse_size; empty items are skipped ('' is none)."""
    return tuple(parse_size(t, name, kind) for t in str(text).split(",") if t.strip())


# dtype names users give -> the torch dtype's attribute name
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype from its name ("bf16", "float32", ...); None and torch dtypes pass through."""
    import torch  # here, not at the top: importing this module stays free of torch

    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise M3CompileError(f"unknown dtype {name!r} (use one of {', '.join(DTYPES)})")
    return getattr(torch, DTYPES[name])


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_msa_ranges(*, block_size, topk, init_blocks, local_blocks, index_dim=None, index_heads=None,
                     top_p=1.0, min_blocks=0, names: dict[str, str] | None = None, min_local: int = 1) -> None:
    """The one range check of MSA settings, for MSAConfig and for the settings a converted config.json holds: whole
    numbers within [minimum, MAX_*], init_blocks + local_blocks within topk, top_p a number in (0, 1], min_blocks
    (the adaptive budget's floor) within topk (its ceiling). `names` labels each setting in the error (config.json
    keys); by default `MSAConfig.<name>`."""
    names = names or {}
    label = lambda n: names.get(n, f"MSAConfig.{n}")  # noqa: E731
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise M3CompileError(f"{label('top_p')} must be a number in (0, 1] (1: the fixed top-k), got {top_p!r}")
    bounds = {"block_size": (1, MAX_BLOCK_SIZE), "topk": (1, MAX_TOPK), "init_blocks": (0, MAX_TOPK),
              "local_blocks": (min_local, MAX_TOPK), "index_dim": (1, MAX_INDEX_DIM),
              "index_heads": (1, MAX_INDEX_HEADS), "min_blocks": (0, MAX_TOPK)}
    values = dict(block_size=block_size, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks,
                  index_dim=index_dim, index_heads=index_heads, min_blocks=min_blocks)
    for name, value in values.items():
        if value is None and name in ("index_dim", "index_heads"):
            continue
        (low, high) = bounds[name]
        if not _is_int(value):
            raise M3CompileError(f"{label(name)} must be an integer, got {value!r}")
        if value < low:
            raise M3CompileError(f"{label(name)} must be >= {low}, got {value}")
        if value > high:
            raise M3CompileError(f"{label(name)} {value:,} is past any sensible setting (at most {high:,})")
    short = lambda n: names.get(n, n)  # noqa: E731
    if init_blocks + local_blocks > topk:
        raise M3CompileError(f"{short('init_blocks')} ({init_blocks}) + {short('local_blocks')} ({local_blocks}) "
                             f"exceed {short('topk')} ({topk})")
    if min_blocks > topk:
        raise M3CompileError(f"{short('min_blocks')} ({min_blocks}), the adaptive budget's floor, exceeds "
                             f"{short('topk')} ({topk}), its ceiling")


def check_floor_fits(min_blocks: int, block_size: int, positions: int | None) -> None:
    """The adaptive budget's floor within the blocks of the model's context: a floor no sequence can reach would
    keep every block (dense attention at MSA's cost). positions: the model's (None: not known, nothing checked)."""
    if positions is None or min_blocks <= 0:
        return
    blocks = -(-positions // block_size)
    if min_blocks > blocks:
        raise M3CompileError(f"min_blocks ({min_blocks}), the adaptive budget's floor, exceeds the {blocks:,} blocks of "
                             f"the model's context ({positions:,} positions in blocks of {block_size})")


@dataclass(frozen=True)
class MSAConfig:
    """Settings of the GQA -> MSA conversion.

    block_size    keys per block (also the KV-cache page)                         M3: 128
    topk          blocks each (KV group, query) attends to, local block included  M3: 16
    index_heads   index query heads; None = the model's KV head count (must equal it: one per KV group)
    index_dim     index head dim; None = the model's head dim                     M3: 128
    init_blocks   leading blocks always kept                                       M3: 0
    local_blocks  most recent blocks always kept, the query's own first            M3: 1
    dense_layers  layer indices that keep dense attention                          M3: (0, 1, 2)
    vision_window multimodal models: temporal steps per 3D ViT attention window     M3: 4
    index_dtype   index scoring: "auto" (the compute dtype) or "fp8" (e4m3 x e4m3, per-token key scale; not an M3
                  key: config.json gets sparse_attention_config.sparse_index_dtype only when it is "fp8")
    top_p         the adaptive budget (docs/msa.md 2.8): each (KV group, query) keeps, beside its forced blocks, the
                  fewest best blocks whose index-branch probability sums to at least top_p; topk is then the
                  ceiling. 1: the fixed top-k (M3). Not an M3 key: config.json gets sparse_top_p only below 1
    min_blocks    the adaptive budget's floor: at least this many blocks (forced ones included) where visible
    answer_budget the budget (kN or pP:FLOOR:CEILING, parse_budget) of each prompt's last answer_tokens tokens,
                  where a question sits, and of the answer, when m3compile.generate runs the model; None: the
                  model's throughout. Not an M3 key: config.json gets sparse_answer_budget (and
                  sparse_answer_tokens, sparse_decode_budget) only when set
    answer_tokens the prompt's last tokens read at answer_budget
    decode_budget the answer's budget where it differs from answer_budget (None: answer_budget's; "off": the
                  model's own)
    """

    block_size: int = 128
    topk: int = 16
    index_heads: int | None = None
    index_dim: int | None = None
    init_blocks: int = 0
    local_blocks: int = 1
    dense_layers: tuple[int, ...] = (0,)
    vision_window: int = 4  # multimodal models: ViT attention in 3D windows of <= this many temporal steps
    index_dtype: str = "auto"
    top_p: float = 1.0
    min_blocks: int = 0
    answer_budget: str | None = None
    answer_tokens: int = 128
    decode_budget: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "dense_layers", tuple(sorted(set(int(i) for i in self.dense_layers))))
        check_question_budgets(self.answer_budget, self.answer_tokens, self.decode_budget, block_size=self.block_size,
                               init_blocks=self.init_blocks, local_blocks=self.local_blocks)
        if self.vision_window < 1:
            raise M3CompileError(f"MSAConfig.vision_window must be >= 1, got {self.vision_window}")
        check_msa_ranges(block_size=self.block_size, topk=self.topk, init_blocks=self.init_blocks,
                         local_blocks=self.local_blocks, index_dim=self.index_dim, index_heads=self.index_heads,
                         top_p=self.top_p, min_blocks=self.min_blocks)
        if self.index_dtype not in INDEX_DTYPES:
            raise M3CompileError(f"MSAConfig.index_dtype must be one of {', '.join(INDEX_DTYPES)}, got {self.index_dtype!r}")
        if any(i < 0 for i in self.dense_layers):
            raise M3CompileError(f"dense_layers must be layer indices >= 0, got {self.dense_layers}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["dense_layers"] = list(self.dense_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MSAConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise M3CompileError(f"unknown MSAConfig keys: {sorted(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "MSAConfig":
        return cls.from_dict(json.loads(text))

    def m3_config(self, n_layers: int, index_heads: int, index_dim: int, sparse_layers: list[bool],
                  index_rope: str = "m3") -> dict:
        """`sparse_attention_config` with M3's own key names (plus sparse_index_dtype for fp8 scoring,
        sparse_index_rope for an index head narrower than the rotary width, sparse_top_p and sparse_min_blocks for an
        adaptive budget: not M3 keys, written only when set) and the format version it is written in
        (FORMAT_VERSION_KEY)."""
        out = {
            FORMAT_VERSION_KEY: FORMAT_VERSION,
            "use_sparse_attention": True,
            "sparse_num_index_heads": index_heads,
            "sparse_index_dim": index_dim,
            "sparse_block_size": self.block_size,
            "sparse_topk_blocks": self.topk,
            "sparse_score_type": "max",
            "sparse_init_block": self.init_blocks,
            "sparse_local_block": self.local_blocks,
            "sparse_attention_freq": [int(s) for s in sparse_layers],
            "sparse_disable_index_value": [1] * n_layers,
        }
        if self.index_dtype != "auto":
            out["sparse_index_dtype"] = self.index_dtype
        if index_rope != "m3":
            out["sparse_index_rope"] = index_rope
        if self.top_p < 1:
            out.update(sparse_top_p=self.top_p, sparse_min_blocks=self.min_blocks)
        if self.answer_budget is not None or self.decode_budget is not None:
            out["sparse_answer_tokens"] = self.answer_tokens
            out.update({f"sparse_{k}": getattr(self, k) for k in ("answer_budget", "decode_budget")
                        if getattr(self, k) is not None})
        return out


@dataclass(frozen=True)
class EvalConfig:
    """The numeric options of `m3c eval loss` and `m3c eval retrieval` (evaluate / retrieval), each checked for its
    range and meaning.

    seq_len      tokens per evaluated window (retrieval: the longest probe)
    max_windows  evaluate at most this many windows; None = all (0 is not "all": it would evaluate nothing)
    batch        windows per forward
    probes       retrieval: probes per distance
    kv_cache     loss: "auto" scores the model's own forward; another K/V cache dtype scores each window through the
                 paged prefill, one window at a time (so with a batch of one only)
    """

    seq_len: int = 4096
    max_windows: int | None = None
    batch: int = 1
    probes: int = 16
    kv_cache: str = "auto"

    def __post_init__(self):
        check_size(self.seq_len, "seq_len")
        check_size(self.batch, "batch", "batch")
        check_size(self.probes, "probes", "samples")
        if self.max_windows is not None:
            if not _is_int(self.max_windows):
                raise M3CompileError(f"max_windows must be an integer, got {self.max_windows!r}")
            if self.max_windows < 1:
                raise M3CompileError(f"max_windows must be >= 1, got {self.max_windows} (leave it out to evaluate "
                                     f"every window)")
        if self.kv_cache not in KV_CACHE_DTYPES:
            raise M3CompileError(f"kv_cache must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache!r}")
        if self.kv_cache != "auto" and self.batch != 1:
            raise M3CompileError(f"--kv-cache {self.kv_cache} scores one window at a time through the paged prefill; "
                                 f"--batch {self.batch} cannot apply (leave it out)")


def budget_words(topk: int, top_p: float = 1.0, min_blocks: int = 0) -> str:
    """A selection budget in words: "top-k 16", or "top-p 0.9 of 4-16 blocks" for an adaptive one."""
    if top_p >= 1:
        return f"top-k {topk}"
    return f"top-p {top_p:g} of {min_blocks}-{topk} blocks"


def parse_budget(spec: str, name: str = "budget") -> dict:
    """A selection budget written as kN (the fixed top-N) or pP:FLOOR:CEILING (top-p P between FLOOR and CEILING
    blocks) -> Decoder.set_budget's keywords {top_p, min_blocks, topk}. Its ranges are checked where it is set."""
    text = str(spec).strip()
    try:
        if text[:1] == "k":
            return {"top_p": 1.0, "min_blocks": 0, "topk": int(text[1:])}
        if text[:1] == "p":
            p, floor, ceiling = text[1:].split(":")
            return {"top_p": float(p), "min_blocks": int(floor), "topk": int(ceiling)}
    except ValueError:
        pass
    raise M3CompileError(f"{name} is kN (the fixed top-N blocks) or pP:FLOOR:CEILING (top-p P of FLOOR-CEILING "
                         f"blocks, e.g. p0.95:16:64), got {spec!r}")


def budget_spec(budget: dict) -> str:
    """set_budget's keywords {top_p, min_blocks, topk} -> the kN / pP:FLOOR:CEILING form parse_budget reads."""
    if budget["top_p"] >= 1:
        return f"k{budget['topk']}"
    return f"p{budget['top_p']:g}:{budget['min_blocks']}:{budget['topk']}"


def check_question_budgets(answer_budget, answer_tokens, decode_budget, *, block_size: int, init_blocks: int,
                           local_blocks: int, names: dict[str, str] | None = None) -> None:
    """A stored answer budget and decode budget (kN or pP:FLOOR:CEILING strings, or None) within the ranges of a
    budget (check_msa_ranges, with the model's forced blocks), and answer_tokens a whole number >= 0. `names` labels
    the three in the error (config.json keys); by default `MSAConfig.<name>`."""
    names = names or {}
    label = lambda n: names.get(n, f"MSAConfig.{n}")  # noqa: E731
    if not _is_int(answer_tokens) or answer_tokens < 0:
        raise M3CompileError(f"{label('answer_tokens')} must be a whole number of tokens >= 0, got {answer_tokens!r}")
    for name, spec in (("answer_budget", answer_budget), ("decode_budget", decode_budget)):
        if spec is None or (name == "decode_budget" and spec == "off"):  # off: the answer at the model's budget
            continue
        if not isinstance(spec, str):
            raise M3CompileError(f"{label(name)} is kN or pP:FLOOR:CEILING, got {spec!r}")
        b = parse_budget(spec, label(name))
        check_msa_ranges(block_size=block_size, init_blocks=init_blocks, local_blocks=local_blocks, min_local=0,
                         names={k: f"{label(name)} {spec}: {k}" for k in ("topk", "top_p", "min_blocks")}, **b)


def max_positions(cfg: dict | None) -> int | None:
    """The positions a model was trained for (config.json's max_position_embeddings; a minimax_m3_vl model's text
    model's), or None when the config does not say."""
    if not isinstance(cfg, dict):
        return None
    if cfg.get("model_type") == "minimax_m3_vl" and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    value = cfg.get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
