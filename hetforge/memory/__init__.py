"""Memory planning: profile, plan (MILP and baselines), execute, verify."""
