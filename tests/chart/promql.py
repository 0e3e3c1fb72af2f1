"""A small PromQL parser for the chart's alert rules and dashboard: enough of the grammar to refuse what
Prometheus would refuse in the expressions we write (unbalanced brackets, unknown functions, a range
function given an instant vector, malformed label matchers) and to list the metrics an expression reads.

Not the whole language: no subqueries, no @ modifier, no offset. An expression that uses them fails here
with the position, and then this parser is extended, not bypassed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

AGGREGATIONS = {"sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk", "quantile"}
# Functions whose argument is a range vector (a selector with [duration]).
RANGE_FUNCTIONS = {
    "rate",
    "irate",
    "increase",
    "delta",
    "idelta",
    "deriv",
    "changes",
    "resets",
    "avg_over_time",
    "min_over_time",
    "max_over_time",
    "sum_over_time",
    "count_over_time",
}
FUNCTIONS = RANGE_FUNCTIONS | {
    "histogram_quantile",
    "abs",
    "absent",
    "ceil",
    "floor",
    "round",
    "clamp_min",
    "clamp_max",
    "scalar",
    "vector",
    "time",
}
BINARY = {"+", "-", "*", "/", "%", "^", "==", "!=", ">", "<", ">=", "<=", "and", "or", "unless"}
COMPARISONS = {"==", "!=", ">", "<", ">=", "<="}

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
    |(?P<string>"(?:[^"\\]|\\.)*")
    |(?P<range>\[(?:[0-9]+[smhdwy])+\]|\[\$__rate_interval\]|\[\$__range\])
    |(?P<number>[0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)
    |(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    |(?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=(){},])
    """,
    re.VERBOSE,
)


class PromQLError(ValueError):
    pass


@dataclass
class _Token:
    kind: str
    text: str
    at: int


def tokenize(expr: str) -> list[_Token]:
    tokens, at = [], 0
    while at < len(expr):
        match = _TOKEN.match(expr, at)
        if not match:
            raise PromQLError(f"unexpected {expr[at : at + 12]!r} at {at} in {expr!r}")
        if match.lastgroup != "space":
            tokens.append(_Token(str(match.lastgroup), match.group(), at))
        at = match.end()
    return tokens


@dataclass
class _Parser:
    expr: str
    tokens: list[_Token]
    at: int = 0
    metrics: set[str] = field(default_factory=set)

    def peek(self) -> _Token | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, text: str | None = None, kind: str | None = None) -> _Token:
        token = self.peek()
        if token is None or (text is not None and token.text != text) or (kind is not None and token.kind != kind):
            where = f"{token.text!r} at {token.at}" if token else "the end"
            raise PromQLError(f"expected {text or kind}, found {where} in {self.expr!r}")
        self.at += 1
        return token

    def accept(self, text: str) -> bool:
        token = self.peek()
        if token is not None and token.text == text:
            self.at += 1
            return True
        return False

    # expr := unary (binop [bool] [on|ignoring (labels)] [group_left|group_right [(labels)]] unary)*
    def expression(self) -> str:
        kind = self.unary()
        while (token := self.peek()) is not None and token.text in BINARY:
            self.at += 1
            if token.text in COMPARISONS:
                self.accept("bool")
            if self.accept("on") or self.accept("ignoring"):
                self.labels()
            grouped = self.accept("group_left") or self.accept("group_right")
            if grouped and (nxt := self.peek()) is not None and nxt.text == "(":
                self.labels()
            self.unary()
            kind = "instant"
        return kind

    def unary(self) -> str:
        if self.accept("-") or self.accept("+"):
            return self.unary()
        return self.primary()

    def primary(self) -> str:
        token = self.peek()
        if token is None:
            raise PromQLError(f"unexpected end of {self.expr!r}")
        if token.kind == "number":
            self.at += 1
            return "scalar"
        if token.kind == "string":
            self.at += 1
            return "string"
        if token.text == "(":
            self.at += 1
            kind = self.expression()
            self.take(")")
            return kind
        if token.kind != "ident":
            raise PromQLError(f"unexpected {token.text!r} at {token.at} in {self.expr!r}")
        if token.text in AGGREGATIONS:
            return self.aggregation()
        nxt = self.tokens[self.at + 1] if self.at + 1 < len(self.tokens) else None
        if nxt is not None and nxt.text == "(":
            return self.call()
        return self.selector()

    def aggregation(self) -> str:
        name = self.take(kind="ident").text
        grouped = self.grouping()
        self.take("(")
        if name in {"topk", "bottomk", "quantile"}:
            self.expression()
            self.take(",")
        if self.expression() != "instant":
            raise PromQLError(f"{name} needs an instant vector in {self.expr!r}")
        self.take(")")
        if not grouped:
            self.grouping()
        return "instant"

    def grouping(self) -> bool:
        if self.accept("by") or self.accept("without"):
            self.labels()
            return True
        return False

    def labels(self) -> None:
        self.take("(")
        while not self.accept(")"):
            self.take(kind="ident")
            if not self.accept(","):
                self.take(")")
                return

    def call(self) -> str:
        name = self.take(kind="ident")
        if name.text not in FUNCTIONS:
            raise PromQLError(f"unknown function {name.text!r} at {name.at} in {self.expr!r}")
        self.take("(")
        kinds = []
        while not self.accept(")"):
            kinds.append(self.expression())
            if not self.accept(","):
                self.take(")")
                break
        if name.text in RANGE_FUNCTIONS and kinds != ["range"]:
            raise PromQLError(f"{name.text} takes one range vector (a selector with [duration]) in {self.expr!r}")
        if name.text == "histogram_quantile" and kinds != ["scalar", "instant"]:
            raise PromQLError(f"histogram_quantile takes a quantile and an instant vector in {self.expr!r}")
        return "instant"

    def selector(self) -> str:
        name = self.take(kind="ident").text
        if name in BINARY or name in {"by", "without", "on", "ignoring", "bool", "offset"}:
            raise PromQLError(f"keyword {name!r} where a metric was expected in {self.expr!r}")
        self.metrics.add(name)
        if self.accept("{"):
            while not self.accept("}"):
                self.take(kind="ident")
                op = self.take()
                if op.text not in {"=", "!=", "=~", "!~"}:
                    raise PromQLError(f"bad label matcher {op.text!r} at {op.at} in {self.expr!r}")
                self.take(kind="string")
                if not self.accept(","):
                    self.take("}")
                    break
        if (token := self.peek()) is not None and token.kind == "range":
            self.at += 1
            return "range"
        return "instant"


def metrics_of(expr: str) -> set[str]:
    """The metric names ``expr`` selects; raises PromQLError when it does not parse."""
    parser = _Parser(expr, tokenize(expr))
    parser.expression()
    if parser.peek() is not None:
        token = parser.peek()
        assert token is not None
        raise PromQLError(f"unexpected {token.text!r} at {token.at} in {expr!r}")
    return parser.metrics
