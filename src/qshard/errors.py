"""The one exception type for problems the user can fix (bad config, bad files, bad data)."""


class QShardError(Exception):
    """A user-facing error: printed as one line by the CLI, which then exits non-zero.

    Internal invariants use ``assert``; anything caused by input (options, files, data) raises this.
    """


class CollectiveError(QShardError):
    """A collective that timed out or lost a peer: a consequence of another rank's failure, which the
    launcher names instead of this error when it can."""
