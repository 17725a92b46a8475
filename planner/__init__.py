"""Search, baselines, what-if and the moeplan CLI (imports plans and cost_models, never torch)."""
