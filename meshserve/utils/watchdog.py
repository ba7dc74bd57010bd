"""A process that must never outlive its parent (an engine its front end, a rank its engine)."""
from __future__ import annotations

import os
import threading
from multiprocessing.connection import Connection


def exit_when_parent_goes(parent_alive: Connection, name: str) -> None:
    """Start a thread that ends this process, whatever it is doing (a wedged step, a collective),
    once the parent's end of `parent_alive` closes: the parent never writes to it, so recv()
    returns (EOF) only when the parent is gone, even if it was killed."""
    def watch() -> None:
        try:
            parent_alive.recv()
        except (EOFError, OSError):
            pass
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name=name).start()
