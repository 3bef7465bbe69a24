"""`sparrow up`: a whole local cluster for an RL run, its supervision, progress, history and report."""
