"""The one error type of `expertize specialize`."""

from ..errors import ExpertizeError

__all__ = ["SpecializationError"]


class SpecializationError(ExpertizeError, ValueError):
    """`expertize specialize` cannot run on what it was given; the message names the problem and the fix."""
