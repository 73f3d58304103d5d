"""The problem: the model and cluster a user names (catalog, config), the knobs a configuration sets and
what may combine with them, the batch arithmetic, sequence packing, MoE routing, and the tune options."""
