"""What both services share: the request loop (``_loop``), the parking lot where waiting
requests wait (``_parking``), Prometheus metrics (``_metrics``), one ``Config`` for every way to
run them (``_config``), one service on its own (``_serve``)."""
