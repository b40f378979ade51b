"""The compiled program read as data: the HLO parser and its collectives (``hlo_parse``, ``hlo``),
XLA:GPU's program for abstract GPU devices (``gpu_target``, ``gpu_plan``) and the sync's window in
it (``hlo_overlap``, ``gpu_window``), the analytic GPU memory estimate (``memory_estimate``) and a
profiler trace summarised per op category (``profile``). Used by the commands, the tests and the
benchmarks; nothing here runs training."""
