"""Starting the services: ``local_cluster`` (``_cluster``), ``background_cluster``
(``_background``), the ``tq-async`` CLI (``_cli``)."""
