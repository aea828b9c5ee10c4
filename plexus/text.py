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


# The most of one message that leaves a process or is stored from elsewhere: gRPC carries a status message
# percent-encoded in HTTP/2 trailers, which a client refuses beyond 8 KiB, and logs, audit entries and
# `plexus job show` need no more to say what went wrong.
MAX_MESSAGE_BYTES = 2048


def bounded(text: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`text` if it fits in `limit` bytes (UTF-8), else its start and its end (which says how to fix it)
    around how many characters were left out."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    head = raw[:limit * 3 // 4].decode("utf-8", "ignore")
    tail = raw[len(raw) - limit // 4:].decode("utf-8", "ignore")
    return f"{head}… ({len(text) - len(head) - len(tail)} more characters) …{tail}"


def listing(items, shown: int = 20) -> str:
    """A list of names for a message: the first `shown` as a Python list, then how many more there are."""
    items = list(items)
    if len(items) <= shown:
        return repr(items)
    return repr(items[:shown])[:-1] + f", … and {len(items) - shown} more]"
