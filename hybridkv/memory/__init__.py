"""The memory of each kind of layer (full-attention KV, sliding-window KV, recurrent state) and
the coordinator that runs the manager's verbs over a model's kinds."""
