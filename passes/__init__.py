"""The graph passes, in the order autopar runs them.

capture → (strategies, rules) → search (ilp, cost) → gradients → rewrite → export;
``pipeline`` runs and times them. Each module states its pre- and post-conditions.
"""
