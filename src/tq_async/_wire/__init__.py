"""The wire's vocabulary: control messages (``_protocol``), columns as bytes (``_columns``),
tensors <-> columns (``_codec``), jagged nested tensors built in bulk (``_nested``), recycled
copy buffers (``_buffers``). Pure: no sockets, no loop."""
