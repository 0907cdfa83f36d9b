"""The controller service: a thin I/O shell (``_server``, ``_shell``, ``_puts``, read-only
``_queries``) around the pure core in :mod:`tq_async._core`."""
