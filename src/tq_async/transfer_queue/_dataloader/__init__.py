"""The submodules of ``transfer_queue.dataloader`` (its ``__path__`` names this folder)."""
