"""The command workload: any script governed without changing prereg (declaration, process runner, windows)."""
