"""Ray wiring: Ray Data pipelines, Ray Train workers, actor groups and placement."""
