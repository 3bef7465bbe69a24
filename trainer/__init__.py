"""Learning code: GRPO and TIS, teacher-forced (sparse) scoring, exact alpha, DistillSparse, FSDP2 (no services)."""
