"""Fleets of simulated devices over HTTP against a real server: local and Ray back-ends, faults, the demo."""
