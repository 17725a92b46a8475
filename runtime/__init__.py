"""moeplan runtime: a plain MoE transformer, the parallel transforms a Plan asks for, and the
training loop. It reads only ``plans``; it never imports the planner or the cost models."""
