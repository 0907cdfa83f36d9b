"""The asynchronous client: ``AsyncClient`` (``_client``) composed of its links (``_base``), put
and get paths, other calls, NIXL and device links, checkpoints."""
