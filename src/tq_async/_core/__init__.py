"""The controller's pure core: its state (``_state``), transitions (``_transitions``) and their
parts (put leases, admission, liveness, the catalogue), and the records they return
(``_effects``). No loop, no socket, no clock."""
