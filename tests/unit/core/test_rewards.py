"""Rewards: exact match for the chain task, normalised `\\boxed{}` math answers, and no crash on any output."""

import random

import pytest

from sparrow.rewards import chain_reward, last_boxed, math_reward, normalize_math


@pytest.mark.parametrize(
    "text, expected",
    [
        ("\\boxed{ kab }", "kab"),
        ("a \\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed {x}", "x"),
        ("\\boxed{{a}{b}}", "{a}{b}"),
        ("\\boxed{1} \\boxed{2", "1"),  # the last box is unbalanced: fall back to a well-formed one
        ("\\boxed{", None),
        ("\\boxed", None),
        ("\\boxed}", None),
        ("no box", None),
        ("", None),
        (None, None),
        (42, None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_chain_reward_exact_match():
    assert chain_reward("3 a b ; 2 b c ; 1 c d ; \\boxed{ dop }", "dop") == 1.0
    assert chain_reward("\\boxed{dop}", "dop") == 1.0
    assert chain_reward("\\boxed{ dop } \\boxed{ kab }", "dop") == 0.0  # the last answer counts
    assert chain_reward("\\boxed{ do }", "dop") == 0.0
    assert chain_reward("dop", "dop") == 0.0


@pytest.mark.parametrize(
    "output, reference",
    [
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{1/2}", "\\frac{1}{2}"),
        ("\\boxed{0.50}", "1/2"),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12"),
        ("\\boxed{-\\frac{3}{4}}", "-0.75"),
        ("\\boxed{+7}", "7"),
        ("\\boxed{1,234,567}", "1234567"),
        ("\\boxed{$42$}", "42"),
        ("\\boxed{{42}}", "42"),
        ("\\boxed{42}", 42),
        ("\\boxed{0.25}", 0.25),
        ("\\boxed{50\\%}", "50"),
        ("\\boxed{90^\\circ}", "90"),
        ("\\boxed{\\text{5}}", "5"),
        ("\\boxed{\\left(3\\right)}", "3"),
        ("\\boxed{x + 1}", "x+1"),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}"),
        ("the answer is \\boxed{\\frac{\\frac{1}{2}}{2}} ok", "\\boxed{0.25}"),
    ],
)
def test_math_reward_accepts_equal_answers(output, reference):
    assert math_reward(output, reference) == 1.0


@pytest.mark.parametrize(
    "output, reference",
    [
        ("\\boxed{1/3}", "0.33"),
        ("\\boxed{-1}", "1"),
        ("\\boxed{12,34}", "1234"),  # not a thousands separator
        ("\\boxed{1/0}", "1"),
        ("\\boxed{\\frac{1}{0}}", "0"),
        ("\\boxed{}", ""),
        ("\\boxed{ }", " "),
        ("\\boxed{x}", "y"),
        ("\\boxed{2}", "x"),
        ("42", "42"),
        ("\\boxed{42}", None),
        ("\\boxed{42}", True),
        ("\\boxed{42}", ["42"]),
        ("\\boxed{42}", "\\boxed{"),
    ],
)
def test_math_reward_rejects(output, reference):
    assert math_reward(output, reference) == 0.0


def test_normalize_math_numbers():
    assert normalize_math("\\frac{2}{4}") == normalize_math("0.5") == normalize_math("1/2")
    assert normalize_math(" x ") == "x"


NASTY = [
    "",
    "\\boxed{" * 10_000,
    "}" * 10_000 + "\\boxed{1}",
    "\\boxed{" + "{" * 5000 + "1" + "}" * 4999,
    "\\boxed{" + "9" * 100_000 + "}",
    "\\boxed{1" + "0" * 5000 + "/3}",
    "\\boxed{1e999999999}",
    "\\boxed{\\frac{" * 200 + "}",
    "\\boxed{\\frac{1}{2}{3}}",
    "\\boxed{1/2/3}",
    "\\boxed{--1}",
    "\\boxed{.}",
    "\\boxed{+}",
    "\\boxed{,}",
    "\\boxed{1,}",
    "\\boxed{\\x00\\xff\ud800}",
    "\\boxed{\u0661\u0662}",  # Arabic-Indic digits
    "\\boxed{nan}",
    "\\boxed{inf}",
    "\\boxed{\\infty}",
    "x" * 2_000_000,
    "\\boxed{" + "x" * 2_000_000 + "}",
    "\\boxed\\boxed\\boxed{}}}",
    "$$\\boxed{$}$$",
    "\\boxed{\\frac{}{}}",
    "\\boxed{\\frac12}",
    "\\boxed{\\frac{a}{b}}",
    "\\boxed{\\text{}}",
    "\\boxed{\\left(}",
    b"\\boxed{1}",
    None,
    3.5,
    float("nan"),
    ["\\boxed{1}"],
]


@pytest.mark.parametrize("output", NASTY, ids=range(len(NASTY)))
@pytest.mark.parametrize("reference", ["1", "0.5", "\\frac{1}{2}", "", "kab", "\\boxed{", None, float("nan")])
def test_rewards_never_raise(output, reference):
    assert math_reward(output, reference) in (0.0, 1.0)
    if isinstance(reference, str):
        assert chain_reward(output, reference) in (0.0, 1.0)
    assert chain_reward(output, reference) in (0.0, 1.0)


def test_random_garbage_never_raises():
    rng = random.Random(0)
    alphabet = list("\\boxed{}frac0123456789.,/-+ $()^%text") + ["\\boxed{", "\\frac", "}", "{"]
    for _ in range(2000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        assert math_reward(s, "1/2") in (0.0, 1.0)
        assert chain_reward(s, "1") in (0.0, 1.0)
