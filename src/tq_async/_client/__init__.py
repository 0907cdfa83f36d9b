"""The clients: the asynchronous one in ``_async/``, its blocking twin in ``_sync/`` (generated
from ``_async/`` by ``scripts/unasync.py``: do not edit), their options (``_options``)."""
