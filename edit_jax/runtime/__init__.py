"""Devices, processes and the mesh: ``mesh`` (the mesh from devices), ``multihost`` (one process
per worker), ``launch`` (starting them on one machine), ``cluster`` (a cluster's environment),
``stdout_filter`` (the runtime's chatter out of standard output)."""
