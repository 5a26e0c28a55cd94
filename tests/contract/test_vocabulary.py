"""One status vocabulary (elastune_contract.vocabulary): every reason the product writes is a constant
defined there. The scan below reads the source of every product package and fails on a string literal
in a reason position — a ``reason=`` argument, a ``"reason"`` key, a comparison with ``.reason``, the
reason argument of the status helpers — and on any literal spelling of a defined reason (use the
constant), so a reason can neither be invented nor spelled twice."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from elastune_contract import vocabulary as V
from elastune_contract.api.common import CONDITION_TYPE_PATTERN, REASON_PATTERN

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = [ROOT / "contract", ROOT / "operator", ROOT / "worker"]
VOCABULARY = ROOT / "contract" / "elastune_contract" / "vocabulary.py"
#: Calls whose n-th positional argument is a reason (0-based).
REASON_ARGS = {
    "condition": 3,
    "set_condition": 3,
    "failed": 1,
    "finished": 3,
    "retrying": 1,
    "bank_skipped": 1,
    "_fail": 1,
    "BankChoice": 1,
    "BankError": 0,
    "DatasetError": 0,
    "AssignmentFailed": 0,
    "Selection": 2,
}
CAMEL = re.compile(r"^[A-Z][A-Za-z0-9]*$")


def _sources() -> list[Path]:
    return [p for root in PRODUCT for p in root.rglob("*.py") if p != VOCABULARY]


def _str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _exempt(tree: ast.AST) -> set[int]:
    """Strings that name things, not reasons: ``__all__`` and lazy ``*_NAMES`` export lists (exception
    classes share a reason's name, e.g. CollectiveTimeout) and ``Literal[...]`` types that mirror the
    constants for mypy."""
    ids: set[int] = set()
    for node in ast.walk(tree):
        names = [getattr(t, "id", "") for t in getattr(node, "targets", [])]
        if isinstance(node, ast.Assign) and any(n == "__all__" or n.endswith("_NAMES") for n in names):
            ids |= {id(n) for n in ast.walk(node.value)}
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", "") == "Literal":
            ids |= {id(n) for n in ast.walk(node.slice)}
    return ids


def _reason_literals(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            for kw in node.keywords:
                if kw.arg == "reason" and (v := _str(kw.value)) is not None:
                    found.append((node.lineno, v))
            i = REASON_ARGS.get(name)
            if i is not None and i < len(node.args) and (v := _str(node.args[i])) is not None:
                found.append((node.lineno, v))
        elif isinstance(node, ast.Dict):
            for k, v_node in zip(node.keys, node.values, strict=True):
                if _str(k) == "reason" and (v := _str(v_node)) is not None:
                    found.append((node.lineno, v))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "reason" for s in sides):
                found += [(node.lineno, v) for s in sides if (v := _str(s)) is not None]
    return found


def test_reasons_are_unique_camelcase_and_fit_the_schema() -> None:
    reasons = [v for k, v in vars(V.Reason).items() if k.isupper()]
    assert len(reasons) == len(set(reasons)) == len(V.REASONS)
    for reason in reasons:
        assert CAMEL.match(reason) and re.fullmatch(REASON_PATTERN.strip("^$"), reason), reason
    for ctype in V.CONDITION_TYPES:
        assert re.fullmatch(CONDITION_TYPE_PATTERN.strip("^$"), ctype), ctype
    assert V.PERMANENT_FAILURE_REASONS <= V.REASONS
    assert V.PROMPT_BANK_SKIP_REASONS <= V.REASONS
    assert set(V.PROMPT_BANK_ERROR_REASONS) <= V.REASONS


def test_no_product_code_writes_a_reason_literal() -> None:
    offences = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        for line, value in _reason_literals(tree):
            where = f"{path.relative_to(ROOT)}:{line}"
            if value in V.REASONS:
                offences.append(f"{where}: {value!r} — use the vocabulary constant")
            else:
                offences.append(f"{where}: {value!r} is not a reason of elastune_contract.vocabulary")
    assert not offences, "\n".join(offences)


def test_no_product_code_spells_a_defined_reason() -> None:
    """Anywhere, not only in reason positions: a second spelling of a reason is how they drift."""
    offences = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        exempt = _exempt(tree)
        for node in ast.walk(tree):
            value = None if id(node) in exempt else _str(node)
            if value is not None and value in V.REASONS and value not in V.CONDITION_TYPES:
                offences.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}: {value!r}")
    assert not offences, "use elastune_contract.vocabulary constants:\n" + "\n".join(offences)


@pytest.mark.parametrize(
    "snippet",
    [
        'core._fail(job, "OutOfCoffee", "msg", now)',
        'Event(type="failed", reason="WorkerErorr")',
        'doc = {"reason": "OverBudget"}',
        'if rec.reason == "Disabled": pass',
    ],
)
def test_the_scan_catches_a_literal(snippet: str) -> None:
    assert _reason_literals(ast.parse(snippet)), snippet
