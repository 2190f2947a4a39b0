"""The calculator tool: safe, exact arithmetic on one expression written by a language model.

`calculate("(12.50 * 3) - 4 / 2")` answers `Result(value=Fraction(71, 2), text="35.5")`; anything
it will not evaluate answers `Result(value=None, text="error: ...", error="...")`, one short line
that says what was wrong and what is allowed. `text` is what the model gets back as the tool
result, answer or error alike; `calculate` never raises.

The language: numbers written as plain decimal digits with at most one decimal point (`12`,
`12.50`, `.5`, `3.`), the binary operators `+ - * / // % **`, unary `+` and `-`, and
parentheses. Python's precedence and associativity (`-2**2` is -4, `2**3**2` is 512) and Python's
floor division and remainder (`-7 // 2` is -4, `-7 % 3` is 2, `7 % -3` is -2). A few forms models
write are accepted: surrounding whitespace, one trailing `=`, line breaks (read as spaces), and
the signs `×`, `÷` and `−` (U+2212), read as `*`, `/` and `-`. Nothing else: no names, constants,
calls, attributes, subscripts, comparisons, boolean or bitwise operators, strings, lambdas,
comprehensions or assignments; no thousands separators (`1,000`: a comma is ambiguous, refused),
no `_` digit separators, no scientific notation, no currency signs, no percent sign (`%` is the
remainder; `a % -b` must be written `a % (-b)`, so that `50% + 10` is refused, not read as 0).

Why not an existing "safe eval": popular ones have had code-execution holes (simpleeval before
1.0.5, asteval, numexpr's evaluate on untrusted strings), because they start from Python and
take the dangerous parts away, and one missed path is enough. This module goes the other way:
the text is parsed with `ast.parse(..., mode="eval")`, never compiled to code, and the whole tree
is checked against an allow-list (`Expression`, `BinOp`, `UnaryOp`, `Constant` int or float, the
operators above) before anything is computed; any other node is refused, so a name, a call or an
attribute never reaches the evaluator, which only ever does Fraction arithmetic. Numeric literals
are re-read from their source text (never through float) as exact `Fraction`s, and every
operation is exact: `0.1 + 0.2` is 0.3 and `1/3*3` is 1. A few checks on the text come first, for
clearer messages (`1,000`, `$5`, `3x`, `1e5`) and so that Python's parser never warns.

Limits (so that no input costs more than microseconds or a few kilobytes):

- MAX_LENGTH characters of expression, after surrounding whitespace is stripped;
- MAX_NESTING levels of parentheses (the tree's depth is bounded by the length as well);
- exponents must be whole numbers with |exponent| <= MAX_EXPONENT (`9**9**9` is refused at the
  outer power, its exponent 387420489, before anything large is computed);
- every number, literal, intermediate or final, must have a numerator and a denominator of at
  most MAX_BITS bits (about MAX_DIGITS decimal digits), checked after every operation. Since the
  operands of every operation are within that bound and exponents are small, the largest value
  ever computed has MAX_BITS * MAX_EXPONENT bits: `(10**60)**60` is refused, never carried on.

The answer's text: an integer in plain digits (`42`, `-7`); a non-integer whose decimal expansion
ends within MAX_EXACT_PLACES places, as that exact decimal without trailing zeros (`2.5`,
`0.125`); any other value rounded (half to even) to ROUND_PLACES decimal places, or to
ROUND_PLACES significant digits when it is below 1 in magnitude, followed by the exact fraction:
`0.3333333333 (rounded; exact: 1/3)`.

TOOL is the calculator's function definition in OpenAI's `tools` shape, and
`calculate_arguments` answers a tool call's JSON arguments (`{"expression": "..."}`).
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

MAX_LENGTH = 200
MAX_NESTING = 32
MAX_EXPONENT = 256
MAX_BITS = 256
MAX_DIGITS = math.floor(MAX_BITS * math.log10(2))  # 77: 10**77 fits in MAX_BITS, 10**78 does not
MAX_EXACT_PLACES = 20
ROUND_PLACES = 10

TOOL_NAME = "calculator"
EXAMPLE = "(12.50 * 3) - 4 / 2"
ALLOWED = "use only numbers, + - * / // % ** and parentheses"
# The characters of the language, for the tool's schema: what constrained decoding lets a model
# write in a forced call (every valid expression matches; not every match is valid: "1 +").
EXPRESSION_PATTERN = r"^[0-9.+\-*/%() ]+$"
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Evaluate one arithmetic expression exactly and return its value. Numbers (like 12 or 12.50), "
            f"+ - * / // % ** and parentheses only, e.g. {EXAMPLE}."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": f"the arithmetic expression, at most {MAX_LENGTH} characters",
                    "maxLength": MAX_LENGTH,
                    "pattern": EXPRESSION_PATTERN,
                }
            },
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is the model's answer."""


@dataclass(frozen=True)
class Result:
    """A calculation: `text` is fed back to the model; `error` (without the "error: " of `text`) is
    None when it succeeded, and then `value` holds the exact value."""

    value: Fraction | None
    text: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def calculate(expression: object) -> Result:
    """The value of `expression`, or the error that explains why there is none. Never raises."""
    try:
        value = evaluate(expression)
    except CalculatorError as exc:
        return Result(value=None, text=f"error: {exc}", error=str(exc))
    return Result(value=value, text=format_value(value))


def calculate_arguments(arguments: object) -> Result:
    """A tool call's arguments, a JSON string or an already decoded object, answered like `calculate`."""
    if isinstance(arguments, str | bytes):
        if len(arguments) > 4 * MAX_LENGTH:
            return _failed(f"arguments too long (the expression's limit is {MAX_LENGTH} characters)")
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return _failed(f'arguments are not valid JSON: send {{"expression": "{EXAMPLE}"}}')
    if not isinstance(arguments, Mapping):
        return _failed(f'arguments must be a JSON object: send {{"expression": "{EXAMPLE}"}}')
    unexpected = sorted(str(key) for key in arguments if key != "expression")
    if unexpected:
        return _failed(f'unexpected argument {unexpected[0]!r}: send only {{"expression": "..."}}')
    if "expression" not in arguments:
        return _failed(f'missing "expression": send {{"expression": "{EXAMPLE}"}}')
    return calculate(arguments["expression"])


def _failed(message: str) -> Result:
    return Result(value=None, text=f"error: {message}", error=message)


def evaluate(expression: object) -> Fraction:
    """The exact value of `expression`; raises CalculatorError with a short, model-facing message."""
    text = _normalized(expression)
    _precheck(text)
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(_syntax_message(text, exc)) from None
    except ValueError:  # e.g. null bytes on older Pythons; _precheck refuses them first
        raise CalculatorError(f"malformed expression; {ALLOWED}") from None
    walker = _Evaluator(text)
    walker.check(tree)
    try:
        return walker.value(tree)
    except RecursionError:  # unreachable within MAX_LENGTH from a normal stack; kept as a guard
        raise CalculatorError(f"expression nested too deeply; {ALLOWED}") from None


def format_value(value: Fraction) -> str:
    """The answer's text (see the module docstring): exact where the decimal is short, else rounded."""
    if value.denominator == 1:
        return str(value.numerator)
    places = _terminating_places(value.denominator)
    if places is not None and places <= MAX_EXACT_PLACES:
        return _decimal(value, places)
    magnitude = abs(value)
    places = ROUND_PLACES
    while magnitude * 10 ** (places - ROUND_PLACES + 1) < 1:  # leading zeros after the point
        places += 1
    return f"{_decimal(round(value, places), places)} (rounded; exact: {value.numerator}/{value.denominator})"


def _terminating_places(denominator: int) -> int | None:
    """The decimal places a fraction with this (reduced) denominator needs, or None if never ending."""
    twos = fives = 0
    while denominator % 2 == 0:
        denominator //= 2
        twos += 1
    while denominator % 5 == 0:
        denominator //= 5
        fives += 1
    return max(twos, fives) if denominator == 1 else None


def _decimal(value: Fraction, places: int) -> str:
    """`value` (a multiple of 10**-places) as a decimal, trailing zeros and a bare point dropped."""
    scaled = abs(value) * 10**places
    assert scaled.denominator == 1
    digits = str(scaled.numerator).rjust(places + 1, "0")
    whole, fraction = digits[: len(digits) - places], digits[len(digits) - places :].rstrip("0")
    sign = "-" if value < 0 else ""
    return f"{sign}{whole}.{fraction}" if fraction else f"{sign}{whole}"


# --- reading the text -------------------------------------------------------------------------

_SIGNS = str.maketrans({"×": "*", "÷": "/", "−": "-", "\t": " ", "\n": " ", "\r": " "})
_CURRENCY = set("$€£¥₹¢")
_NUMBER = re.compile(r"[0-9]+\.?[0-9]*|\.[0-9]+")
_NUMBER_THEN_LETTER = re.compile(r"(?<![A-Za-z0-9_])(?:[0-9]+\.?[0-9]*|\.[0-9]+)[A-Za-z_][A-Za-z0-9_]*")
_SCIENTIFIC = re.compile(r"(?<![A-Za-z0-9_])(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][+-]?[0-9]+")
_TIMES_X = re.compile(r"[0-9.)]\s*[xX]\s*[0-9.(]")
_PERCENT_THEN_SIGN = re.compile(r"%\s*[+-]")


def _normalized(expression: object) -> str:
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, like {EXAMPLE!r}")
    text = expression.strip()
    if len(text) > MAX_LENGTH:
        raise CalculatorError(f"expression too long ({len(text)} characters; the limit is {MAX_LENGTH})")
    text = text.translate(_SIGNS)
    if text.endswith("="):
        text = text[:-1].rstrip()
    if not text:
        raise CalculatorError(f"empty expression: send one arithmetic expression, like {EXAMPLE}")
    return text


def _precheck(text: str) -> None:
    """Refuse what Python's parser would misread or explain badly (and what it warns about), before
    parsing; everything else is left to the allow-list walk."""
    for char in text:
        if char in _CURRENCY:
            raise CalculatorError("currency signs are not allowed: write plain numbers (12.50, not $12.50)")
        if char == "=":
            raise CalculatorError(f"'=' is allowed only at the end: send one expression to evaluate, like {EXAMPLE}")
        if char == "#":
            raise CalculatorError(f"comments (#) are not allowed; {ALLOWED}")
        if not (" " <= char <= "~") or char in "\\!?`":
            raise CalculatorError(f"character {char!r} is not allowed; {ALLOWED}")
    if "," in text:
        raise CalculatorError("commas are not allowed: write 1000, not 1,000 (and 2.5, not 2,5); one expression only")
    if scientific := _SCIENTIFIC.search(text):
        raise CalculatorError(
            f"scientific notation is not allowed: write the number in full, not {scientific.group()!r}"
        )
    if times := _TIMES_X.search(text):
        raise CalculatorError(f"write * to multiply, not x: {times.group()!r}")
    if glued := _NUMBER_THEN_LETTER.search(text):
        written = glued.group()
        if "_" in written and not written.startswith("_"):
            raise CalculatorError(f"'_' in numbers is not allowed: write 1000, not 1_000 ({written!r})")
        raise CalculatorError(
            f"a number followed by letters is not allowed: {written!r} (write * to multiply; no units)"
        )
    if _PERCENT_THEN_SIGN.search(text):
        raise CalculatorError(
            "'%' is the remainder operator and takes a number after it: for a percentage write 15/100 or 0.15; "
            "for a remainder by a negative number write 7 % (-3)"
        )
    depth = deepest = 0
    for char in text:
        depth = depth + 1 if char == "(" else max(depth - 1, 0) if char == ")" else depth
        deepest = max(deepest, depth)
    if deepest > MAX_NESTING:
        raise CalculatorError(f"parentheses nested too deeply ({deepest} levels; the limit is {MAX_NESTING})")


def _syntax_message(text: str, exc: SyntaxError) -> str:
    reason = (exc.msg or "invalid syntax").split(";")[0]
    if reason.startswith("leading zeros"):
        reason = "a number may not start with 0 (write 7, not 07)"
    elif reason == "invalid syntax" and exc.offset:
        reason = f"invalid syntax at character {exc.offset}"
    hint = " (for a percentage write 15/100 or 0.15)" if "%" in text else ""
    return f"malformed expression: {reason}{hint}; write one arithmetic expression, like {EXAMPLE}"


# --- the allow-list walk --------------------------------------------------------------------------

_BINARY = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_UNARY = (ast.UAdd, ast.USub)
_PLAIN_NODES = (ast.Expression, *_BINARY, *_UNARY)  # allowed as they are; BinOp, UnaryOp by their operator
_OPERATOR_SIGNS = {
    ast.BitXor: "^",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.MatMult: "@",
    ast.Invert: "~",
    ast.Not: "not",
}
_REFUSED = {  # node type -> the message's start; any type not here is refused by its own name
    ast.Name: "names are not allowed",
    ast.Attribute: "attributes are not allowed",
    ast.Subscript: "subscripts are not allowed",
    ast.Slice: "slices are not allowed",
    ast.Compare: "comparisons are not allowed",
    ast.BoolOp: "'and' and 'or' are not allowed",
    ast.IfExp: "conditionals are not allowed",
    ast.Lambda: "lambdas are not allowed",
    ast.NamedExpr: "assignments are not allowed",
    ast.Starred: "starred expressions are not allowed",
    ast.JoinedStr: "f-strings are not allowed",
    ast.FormattedValue: "f-strings are not allowed",
    ast.List: "square brackets are not allowed, use parentheses",
    ast.Set: "braces are not allowed, use parentheses",
    ast.Dict: "braces are not allowed, use parentheses",
    ast.Tuple: "commas are not allowed",
    ast.ListComp: "comprehensions are not allowed",
    ast.SetComp: "comprehensions are not allowed",
    ast.DictComp: "comprehensions are not allowed",
    ast.GeneratorExp: "comprehensions are not allowed",
    ast.Await: "'await' is not allowed",
    ast.Yield: "'yield' is not allowed",
    ast.YieldFrom: "'yield' is not allowed",
}


class _Evaluator:
    """Walks a parsed expression: every node is checked against the allow-list before it is used."""

    def __init__(self, source: str):
        self.source = source

    def check(self, tree: ast.AST) -> None:
        """Refuse the first node (breadth first: the outermost) that is not arithmetic, and any literal
        that is not a plain decimal number, before anything is computed."""
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant):
                self._literal(node)
            elif not (
                isinstance(node, _PLAIN_NODES)
                or (isinstance(node, ast.BinOp) and isinstance(node.op, _BINARY))
                or (isinstance(node, ast.UnaryOp) and isinstance(node.op, _UNARY))
            ):
                raise CalculatorError(self._refusal(node))

    def value(self, node: ast.AST) -> Fraction:
        """The node's exact value; every node is checked again here, so nothing unchecked is ever run."""
        if isinstance(node, ast.Expression):
            return self.value(node.body)
        if isinstance(node, ast.Constant):
            return self._literal(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, _UNARY):
            operand = self.value(node.operand)
            return operand if isinstance(node.op, ast.UAdd) else -operand
        if isinstance(node, ast.BinOp) and isinstance(node.op, _BINARY):
            left = self.value(node.left)
            right = self.value(node.right)
            return _bounded(_apply(node.op, left, right))
        raise CalculatorError(self._refusal(node))

    def _literal(self, node: ast.Constant) -> Fraction:
        source = ast.get_source_segment(self.source, node) or ""
        written = self._written(node)
        if isinstance(node.value, bool) or node.value is None or node.value is Ellipsis:
            raise CalculatorError(f"names are not allowed ({ALLOWED}): {written!r}")
        if isinstance(node.value, str | bytes):
            raise CalculatorError(f"text is not allowed ({ALLOWED}): {written!r}")
        if not isinstance(node.value, int | float) or not _NUMBER.fullmatch(source):
            raise CalculatorError(f"only plain decimal numbers like 12 or 12.50 are allowed, not {written!r}")
        whole, _, fraction = source.partition(".")
        return _bounded(Fraction(int(whole + fraction or "0"), 10 ** len(fraction)))

    def _refusal(self, node: ast.AST) -> str:
        written = self._written(node)
        sign = _OPERATOR_SIGNS.get(type(node.op)) if isinstance(node, ast.BinOp | ast.UnaryOp) else None
        if sign is not None:
            power = "; write powers as **, e.g. 2**3" if sign == "^" else ""
            return f"the operator {sign!r} is not allowed ({ALLOWED}){power}: {written!r}"
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Constant | ast.BinOp | ast.UnaryOp):
                return f"implicit multiplication is not allowed: write * between factors, like 2*(3+4): {written!r}"
            return f"function calls are not allowed ({ALLOWED}): {written!r}"
        what = _REFUSED.get(type(node), f"{type(node).__name__} expressions are not allowed")
        return f"{what} ({ALLOWED}): {written!r}"

    def _written(self, node: ast.AST) -> str:
        written = ast.get_source_segment(self.source, node) or type(node).__name__
        return written if len(written) <= 40 else written[:37] + "..."


def _apply(op: ast.operator, left: Fraction, right: Fraction) -> Fraction:
    if isinstance(op, ast.Add):
        return left + right
    if isinstance(op, ast.Sub):
        return left - right
    if isinstance(op, ast.Mult):
        return left * right
    if isinstance(op, ast.Pow):
        return _power(left, right)
    if right == 0:
        raise CalculatorError("modulo by zero" if isinstance(op, ast.Mod) else "division by zero")
    if isinstance(op, ast.Div):
        return left / right
    if isinstance(op, ast.FloorDiv):
        return Fraction(left // right)
    if isinstance(op, ast.Mod):
        return left % right
    raise CalculatorError(f"operator not allowed; {ALLOWED}")  # unreachable: value() checks _BINARY


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        written = format_value(exponent).split(" (")[0]  # the rounded decimal, without its exact fraction
        raise CalculatorError(f"only whole-number exponents are allowed, not {written}")
    if abs(exponent.numerator) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent.numerator} is too large (the limit is {MAX_EXPONENT})")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero (0 to a negative power)")
    # both within bounds: at most MAX_BITS * MAX_EXPONENT bits, cheap to compute, then checked
    return Fraction(base**exponent.numerator)


def _bounded(value: Fraction) -> Fraction:
    if value.numerator.bit_length() > MAX_BITS:
        raise CalculatorError(f"a number in the calculation is too large (the limit is about {MAX_DIGITS} digits)")
    if value.denominator.bit_length() > MAX_BITS:
        raise CalculatorError(
            f"a number in the calculation is too precise (its exact fraction needs over {MAX_DIGITS} digits)"
        )
    return value
