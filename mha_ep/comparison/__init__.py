"""Stock ORT vs the plugin on the same feeds: a verdict, and per-output (and, on request, per-node) errors.

Three rooms: ``report.py`` (the verdicts in the order they are decided, the value types, the text tables),
``maths.py`` (the error maths and the dtype-keyed tolerances, pure functions) and ``runner.py`` (the sessions
and the run loop, ``compare``). The names below are the package's public ones, importable from here as before.
"""

from __future__ import annotations

from mha_ep.comparison.maths import (
    FLOAT_ELEM_TYPES,
    INTEGER_TOLERANCE,
    MODEL_TOLERANCE,
    compare_arrays,
    compute_dtype,
    default_tolerance,
    errors,
    loosest,
)
from mha_ep.comparison.report import COMPARISON_HEADER, CompareReport, Comparison, Verdict, json_of, table
from mha_ep.comparison.runner import (
    check_feeds,
    check_reference,
    compare,
    expose_mha_outputs,
    first_line,
    graph_inputs,
    model_label,
    stock_session,
)

__all__ = [
    "COMPARISON_HEADER",
    "FLOAT_ELEM_TYPES",
    "INTEGER_TOLERANCE",
    "MODEL_TOLERANCE",
    "CompareReport",
    "Comparison",
    "Verdict",
    "check_feeds",
    "check_reference",
    "compare",
    "compare_arrays",
    "compute_dtype",
    "default_tolerance",
    "errors",
    "expose_mha_outputs",
    "first_line",
    "graph_inputs",
    "json_of",
    "loosest",
    "model_label",
    "stock_session",
    "table",
]
