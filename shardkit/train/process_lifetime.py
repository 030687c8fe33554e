"""Processes of a ``shardkit train`` run end with the process that started them.

``shardkit train --nproc N`` starts torchrun, which starts the workers. Killing ``shardkit train``
(SIGKILL, a closed terminal, a batch system's cancel) would leave torchrun and its workers
training on as orphans, holding the GPUs and the rendezvous port. So each child asks Linux to
send it SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``): torchrun on SIGTERM stops its
workers, and a worker whose torchrun died ends itself. Elsewhere than Linux this is a no-op.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have this process receive ``sig`` when its parent exits (Linux; elsewhere nothing).

    Usable as ``subprocess.Popen(preexec_fn=die_with_parent)``: then it runs in the child. If the
    parent is already gone (adopted by init), the signal is sent at once.

    Example:
        >>> subprocess.run(["torchrun", ...], preexec_fn=die_with_parent)   # doctest: +SKIP
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return  # best effort: a sandbox may refuse prctl
    if os.getppid() != parent or parent == 1:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)
