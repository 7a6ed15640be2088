"""What every model family shares: pytrees, norms and projections, RoPE variants, routers, and the MoE block
with its routed experts on the CPU behind the hybrid hand-off (or held by XLA). A family (models/<family>/)
adds its attention, its config and its checkpoint map, and composes the rest from here."""
