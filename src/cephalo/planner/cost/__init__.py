"""The cost model: what a GPU, a collective and a step cost, from the catalog, a profile or an
estimate (catalog, estimate, authors_profiles, costmodel, comm_model, topology).
The planner's lowest layer: it imports only `cephalo.api` and its own modules, never the
search, outputs or feedback sub-packages."""
