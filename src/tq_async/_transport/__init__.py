"""Moving frames: addresses and the ZMQ context (``_endpoints``), CURVE (``_security``), the
services' ROUTER (``_router``), the clients' connections (their shared core without I/O
``_connection``, the asynchronous shell ``_dealer``, the blocking ``_sync_dealer``), in-process
routes (``_routes``), Unix sockets (``_unix``)."""
