"""The base class of every error a user can fix (bad config, data, layout, checkpoint).

The CLI prints such an error as one line and exits non-zero; anything else is a bug and keeps its
traceback.
"""


class UserError(Exception):
    """An error whose message alone tells the user what is wrong and how to fix it."""


class PeerUserError(UserError):
    """This process stops because another rank of the job met a user error; the message is that rank's."""


class StorageError(UserError, OSError):
    """Storage refused a write (full, over quota, read-only); the message says which, and where.
    An ``OSError`` too, so code that tolerates a failed write (heartbeats, exit records) still does."""
