"""Process lifetime helpers shared by `moeplan train`'s launcher and the runtime's workers (no
torch here): a child that must not outlive its parent asks the kernel to signal it."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int) -> bool:
    """Linux prctl(2); False where there is none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """This process gets ``sig`` when the thread that started it exits (Linux)."""
    prctl(PR_SET_PDEATHSIG, int(sig))


def adopt_orphans() -> None:
    """Become a child subreaper: descendants orphaned below this process are re-parented to it
    (so a launcher can find and stop workers whose own parent was killed)."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)
