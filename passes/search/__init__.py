"""The search: degrees, ZeRO and schedules (``search``), one ILP per mesh axis (``axes`` builds it,
``ilp`` solves it), pipeline schedules and microbatches (``schedule``) and stage cuts
(``partition``, Alpa's inter-op dynamic program)."""
