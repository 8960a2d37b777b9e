"""Long-running checks outside the default test run (python -m benchmarks.<name>)."""
