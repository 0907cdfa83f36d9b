"""The blocking client, generated from `tq_async._client._async` by
``scripts/unasync.py``: do not edit these modules, change their async source."""
