"""The metric names a PromQL expression reads, for checking rules and dashboards against the code.

A small tokenizer and a walk over its tokens, not a parser: enough to tell the metric names of an
expression from what else its identifiers are. An identifier is a metric name unless it is

- a function or aggregation (followed by ``(``; an unknown one is an error, not a metric),
- a keyword (``and``, ``or``, ``unless``, ``bool``, ``offset``, ``atan2``, ``inf``, ``nan``),
- a label name: inside ``{...}`` matchers, or in the list after ``by``, ``without``, ``on``,
  ``ignoring``, ``group_left`` or ``group_right``,
- inside ``[...]`` (a range or subquery: durations, Grafana's ``$__rate_interval``).

Strings (label values, ``label_replace`` arguments), numbers, durations and Grafana template
variables (``$model``, ``${model}``, ``[[model]]``) are skipped; a ``{__name__="x"}`` matcher
names metric ``x``. Anything the tokenizer does not know raises :class:`PromQLError`, so a typo
fails loudly instead of hiding a name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

FUNCTIONS = frozenset(
    [
        "abs",
        "absent",
        "absent_over_time",
        "acos",
        "acosh",
        "asin",
        "asinh",
        "atan",
        "atanh",
        "avg_over_time",
        "ceil",
        "changes",
        "clamp",
        "clamp_max",
        "clamp_min",
        "cos",
        "cosh",
        "count_over_time",
        "day_of_month",
        "day_of_week",
        "day_of_year",
        "days_in_month",
        "deg",
        "delta",
        "deriv",
        "double_exponential_smoothing",
        "exp",
        "floor",
        "histogram_avg",
        "histogram_count",
        "histogram_fraction",
        "histogram_quantile",
        "histogram_stddev",
        "histogram_stdvar",
        "histogram_sum",
        "holt_winters",
        "hour",
        "idelta",
        "increase",
        "info",
        "irate",
        "label_join",
        "label_replace",
        "last_over_time",
        "ln",
        "log10",
        "log2",
        "mad_over_time",
        "max_over_time",
        "min_over_time",
        "minute",
        "month",
        "pi",
        "predict_linear",
        "present_over_time",
        "quantile_over_time",
        "rad",
        "rate",
        "resets",
        "round",
        "scalar",
        "sgn",
        "sin",
        "sinh",
        "sort",
        "sort_by_label",
        "sort_by_label_desc",
        "sort_desc",
        "sqrt",
        "stddev_over_time",
        "stdvar_over_time",
        "sum_over_time",
        "tan",
        "tanh",
        "time",
        "timestamp",
        "vector",
        "year",
    ]
)
AGGREGATIONS = frozenset(
    [
        "avg",
        "bottomk",
        "count",
        "count_values",
        "group",
        "limit_ratio",
        "limitk",
        "max",
        "min",
        "quantile",
        "stddev",
        "stdvar",
        "sum",
        "topk",
    ]
)
# Followed by a parenthesised list of label names (group_left/right: optionally).
LABEL_LIST_KEYWORDS = frozenset(["by", "without", "on", "ignoring", "group_left", "group_right"])
KEYWORDS = frozenset(["and", "or", "unless", "bool", "offset", "atan2"])
AT_FUNCTIONS = frozenset(("start", "end"))  # `@ start()`, `@ end()`

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$[A-Za-z_]\w*|\[\[[A-Za-z_]\w*(?::\w+)?\]\])
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+(?![\w:]))
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][\w:]*)
  | (?P<op>==|!=|=~|!~|>=|<=|[-+*/%^<>=,:@(){}\[\]])
    """,
    re.VERBOSE,
)


class PromQLError(ValueError):
    """An expression this module cannot read (or an unknown function)."""


@dataclass(frozen=True)
class Token:
    kind: str  # string, var, duration, number, ident, op
    text: str
    pos: int


def tokenize(expr: str) -> list[Token]:
    tokens: list[Token] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise PromQLError(f"cannot read {expr[pos : pos + 20]!r} at {pos} in {expr!r}")
        kind = m.lastgroup
        assert kind is not None
        if kind not in ("space", "comment"):
            tokens.append(Token(kind, m.group(), pos))
        pos = m.end()
    return tokens


def _closing(tokens: list[Token], i: int, open_: str, close: str, expr: str) -> int:
    """The index of the token closing the bracket opened at ``i``."""
    depth = 0
    for j in range(i, len(tokens)):
        if tokens[j].kind == "op" and tokens[j].text == open_:
            depth += 1
        elif tokens[j].kind == "op" and tokens[j].text == close:
            depth -= 1
            if depth == 0:
                return j
    raise PromQLError(f"unclosed {open_!r} at {tokens[i].pos} in {expr!r}")


def _unquote(text: str) -> str:
    if text.startswith("`"):
        return text[1:-1]
    return bytes(text[1:-1], "utf-8").decode("unicode_escape")


def metric_names(expr: str) -> set[str]:
    """Every metric name ``expr`` reads."""
    tokens = tokenize(expr)
    names: set[str] = set()
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        opens_paren = nxt is not None and nxt.kind == "op" and nxt.text == "("
        if tok.kind == "op" and tok.text == "{":
            end = _closing(tokens, i, "{", "}", expr)
            names |= _names_in_matchers(tokens[i + 1 : end], expr)
            i = end + 1
            continue
        if tok.kind == "op" and tok.text == "[":
            i = _closing(tokens, i, "[", "]", expr) + 1
            continue
        if tok.kind != "ident":
            i += 1
            continue
        word = tok.text
        if word in LABEL_LIST_KEYWORDS:
            if opens_paren:
                i = _closing(tokens, i + 1, "(", ")", expr) + 1
            elif word in ("group_left", "group_right"):
                i += 1
            else:
                raise PromQLError(f"{word} without a label list at {tok.pos} in {expr!r}")
            continue
        if word in KEYWORDS or word.lower() in ("inf", "nan"):
            i += 1
            continue
        if word in AGGREGATIONS and nxt is not None and nxt.text in ("by", "without"):
            i += 1  # `sum by (le) (...)`: the label list comes next
            continue
        if opens_paren:
            if word not in FUNCTIONS and word not in AGGREGATIONS and word not in AT_FUNCTIONS:
                raise PromQLError(f"unknown function {word!r} at {tok.pos} in {expr!r}")
            i += 1
            continue
        names.add(word)
        i += 1
    return names


def _names_in_matchers(tokens: list[Token], expr: str) -> set[str]:
    """Metric names inside ``{...}``: ``__name__="x"``, or a quoted name standing alone."""
    names: set[str] = set()
    for k, tok in enumerate(tokens):
        if tok.kind == "ident" and tok.text == "__name__":
            op = tokens[k + 1] if k + 1 < len(tokens) else None
            value = tokens[k + 2] if k + 2 < len(tokens) else None
            if op is None or value is None or value.kind != "string":
                raise PromQLError(f"bad __name__ matcher at {tok.pos} in {expr!r}")
            if op.text != "=":
                raise PromQLError(f"a __name__ regex names no metric, at {tok.pos} in {expr!r}")
            names.add(_unquote(value.text))
        elif tok.kind == "string":
            before = tokens[k - 1] if k else None
            after = tokens[k + 1] if k + 1 < len(tokens) else None
            standalone = (before is None or before.text == ",") and (
                after is None or after.text == ","
            )
            if standalone:  # Prometheus 3: {"metric.name", label="v"}
                names.add(_unquote(tok.text))
    return names


def unknown_metrics(exprs: Iterable[str], exported: set[str]) -> dict[str, set[str]]:
    """For each expression naming a metric not in ``exported``: those names."""
    missing: dict[str, set[str]] = {}
    for expr in exprs:
        unknown = metric_names(expr) - exported
        if unknown:
            missing[expr] = unknown
    return missing


def sample_names(registries: Iterable[object]) -> set[str]:
    """The names of the samples the registries expose (``registry.collect()`` families
    expanded the way the text format writes them: ``_total`` and ``_created`` of a counter,
    ``_bucket``, ``_sum``, ``_count`` and ``_created`` of a histogram, ...), whether or not a
    labelled family has a sample yet."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
        "stateset": ("",),
        "gauge": ("",),
        "unknown": ("",),
    }
    names: set[str] = set()
    for registry in registries:
        for family in registry.collect():  # type: ignore[attr-defined]
            names.update(family.name + s for s in suffixes[family.type])
            names.update(sample.name for sample in family.samples)
    return names
