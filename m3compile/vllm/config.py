"""What vLLM is asked to serve, checked in vLLM's configuration step, before it starts an engine.

vLLM runs a model's config hooks (vllm.model_executor.models.config.MODELS_CONFIG_MAP, keyed by architecture) while
it builds its configuration: `verify_and_update_model_config` when it has read config.json, `verify_and_update_config`
when it has the whole configuration. Here they read config.json as m3compile does (io.hf_config.args_from_config:
its checks, the format version among them), refuse what the plugin cannot serve, and set the KV cache's block size
to the MSA block (a cache page is one key block: docs/vllm.md). A byte-level model without a tokenizer of its own
(vocab 256, token id = byte value, as m3compile reads it: io.tokenizer.TextCodec) gets BYTE_TOKENIZER, that
convention written as a tokenizer.json, so vLLM takes and returns text. Each refusal is an M3CompileError, one line
that names the problem; at the top of a `vllm serve` process it is printed alone (`report_errors`).
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

from vllm.config import ModelConfig, VllmConfig
from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

from m3compile.errors import M3CompileError
from m3compile.io.hf_config import args_from_config
from m3compile.io.shards import SourceTensors
from m3compile.io.weights import TOKENIZER_FILES
from m3compile.models.decoder import ModelArgs

__all__ = ["model_args", "check_model", "check_cache", "register_checks", "report_errors", "ConvertedModelConfig"]

# token id = byte value as a tokenizer.json (BPE over the 256 byte symbols, no merges), for byte-level models
BYTE_TOKENIZER = Path(__file__).with_name("byte_tokenizer")


def model_args(hf_config) -> ModelArgs:
    """ModelArgs of a converted model from the config vLLM read (transformers' config object of config.json)."""
    return args_from_config(hf_config.to_dict())[0]


def check_model(model_config: ModelConfig) -> ModelArgs:
    """The converted model's ModelArgs; a one-line M3CompileError for a config m3compile refuses (a newer format,
    values out of range), for a directory that is not a converted model (no MSA layers in config.json, or weights
    that are not the converted model's: names and shapes from the safetensors headers, no tensor read) and for
    settings the plugin does not serve. Sets the byte tokenizer for a byte-level model without one."""
    where = model_config.model
    args = model_args(model_config.hf_config)
    if args.msa is None:
        raise M3CompileError(f"{where}: config.json has no MSA layers (sparse_attention_config): not a converted "
                             f"model; serve its dense source with vLLM's own model class")
    if Path(where).is_dir():
        try:
            SourceTensors(Path(where)).check(args)
        except M3CompileError as e:
            raise M3CompileError(f"not a converted model: {e}") from None
    if args.msa.answer_budget is not None or args.msa.decode_budget is not None:
        warnings.warn(f"{where}: vLLM selects every token at the model's budget ({args.msa.topk} blocks); the answer "
                      f"and decode budgets in config.json apply in m3c generate and transformers' generate()",
                      stacklevel=2)
    if args.msa.index_dtype != "auto":
        raise M3CompileError(f"{where}: sparse_index_dtype {args.msa.index_dtype!r} (fp8 index scoring) is not "
                             f"served by vLLM yet; use `m3c generate`, or convert with --index-dtype auto")
    tokenizer = Path(model_config.tokenizer)
    if args.vocab_size == 256 and tokenizer == Path(where) and tokenizer.is_dir() \
            and not any((tokenizer / name).is_file() for name in TOKENIZER_FILES if name != "generation_config.json"):
        model_config.tokenizer = str(BYTE_TOKENIZER)
    return args


def check_cache(vllm_config: VllmConfig, args: ModelArgs) -> None:
    """The KV cache vLLM will allocate: pages of one MSA key block, in the model's dtype, on one device. Sets the
    block size (vLLM picks its own where the user gives none); refuses a --block-size or --kv-cache-dtype that
    differs, and tensor or pipeline parallelism."""
    cache, block = vllm_config.cache_config, args.msa.block_size
    if cache.user_specified_block_size and cache.block_size != block:
        raise M3CompileError(f"{vllm_config.model_config.model}: --block-size {cache.block_size}, but the model's MSA "
                             f"block is {block} tokens and a cache page must be one block: leave --block-size out "
                             f"or give {block}")
    if cache.cache_dtype not in ("auto", str(vllm_config.model_config.dtype).removeprefix("torch.")):
        raise M3CompileError(f"--kv-cache-dtype {cache.cache_dtype} is not served for MSA models yet: leave it out "
                             f"(the cache takes the model's dtype)")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
        raise M3CompileError("tensor and pipeline parallel serving are not supported for MSA models yet (the model's "
                             "layers are whole, not sharded): serve on one device")
    cache.block_size = block
    cache.user_specified_block_size = True  # so the platform's default (128 on a CPU) does not replace it


class ConvertedModelConfig(VerifyAndUpdateConfig):
    """vLLM's config hooks for the converted model's architecture."""

    @staticmethod
    def verify_and_update_model_config(model_config: ModelConfig) -> None:
        check_model(model_config)

    @staticmethod
    def verify_and_update_config(vllm_config: VllmConfig) -> None:
        check_cache(vllm_config, model_args(vllm_config.model_config.hf_config))


def register_checks(architecture: str) -> None:
    """Run ConvertedModelConfig's checks for `architecture`, and print their errors alone (`report_errors`)."""
    MODELS_CONFIG_MAP[architecture] = ConvertedModelConfig
    if not isinstance(sys.excepthook, _OneLineErrors):
        sys.excepthook = _OneLineErrors(sys.excepthook)


def report_errors(error: BaseException) -> str | None:
    """The message of the M3CompileError that `error` is or wraps (vLLM's configuration is a pydantic dataclass,
    which re-raises what a hook raises as its own ValidationError), else None."""
    seen = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, M3CompileError):
            return str(e)
        stack += [e.__cause__, e.__context__]
        errors = getattr(e, "errors", None)  # pydantic's ValidationError: the original exception in each ctx
        if callable(errors):
            try:
                stack += [(err.get("ctx") or {}).get("error") for err in errors()]
            except TypeError:
                pass
    return None


class _OneLineErrors:
    """sys.excepthook of a vLLM process: an M3CompileError (the user's mistake) that reaches the top is printed as
    `error: MESSAGE` alone, without a traceback, as m3c prints it; anything else goes to the hook before."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, kind, value, tb):
        message = report_errors(value)
        if message is None:
            return self.previous(kind, value, tb)
        print(f"error: {message}", file=sys.stderr)
