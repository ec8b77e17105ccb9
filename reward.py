"""The DAPO paper's rule-based answer reward (arXiv 2503.14476, §2.4, Eq. 7).

    R(y, y_hat) = +1 if is_equivalent(y, y_hat) else -1

"Equivalent" is decided the way the paper's released evaluation decides it:
take the last "Answer: ..." line of the response's last 300 characters and
compare it with the ground truth after a Minerva-style string normalisation.
The verdicts must match that check exactly, quirks included, or AIME numbers
stop being comparable with the paper's (`data/reward_spec.md` is the spec).

Quirks a user will trip over: "Answer: 540." scores -1 (the period stays),
"**Answer:** 540" scores -1 (the captured text is "** 540"), and an answer
that ends more than 300 characters before the end of the response is not seen.

Pure standard library; every call runs in time linear in its input. The
released check uses regular expressions that backtrack quadratically on long
lines; the loops below reproduce their results without the backtracking.
"""

import functools
import random
import re

WINDOW = 300  # only the last 300 characters of a response are read
INVALID = "[INVALID]"  # the prediction when no answer line is found

# `\s` and IGNORECASE are Python's Unicode ones, as in the released check
# (so "ANSWER", "anſwer" and a no-break space all behave as they do there).
# On a 300-character window this pattern cannot backtrack badly.
_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
_LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)


def _check_str(name, value):
    if not isinstance(value, str):
        raise TypeError(f"{name} must be str, got {type(value).__name__}")


def extract_answer(response: str) -> str:
    """Spec steps 1-2: the text after the last "Answer:" in the last 300 chars."""
    _check_str("response", response)
    matches = _ANSWER_LINE.findall(response[-WINDOW:])
    return matches[-1] if matches else INVALID


def extract_boxed(response: str) -> str:
    r"""Optional mode: the content of the last balanced \boxed{...} in the window."""
    _check_str("response", response)
    window = response[-WINDOW:]
    start = window.rfind("\\boxed{")
    if start < 0:
        return INVALID
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(window)):
        depth += {"{": 1, "}": -1}.get(window[j], 0)
        if depth == 0:
            return window[i + 1 : j]
    return INVALID


def extract_last_number(response: str) -> str:
    """Optional lenient mode (CPU demo only): the last number in the window."""
    _check_str("response", response)
    matches = _LAST_NUMBER.findall(response[-WINDOW:].replace(",", ""))
    return matches[-1] if matches else INVALID


# The released check applies `re.sub` passes in which `.` never crosses a
# newline, so each pass acts on one line at a time; the helpers below do the
# same per line with str.find, in linear time.


def _keep_first_dollar_pair(line):
    # (.*?)(\$)(.*?)(\$)(.*) -> $\3$ : a line with two `$` keeps the first pair.
    a = line.find("$")
    b = line.find("$", a + 1) if a >= 0 else -1
    return line if b < 0 else "$" + line[a + 1 : b] + "$"


def _unwrap_shortest(line, opener):
    # (\\cmd\{)(.*?)(\}) -> \2 : each \cmd{X}, X up to the next `}`.
    out, pos = [], 0
    while True:
        i = line.find(opener, pos)
        j = line.find("}", i + len(opener)) if i >= 0 else -1
        if j < 0:  # no later `}`: no later \cmd{ can match either
            out.append(line[pos:])
            return "".join(out)
        out.append(line[pos:i])
        out.append(line[i + len(opener) : j])
        pos = j + 1


def _unwrap_boxed(line):
    # (\\boxed\{)(.*)(\}) -> \2 : the first \boxed{ up to the line's last `}`.
    i = line.find("\\boxed{")
    j = line.rfind("}", i + 7) if i >= 0 else -1
    return line if j < 0 else line[:i] + line[i + 7 : j] + line[j + 1 :]


def _expand_shorthand(text, word, args):
    # (frac)([^{])(.) -> frac{\2}{\3} and (sqrt)([^{]) -> sqrt{\2}. The first
    # character may be a newline (`[^{]` matches one), a second may not (`.`).
    out, pos = [], 0
    while True:
        i = text.find(word, pos)
        if i < 0:
            out.append(text[pos:])
            return "".join(out)
        k = i + len(word)
        chars = text[k : k + args]
        if len(chars) == args and chars[0] != "{" and (args == 1 or chars[1] != "\n"):
            out.append(text[pos:k])
            out.append("".join("{" + c + "}" for c in chars))
            pos = k + args
        else:
            out.append(text[pos : i + 1])
            pos = i + 1


def normalize(answer: str) -> str:
    """Spec step 3: the released Minerva-style normalisation, quirks included."""
    _check_str("answer", answer)
    # Ground truths repeat across the G samples of a group: cache short ones.
    return _normalize_cached(answer) if len(answer) <= 512 else _normalize(answer)


def _normalize(answer):
    text = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        text = text.replace(before, after)
    for expr in _REMOVED:
        text = text.replace(expr, "")
    lines = []
    for line in text.split("\n"):
        line = _keep_first_dollar_pair(line)
        for opener in ("\\text{", "\\textbf{", "\\overline{"):
            line = _unwrap_shortest(line, opener)
        lines.append(_unwrap_boxed(line))
    text = "\n".join(lines)
    text = _expand_shorthand(text, "frac", 2)
    text = _expand_shorthand(text, "sqrt", 1)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


_normalize_cached = functools.lru_cache(maxsize=65536)(_normalize)

EXTRACTORS = {"answer": extract_answer, "boxed": extract_boxed, "last_number": extract_last_number}


def compute_score(response: str, ground_truth: str, mode: str = "answer") -> float:
    """+1.0 if the response's final answer equals the ground truth, else -1.0.

    mode "answer" is the paper's check and the default; "boxed" reads the last
    \\boxed{} instead (Qwen-Math style prompts); "last_number" is a lenient
    check used only by the CPU demo, never for reported numbers.
    """
    _check_str("response", response)
    _check_str("ground_truth", ground_truth)
    if mode not in EXTRACTORS:
        raise ValueError(f"mode must be one of {sorted(EXTRACTORS)}, got {mode!r}")
    pred = EXTRACTORS[mode](response)
    return 1.0 if normalize(pred) == normalize(ground_truth) else -1.0


def final_answer(response: str, mode: str = "answer"):
    """The normalised answer compute_score compares with the ground truth, or None when the
    response has none (maj@k's vote: a response without an answer casts no vote)."""
    _check_str("response", response)
    if mode not in EXTRACTORS:
        raise ValueError(f"mode must be one of {sorted(EXTRACTORS)}, got {mode!r}")
    pred = EXTRACTORS[mode](response)
    return None if pred == INVALID else normalize(pred)


def random_score(seed: int, position: int, index: int) -> float:
    """An experiment, not a task (--reward_mode random): +1.0 or -1.0 with probability 1/2 each,
    independent of the response. Drawn from (seed, the prompt's stream position, the sample's
    index in its group), so a resumed run, or one on another world size, draws the same rewards."""
    draw = random.Random(f"dapo random reward {seed} {position} {index}").random()
    if draw < 0.5:
        return 1.0
    return -1.0


if __name__ == "__main__":  # benchmark: python reward.py
    import random
    import time

    rng = random.Random(0)
    words = "the sum of two numbers is so we add them and get carry step".split()
    responses = [
        " ".join(rng.choice(words) for _ in range(500))[:1990]  # distinct answers: no cache hits
        + f"\nAnswer: {rng.randint(0, 10**9)}"
        for _ in range(8192)
    ]
    truths = [
        str(rng.randint(0, 999)) for _ in range(64)
    ]  # as in training: G samples share one truth
    for mode in EXTRACTORS:
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < 2.0:
            _normalize_cached.cache_clear()  # each pass starts cold
            for i, r in enumerate(responses):
                compute_score(r, truths[i % 64], mode)
            n += len(responses)
        rate = n / (time.perf_counter() - t0)
        print(
            f"mode={mode}: {rate:,.0f} responses/s "
            f"({sum(map(len, responses)) / len(responses):.0f} chars each)"
        )
    worst = []
    for text in [
        "x" * 1_000_000,
        "Answer: " * 100_000,
        "{" * 50_000 + "}" * 50_000,
        "\\boxed{" * 50_000,
        "$" * 100_000,
        "frac" * 100_000,
        "\\text{" * 100_000,
    ]:
        for args in ((text, "5"), ("Answer: 5", text)):
            t0 = time.perf_counter()
            compute_score(*args)
            worst.append((time.perf_counter() - t0) * 1e3)
    print(
        "slowest adversarial call (1 MB-class strings, as response or as ground truth): "
        f"{max(worst):.1f} ms"
    )
