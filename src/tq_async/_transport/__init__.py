"""Moving frames: addresses and the ZMQ context (``_endpoints``), CURVE (``_security``), the
services' ROUTER (``_router``), the clients' connections (``_dealer``, blocking
``_sync_dealer``), in-process routes (``_routes``), Unix sockets (``_unix``)."""
