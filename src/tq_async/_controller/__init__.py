"""The controller service: a thin I/O shell around the pure core in `tq_async._core`.

``_server.ControllerServer`` holds its parts and dispatches to them: the plumbing they share
(``_shell``), the links to the storage units (``_units``), the put path (``_puts``), the get
path (``_gets``), the other calls (``_calls``) and the read-only answers (``_queries``)."""
