"""The wire's vocabulary: control messages (``_protocol``), columns as bytes (``_columns``),
tensors <-> columns (``_codec``), recycled copy buffers (``_buffers``). Pure: no sockets, no
loop."""
