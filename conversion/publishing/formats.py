"""How numbers and values are written in the model card, the variants table and the end-of-run summary: CE-like
floats with 4 decimals (scientific below 1e-3), fractions as percentages, counts with thousands separators, any
value as one Markdown table cell. A missing value renders as "—".

A leaf module (the standard library only), so that any room can share these formats without importing the card.
"""

import json
import math
from typing import Any

__all__ = ["MISSING", "cell", "code_cell", "format_count", "format_number", "format_percent", "is_number"]

MISSING = "—"


def is_number(x: Any) -> bool:
    """A finite int or float (a bool is not a number here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def format_number(x: Any, decimals: int = 4) -> str:
    """A float with `decimals` decimals; scientific (decimals - 1 decimals) when |x| < 1e-3 or >= 1e6."""
    if x is None:
        return MISSING
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return cell(x)
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) < 1e-3 or abs(x) >= 1e6:
        return f"{x:.{max(decimals - 1, 1)}e}"
    return f"{x:.{decimals}f}"


def format_count(x: Any) -> str:
    """An integer with thousands separators (an integral float is shown as an integer)."""
    if is_number(x) and float(x).is_integer():
        return f"{int(x):,}"
    return format_number(x, 2)


def format_percent(x: Any, decimals: int = 2) -> str:
    """A fraction (1.0 = 100 %) as a percentage."""
    if not is_number(x):
        return format_number(x)
    return f"{100 * x:.{decimals}f}%"


def cell(x: Any) -> str:
    """Any value as one Markdown table cell."""
    if x is None:
        return MISSING
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return format_count(x)
    if isinstance(x, float):
        return format_count(x) if x.is_integer() and abs(x) >= 1000 else f"{x:g}"
    if isinstance(x, (list, tuple, dict)):
        text = json.dumps(x, default=str)
    else:
        text = str(x)
    return text.replace("|", "\\|").replace("\n", " ")


def code_cell(x: Any) -> str:
    """A value as a table cell in code format (`x`)."""
    return f"`{cell(x)}`"
