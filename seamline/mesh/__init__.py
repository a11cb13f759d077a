"""The mesh: node and link descriptions, the pure planner, and the coordinator around it."""
