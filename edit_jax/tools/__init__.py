"""Commands and instruments around training: ``plan`` (does a config fit its devices), ``plot``,
``profile``, ``hlo`` (the collective parser), ``sample``."""
