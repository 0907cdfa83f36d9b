"""Data paths besides the control socket: shared memory on one host (``_shm``), NIXL between hosts
(``_nixl``), device arenas (``_device``) and device <-> host copies (``_device_copy``)."""
