"""The controller's pure core: its state (``_state``) and ready sets (``_ready``), the
transitions (``_transitions``: ``ControllerCore``) and their parts — the get path decided in
one call (``_gets``) with its leases (``_leases``) and sampler calls (``_sampling``), put
leases, admission, liveness, the catalogue — and the records they return (``_effects``). No
loop, no socket, no clock."""
