"""The Plexus error hierarchy; each maps to one gRPC status code (see plexus.rpc)."""


class PlexusError(Exception):
    """Base class of every error Plexus raises on purpose."""


class ConfigError(PlexusError, ValueError):
    """A configuration file or value is invalid; the message names the key and line."""


class IntegrityError(PlexusError, ValueError):
    """Data failed validation: wrong shape, dtype, size, NaN, bad signature, replay."""


class NotFound(PlexusError, LookupError):
    """A job, round, site or checkpoint that does not exist."""


class UnknownSite(NotFound):
    """A certificate names a site the federation does not know."""


class RoundClosed(PlexusError):
    """A submission arrived for a round that is no longer accepting updates."""


class FailedPrecondition(PlexusError):
    """The request is valid but the system is not in a state to honour it."""


class PolicyViolation(PlexusError):
    """A site's policy forbids what was asked."""


class PermissionDenied(PlexusError):
    """The caller's role does not allow this call."""


class Unauthenticated(PlexusError):
    """The caller's certificate is missing, revoked or not from this federation."""
