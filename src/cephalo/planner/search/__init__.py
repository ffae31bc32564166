"""The search: the planning problem as numbers (problem) and the exact search over it
(solver, bottleneck, subset, unit_search, hybrid_search, ...), the assignment's scoring
(evaluate) and what `solve` puts in a Plan beside the split (baselines, offload, precision).
It may import `cost`; never `outputs` or `feedback`."""
