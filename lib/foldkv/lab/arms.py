"""What every lab "arm" (a way of computing the same thing, timed or compared side by side) shares."""

from __future__ import annotations


class ArmUnavailable(RuntimeError):
    """An arm cannot run on this machine (a missing package, device or kernel); the message is the reason recorded
    as "not run: <reason>"."""
