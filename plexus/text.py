"""Text that came from elsewhere (sites, the coordinator), made safe to show: a site's failure message or
metric name must not drive an operator's terminal (escape sequences, bidi overrides) or run as a
spreadsheet formula (`=HYPERLINK(...)`) in an exported CSV."""

from __future__ import annotations

# A spreadsheet reads a cell starting with one of these as a formula (OWASP's list for CSV injection).
FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")


def printable(text: str) -> str:
    """`text` with every character a terminal would act on (controls, format characters such as bidi
    overrides, line breaks) shown as its visible escape: ESC as \\x1b, U+202E as \\u202e."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def csv_cell(value):
    """A CSV cell that opens as plain text in a spreadsheet and prints harmlessly: strings are made
    printable and, when they would start a formula, prefixed with an apostrophe. Numbers are kept."""
    if not isinstance(value, str):
        return value
    return ("'" if value.startswith(FORMULA_PREFIXES) else "") + printable(value)
