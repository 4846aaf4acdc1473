"""The RULER-style synthetic tasks (NVIDIA/RULER's definitions, written anew): each builds, from a seed, prompts of
a given token length and the answers a model must give, with haystacks of a fixed noise text, of needles, or of
real code from the data file.

    niah_single_1     one needle "One of the special magic numbers for <key> is: <7 digits>." in the noise text
                      "The grass is green. The sky is blue. ..." repeated; the question asks for the key's number
    niah_single_2     the same needle in real code (lines of the data file, the needle on a line of its own)
    niah_single_3     the same in code, with a uuid for the value
    niah_multikey_1   four needles of four keys in code; one key is asked (three distractors)
    niah_multikey_2   a haystack made only of needles (a number for each of many keys); one is asked
    niah_multikey_3   the same with uuid keys and uuid values
    niah_multivalue   four needles of one key in code; all four numbers are asked
    niah_multiquery   four needles of four keys in code; all four keys are asked
    vt                variable tracking: a chain "VAR AAAAA = 12345", "VAR BBBBB = VAR AAAAA", ... (4 hops) spread
                      through the noise text, after one worked example; every variable holding the value is asked
    cwe               common words: a numbered list of words from the data file, 10 of them 30 times each and the
                      rest 3 times (6 / 1 below 4K), after one worked example; the 10 common words are asked
    fwe               frequent words: random 6-letter coded words drawn from a Zipf law (alpha 2, the first one
                      replaced by "..."); the three most frequent coded words are asked

Keys of the needles are two words of the data file joined by a hyphen (RULER: an adjective and a noun). A prompt
is the task's question in the model's chat template (or plain), then the answer's opening words as RULER writes them
(" The special magic number for <key> mentioned in the provided text is"); its length, the task's max_new_tokens
included, is the largest haystack that fits the asked length (RULER's rule: prompt + generated <= length).
Scoring (ruler.py) is RULER's string_match_all: the share of the expected answers found in the generated text.
"""
from __future__ import annotations

import math
import random
import re
import string
import uuid
from dataclasses import dataclass
from typing import Callable

from m3compile.errors import M3CompileError

__all__ = ["Task", "Instance", "Haystacks", "Sample", "TASKS", "build_samples", "check_fits"]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH_QUESTION = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz "
                 "you about the {kind} afterwards.\n{context}\nWhat are all the special magic {kind} for {query} "
                 "mentioned in the provided text?")
NIAH_QUESTION_ONE = ("A special magic {kind} is hidden within the following text. Make sure to memorize it. I will "
                     "quiz you about the {kind} afterwards.\n{context}\nWhat is the special magic {kind} for {query} "
                     "mentioned in the provided text?")
NIAH_ANSWER = " The special magic {kind} for {query} mentioned in the provided text are"
NIAH_ANSWER_ONE = " The special magic {kind} for {query} mentioned in the provided text is"
VT_QUESTION = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER = (" Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
             "assigned the value {query}, they are: ")
CWE_QUESTION = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
                "list?")
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
FWE_QUESTION = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"
DEPTHS = [round(100 * i / 39) for i in range(40)]  # needle depths (percent of the haystack) in real text
_ZETA2 = math.pi ** 2 / 6  # Riemann zeta(2): the Zipf law's normaliser at fwe's alpha = 2


@dataclass(frozen=True)
class Instance:
    """One prompt before tokenization: the user's question, the answer's opening words, the expected answers."""

    question: str
    answer_prefix: str
    answers: tuple[str, ...]


@dataclass(frozen=True)
class Sample:
    """One prompt as the model reads it: token ids (chat template and answer prefix included), the answers."""

    ids: list[int]
    answers: tuple[str, ...]


class Haystacks:
    """What the tasks draw from the data file: its lines (the code haystack) and its words (needle keys, cwe's list:
    lowercase words of 4-10 letters, between non-letters)."""

    def __init__(self, text: str, name: str = "the data file"):
        self.name = name
        self.lines = text.split("\n")
        while self.lines and not self.lines[-1].strip():
            self.lines.pop()
        self.words = sorted(set(re.findall(r"(?<![A-Za-z])[a-z]{4,10}(?![A-Za-z])", text)))

    def code(self, rng: random.Random, n: int) -> list[str]:
        """n consecutive lines from a random place in the data (n <= len(lines): Task.capacity)."""
        start = rng.randrange(len(self.lines) - n + 1)
        return self.lines[start: start + n]

    def draw_words(self, rng: random.Random, n: int) -> list[str]:
        """n distinct words of the data, in random order."""
        if n > len(self.words):
            raise M3CompileError(f"{self.name} holds {len(self.words)} distinct words (lowercase, 4-10 letters); "
                                 f"the tasks need at least {n}")
        return rng.sample(self.words, n)


@dataclass(frozen=True)
class Task:
    """A task: its name, family (RULER's niah / variable_tracking / common_words / freq_words), the tokens RULER
    generates for it, and `make(rng, n, haystacks, length)`: an instance with a haystack of n units (lines, noise
    sentences, needles or words; more units, longer prompt); `min_units` is the smallest haystack it takes,
    `capacity(haystacks)` the largest the data file holds (None: no limit)."""

    name: str
    family: str
    max_new_tokens: int
    make: Callable[[random.Random, int, Haystacks, int], Instance]
    min_units: int = 1
    capacity: Callable[[Haystacks], int | None] = lambda hay: None
    unit: str = "units"


def _key(rng: random.Random, kind: str, hay: Haystacks) -> str:
    if kind == "words":
        return "-".join(hay.draw_words(rng, 2))
    return _value(rng, kind)


def _value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _niah(haystack: str, key_kind: str = "words", value_kind: str = "numbers", num_k: int = 1, num_v: int = 1,
          num_q: int = 1):
    num_k = max(num_k, num_q)

    def make(rng: random.Random, n: int, hay: Haystacks, length: int) -> Instance:
        keys, values, needles = [], [], []
        if key_kind == "words":  # keys of two distinct words: the data must hold enough of them, or drawing never ends
            need = num_k + (haystack == "needles")  # the needles' haystack needs at least one other key
            if len(hay.words) * (len(hay.words) - 1) < need:
                raise M3CompileError(f"{hay.name} holds {len(hay.words)} distinct words (lowercase, 4-10 letters); "
                                     f"the task's {need} distinct two-word keys need more")
        while len(keys) < num_k:
            key = _key(rng, key_kind, hay)
            if key in keys:
                continue
            keys.append(key)
            values.append([_value(rng, value_kind) for _ in range(num_v)])
            needles += [NEEDLE.format(kind=value_kind, key=key, value=v) for v in values[-1]]
        rng.shuffle(needles)
        if haystack == "code":
            lines = hay.code(rng, n)
            at = sorted(n * d // 100 for d in rng.sample(DEPTHS, len(needles)))
            for i, (pos, needle) in enumerate(zip(at, needles)):
                lines.insert(pos + i, needle)
        else:
            if haystack == "noise":
                lines = [NOISE] * n
            else:  # a haystack of needles: a value for each of n other keys
                lines = []
                while len(lines) < n:
                    key = _key(rng, key_kind, hay)
                    if key not in keys:
                        lines.append(NEEDLE.format(kind=value_kind, key=key, value=_value(rng, value_kind)))
            for pos, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
                lines.insert(pos, needle)
        asked = rng.sample(range(num_k), num_q)
        query = ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]] if num_q > 1 else keys[asked[0]]
        answers = tuple(v for i in asked for v in values[i])
        context = "\n".join(lines)
        if num_q * num_v == 1:
            kind = value_kind[:-1]
            return Instance(NIAH_QUESTION_ONE.format(kind=kind, context=context, query=query),
                            NIAH_ANSWER_ONE.format(kind=kind, query=query), answers)
        return Instance(NIAH_QUESTION.format(kind=value_kind, context=context, query=query),
                        NIAH_ANSWER.format(kind=value_kind, query=query), answers)
    return make


def _variables(rng: random.Random, n: int, letters: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in out:
            out.append(name)
    return out


def _vt_instance(rng: random.Random, n: int, hops: int, letters: int, value: str) -> Instance:
    names = _variables(rng, hops + 1, letters)
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    lines = [NOISE] * n
    for j, pos in enumerate(sorted(rng.sample(range(n), len(chain)))):
        lines.insert(pos + j, chain[j])
    context = "\n".join(lines).replace(". \n", ".\n")
    return Instance(VT_QUESTION.format(context=context, query=value), VT_ANSWER.format(n=hops + 1, query=value),
                    tuple(names))


def _vt(hops: int = 4, example_lines: int = 10):
    def make(rng: random.Random, n: int, hay: Haystacks, length: int) -> Instance:
        example = _vt_instance(rng, example_lines, hops, 5, str(rng.randint(10000, 99999)))
        shown = example.question + example.answer_prefix + " " + " ".join(example.answers) + "\n"
        task = _vt_instance(rng, n, hops, 5, str(rng.randint(10000, 99999)))
        return Instance(shown + "\n" + task.question, task.answer_prefix, task.answers)
    return make


def _word_list(rng: random.Random, words: list[str], common: int, common_repeats: int, other_repeats: int) -> str:
    listed = words[:common] * common_repeats + words[common:] * other_repeats
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed))


def _cwe(common: int = 10):
    def make(rng: random.Random, n: int, hay: Haystacks, length: int) -> Instance:
        short = length < 4096  # RULER's settings below 4K: a shorter example and fewer repeats
        example_words = hay.draw_words(rng, 20 if short else 40)
        example = CWE_QUESTION.format(context=_word_list(rng, example_words, common, 3 if short else 10,
                                                         1 if short else 3))
        shown = example + CWE_ANSWER + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_words[:common]))
        words = hay.draw_words(rng, common + n)
        context = _word_list(rng, words, common, 6 if short else 30, 1 if short else 3)
        return Instance(shown + "\n" + CWE_QUESTION.format(context=context), CWE_ANSWER, tuple(words[:common]))
    return make


def _fwe(alpha: float = 2.0, letters: int = 6):
    if alpha != 2.0:
        raise ValueError("fwe's Zipf normaliser is written for alpha = 2")

    def make(rng: random.Random, n: int, hay: Haystacks, length: int) -> Instance:
        size = max(8, (length - FWE.max_new_tokens) // 50)  # RULER: the coded vocabulary grows with the length
        vocab = _variables(rng, size, letters)
        vocab = [w.lower() for w in vocab]
        vocab[0] = "..."  # the most frequent "word" is noise
        counts = [int(n * k ** -alpha / _ZETA2) for k in range(1, size + 1)]
        listed = [w for w, c in zip(vocab, counts) for _ in range(c)]
        rng.shuffle(listed)
        return Instance(FWE_QUESTION.format(context=" ".join(listed)), FWE_ANSWER, tuple(vocab[1:4]))
    return make


FWE = Task("fwe", "freq_words", 50, _fwe(), min_units=64)
_CODE = dict(capacity=lambda hay: len(hay.lines), unit="lines")
TASKS: dict[str, Task] = {t.name: t for t in [  # the names and order of m3compile.config.RULER_TASKS
    Task("niah_single_1", "niah", 128, _niah("noise")),
    Task("niah_single_2", "niah", 128, _niah("code"), **_CODE),
    Task("niah_single_3", "niah", 128, _niah("code", value_kind="uuids"), **_CODE),
    Task("niah_multikey_1", "niah", 128, _niah("code", num_k=4), **_CODE),
    Task("niah_multikey_2", "niah", 128, _niah("needle")),
    Task("niah_multikey_3", "niah", 128, _niah("needle", key_kind="uuids", value_kind="uuids")),
    Task("niah_multivalue", "niah", 128, _niah("code", num_v=4), **_CODE),
    Task("niah_multiquery", "niah", 128, _niah("code", num_q=4), **_CODE),
    Task("vt", "variable_tracking", 30, _vt(), min_units=5),
    Task("cwe", "common_words", 120, _cwe(), capacity=lambda hay: len(hay.words) - 10, unit="distinct words"),
    FWE,
]}


class _TooLong(Exception):
    """The smallest haystack already overflows the budget (its token count)."""


def _fit(tokens: Callable[[int], int], budget: int, lo: int, hi: int | None) -> tuple[int, int, int]:
    """The largest n in [lo, hi] with tokens(n) <= budget, for tokens() increasing (roughly linearly) in n: a
    bracket grown by extrapolation, then closed by interpolation (a few calls, each one tokenization).
    Returns (n, tokens(n), tokens(lo)). tokens(lo) > budget raises _TooLong; hi limits the search."""
    base = tokens(lo)
    if base > budget:
        raise _TooLong(base)
    a, fa = lo, base
    b = fb = None
    while b is None:  # grow until over the budget (or at hi), stepping by the mean tokens per unit so far
        slope = max(1.0, fa / max(1, lo)) if a == lo else max(1e-3, (fa - base) / (a - lo))
        n = a + max(1, int((budget - fa) / slope))
        n = n if hi is None else min(hi, n)
        if n == a:
            return a, fa, base
        fn = tokens(n)
        if fn > budget:
            b, fb = n, fn
        else:
            a, fa = n, fn
            if (hi is not None and n == hi) or budget - fa < (fa - base) / max(1, a - lo):  # within one unit
                return a, fa, base
    while b - a > 1 and budget - fa >= (fb - fa) / (b - a):
        n = min(b - 1, max(a + 1, a + int((budget - fa) * (b - a) / (fb - fa))))
        fn = tokens(n)
        if fn <= budget:
            a, fa = n, fn
        else:
            b, fb = n, fn
    return a, fa, base


def _instance(task: Task, length: int, seed: int, haystacks: Haystacks, i: int, n: int) -> Instance:
    return task.make(random.Random(f"{seed}:{task.name}:{length}:{i}"), n, haystacks, length)


def check_fits(task: Task, length: int, seed: int, haystacks: Haystacks,
               render: Callable[[Instance], str], encode_batch: Callable[[list[str]], list[list[int]]]) -> int:
    """Whether `task` can fill a `length`-token prompt (its answer's tokens included) from `haystacks`: one
    tokenization of its smallest prompt, before any sample is built. Returns the smallest prompt's tokens; a data
    file too small for the task, or a length too short for its smallest prompt, is a one-line error."""
    hi = task.capacity(haystacks)
    if hi is not None and hi < task.min_units:
        raise M3CompileError(f"{haystacks.name} is too short to fill a {length}-token {task.name} haystack: it holds "
                             f"{max(0, hi)} {task.unit}")
    smallest = len(encode_batch([render(_instance(task, length, seed, haystacks, 0, task.min_units))])[0])
    if smallest > length - task.max_new_tokens:
        raise M3CompileError(f"length {length} is too short for {task.name}: its smallest prompt takes "
                             f"{smallest} tokens + {task.max_new_tokens} generated")
    return smallest


def build_samples(task: Task, length: int, count: int, seed: int, haystacks: Haystacks,
                  render: Callable[[Instance], str], encode_batch: Callable[[list[str]], list[list[int]]]) -> list[Sample]:
    """`count` samples of `task` whose prompts fill `length` tokens (with the task's max_new_tokens), each from its
    own seed (seed, task, length, index): the same samples for every selection, run and machine.

    render: an instance -> the prompt text (chat template and answer prefix); encode_batch: texts -> ids. The
    haystack size comes from sample 0 (a few tokenizations); every sample is built at it, and those whose own
    haystack (other lines, other words) lands over the budget or more than 1% under it move toward it, all of them
    tokenized together per round."""
    budget = length - task.max_new_tokens

    def instance(i: int, n: int) -> Instance:
        return _instance(task, length, seed, haystacks, i, n)

    def prompt_tokens(i: int, n: int) -> int:
        return len(encode_batch([render(instance(i, n))])[0])

    hi = task.capacity(haystacks)
    short = f"{haystacks.name} is too short to fill a {length}-token {task.name} haystack"
    check_fits(task, length, seed, haystacks, render, encode_batch)
    n, tokens, base = _fit(lambda n: prompt_tokens(0, n), budget, task.min_units, hi)
    slope = max(1e-3, (tokens - base) / max(1, n - task.min_units))  # mean tokens per unit
    if n == hi and budget - tokens > slope:
        raise M3CompileError(f"{short}: all its {hi} {task.unit} make a {tokens + task.max_new_tokens}-token "
                             f"prompt")
    tol = max(2.0 * slope, 0.01 * budget)  # a prompt within this of the budget is full
    sizes = [n] * count
    best: list[Sample | None] = [None] * count  # each sample's longest prompt within the budget so far
    todo = list(range(count))
    for _ in range(8):  # each round one batch tokenization of the samples still off; their haystacks differ
        if not todo:
            break
        made = [instance(i, sizes[i]) for i in todo]
        left = []
        for i, inst, x in zip(todo, made, encode_batch([render(inst) for inst in made])):
            gap = budget - len(x)
            if gap >= 0 and (best[i] is None or len(x) > len(best[i].ids)):
                best[i] = Sample(x, inst.answers)
            own = max(1e-3, (len(x) - base) / max(1, sizes[i] - task.min_units))  # this haystack's tokens per unit
            step = math.floor(gap / own) if gap >= 0 else -math.ceil(-gap / own) - 1
            new = max(task.min_units, sizes[i] + step if hi is None else min(hi, sizes[i] + step))
            if (0 <= gap <= tol) or new == sizes[i]:
                continue
            sizes[i] = new
            left.append(i)
        todo = left
    for i in range(count):
        while best[i] is None:  # still over the budget: shrink one unit at a time
            if sizes[i] == task.min_units:
                raise M3CompileError(f"length {length} is too short for {task.name}: sample {i}'s smallest prompt "
                                     f"takes more than {budget} tokens + {task.max_new_tokens} generated")
            sizes[i] -= 1
            inst = instance(i, sizes[i])
            x = encode_batch([render(inst)])[0]
            if len(x) <= budget:
                best[i] = Sample(x, inst.answers)
    return best
