"""The search: configurations and their prune rules (``space``), degrees, ZeRO and schedules
(``search``), identical layers solved once (``fold``), one ILP per mesh axis (``axes`` builds it from each
node's ``candidates``, ``elimination`` or ``ilp`` solves it), pipeline schedules and microbatches (``schedule``), stage
cuts (``partition``, Alpa's inter-op dynamic program) and the tie rule (``ranking``)."""
