"""The built-in verifiable task: short integer arithmetic, e.g. ``"12+7*3="`` -> ``"33"``.

Problems are generated offline and deterministically: problem ``i`` of seed ``s`` depends
only on ``(s, i)``, through a small counter-based generator defined here, so it is the
same on every machine and library version, and any slice can be generated on its own.
Answers follow the usual precedence (``*`` before ``+`` and ``-``). Prompts are a few
characters and answers at most a few digits, so a tiny model can learn the task after a
short supervised warm-up and then improve with RL.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHABET = "0123456789+-*="
_OPERATORS = "+-*"
_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class ArithmeticConfig:
    """Difficulty knobs of the arithmetic task.

    num_operands: numbers per problem (2 to 8).
    max_digits: each number is drawn uniformly from ``[0, 10**max_digits)`` (1 to 6).
    operators: the operators to draw from, a non-empty subset of ``"+-*"``.
    seed: picks the problem set; use different seeds for train and evaluation.
    """

    num_operands: int = 2
    max_digits: int = 2
    operators: str = "+-"
    seed: int = 0

    def __post_init__(self) -> None:
        if not 2 <= self.num_operands <= 8:
            raise ValueError(f"num_operands={self.num_operands}; use 2 to 8")
        if not 1 <= self.max_digits <= 6:
            raise ValueError(f"max_digits={self.max_digits}; use 1 to 6")
        if not self.operators or set(self.operators) - set(_OPERATORS):
            raise ValueError(f"operators={self.operators!r}; use a non-empty subset of '+-*'")
        if len(set(self.operators)) != len(self.operators):
            raise ValueError(f"operators={self.operators!r} repeats an operator")

    @classmethod
    def level(cls, difficulty: int, seed: int = 0) -> ArithmeticConfig:
        """Presets from 1 (one-digit sums) to 5; the default config is level 2."""
        presets = {
            1: (2, 1, "+-"),
            2: (2, 2, "+-"),
            3: (3, 2, "+-*"),
            4: (4, 2, "+-*"),
            5: (4, 3, "+-*"),
        }
        if difficulty not in presets:
            raise ValueError(f"difficulty={difficulty}; use 1 to {max(presets)}")
        operands, digits, ops = presets[difficulty]
        return cls(num_operands=operands, max_digits=digits, operators=ops, seed=seed)


@dataclass(frozen=True, slots=True)
class Problem:
    index: int
    prompt: str  # e.g. "12+7*3="
    answer: str  # e.g. "33"


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class _Stream:
    """Random integers for one problem, keyed by (seed, index)."""

    def __init__(self, seed: int, index: int) -> None:
        self._state = _splitmix64(_splitmix64(seed & _MASK) ^ (index & _MASK))

    def below(self, n: int) -> int:
        self._state = (self._state + 1) & _MASK
        return _splitmix64(self._state) % n  # bias < n / 2**64: irrelevant here


def evaluate(tokens: list[int | str]) -> int:
    """Value of ``[n0, op, n1, op, ...]`` with ``*`` binding tighter than ``+`` and ``-``."""
    total, term, sign = 0, int(tokens[0]), 1
    for op, value in zip(tokens[1::2], tokens[2::2], strict=True):
        if op == "*":
            term *= int(value)
        else:
            total += sign * term
            term, sign = int(value), (1 if op == "+" else -1)
    return total + sign * term


class ArithmeticTask:
    """Problem ``i`` for any ``i >= 0``; the set is unbounded and needs no storage."""

    def __init__(self, config: ArithmeticConfig | None = None) -> None:
        self.config = config or ArithmeticConfig()

    def problem(self, index: int) -> Problem:
        if index < 0:
            raise ValueError(f"problem index {index} is negative")
        cfg = self.config
        rng = _Stream(cfg.seed, index)
        limit = 10**cfg.max_digits
        parts: list[int | str] = [rng.below(limit)]
        for _ in range(cfg.num_operands - 1):
            parts.append(cfg.operators[rng.below(len(cfg.operators))])
            parts.append(rng.below(limit))
        prompt = "".join(map(str, parts)) + "="
        return Problem(index, prompt, str(evaluate(parts)))

    def problems(self, count: int, start: int = 0) -> list[Problem]:
        return [self.problem(i) for i in range(start, start + count)]

    @property
    def max_prompt_chars(self) -> int:
        cfg = self.config
        return cfg.num_operands * (cfg.max_digits + 1)

    @property
    def max_answer_chars(self) -> int:
        largest = (10**self.config.max_digits - 1) ** (
            self.config.num_operands if "*" in self.config.operators else 1
        ) * (1 if "*" in self.config.operators else self.config.num_operands)
        return len(str(largest)) + 1  # a minus sign


def check(response_text: str, answer: str) -> float:
    """1.0 when the response is exactly the answer (surrounding whitespace ignored).

    Exact match, not "contains": a response that lists several numbers gets no credit.
    """
    return 1.0 if response_text.strip() == answer.strip() else 0.0


# The response format. A response reduces the expression one operator at a time, the
# leftmost ``*`` first and then ``+``/``-`` left to right, each intermediate expression
# followed by ``=``, ending in the answer: "12+7*3=" -> "12+21=33", and "63+23=" -> "86"
# (two operands: just the answer). Showing the steps keeps each token a small, local
# computation that a tiny model can learn; the reward reads only the text after the last
# ``=``.


class ExpressionError(ValueError):
    """Text that is not digits joined by ``+ - *``: ``char`` is the first character that
    cannot be read, or ``None`` when the text ends in an operator."""

    def __init__(self, char: str | None) -> None:
        super().__init__(f"cannot read {char!r}" if char else "ends in an operator")
        self.char = char


def split_expression(text: str) -> list[int | str]:
    """``"12+3*4"`` as ``[12, "+", 3, "*", 4]``; raises :class:`ExpressionError`."""
    parts: list[int | str] = []
    number = ""
    for char in text:
        if char.isdigit():
            number += char
        elif char in _OPERATORS and number:
            parts += [int(number), char]
            number = ""
        else:
            raise ExpressionError(char)
    if not number:
        raise ExpressionError(None)
    parts.append(int(number))
    return parts


def _parse(prompt: str) -> list[int | str]:
    try:
        return split_expression(prompt.strip().removesuffix("="))
    except ExpressionError as e:
        if e.char is None:
            raise ValueError(
                f"cannot parse the prompt {prompt!r}: it ends in an operator"
            ) from None
        raise ValueError(f"cannot parse the prompt {prompt!r} at {e.char!r}") from None


def _reduce_once(parts: list[int | str]) -> list[int | str]:
    ops = parts[1::2]
    # the leftmost "*" first (precedence), else the leftmost "+" or "-" (left associativity)
    i = 2 * ops.index("*") + 1 if "*" in ops else 1
    left, op, right = int(parts[i - 1]), parts[i], int(parts[i + 1])
    value = left * right if op == "*" else left + right if op == "+" else left - right
    return [*parts[: i - 1], value, *parts[i + 2 :]]


def solution_steps(problem: Problem | str) -> str:
    """The target response for a problem (or its prompt), without EOS.

    One step per operator, ``=``-separated, the last step being the answer:
    ``"12+7*3="`` -> ``"12+21=33"``; with two operands just the answer, ``"63+23="`` ->
    ``"86"``. Only the leading number of a step can be negative (``"5-9+3="`` ->
    ``"-4+3=-1"``), since ``*`` is reduced before any subtraction, so every step is a
    well-formed expression over :data:`ALPHABET` whose value is the answer.
    """
    prompt = problem.prompt if isinstance(problem, Problem) else problem
    parts = _parse(prompt)
    steps: list[str] = []
    while len(parts) > 1:
        parts = _reduce_once(parts)
        steps.append("".join(map(str, parts)))
    if not steps:
        raise ValueError(f"the prompt {prompt!r} has no operator")
    return "=".join(steps)


def extract_answer(response_text: str) -> str:
    """The final answer of a response: the text after its last ``=``, stripped (the whole
    text, stripped, when it has no ``=``). Compare it with :attr:`Problem.answer` exactly."""
    return response_text.rpartition("=")[2].strip()
