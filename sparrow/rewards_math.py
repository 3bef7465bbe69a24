"""The `math` reward: `math-verify` (the verifier open-r1, TRL, AReaL and verl use) on the response.

The ground truth is parsed as LaTeX or a plain expression (`$...$` is added around a bare one, as
math-verify's own examples do); the response is parsed for its final answer (the last `\\boxed{}`
first, then the last expression). math-verify's own timeouts use SIGALRM, which only works in a
main thread; the reward pool runs every reward in a worker process's main thread, and bounds the
whole call with its own timeout as well.
"""

from __future__ import annotations

PARSE_TIMEOUT_S = 5
VERIFY_TIMEOUT_S = 5


def math_verify_score(response: str, ground_truth: str | None, extras: dict) -> dict:
    """1.0 when math-verify finds the response's final answer equal to the ground truth, else 0.0."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if ground_truth is None or not str(ground_truth).strip():
        return {"score": 0.0, "parsed": False}
    gold_text = str(ground_truth).strip()
    if "\\boxed" not in gold_text and not gold_text.startswith("$"):
        gold_text = f"${gold_text}$"
    gold = parse(gold_text, parsing_timeout=PARSE_TIMEOUT_S)
    answer = parse(
        response,
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
        parsing_timeout=PARSE_TIMEOUT_S,
    )
    if not gold or not answer:
        return {"score": 0.0, "parsed": bool(answer)}
    return {"score": 1.0 if verify(gold, answer, timeout_seconds=VERIFY_TIMEOUT_S) else 0.0, "parsed": True}
