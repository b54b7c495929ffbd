"""Verifiable prompt sources and rule-based rewards.

The built-in long-tail tasks map a list of digits to a list of digits. Each digit
is preceded by a position marker (``a``, ``b``, ... ``z``, ``A``, ...), in the
prompt and in the answer, so emitting the k-th answer digit means attending to the
same marker in the prompt (an induction-head pattern) instead of counting
positions. The list length ``n`` is drawn with ``p(n) ~ n^-a`` on
``[min_len, max_len]``, so correct responses (``2n + 2`` tokens) have a heavy
tail: most are short, a few are long. That is exactly the workload where
synchronous RL idles on stragglers and multi-version streaming helps.

* ``digit_cipher`` (the main job's task): every digit goes through a fixed
  substitution table, ``d -> (3d + 1) mod 10``: ``a3b1c9:`` -> ``a0b4c8.``.
  A 4-layer model learns the format and the short lists from a warm start of a
  minute or two; one wrong digit anywhere fails the whole answer, so the long lists
  are where RL has room to improve within minutes on a CPU.
* ``running_sum``: the answer is the running sum mod 10 after each digit,
  ``a3b1c9:`` -> ``a3b4c3.``. Each answer digit depends on the previous one, a
  two-argument function a tiny model does not learn from minutes of warm start
  (measured: after 600 warm-start steps it is exact only on single digits), so RL
  finds almost no reward signal on it at the CPU scale. Kept as a harder task
  for bigger models.

Everything here is pure Python (no torch) so the controller, the simulator and the
tests share it.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Mapping, Protocol

PROMPT_SEP = ":"
ANSWER_END = "."
#: Position markers of the running-sum task (one per list element).
MARKERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class Prompt:
    """One RL prompt: an index in the stream, its text and the ground truth.

    A dataset row's prompt may be a chat (``messages``: system, user, earlier turns); ``text`` is
    then empty, and :meth:`~dora_megatron.data.codec.TextCodec.encode_prompt` renders the messages.
    ``data_source`` and ``extra_info`` are the row's (verl layout), handed to the reward."""

    index: int
    text: str
    answer: str
    data_source: str = ""
    extra_info: Mapping = field(default_factory=dict)
    messages: tuple[Mapping[str, Any], ...] = ()


class PromptSource(Protocol):
    """An endless, seekable prompt stream (position is checkpointed on resume)."""

    def get(self, index: int) -> Prompt: ...


def heavy_tail_lengths(min_len: int, max_len: int, exponent: float) -> tuple[list[int], list[float]]:
    """Support and normalised weights of ``p(n) ~ n^-exponent`` on ``[min_len, max_len]``."""
    support = list(range(min_len, max_len + 1))
    weights = [n ** (-exponent) for n in support]
    total = sum(weights)
    return support, [w / total for w in weights]


#: ``digit_cipher`` substitution table: digit d maps to CIPHER[d] = (3d + 1) mod 10.
CIPHER = "1470369258"


def digit_cipher_answer(digits: list[int]) -> str:
    """The marked substituted digits (``[3,1,9] -> 'a0b4c8'``)."""
    return "".join(MARKERS[i] + CIPHER[d] for i, d in enumerate(digits))


def running_sum_answer(digits: list[int]) -> str:
    """The marked running sums mod 10 of ``digits`` (``[3,1,9] -> 'a3b4c3'``)."""
    out, acc = [], 0
    for i, d in enumerate(digits):
        acc = (acc + d) % 10
        out.append(MARKERS[i] + str(acc))
    return "".join(out)


def running_sum_prompt(digits: list[int]) -> str:
    """``[3,1,9] -> 'a3b1c9:'``."""
    return "".join(MARKERS[i] + str(d) for i, d in enumerate(digits)) + PROMPT_SEP


def parse_running_sum_prompt(text: str) -> list[int]:
    """Inverse of :func:`running_sum_prompt` (ignores anything after the separator)."""
    body = text.split(PROMPT_SEP, 1)[0]
    return [int(ch) for ch in body if ch.isdigit()]


#: Marked-digit tasks by name: the answer function of each.
DIGIT_TASKS: dict[str, Callable[[list[int]], str]] = {
    "digit_cipher": digit_cipher_answer,
    "running_sum": running_sum_answer,
}


class RunningSumTask:
    """Deterministic prompt ``index -> (digits, answer)`` stream for a seed.

    ``kind`` names the answer function (a key of :data:`DIGIT_TASKS`; the class name
    is historical: every marked-digit task shares the prompts and the heavy tail).
    Response format: the marked answer followed by ``.`` and end-of-sequence.
    Reward: 1.0 for an exact answer, else 0 (optionally partial credit, see
    :func:`running_sum_reward`).
    """

    def __init__(self, min_len: int = 1, max_len: int = 24, exponent: float = 1.6, seed: int = 0,
                 kind: str = "running_sum") -> None:
        if kind not in DIGIT_TASKS:
            raise ValueError(f"unknown digit task {kind!r} (valid: {', '.join(DIGIT_TASKS)})")
        self.kind = kind
        self._answer = DIGIT_TASKS[kind]
        if min_len < 1 or max_len < min_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        if max_len > len(MARKERS):
            raise ValueError(f"max_len must be <= {len(MARKERS)} (one position marker per digit), got {max_len}")
        self.support, self.weights = heavy_tail_lengths(min_len, max_len, exponent)
        self.seed = seed

    def digits(self, index: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + index)
        n = rng.choices(self.support, weights=self.weights, k=1)[0]
        return [rng.randrange(10) for _ in range(n)]

    def get(self, index: int) -> Prompt:
        digits = self.digits(index)
        return Prompt(index, running_sum_prompt(digits), self._answer(digits))

    @staticmethod
    def target(prompt: Prompt) -> str:
        """The supervised response text for warm starts."""
        return prompt.answer + ANSWER_END



def running_sum_reward(response: str, answer: str, partial_credit: bool = False) -> float:
    """1.0 for the exact answer; otherwise 0, or with ``partial_credit`` half the fraction of
    correct leading characters (a denser but noisier signal: it separates samples of groups
    where every sample is wrong)."""
    text = response.split(ANSWER_END, 1)[0].strip()
    if text == answer:
        return 1.0
    if not partial_credit:
        return 0.0
    prefix = 0
    for a, b in zip(text, answer):
        if a != b:
            break
        prefix += 1
    return 0.5 * prefix / max(len(answer), 1)


def math_verify_available() -> bool:
    try:
        import math_verify  # type: ignore # noqa: F401
    except ImportError:
        return False
    return True


def math_reward(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals ``answer``; uses ``math-verify`` when installed,
    else :func:`same_answer` on the last ``\\boxed{}`` / ``Answer:`` / last token."""
    try:
        from math_verify import parse, verify  # type: ignore
    except ImportError:
        return 1.0 if same_answer(_last_answer(response), answer) else 0.0
    try:
        return 1.0 if verify(parse(f"${answer}$"), parse(response)) else 0.0
    except Exception:  # math-verify raises on unparsable text; that is a wrong answer
        return 0.0


def reward_description(task: str, partial_credit: bool = False) -> str:
    """Which reward a job uses, in words (logged at start, ``summary.json`` ``reward_fn``)."""
    if task in DIGIT_TASKS:
        return f"{task}: exact answer" + (" with partial credit" if partial_credit else "")
    if math_verify_available():
        return "math: math-verify"
    return ("math: builtin final-answer match (math-verify cannot be imported: pip install math-verify for "
            "symbolic equivalence)")


_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_FRAC = re.compile(r"^(-?)\\d?frac\{(-?\d+)\}\{(-?\d+)\}$")


def _number(text: str) -> Fraction | None:
    """``text`` as an exact number when it is one: ``12``, ``-0.5``, ``1/2``, ``\\frac{1}{2}``."""
    m = _FRAC.match(text)
    if m:
        text = f"{m.group(1)}{m.group(2)}/{m.group(3)}"
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def same_answer(got: str, want: str) -> bool:
    """The fallback comparison without ``math-verify``: equal after removing ``$``, spaces, a
    final period and thousands separators, or equal as numbers (``1/2`` = ``0.5``, ``1,000`` =
    ``1000``). Anything symbolic beyond that needs ``math-verify``."""
    a = _THOUSANDS.sub("", _normalise(got))
    b = _THOUSANDS.sub("", _normalise(want))
    if a == b:
        return True
    x, y = _number(a), _number(b)
    return x is not None and y is not None and x == y


def _normalise(text: str) -> str:
    return text.strip().strip("$").replace(" ", "").rstrip(".")


def _last_answer(response: str) -> str:
    if "\\boxed{" in response:
        start = response.rindex("\\boxed{") + len("\\boxed{")
        depth, end = 1, start
        while end < len(response) and depth:
            depth += {"{": 1, "}": -1}.get(response[end], 0)
            end += 1
        return _normalise(response[start:end - 1])
    if "Answer:" in response:
        return _normalise(response.rsplit("Answer:", 1)[1].splitlines()[0] if response.rsplit("Answer:", 1)[1] else "")
    tokens = response.strip().split()
    return _normalise(tokens[-1]) if tokens else ""


def make_prompt_source(task: str, partial_credit: bool = False, **kwargs) -> tuple[PromptSource, Callable[[str, str], float]]:
    """Build the prompt source and reward function of the digit task ``task``."""
    if task in DIGIT_TASKS:
        return RunningSumTask(kind=task, **kwargs), functools.partial(running_sum_reward, partial_credit=partial_credit)
    raise ValueError(f"data.task: unknown task {task!r} (digit tasks: {', '.join(DIGIT_TASKS)}; a prompt dataset is "
                     "read by dora_megatron.data.dataset)")
