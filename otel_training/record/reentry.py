"""Whether a signal handler interrupted our own bookkeeping on the training thread.

Python runs a signal handler on the main thread between two bytecodes, wherever
they are: inside ``Tracker._close`` (the step already taken off the tracker, not
yet handed on), or inside the assembler or the pipeline's ``submit``. A SIGTERM
handler that ended the run from there would lose that step, or hand on a
half-updated one. ``runtime`` asks this first and, if so, delivers the signal
again a moment later, once the training thread is back in the user's code.
"""

from __future__ import annotations

import os
import sys
from types import FrameType

_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the otel_training package
_STDLIB = os.path.dirname(os.__file__) + os.sep


def interrupted_bookkeeping(frame: FrameType | None) -> bool:
    """True if the innermost frame that is not torch's, the standard library's or
    generated code's is otel-training's.

    Those are skipped: our bookkeeping calls into them (``torch.cuda.is_initialized``,
    ``threading``, a NamedTuple's ``__new__``). A wrapper of ours waiting on a torch
    call (``nn.Linear`` inside a timed root call) also answers True: a harmless wait of
    one more delivery."""
    torch = sys.modules.get("torch")
    torch_file = getattr(torch, "__file__", None)
    torch_dir = os.path.dirname(torch_file) + os.sep if torch_file else "\0"
    depth = 0
    while frame is not None and depth < 64:
        path = frame.f_code.co_filename
        if path.startswith(_OURS):
            return True
        stdlib = path.startswith(_STDLIB) and "-packages" not in path
        generated = path.startswith("<")  # a NamedTuple's __new__, a dataclass's __init__
        if not (stdlib or generated or path.startswith(torch_dir)):
            return False  # the user's code (or a library's) was running
        frame = frame.f_back
        depth += 1
    return False
