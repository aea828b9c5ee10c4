"""The Plexus error hierarchy; each maps to one gRPC status code (see plexus.rpc)."""

import enum
import errno
import sqlite3


class Reason(str, enum.Enum):
    """Why data was refused: a bounded code carried as a field to audit entries and metrics labels, so no
    one ever parses it back out of a message. A new kind of check that refuses updates adds a member."""

    NON_FINITE = "non_finite"     # NaN or Inf
    NUM_SAMPLES = "num_samples"   # the declared sample count is out of bounds
    METRICS = "metrics"           # reported metrics malformed
    SIZE = "size"                 # bytes missing, extra or out of order
    LAYOUT = "layout"             # tensors, dtypes or shapes differ from the job's model
    NORM = "norm"                 # values too large: beyond the clip norm or the exact-sum range
    STALE = "stale"               # asynchronous: computed from a model more than max_staleness versions old
    OTHER = "other"


class PlexusError(Exception):
    """Base class of every error Plexus raises on purpose."""


class ConfigError(PlexusError, ValueError):
    """A configuration file or value is invalid; the message names the key and line."""


class IntegrityError(PlexusError, ValueError):
    """Data failed validation: wrong shape, dtype, size, NaN, bad signature, replay; `reason` says which kind."""

    def __init__(self, *args, reason: Reason = Reason.OTHER):
        super().__init__(*args)
        self.reason = reason


class NotFound(PlexusError, LookupError):
    """A job, round, site or checkpoint that does not exist."""


class UnknownSite(NotFound):
    """A certificate names a site the federation does not know."""


class RoundClosed(PlexusError):
    """A submission arrived for a round that is no longer accepting updates."""


class Stale(RoundClosed):
    """Asynchronous training: an update computed from a model version too old to be aggregated."""


class FailedPrecondition(PlexusError):
    """The request is valid but the system is not in a state to honour it."""


class PolicyViolation(PlexusError):
    """A site's policy forbids what was asked."""


class PermissionDenied(PlexusError):
    """The caller's role does not allow this call."""


class Unauthenticated(PlexusError):
    """The caller's certificate is missing, revoked or not from this federation."""


class ResourceExhausted(PlexusError):
    """The caller is over a limit on what it may hold at once (calls in progress); it may retry later."""


class Unavailable(PlexusError):
    """The service cannot do this now (its state dir cannot be written: a full disk); the caller retries later."""


class TimedOut(PlexusError):
    """A peer did not send (or take) the next message of a stream in time; the stream was dropped."""


_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)


def storage_failure(exc: BaseException) -> bool:
    """A full or failing disk: to be waited out, not a reason to fail a job or blame a caller."""
    if isinstance(exc, sqlite3.OperationalError):
        return exc.sqlite_errorcode & 0xFF in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN)
    return isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS


def out_of_space(exc: BaseException) -> bool:
    """A storage failure that more free space cures (not quota, read-only or I/O errors)."""
    if isinstance(exc, sqlite3.OperationalError):
        return exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_FULL
    return isinstance(exc, OSError) and exc.errno == errno.ENOSPC


def storage_text(exc: BaseException) -> str:
    """A storage failure in words, without the path an OSError names (it stays in the local log)."""
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
