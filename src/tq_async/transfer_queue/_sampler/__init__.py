"""The submodules of ``transfer_queue.sampler`` (its ``__path__`` names this folder)."""
