"""The exception classes of colltune.

Every error colltune raises on purpose derives from :class:`ColltuneError`, so
``except ColltuneError`` catches all of them. The concrete classes also derive
from the matching builtin (``ValueError``, ``TypeError``, ``RuntimeError``) so
that code written against plain Python conventions keeps working.

Messages follow one rule: name the argument, say what was expected, what came
instead, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "ColltuneError",
    "ColltuneValueError",
    "ColltuneTypeError",
    "RankMismatchError",
    "RemoteInputError",
    "CollectiveError",
    "AbandonedCallError",
]


class ColltuneError(Exception):
    """Root of all colltune errors.

    Attributes:
        argument: the name of the argument at fault (``"indices"``,
            ``"knobs"``...), or ``None`` when no single argument is. The
            metadata record carries it, so that the other ranks of a
            collective can name it in their :class:`RemoteInputError`.
    """

    argument: str | None = None

    def __init__(self, *args: object, argument: str | None = None) -> None:
        super().__init__(*args)
        if argument is not None:
            self.argument = argument


class ColltuneValueError(ColltuneError, ValueError):
    """An argument has the right type but a wrong value."""


class ColltuneTypeError(ColltuneError, TypeError):
    """An argument has the wrong type or dtype."""


class RankMismatchError(ColltuneError, RuntimeError):
    """Ranks of one group called the same collective with arguments that disagree.

    Raised on every rank of the group, never on one alone, so no rank is left
    waiting in a collective the others have abandoned.

    Attributes:
        field: the metadata record's field the ranks disagree on (``"size"``,
            ``"dtype"``...), or ``None`` when no single field says it.
    """

    field: str | None = None


class RemoteInputError(ColltuneError, ValueError):
    """Another rank of the group rejected its own input, so this call was abandoned.

    The rank whose input was bad raises the specific error; the other ranks
    raise this one, naming that rank, instead of hanging.
    """


class CollectiveError(ColltuneError, RuntimeError):
    """A collective failed in the backend: a peer rank died, or did not answer within the process group's timeout.

    Raised on the ranks that notice; ``__cause__`` is the backend's own error.
    The process group cannot run collectives after it: restart the job.

    The first colltune call on a group also raises it when a peer rank does
    not join, within the group's timeout, the set-up of colltune's private
    copy of the group (:func:`~colltune.algorithms.comm.private_group`); the
    message names the group and the timeout. colltune does not try that
    set-up again: later calls on the group raise this error at once, naming
    the earlier failure, until the group is made anew.
    """


class AbandonedCallError(ColltuneError, RuntimeError):
    """A queued call that was not run because a call queued before it failed out of step with the other ranks.

    A call that fails in the backend (a peer rank died, a collective timed
    out) stops each rank at a different message, so the ranks are no longer
    in step. The calls queued behind it on this process would pair their
    messages with another call's, or wait a whole process-group timeout
    each; they raise this at once instead. ``__cause__`` is that failure.
    """
