"""A checkpoint's tokenizer and chat template: text <-> token ids through its tokenizer.json (UTF-8 bytes for a
byte-level model), streamed decoding, its end-of-sequence id, and prompts as its users send them (a question in the
model's chat template when the checkpoint has one, plain text otherwise).

The chat template is the Jinja template that tokenizer_config.json ("chat_template") or chat_template.jinja holds,
rendered as Hugging Face renders it (jinja2's sandbox, trim_blocks and lstrip_blocks, `tojson`, `raise_exception`)
with one user message and the generation prompt; the answer's opening words follow the assistant header. It is
checked as the codec opens: read (UTF-8; a tokenizer_config.json that is not a JSON object, or a chat_template that
is not text, is an error, never a silent fallback to plain prompts) and rendered once on a probe message, so a
template that fails does so before any work, as one line naming its file.

    codec = PromptCodec("out", vocab_size=151936)
    ids = codec.encode_batch([codec.prompt("What is 2 + 2?", answer_prefix=" The answer is")])[0]
"""
from __future__ import annotations

import codecs
import datetime
import json
import os
from pathlib import Path
from typing import Callable

from m3compile.data import read_tokenizer
from m3compile.errors import M3CompileError

__all__ = ["TextCodec", "eos_token_id", "PromptCodec", "read_chat_template"]


class TextCodec:
    """Text <-> token ids of a checkpoint: its tokenizer.json, or raw UTF-8 bytes for a byte-level (vocab 256)
    model without one. `stream()` gives a decoder that turns ids, one at a time, into the new text they complete."""

    def __init__(self, model_dir: str | os.PathLike, vocab_size: int):
        self.tokenizer = None
        tok_file = Path(model_dir) / "tokenizer.json"
        if tok_file.is_file():
            self.tokenizer = read_tokenizer(tok_file)
        elif vocab_size != 256:
            raise M3CompileError(f"{model_dir}: no tokenizer.json, and the model is not byte-level (vocab "
                                 f"{vocab_size}, not 256): cannot turn text into tokens")

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text).ids

    def stream(self) -> Callable[[int], str]:
        if self.tokenizer is None:
            utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            return lambda t: utf8.decode(bytes([t]))
        ids: list[int] = []
        shown = [""]

        def push(t: int) -> str:  # decode everything so far, emit what is new (tokens may merge across ids)
            ids.append(t)
            text = self.tokenizer.decode(ids)
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
                return ""
            new, shown[0] = text[len(shown[0]):] if text.startswith(shown[0]) else text, text
            return new
        return push


def eos_token_id(config: dict, model_dir: str | os.PathLike | None = None) -> int | None:
    """The end-of-sequence id of generation_config.json or config.json (the first, when a list), or None."""
    sources = []
    if model_dir is not None and (Path(model_dir) / "generation_config.json").is_file():
        try:
            sources.append(json.loads((Path(model_dir) / "generation_config.json").read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise M3CompileError(f"{model_dir}/generation_config.json: not valid JSON") from None
    sources.append(config)
    for src in sources:
        value = src.get("eos_token_id") if isinstance(src, dict) else None
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _json(path: Path) -> dict:
    """A JSON object file; anything else is an error naming the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise M3CompileError(f"{path}: not valid JSON") from None
    except OSError as e:
        raise M3CompileError(f"{path}: cannot read it ({e.strerror})") from None
    if not isinstance(value, dict):
        raise M3CompileError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _template_value(found, path: Path) -> str | None:
    """A "chat_template" entry: text, or a list of {"name", "template"} whose "default" is taken; else an error."""
    if isinstance(found, list):
        found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
    if found is not None and not isinstance(found, str):
        raise M3CompileError(f"{path}: chat_template must be text (or a list of named templates), got "
                             f"{json.dumps(found)[:40]}")
    return found if found and found.strip() else None


def read_chat_template(model_dir: str | os.PathLike) -> str | None:
    """The checkpoint's chat template (tokenizer_config.json's "chat_template": a string, or the one named "default"
    of a list; else chat_template.jinja; else chat_template.json), or None."""
    found = _chat_template(Path(model_dir))
    return None if found is None else found[0]


def _chat_template(model_dir: Path) -> tuple[str, Path] | None:
    """read_chat_template's template, and the file it is in."""
    root = Path(model_dir)
    for name in ("tokenizer_config.json", "chat_template.jinja", "chat_template.json"):
        path = root / name
        if not path.is_file():
            continue
        if name.endswith(".jinja"):
            try:
                found = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError as e:
                raise M3CompileError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None
        else:
            found = _template_value(_json(path).get("chat_template"), path)
        if found:
            return found, path
    return None


def _first_line(e: Exception) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _token_text(value) -> str | None:
    """A special token of tokenizer_config.json: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class PromptCodec:
    """The checkpoint's prompt format and tokenizer: `prompt` wraps a question in the chat template (when there is
    one and `chat`), `encode_batch` turns prompts into ids, `decode` turns generated ids into text (special tokens
    dropped), `stop_ids` are the ids that end an answer (generation_config.json / config.json's eos_token_id and the
    tokenizer's eos_token)."""

    def __init__(self, model_dir: str | os.PathLike, vocab_size: int, config: dict | None = None, chat: bool = True):
        root = Path(model_dir)
        self.tokenizer = None
        if (root / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            try:
                self.tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
            except Exception as e:  # tokenizers raises its own exception type for malformed files
                raise M3CompileError(f"{root / 'tokenizer.json'}: cannot read tokenizer "
                                     f"({str(e).splitlines()[0]})") from None
        elif vocab_size < 256:
            raise M3CompileError(f"{model_dir}: no tokenizer.json, and the model is not byte-level (vocab "
                                 f"{vocab_size} < 256): cannot turn text into tokens")
        special = _json(root / "tokenizer_config.json") if (root / "tokenizer_config.json").is_file() else {}
        self.special = {name: _token_text(special.get(name)) for name in ("bos_token", "eos_token", "pad_token",
                                                                           "unk_token")}
        self.template, self.template_file = None, None
        found = _chat_template(root) if chat else None
        if found is not None:
            self.template, self.template_file = self._compile(*found), found[1]
            self.prompt("probe")  # a template that fails, fails here: before any work
        stops = []
        for value in self._config_eos(config or {}, root):
            if value not in stops:
                stops.append(value)
        eos = self.special["eos_token"]
        if self.tokenizer is not None and eos is not None:
            eos_id = self.tokenizer.token_to_id(eos)
            if eos_id is not None and eos_id not in stops:
                stops.append(eos_id)
        self.stop_ids = stops

    @staticmethod
    def _config_eos(config: dict, root: Path) -> list[int]:
        """Every eos id that generation_config.json or config.json lists (a chat model often lists two)."""
        out = []
        sources = [_json(root / "generation_config.json")] if (root / "generation_config.json").is_file() else []
        for src in sources + [config]:
            value = src.get("eos_token_id")
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, int) and not isinstance(v, bool):
                    out.append(v)
        return out

    @staticmethod
    def _compile(source: str, path: Path):
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:  # pragma: no cover - jinja2 is a dependency (and torch's)
            raise M3CompileError("rendering the checkpoint's chat template needs jinja2 (pip install jinja2)") from None

        def raise_exception(message):
            raise M3CompileError(f"{path}: the chat template refused the prompt: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: \
            json.dumps(x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            return env.from_string(source)
        except Exception as e:  # noqa: BLE001 - jinja2's errors and what its parser lets through, as one line
            raise M3CompileError(f"{path}: cannot read the chat template ({_first_line(e)})") from None

    @property
    def chat(self) -> bool:
        """Whether prompts are wrapped in the checkpoint's chat template."""
        return self.template is not None

    def prompt(self, question: str, answer_prefix: str = "") -> str:
        """The text the model is given: the chat template around one user message `question` with the generation
        prompt, then `answer_prefix` (the answer's opening words); without a template, question + answer_prefix."""
        if self.template is None:
            return question + answer_prefix
        try:
            text = self.template.render(messages=[{"role": "user", "content": question}], add_generation_prompt=True,
                                        tools=None, documents=None, **self.special)
        except M3CompileError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the template raises (TypeError, the sandbox's limits), one line
            raise M3CompileError(f"{self.template_file}: cannot render the chat template "
                                 f"({_first_line(e)})") from None
        if not isinstance(text, str):
            raise M3CompileError(f"{self.template_file}: the chat template did not render text")
        return text + answer_prefix

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text. A chat prompt carries its special tokens as text (the template wrote them), so
        the tokenizer adds none of its own; a plain prompt gets the tokenizer's (a BOS, say) as in use."""
        if self.tokenizer is None:
            return [list(t.encode("utf-8")) for t in texts]
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=not self.chat)]

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, special tokens (end of turn, ...) dropped; invalid UTF-8 bytes replaced."""
        if self.tokenizer is None:
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=True)
